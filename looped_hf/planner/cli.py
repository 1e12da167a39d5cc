"""``looped-hf plan``: parse, plan, print (a table, or ``--json``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looped_hf.scaling import ScalingLawFit

from .search import plan


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf plan",
        description="Plan compute-optimal looped models from a fitted law: width, r, tokens, predicted loss.",
    )
    p.add_argument("fit", help="fit.json written by `looped-hf fit --out` (with its bootstrap resamples)")
    p.add_argument("--budget", type=float, nargs="+", default=[], metavar="C", help="training FLOP budgets")
    p.add_argument("--recurrences", type=int, nargs="+", default=None, metavar="R",
                   help="r values to compare (default: the fitted runs')")  # fmt: skip
    p.add_argument("--inference-tokens", type=float, default=None, metavar="T",
                   help="tokens to serve: pick r by training + T x inference FLOPs at equal loss")  # fmt: skip
    p.add_argument("--inference-recurrences", nargs="+", default=None, metavar="R=MEAN",
                   help="mean recurrences at inference per trained r (adaptive exit), e.g. 4=2.7")  # fmt: skip
    p.add_argument("--kv-budget", type=int, default=None, metavar="K", help="also KV bytes with K recurrences kept")
    p.add_argument("--kv-bytes", type=float, default=2.0, metavar="B", help="bytes per KV element (default 2, bf16)")
    p.add_argument("--target-loss", type=float, default=None, metavar="L", help="cheapest model per r reaching L")
    p.add_argument("--recipe", default=None, metavar="SWEEP_YAML",
                   help="the sweep recipe of the fitted runs (default: sweep.yaml beside the fit's results.jsonl)")  # fmt: skip
    p.add_argument("--resamples", type=int, default=None, metavar="N", help="use at most N bootstrap resamples")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _parse_inference_recurrences(items: list[str] | None) -> dict[int, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        try:
            r, mean = item.split("=")
            out[int(r)] = float(mean)
        except ValueError:
            raise ValueError(f"--inference-recurrences {item!r}: expected R=MEAN, e.g. 4=2.7") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """``looped-hf plan``: exit 0 with the plan, 2 on bad input (the message names the field)."""
    args = _parser().parse_args(argv)
    try:
        if not Path(args.fit).is_file():
            raise ValueError(f"fit={args.fit!r}: no such file")
        fit = ScalingLawFit.from_json(args.fit)
        if not args.budget and args.target_loss is None:
            raise ValueError("--budget: give at least one training budget C (or --target-loss L)")
        result = plan(
            fit, args.budget, recurrences=args.recurrences, recipe=args.recipe,
            inference_tokens=args.inference_tokens,
            inference_recurrences=_parse_inference_recurrences(args.inference_recurrences),
            kv_budget=args.kv_budget, target_loss=args.target_loss, kv_bytes_per_element=args.kv_bytes,
            resamples=args.resamples,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        print(f"looped-hf plan: {err}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table())
    return 0

