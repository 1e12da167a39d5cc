"""``looped-hf retrofit PARENT_DIR``: a dense transformers checkpoint -> a Hub-ready looped folder.

    looped-hf retrofit tinyllama --layers 4,8,4                     # McLeish et al. 2025's rule
    looped-hf retrofit tinyllama --prelude 0-3 --recurrent 10-17 --coda 18-21
    looped-hf retrofit olmo --loop-in-place --layers 7,4,5           # every layer kept: r = 1 is the parent
    looped-hf retrofit smollm --share average --blocks 10 --lora-rank 64   # Relaxed Recursive Transformers

Bad input is one line naming the flag (or config field) and the value, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from ..convert.common import ConversionError
from ..publish import PublishError
from .core import ADAPTER_INITS, DEFAULT_OUT_SUFFIX, STATE_INITS, retrofit
from .plan import (
    SHARE_STRATEGIES,
    LayerPlan,
    default_loop_in_place_split,
    explicit,
    loop_in_place,
    paper_rule,
    parse_range,
)
from .plan import share as share_plan


def _parser() -> argparse.ArgumentParser:
    from looped_hf.cli import positive_int

    p = argparse.ArgumentParser(prog="looped-hf retrofit", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("parent_dir", help="the parent: a transformers checkpoint folder (config.json + safetensors) of "
                                      "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or "
                                      "Olmo2ForCausalLM")  # fmt: skip
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help=f"the folder to write (default: PARENT_DIR{DEFAULT_OUT_SUFFIX})",
    )
    layers = p.add_argument_group("layer choice (one form)")
    layers.add_argument(
        "--layers",
        default=None,
        metavar="P,R,C",
        help="the first P layers, the R before the last C, the last C (the rest dropped)",
    )
    layers.add_argument("--prelude", default=None, metavar="A-B", help="explicit prelude layers (from 0)")
    layers.add_argument("--recurrent", default=None, metavar="A-B", help="explicit recurrent-block layers")
    layers.add_argument("--coda", default=None, metavar="A-B", help="explicit coda layers (to the last)")
    layers.add_argument("--loop-in-place", action="store_true",
                        help="keep every layer and loop a span (--layers / ranges covering all layers; default "
                             "a quarter / the middle half / a quarter)")  # fmt: skip
    layers.add_argument("--share", default=None, choices=SHARE_STRATEGIES,
                        help="Relaxed Recursive Transformers: K shared layers looped L/K times, initialised stepwise, "
                             "as the average of the layers tied to each, or from the lower K")  # fmt: skip
    layers.add_argument(
        "--blocks",
        default=None,
        type=positive_int("--blocks"),
        metavar="K",
        help="with --share: the shared layers K",
    )
    layers.add_argument("--lora-rank", default=None, type=positive_int("--lora-rank"), metavar="N",
                        help="with --share: a LoRA per loop position from the SVD of (W_original - W_shared); "
                             "full rank reproduces the parent")  # fmt: skip
    p.add_argument(
        "--num-recurrences",
        default=None,
        type=positive_int("--num-recurrences"),
        metavar="R",
        help="the folder's r (default 1: the first pass; --share: L/K, fixed)",
    )
    p.add_argument("--adapter-init", default=None, choices=ADAPTER_INITS,
                   help="identity (default: [0 | I] on [state; embedding], the block reads the prelude output) or "
                        "study (the paper's runs: a random nn.Linear, --seed)")  # fmt: skip
    p.add_argument("--state-init", default=None, choices=STATE_INITS,
                   help="h_0: truncated_normal (default, the paper's: std sqrt(2/(5d))), zeros (deterministic, "
                        "needed to serve with vLLM) or prelude (h_0 = e)")  # fmt: skip
    p.add_argument("--seed", default=None, help="seed of the study adapter init (default 0; only with "
                                                             "--adapter-init study, the one random init)")  # fmt: skip
    p.add_argument("--repo-id", default=None, metavar="ORG/NAME", help="Hub id shown in the card")
    p.add_argument("--license", default=None, help="license id for the card metadata (default: none stated)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    return p


def _seed(text: str) -> int:
    """``--seed`` as an integer in 0 .. 2**32 - 1; anything else (9e22, 10**30, -1) one
    ``ConversionError`` line (read after argparse, whose type errors print the usage too)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32:
        raise ConversionError(f"--seed={text!r}: must be an integer in [0, 2**32 - 1]")
    return value


def _given(args: argparse.Namespace, *names: str) -> list[str]:
    flags = {"layers": "--layers", "prelude": "--prelude", "recurrent": "--recurrent", "coda": "--coda",
             "loop_in_place": "--loop-in-place", "lora_rank": "--lora-rank", "num_recurrences": "--num-recurrences",
             "adapter_init": "--adapter-init", "state_init": "--state-init", "blocks": "--blocks", "seed": "--seed"}  # fmt: skip
    return [flags[n] for n in names if getattr(args, n) not in (None, False)]


def plan_from_args(args: argparse.Namespace) -> Callable[[int], LayerPlan]:
    """The layer plan the flags ask for, as a function of the parent's layer count; refuses flags
    that do not combine (a flag that would be ignored is an error, not a silent default)."""
    if args.share is not None:
        clash = _given(args, "layers", "prelude", "recurrent", "coda", "loop_in_place", "num_recurrences",
                       "adapter_init", "state_init", "seed")  # fmt: skip
        if clash:
            raise ConversionError(f"{clash[0]}: not an option of --share={args.share} (the shared stack spans every "
                                  "layer, loops L/K times and reads the previous loop's output)")  # fmt: skip
        if args.blocks is None:
            raise ConversionError(f"--share={args.share}: needs --blocks K (the shared layers)")
        return lambda n: share_plan(n, args.blocks, args.share)
    stray = _given(args, "blocks", "lora_rank")
    if stray:
        raise ConversionError(f"{stray[0]}: only with --share (per-loop LoRA relaxes a shared stack)")
    if args.seed is not None:
        args.seed = _seed(args.seed)
    if args.seed is not None and args.adapter_init != "study":
        # Only the study adapter is random; a seed that changes nothing is refused, not ignored.
        raise ConversionError(f"--seed={args.seed}: seeds only --adapter-init study (the adapter is "
                              f"{args.adapter_init or 'identity'}: nothing random to seed)")  # fmt: skip
    r = args.num_recurrences or 1
    ranges = _given(args, "prelude", "recurrent", "coda")
    if args.layers is not None and ranges:
        raise ConversionError(f"--layers={args.layers!r} and {ranges[0]}: give one layer choice, not both")
    if args.layers is not None:
        try:
            counts = [int(x) for x in args.layers.split(",")]
        except ValueError:
            counts = []
        if len(counts) != 3:
            raise ConversionError(f"--layers={args.layers!r}: expected three counts P,R,C (e.g. 4,8,4)")

        def base(n: int) -> LayerPlan:
            return paper_rule(n, *counts, num_recurrences=r)
    elif ranges:
        if args.recurrent is None:
            raise ConversionError(f"{ranges[0]}: explicit ranges need --recurrent A-B too")
        prelude = parse_range("--prelude", args.prelude) if args.prelude else None
        recurrent = parse_range("--recurrent", args.recurrent)
        coda = parse_range("--coda", args.coda) if args.coda else None

        def base(n: int) -> LayerPlan:
            # With --loop-in-place nothing is dropped, so one range says it all: a prelude or a coda
            # not given is every layer before or after the block (--recurrent 2-3 of 6: 0-1 / 4-5).
            before = list(range(recurrent[0])) if args.loop_in_place else []
            after = list(range(recurrent[-1] + 1, n)) if args.loop_in_place else []
            return explicit(n, before if prelude is None else prelude, recurrent, after if coda is None else coda,
                            num_recurrences=r)  # fmt: skip
    elif args.loop_in_place:

        def base(n: int) -> LayerPlan:
            return paper_rule(n, *default_loop_in_place_split(n), num_recurrences=r)
    else:
        raise ConversionError("no layer choice: give --layers P,R,C, --prelude/--recurrent/--coda, --loop-in-place "
                              "or --share")  # fmt: skip
    return (lambda n: loop_in_place(base(n))) if args.loop_in_place else base


def main(argv: list[str] | None = None) -> int:
    """``looped-hf retrofit``; returns 0, or 2 on bad input (one line, nothing written)."""
    args = _parser().parse_args(argv)
    try:
        plan_for = plan_from_args(args)
        if args.lora_rank is not None:
            from .lora_init import retrofit_shared_lora

            folder = retrofit_shared_lora(args.parent_dir, args.out, plan_for, rank=args.lora_rank,
                                          repo_id=args.repo_id, license=args.license, overwrite=args.overwrite)  # fmt: skip
        else:
            folder = retrofit(args.parent_dir, args.out, plan_for, adapter_init=args.adapter_init or "identity",
                              state_init=args.state_init or "truncated_normal", seed=args.seed or 0, repo_id=args.repo_id,
                              license=args.license, overwrite=args.overwrite)  # fmt: skip
    except (ConversionError, PublishError) as err:
        print(f"looped-hf retrofit: error: {err}", file=sys.stderr)
        return 2
    print(f"[retrofit] wrote {folder}: {', '.join(sorted(p.name for p in Path(folder).iterdir()))}")
    return 0


__all__ = ["main", "plan_from_args"]


if __name__ == "__main__":
    sys.exit(main())
