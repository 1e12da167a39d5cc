"""Side by side: the same tiny looped run with looped_hf 0.1.0's model and optimizer, and with the study's.

`recipes/tiny.yaml` (loop4: prelude 1, block 2 x 4, coda 1, d = 64, the embedded BPE corpus), one
seed, the same data order, trained through the real `looped_hf.train.train`:

- `0.1.0`: looped_format 1 (injection W [h; e] = [I | 0]: a passthrough loop at init; QK-norm
  learnable, before RoPE), transformers' init, AdamW at the recipe's lr;
- `study model, adamw`: the study's model (W [e; h], parameter-free QK-norm after RoPE),
  transformers' init, the same AdamW;
- `study model + init, muonh`: the study's model, its init and MuonH with HyperP lrs (scaled
  from this run's batch, tokens and width; no clipping), as recipes/iso_depth_paper.yaml trains.

    python benchmarks/bench_study_fidelity.py [--steps 150] [--out runs/bench_study_fidelity]

Prints one table: held-out loss (nats/token) of each, and the wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from looped_hf.arguments import ModelArguments, load_yaml, parse_recipe
from looped_hf.train import train

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml"


@dataclasses.dataclass
class ModelArguments010(ModelArguments):
    """The model as looped_hf 0.1.0 built it (looped_format 1 and its QK-norm)."""

    def to_config(self, *args, **kwargs):
        config = super().to_config(*args, **kwargs)
        config.looped_format = 1
        config.qk_norm = "learnable_before_rope"
        return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (tiny.yaml: 150)")
    parser.add_argument("--out", default="runs/bench_study_fidelity")
    parser.add_argument("--only", nargs="+", metavar="N", type=int, help="run only these variants (1-based)")
    args = parser.parse_args(argv)
    base = load_yaml(RECIPE)
    base.pop("train_tokens", None)
    base.update(max_steps=args.steps, save_strategy="no", logging_steps=1000)
    variants = {
        "0.1.0 model, adamw": ({}, True),
        "study model, adamw": ({}, False),
        "study model + init, muonh": (
            {"optimizer": "muonh", "init_scheme": "study", "max_grad_norm": 0.0, "learning_rate": None}, False
        ),
        # HyperP's batch factor (1,024 / 262,144)^0.558 = 0.045 shrinks every lr of so small a batch;
        # the study's reference lrs, unscaled, show what MuonH does here without that extrapolation.
        "study model + init, muonh, reference lrs": (
            {"optimizer": "muonh", "init_scheme": "study", "max_grad_norm": 0.0, "learning_rate": None,
             "lr_scaling": "none"}, False
        ),
    }
    rows = []
    for number, (name, (overrides, legacy)) in enumerate(variants.items(), start=1):
        if args.only and number not in args.only:
            continue
        recipe = {**base, **overrides, "output_dir": str(Path(args.out) / name.replace(" ", "_").replace(",", ""))}
        recipe = {k: v for k, v in recipe.items() if v is not None}
        model_args, data_args, training_args = parse_recipe(recipe)
        if legacy:
            model_args = ModelArguments010(**dataclasses.asdict(model_args))
        started = time.time()
        record = train(model_args, data_args, training_args)
        rows.append((name, record["loss"], record["status"], time.time() - started))
    print(f"\ntiny.yaml (loop4, d = 64, {args.steps} steps), held-out loss")
    print(f"| {'variant':<40} | {'held-out loss':>13} | {'status':>6} | {'wall s':>6} |")
    print(f"|{'-' * 42}|{'-' * 15}|{'-' * 8}|{'-' * 8}|")
    for name, loss, status, wall in rows:
        print(f"| {name:<40} | {loss:>13.4f} | {status:>6} | {wall:>6.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
