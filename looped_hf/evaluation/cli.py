"""``looped-hf eval``: downstream tasks of a checkpoint at every r.

    looped-hf eval runs/tiny --bundle builtin --recurrences 1 2 4 8
    looped-hf eval runs/tiny --bundle ~/.cache/nanochat/eval_bundle --max-per-task 500
    looped-hf eval user/looped-model --bundle builtin --lm-eval arc_easy,piqa --out eval/looped-model
    looped-hf eval runs/tiny --bundle builtin --exit-criterion kl --exit-threshold 5e-4

Writes ``eval_results.json``, ``eval_results.md`` and ``eval_results.png`` into ``--out`` (default:
the checkpoint's directory; for a Hub id ``eval/<owner>__<name>``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .builtin import BUILTIN_NAME, DEFAULT_EXAMPLES, write_builtin_bundle
from .bundle import BundleError, load_bundle
from .scoring import DEFAULT_BATCH_TOKENS, EvalError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf eval",
        description="Score a checkpoint on evaluation bundles (the study's YAML + JSONL format) and lm-eval tasks "
        "at every r; writes eval_results.json / .md / .png.",
    )
    p.add_argument("checkpoint", help="a run directory, a published folder or a Hub id")
    p.add_argument(
        "--bundle", action="append", default=[], metavar="DIR",
        help=f"a bundle directory (or its YAML); '{BUILTIN_NAME}' generates the built-in reasoning primitives. "
        "Repeatable.",
    )  # fmt: skip
    p.add_argument("--recurrences", type=int, nargs="+", default=None, metavar="R",
                   help="the r values (default: 1, 2, 4, ... up to 2x the trained r, and the trained r)")  # fmt: skip
    p.add_argument("--tasks", nargs="+", default=None, metavar="LABEL", help="only these bundle tasks")
    p.add_argument("--max-per-task", type=int, default=None, metavar="N",
                   help="at most N items per task (the study's seeded shuffle, then the first N)")  # fmt: skip
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="padded tokens per forward")
    p.add_argument("--builtin-examples", type=int, default=DEFAULT_EXAMPLES, help="rows per built-in task")
    p.add_argument("--exit-criterion", default=None, help="adaptive exit (LoopedConfig.exit_criterion)")
    p.add_argument("--exit-threshold", type=float, default=None, help="its threshold (criterion's default)")
    p.add_argument("--min-recurrences", type=int, default=None, help="no exit before this many (capped at r)")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="KV-cache slots per block layer; below r the continuation is decoded through the cache")  # fmt: skip
    p.add_argument(
        "--lm-eval", default=None, metavar="TASKS", help="comma-separated lm-evaluation-harness tasks"
    )
    p.add_argument("--lm-eval-include", default=None, metavar="DIR", help="a folder of lm-eval task YAMLs")
    p.add_argument("--lm-eval-batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--out", default=None, metavar="DIR", help="where the results go")
    return p


def default_recurrences(trained: int) -> list[int]:
    """1, 2, 4, ... up to 2x the trained r, plus the trained r itself."""
    grid, r = {trained}, 1
    while r <= 2 * trained:
        grid.add(r)
        r *= 2
    return sorted(grid)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 ok, 2 a bundle, checkpoint or option that cannot be evaluated."""
    args = _parser().parse_args(argv)
    if not args.bundle and not args.lm_eval:
        print("looped-hf eval: nothing to evaluate: give --bundle DIR (or builtin) and/or --lm-eval TASKS",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.max_per_task is not None and args.max_per_task < 1:
        print(f"looped-hf eval: --max-per-task {args.max_per_task}: must be >= 1", file=sys.stderr)
        return 2
    import torch

    from .report import summary_line, write_results
    from .runner import evaluate_model, load_checkpoint

    try:
        model, tokenizer, info = load_checkpoint(args.checkpoint)
        out = Path(args.out) if args.out else (
            Path(args.checkpoint) if info["local"] else Path("eval") / args.checkpoint.replace("/", "__")
        )  # fmt: skip
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)
        bundles = [
            load_bundle(
                write_builtin_bundle(out / "builtin_bundle", args.builtin_examples)
                if spec == BUILTIN_NAME
                else spec
            )
            for spec in args.bundle
        ]
        if args.tasks:
            wanted = set(args.tasks)
            missing = sorted(wanted - {t.label for b in bundles for t in b.tasks})
            if missing:
                raise BundleError(f"--tasks {missing}: in none of the bundles given")
            bundles = [b.select([t.label for t in b.tasks if t.label in wanted]) for b in bundles]
            bundles = [b for b in bundles if any(t.label in wanted for t in b.tasks)]
        settings = {
            "exit_criterion": args.exit_criterion, "exit_threshold": args.exit_threshold,
            "min_recurrences": args.min_recurrences, "kv_budget": args.kv_budget,
        }  # fmt: skip
        results = evaluate_model(
            model, tokenizer, bundles, args.recurrences or default_recurrences(int(model.config.num_recurrences)),
            max_per_task=args.max_per_task, batch_tokens=args.batch_tokens, settings=settings,
            lm_eval_tasks=[t.strip() for t in (args.lm_eval or "").split(",") if t.strip()],
            lm_eval_include=args.lm_eval_include, lm_eval_batch_size=args.lm_eval_batch_size, progress=print,
        )  # fmt: skip
    except (BundleError, EvalError, ValueError, FileNotFoundError, OSError) as err:
        print(f"looped-hf eval: {err}", file=sys.stderr)
        return 2
    results = {**info, **results, "device": device}
    paths = write_results(results, out)
    print(f"[eval] {summary_line(results)}\n-> {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
