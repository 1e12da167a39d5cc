"""Training throughput against data-pipeline throughput (tokens/s), and the tiny sweep's wall time.

The input pipeline must never be the bottleneck: for each setting this prints the tokens/s the
DataLoader delivers (warm cache; `benchmarks/bench_data.py`'s `measure_pipeline_throughput`) next
to the tokens/s the Trainer trains (vanilla `Trainer` + `LoopedComputeCallback`, as `looped-hf
train` runs it), and their ratio.

    python benchmarks/bench_train.py                 # the table (a minute or two on 2 CPU cores)
    python benchmarks/bench_train.py --sweep         # also time the full iso_depth_tiny sweep
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_data import measure_pipeline_throughput  # noqa: E402

from looped_hf.arguments import parse_recipe  # noqa: E402
from looped_hf.train import train  # noqa: E402

# (label, tokenizer, seq_len, batch, model fields): tiny.yaml's model and the tiny sweep's extremes.
SETTINGS = [
    ("tiny.yaml (d64, loop4, BPE-4096)", None, 64, 16,
     {"hidden_size": 64, "num_prelude_layers": 1, "num_recurrent_layers": 2, "num_coda_layers": 1, "num_recurrences": 4}),
    ("iso_depth_tiny d32 base (bytes)", "bytes", 64, 4,
     {"hidden_size": 32, "num_prelude_layers": 0, "num_recurrent_layers": 12, "num_coda_layers": 0,
      "num_recurrences": 1, "input_injection": "none"}),
    ("iso_depth_tiny d96 loop8 (bytes)", "bytes", 64, 4,
     {"hidden_size": 96, "num_prelude_layers": 2, "num_recurrent_layers": 1, "num_coda_layers": 2, "num_recurrences": 8}),
]  # fmt: skip


def training_throughput(
    tokenizer: str | None, seq_len: int, batch: int, model: dict, steps: int, out: Path, cache: Path
) -> float:
    """Tokens/s of `steps` Trainer steps (Trainer's train_runtime: model build, data load, final
    evaluation and saving excluded)."""
    recipe = {
        **model, "head_dim": 16, "tokenizer": tokenizer, "seq_len": seq_len, "eval_blocks": 64,
        "data_cache_dir": str(cache), "per_device_train_batch_size": batch, "max_steps": steps,
        "logging_steps": steps, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "output_dir": str(out), "learning_rate": 1e-3, "torch_num_threads": torch.get_num_threads(),
    }  # fmt: skip
    record = train(*parse_recipe(recipe))
    if record["status"] != "ok":
        raise RuntimeError(record["error"])
    return record["tokens"] / record["train_runtime_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per setting")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for tiny models)")
    parser.add_argument("--sweep", action="store_true", help="also run and time recipes/iso_depth_tiny.yaml")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for i, (label, tokenizer, seq_len, batch, model) in enumerate(SETTINGS):
            cache = Path(tmp) / "data"
            pipe = measure_pipeline_throughput(
                tokenizer=tokenizer, seq_len=seq_len, batch_size=batch, max_batches=200, cache_dir=cache,
                compare_hf_collator=False,
            )  # fmt: skip
            trained = training_throughput(
                tokenizer, seq_len, batch, model, args.steps, Path(tmp) / f"run{i}", cache
            )
            rows.append((label, pipe["loader_tokens_per_s"], trained))
            print(f"  measured {label}", flush=True)

    head = f"{'setting':<36} {'pipeline tok/s':>15} {'training tok/s':>15} {'pipeline / training':>20}"
    print(f"\n(torch threads: {args.threads})\n{head}\n{'-' * len(head)}")
    for label, pipe, trained in rows:
        print(f"{label:<36} {pipe:>15,.0f} {trained:>15,.0f} {pipe / trained:>19,.0f}x")

    if args.sweep:
        from looped_hf.sweep import run_sweep

        with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
            started = time.time()
            records = run_sweep(REPO / "recipes" / "iso_depth_tiny.yaml", Path(tmp) / "sweep")
            wall = time.time() - started
        ok = sum(r["status"] == "ok" for r in records)
        print(f"\niso_depth_tiny: {len(records)} runs ({ok} ok) in {wall / 60:.1f} min wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
