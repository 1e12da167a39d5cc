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
from typing import Any

from looped_hf.cli import positive_int
from looped_hf.fileio import check_checkpoint_dir, check_output_path, first_line

from .builtin import BUILTIN_NAME, DEFAULT_EXAMPLES, write_builtin_bundle
from .bundle import BundleError, load_bundle
from .scoring import DEFAULT_BATCH_TOKENS, EvalError

#: Past this many times the trained r, eval warns with the cost before it starts. The ceiling is the
#: model's own (`LoopedConfig.recurrence_ceiling`), checked for every r before the first is scored.
WARN_RECURRENCE_FACTOR = 16


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
    p.add_argument("--recurrences", type=positive_int("--recurrences"), nargs="+", default=None, metavar="R",
                   help="the r values (default: 1, 2, 4, ... up to 2x the trained r, and the trained r); at most "
                   "the model's ceiling (config.max_recurrences, else 64x the trained r)")  # fmt: skip
    p.add_argument("--tasks", nargs="+", default=None, metavar="LABEL", help="only these bundle tasks")
    p.add_argument("--max-per-task", type=positive_int("--max-per-task"), default=None, metavar="N",
                   help="at most N items per task (the study's seeded shuffle, then the first N)")  # fmt: skip
    p.add_argument("--batch-tokens", type=positive_int("--batch-tokens"), default=DEFAULT_BATCH_TOKENS,
                   help="padded tokens per forward")  # fmt: skip
    p.add_argument("--builtin-examples", type=positive_int("--builtin-examples"), default=DEFAULT_EXAMPLES,
                   help="rows per built-in task")  # fmt: skip
    p.add_argument("--exit-criterion", default=None, help="adaptive exit (LoopedConfig.exit_criterion)")
    p.add_argument("--exit-threshold", type=float, default=None, help="its threshold (criterion's default)")
    p.add_argument("--min-recurrences", type=positive_int("--min-recurrences"), default=None,
                   help="no exit before this many (capped at r)")  # fmt: skip
    p.add_argument("--kv-budget", type=positive_int("--kv-budget"), default=None,
                   help="KV-cache slots per block layer; below r the continuation is decoded through the cache")  # fmt: skip
    p.add_argument(
        "--lm-eval", default=None, metavar="TASKS", help="comma-separated lm-evaluation-harness tasks"
    )
    p.add_argument("--lm-eval-include", default=None, metavar="DIR", help="a folder of lm-eval task YAMLs")
    p.add_argument("--lm-eval-batch-size", type=positive_int("--lm-eval-batch-size"), default=8)
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="the tokenizer of a folder that has none (a transformers looped class's, e.g. HRM-Text: "
                   "looped_hf.depth_tools); a Hub name, a folder or a tokenizer.json")  # fmt: skip
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--out", default=None, metavar="DIR", help="where the results go")
    return p


def _check_device(device: str) -> str:
    """A device torch can allocate on, checked before the model is loaded."""
    import torch

    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, ValueError) as err:  # unknown type, no such index, not compiled
        raise EvalError(f"--device {device!r}: not usable here ({first_line(err)})") from None
    return device


def _warn_cost(recurrences: list[int], trained: int) -> None:
    far = [r for r in recurrences if r > WARN_RECURRENCE_FACTOR * trained]
    if far:
        print(f"looped-hf eval: warning: --recurrences {far} are over {WARN_RECURRENCE_FACTOR}x the trained r="
              f"{trained}: the recurrent block runs {max(far)} times per token, ~{max(far) / trained:.0f}x the "
              "trained model's block compute per item", file=sys.stderr)  # fmt: skip


def check_exit_flags(
    config: Any, criterion: str | None, threshold: float | None, minimum: int | None
) -> None:
    """The adaptive-exit flags against the model's config, before any forward, by the config's own
    rule (`LoopedConfig.exit_settings`: a NaN or negative threshold is a ValueError naming it). A
    threshold that no criterion reads (neither --exit-criterion nor the config's) is refused too:
    it would be ignored, and the results would not be what the command line says."""
    if config.exit_settings(criterion, threshold, minimum) is None and threshold is not None:
        raise EvalError(f"--exit-threshold {threshold!r}: no exit criterion reads it (give --exit-criterion; "
                        "this model's config has exit_criterion=None)")  # fmt: skip


def default_recurrences(config: Any, default_r: int | None = None) -> list[int]:
    """1, 2, 4, ... up to 2x the trained r (at most the model's ceiling: a per-loop LoRA retrofit
    runs only the loops that have a LoRA), plus the trained r itself and ``default_r``, the r that
    ``generate()`` runs by default (a generation_config.json's ``num_recurrences``)."""
    trained = int(config.num_recurrences)
    grid, r = {trained} | ({int(default_r)} if default_r is not None else set()), 1
    while r <= min(2 * trained, config.recurrence_ceiling):
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
    import torch

    from looped_hf.generation_looped import generation_depth, saved_generation_depth

    from .report import summary_line, write_results
    from .runner import check_lm_eval_tasks, check_recurrences, evaluate_model, load_checkpoint

    lm_eval_tasks = [t.strip() for t in (args.lm_eval or "").split(",") if t.strip()]
    if args.lm_eval is not None and not lm_eval_tasks:
        print(f"looped-hf eval: --lm-eval {args.lm_eval!r}: names no task", file=sys.stderr)
        return 2
    try:
        # Everything that can be checked is checked before the model is loaded or a task scored.
        device = _check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        local = Path(args.checkpoint).is_dir()
        exit_flags = (args.exit_criterion, args.exit_threshold, args.min_recurrences)
        from looped_hf.depth_tools import check_native_folder, native_entry

        native = local and native_entry(args.checkpoint) is not None
        if args.tokenizer is not None and not native:
            raise EvalError(
                "--tokenizer applies to a folder without a tokenizer of a transformers looped class only"
            )
        if native:  # a looped class transformers ships: each r through looped_hf.at_depth
            from transformers import AutoConfig

            from looped_hf.depth_tools import DepthConfig

            entry = check_native_folder(args.checkpoint, args.tokenizer)
            config = DepthConfig(AutoConfig.from_pretrained(args.checkpoint), entry)
            check_exit_flags(config, *exit_flags)
            check_recurrences(config, args.recurrences or default_recurrences(config), args.kv_budget)
        elif local:  # before the builtin bundle is written into --out: a refused folder leaves nothing
            check_checkpoint_dir(args.checkpoint)
            from looped_hf.model_types import check_weights, load_config

            config = load_config(args.checkpoint)
            check_weights(args.checkpoint, config)
            check_exit_flags(config, *exit_flags)
            saved = generation_depth(config, argparse.Namespace(**saved_generation_depth(args.checkpoint)))
            check_recurrences(config, args.recurrences or default_recurrences(config, saved["num_recurrences"]),
                              args.kv_budget if args.kv_budget is not None else saved["kv_budget"])  # fmt: skip
        out = check_output_path(Path(args.out) if args.out else (
            Path(args.checkpoint) if local else Path("eval") / args.checkpoint.replace("/", "__")
        ), "--out", directory=True)  # fmt: skip
        manager = check_lm_eval_tasks(lm_eval_tasks, args.lm_eval_include) if lm_eval_tasks else None
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
        # The bundles and --tasks are read first: a bad one is refused without loading the model.
        if native:
            from looped_hf.depth_tools import native_checkpoint

            model, tokenizer, info = native_checkpoint(args.checkpoint, args.tokenizer)
        else:
            model, tokenizer, info = load_checkpoint(args.checkpoint)
        check_exit_flags(model.config, *exit_flags)  # a Hub id's config is read only now
        model.to(device)
        # The defaults generate() reads (a generation_config.json's num_recurrences and kv_budget); a
        # transformers looped class (``native``) has its depth in its own config fields (depth.py).
        depth = ({"num_recurrences": None, "kv_budget": None} if native
                 else generation_depth(model.config, model.generation_config))  # fmt: skip
        settings = {
            "exit_criterion": args.exit_criterion, "exit_threshold": args.exit_threshold,
            "min_recurrences": args.min_recurrences,
            "kv_budget": args.kv_budget if args.kv_budget is not None else depth["kv_budget"],
        }  # fmt: skip
        trained = int(model.config.num_recurrences)
        recurrences = args.recurrences or default_recurrences(model.config, depth["num_recurrences"])
        # Every r and the KV budget, through the model's config, before any r is scored.
        _warn_cost(check_recurrences(model.config, recurrences, settings["kv_budget"]), trained)
        results = evaluate_model(
            model, tokenizer, bundles, recurrences,
            max_per_task=args.max_per_task, batch_tokens=args.batch_tokens, settings=settings,
            lm_eval_tasks=lm_eval_tasks, lm_eval_include=args.lm_eval_include,
            lm_eval_batch_size=args.lm_eval_batch_size, lm_eval_manager=manager, progress=print,
        )  # fmt: skip
    except (BundleError, EvalError, ValueError, FileNotFoundError, OSError) as err:
        print(f"looped-hf eval: {err}", file=sys.stderr)
        return 2
    results = {**info, **results, "device": device}
    try:  # checked before the scoring, but a disk can fill or a folder vanish meanwhile
        paths = write_results(results, out)
    except OSError as err:
        print(f"looped-hf eval: --out {out}: cannot be written ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"[eval] {summary_line(results)}\n-> {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
