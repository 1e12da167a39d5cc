"""Retrofitting at real size: time and peak memory for a parent of TinyLlama-1.1B's shape.

    python benchmarks/bench_retrofit_size.py                  # make the parent, retrofit it twice, delete all
    python benchmarks/bench_retrofit_size.py --keep DIR       # keep the parent and the folders in DIR

The parent is a ``LlamaForCausalLM`` of TinyLlama-1.1B's shape (22 layers, hidden 2048,
intermediate 5632, 32 heads, 4 KV heads, vocabulary 32000, untied head) with random bfloat16
weights, written shard by shard (a layer's tensors at a time, never the whole model in memory) as
sharded safetensors with an index, as ``save_pretrained`` writes a large checkpoint. Each retrofit
(``--layers 4,8,4``, McLeish et al.'s TinyLlama split, and ``--loop-in-place``) runs in a fresh
process, so its peak resident memory (``ru_maxrss``) is its own; the target is under 2x the
parent's size on disk. The table prints with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip
RETROFITS = {
    "--layers 4,8,4": ["--layers", "4,8,4"],
    "--loop-in-place": ["--loop-in-place", "--layers", "4,14,4"],
}
CHILD = """
import resource, sys, time
from looped_hf.cli import main
start = time.perf_counter()
code = main(["retrofit", *sys.argv[1:]])
print("RESULT", code, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def make_parent(folder: Path) -> tuple[int, int]:
    """Write the random bf16 parent, one layer's tensors per shard; returns (bytes, shards)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINYLLAMA, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}
    groups: dict[str, list[str]] = {}
    for name in shapes:
        key = name.split(".")[2] if name.startswith("model.layers.") else "outer"
        groups.setdefault(key, []).append(name)
    folder.mkdir(parents=True)
    weight_map, generator = {}, torch.Generator().manual_seed(0)
    for index, names in enumerate(groups.values()):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            std = 1.0 if name.endswith("norm.weight") else 0.02
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = (base + std * torch.randn(shapes[name], generator=generator)).to(torch.bfloat16)
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config.save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")), len(groups)


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")


def run_retrofit(parent: Path, out: Path, flags: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of one retrofit in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run([sys.executable, "-c", CHILD, str(parent), *flags, "--out", str(out)], env=env,
                            capture_output=True, text=True)  # fmt: skip
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT")), None)
    if result.returncode != 0 or line is None or line.split()[1] != "0":
        raise SystemExit(f"retrofit {flags} failed:\n{result.stderr[-3000:]}")
    _, _, seconds, rss = line.split()
    return float(seconds), int(rss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="write into DIR and keep the files (default: a temp dir, deleted)",
    )
    args = p.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-retrofit-"))
    try:
        start = time.perf_counter()
        parent_bytes, shards = make_parent(root / "parent")
        made = time.perf_counter() - start
        rows = []
        for label, flags in RETROFITS.items():
            out = root / label.strip("-").replace(" ", "-").replace(",", "-")
            seconds, rss = run_retrofit(root / "parent", out, flags)
            rows.append((label, folder_size(out), seconds, rss))
            if not args.keep:
                shutil.rmtree(out)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    gb = 1e9
    print(f"command: python benchmarks/bench_retrofit_size.py; machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{platform.python_version()}; parent: TinyLlama-1.1B shape, bf16, {parent_bytes / gb:.2f} GB in "
          f"{shards} shards (made in {made:.0f} s)\n")  # fmt: skip
    print("| retrofit | folder (GB) | time (s) | peak RSS (GB) | peak RSS / parent |")
    print("|---|---|---|---|---|")
    for label, size, seconds, rss in rows:
        print(f"| `{label}` | {size / gb:.2f} | {seconds:.1f} | {rss / gb:.2f} | {rss / parent_bytes:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
