"""`looped-hf sweep` (and `python -m looped_hf.sweep`): print the plan (`--dry-run`) or run it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from looped_hf.arguments import RecipeError, load_yaml
from looped_hf.cli import positive_int
from looped_hf.fileio import OutputPathError, check_output_path

from .plan import EXECUTORS, make_plan
from .runner import available_cores, default_jobs, run_sweep

# The first line of the package's docstring (the package imports this module, not the reverse).
DESCRIPTION = "Iso-depth sweeps: plan (budget x width x r), run resumably, append one record per run."


def with_seeds(recipe: str, seeds: list[int]) -> dict[str, Any]:
    """The recipe at ``recipe`` with ``sweep.seeds`` replaced (each seed checked by the plan)."""
    data = load_yaml(recipe, "sweep recipe")
    section = data.get("sweep")
    if not isinstance(section, dict):
        raise RecipeError(f"sweep recipe {recipe!r}: no 'sweep' section (a single run is `looped-hf train`)")
    return {**data, "sweep": {**section, "seeds": list(seeds)}}


def main(argv: list[str] | None = None) -> int:
    """`looped-hf sweep RECIPE [--dry-run] [--output DIR] [--executor X] [--max-runs N] [--jobs N] [--seeds S ...]
    [--verbose]`."""
    parser = argparse.ArgumentParser(prog="looped-hf sweep", description=DESCRIPTION)
    parser.add_argument("recipe", help="sweep recipe (YAML with a sweep: section)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as a table; write nothing")
    parser.add_argument(
        "--output", default=None, help="sweep directory (default: sweep.output_dir or runs/<stem>)"
    )
    parser.add_argument("--executor", default=None, choices=EXECUTORS, help="override sweep.executor")
    parser.add_argument("--max-runs", type=positive_int("--max-runs"), default=None, metavar="N",
                        help="run at most N runs this session")  # fmt: skip
    parser.add_argument(
        "--jobs", "-j", type=positive_int("--jobs"), default=None, metavar="N",
        help="runs trained at once (default: available cores // the recipe's torch_num_threads, at least 1; "
             "1 if the recipe does not set torch_num_threads)",
    )  # fmt: skip
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, metavar="SEED",
        help="train these seeds instead of sweep.seeds (e.g. a second seed of a finished sweep, into its "
             "own --output; default --output runs/<stem>-seeds-<SEEDS>)",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", "-v", action="store_true",
        help="also print every run's log (always written to <run>/train.log), each line prefixed with its run id",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        recipe = args.recipe if args.seeds is None else with_seeds(args.recipe, args.seeds)
        if args.seeds is not None and args.output is None:
            args.output = str(Path("runs") / f"{Path(args.recipe).stem}-seeds-{'-'.join(map(str, args.seeds))}")
        if args.dry_run:
            plan = make_plan(recipe)
            print(plan.table())
            print(f"default --jobs here: {default_jobs(plan)} (available cores {available_cores()})")
            return 0
        if args.output is not None:  # a sweep dir from the recipe is checked with the recipe's output_dir
            check_output_path(args.output, "--output", directory=True)
        records = run_sweep(recipe, args.output, executor=args.executor, max_runs=args.max_runs,
                            jobs=args.jobs, verbose=args.verbose)  # fmt: skip
    except (RecipeError, OutputPathError) as err:
        print(f"looped-hf sweep: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlooped-hf sweep: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    failed = [r["run_id"] for r in records if r.get("status") != "ok"]
    print(
        f"[sweep] {len(records)} runs recorded, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 0
