"""How close a converted study checkpoint comes to the study's own logits.

    python benchmarks/bench_convert_nanochat.py                     # the six fixtures, in process
    python benchmarks/bench_convert_nanochat.py --through-folder    # via `convert_nanochat` + from_pretrained
    python benchmarks/bench_convert_nanochat.py --data DIR          # other fixtures of the same layout

For every fixture in ``tests/fixtures/study_checkpoints`` (made by the study's own code with
scripts/make_study_fixtures.py; see its PROVENANCE.md) it converts
``model_000020.pt`` with ``looped_hf.convert`` and prints max |logit difference| against each
logits tensor the study stored: ``logits`` (the trained r), ``logits_num_recur_R`` (another r) and
``logits_kv_budget_K`` (the study's KV-cache decode: prefill 16 tokens, then one token at a time,
teacher-forced). The last column is the same trained-r difference for a name-for-name copy without
the RoPE reparametrisation, the error the conversion removes.

``reference_differences`` is the one implementation of these comparisons: the tests load this file
for it, also in a process where looped_hf cannot be imported (only torch is imported at the top).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "study_checkpoints"
PREFILL = 16  # the study's kv decode prefills ids[:, :16] (PROVENANCE.md)


def cached_decode(model, ids: torch.Tensor, kv_budget: int, prefill: int = PREFILL) -> torch.Tensor:
    """Logits of the study's kv decode in transformers terms: ``ids[:, :prefill]`` through a fresh
    cache, then each later token alone (teacher-forced), all with ``kv_budget``."""
    out = model(ids[:, :prefill], use_cache=True, kv_budget=kv_budget)
    logits, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True, kv_budget=kv_budget)
        logits.append(out.logits)
        cache = out.cache
    return torch.cat(logits, dim=1)


def logits_for(model, key: str, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for one reference key; an unknown key raises, so none goes unchecked."""
    if key == "logits":
        return model(ids).logits
    kind, _, value = key.rpartition("_")
    if kind == "logits_num_recur":
        return model(ids, num_recurrences=int(value)).logits
    if kind == "logits_kv_budget":
        return cached_decode(model, ids, int(value))
    raise KeyError(f"reference key {key!r}: no known way to reproduce it")


def reference_differences(model, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |logits - reference[key]| for every logits key of a fixture's reference.safetensors."""
    ids = reference["input_ids"]
    with torch.no_grad():
        return {
            key: float((logits_for(model, key, ids) - reference[key]).abs().max())
            for key in sorted(reference)
            if key != "input_ids"
        }


def undo_reparametrisation(model) -> None:
    """Flip the q/k rows back in place: ``model`` becomes a name-for-name copy of the study's weights."""
    from looped_hf.convert import flip_second_rotary_half

    config = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                p.copy_(flip_second_rotary_half(p, heads, config.head_dim))


def _label(key: str, model) -> str:
    r = model.config.num_recurrences
    if key == "logits":
        return f"r = {r} (trained)"
    kind, _, value = key.rpartition("_")
    if kind == "logits_num_recur":
        return f"r = {value}"
    return f"kv decode, kv_budget = {value}, r = {r}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=DATA,
        help="folder of fixtures (default: tests/fixtures/study_checkpoints)",
    )
    p.add_argument("--through-folder", action="store_true",
                   help="write each Hub folder (convert_nanochat) and load it back with from_pretrained")  # fmt: skip
    args = p.parse_args(argv)
    if not args.data.is_dir():
        print(f"no fixtures at {args.data}", file=sys.stderr)
        return 2
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from looped_hf.convert import convert_nanochat, nanochat_to_looped

    torch.set_num_threads(1)
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in sorted(d for d in args.data.iterdir() if (d / "reference.safetensors").is_file()):
            model, _ = nanochat_to_looped(fixture)
            if args.through_folder:
                folder = convert_nanochat(fixture, Path(tmp) / fixture.name)
                model = AutoModelForCausalLM.from_pretrained(folder).eval()
            ref = load_file(fixture / "reference.safetensors")
            diffs = reference_differences(model, ref)
            undo_reparametrisation(model)
            with torch.no_grad():
                naive = float((model(ref["input_ids"]).logits - ref["logits"]).abs().max())
            for key, diff in diffs.items():
                worst = max(worst, diff)
                rows.append((fixture.name, _label(key, model), diff,
                             f"{naive:.3g}" if key == "logits" else "", float(ref[key].abs().max())))  # fmt: skip
    print("| fixture | logits | max abs diff | without RoPE flip | max abs logit |")
    print("|---|---|---|---|---|")
    for name, label, diff, naive, size in rows:
        print(f"| {name} | {label} | {diff:.3g} | {naive} | {size:.3g} |")
    print(f"\nworst: {worst:.3g} over {len(rows)} stored logits tensors "
          f"({'through the Hub folder' if args.through_folder else 'in process'})")  # fmt: skip
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
