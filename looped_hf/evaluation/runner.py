"""Load a checkpoint and evaluate bundles (and lm-eval tasks) at every r: the results object.

:func:`evaluate_model` is the work (a loaded model, bundles, r values -> one JSON-ready dict);
:func:`load_checkpoint` finds what to load in a run directory (``looped-hf train``), a published
folder (``looped-hf publish``) or a Hub id, as ``looped-hf test-time`` and ``publish`` load them
(``LoopedForCausalLM.from_pretrained`` + ``AutoTokenizer.from_pretrained``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from looped_hf.fileio import (
    TOKENIZER_DEFINING_FILES,
    CheckpointError,
    check_checkpoint_dir,
    check_finished_run,
    first_line,
    has_tokenizer,
)

from .bundle import Bundle
from .scoring import (
    DEFAULT_BATCH_TOKENS,
    EvalError,
    aggregate,
    bos_id,
    prepare_task,
    score_sequences,
    task_metrics,
)

PathLike = str | os.PathLike[str]
#: The settings of generate()/forward that change what the model computes per token at a given r.
CALL_SETTINGS = ("exit_criterion", "exit_threshold", "min_recurrences", "kv_budget")


def check_lm_eval_tasks(tasks: Sequence[str], include_path: PathLike | None = None) -> Any:
    """The lm-eval task manager for `tasks`, checked before the model is loaded: an unknown task or
    lm-eval not installed is an `EvalError` naming it."""
    from .lm_eval_bridge import task_manager_for

    try:
        return task_manager_for(tasks, include_path)
    except (ImportError, ValueError) as err:
        raise EvalError(first_line(err)) from None


def load_pretrained(checkpoint: PathLike) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of a checkpoint folder or Hub id, every failure a
    `CheckpointError` naming the file: a local folder is checked first (`check_checkpoint_dir`:
    a looped model_type, weights not truncated), then loaded with its model type's class
    (`model_types`: a per-loop LoRA retrofit too); a config value `LoopedConfig` refuses
    (num_recurrences 0, ...) and a weights file torch cannot read are named too. Eval, publish and
    test-time all load through here."""
    from transformers import AutoTokenizer

    from looped_hf.model_types import load_causal_lm

    if Path(checkpoint).is_dir():
        check_checkpoint_dir(checkpoint)
        # Said before the model loads, in words a user can act on: transformers' own error for an
        # absent tokenizer ("Couldn't instantiate the backend tokenizer from one of: ...") names neither.
        if not has_tokenizer(checkpoint):
            raise CheckpointError(
                f"checkpoint {str(checkpoint)!r} has no tokenizer (none of {', '.join(TOKENIZER_DEFINING_FILES)}): "
                "save the model's tokenizer into it with tokenizer.save_pretrained (looped-hf convert copies "
                "the source folder's)"
            )
    try:
        model = load_causal_lm(checkpoint).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, SafetensorError, ...: the file is named
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} cannot be loaded: {first_line(err)}") from err
    if len(tokenizer) > model.config.vocab_size:  # its last ids would index past the embedding, mid-run
        raise CheckpointError(
            f"checkpoint {str(checkpoint)!r}: the tokenizer has {len(tokenizer)} tokens, more than the model's "
            f"vocab_size={model.config.vocab_size}; it is not this model's tokenizer"
        )
    return model, tokenizer


def load_checkpoint(checkpoint: PathLike) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, tokenizer, info) of a run directory, a published folder or a Hub id.

    ``info``: ``checkpoint`` (as given), ``run_id`` (the run record's, else the folder or repo
    name), ``local`` (a directory here), ``weights_sha256`` (local weights) and the run record's
    ``train_flops`` / ``tokens`` / ``num_recurrences`` when there is one."""
    from looped_hf.fileio import weights_sha256

    path = Path(checkpoint)
    local = path.is_dir()
    if path.exists() and not local:
        raise EvalError(
            f"checkpoint={str(checkpoint)!r}: not a directory (a run directory, a published folder or a Hub id)"
        )
    try:  # a published or converted folder has no run record; a run directory must be finished
        record: dict[str, Any] = (check_finished_run(path, required=False) if local else None) or {}
    except ValueError as err:
        raise EvalError(str(err)) from None
    model, tokenizer = load_pretrained(checkpoint)
    info = {
        "checkpoint": str(checkpoint),
        "run_id": record.get("run_id") or (path.name if local else str(checkpoint)),
        "local": local,
        "weights_sha256": weights_sha256(path) if local else None,
        "train_flops": record.get("train_flops"),
        "tokens": record.get("tokens"),
        "variant": record.get("variant"),
    }
    return model, tokenizer, info


def check_recurrences(config: Any, recurrences: Sequence[int], kv_budget: int | None = None) -> list[int]:
    """The r values to score (sorted, deduplicated), each checked before the first is scored (for a
    local folder, before the model is loaded), by the model's config, the one owner of the r rules
    (`LoopedConfig.resolve_num_recurrences`: an integer >= 1, at most the ceiling, only the trained r
    for a recurrence-locked model) and of the KV budget (`LoopedConfig.num_kv_slots`; a per-loop LoRA
    model's refuses one below r). A refusal is an `EvalError` naming the field and value."""
    if not recurrences:
        raise EvalError("recurrences=[]: need at least one r")
    try:
        grid = sorted({config.resolve_num_recurrences(r) for r in recurrences})
        for r in grid:
            config.num_kv_slots(r, kv_budget)
    except ValueError as err:
        raise EvalError(str(err)) from None
    return grid


def _call_kwargs(settings: Mapping[str, Any], r: int) -> dict[str, Any]:
    """The forward keywords of one pass. ``min_recurrences`` is capped at r, so one setting serves a
    whole r sweep (r = 1 with min_recurrences 2 runs its one recurrence)."""
    kwargs = {k: v for k, v in settings.items() if v is not None}
    if "min_recurrences" in kwargs:
        kwargs["min_recurrences"] = min(int(kwargs["min_recurrences"]), r)
    return kwargs


def evaluate_model(
    model: Any,
    tokenizer: Any,
    bundles: Sequence[Bundle],
    recurrences: Sequence[int],
    *,
    max_per_task: int | None = None,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    settings: Mapping[str, Any] | None = None,
    lm_eval_tasks: Sequence[str] = (),
    lm_eval_include: PathLike | None = None,
    lm_eval_batch_size: int = 8,
    lm_eval_manager: Any = None,
    seed: int = 0,
    progress: Any = None,
) -> dict[str, Any]:
    """Score every task of ``bundles`` (and the lm-eval tasks) at every r; returns the results dict.

    Args:
        model: a ``LoopedForCausalLM`` (eval mode).
        tokenizer: its tokenizer.
        bundles: read with :func:`looped_hf.evaluation.load_bundle`.
        recurrences: the r values (sorted, deduplicated).
        max_per_task: at most this many items per task (the study's seeded shuffle, then the first N).
        batch_tokens: padded tokens per forward.
        settings: ``exit_criterion`` / ``exit_threshold`` / ``min_recurrences`` / ``kv_budget`` for
            every forward (None: the model's config).
        lm_eval_tasks: lm-evaluation-harness task names run at every r too (table rows ``lm_eval``).
        lm_eval_include: a folder of lm-eval task YAMLs to register.
        lm_eval_manager: the task manager `check_lm_eval_tasks` returned (else built when needed).
        seed: torch is re-seeded before each r (a model with a random initial state scores the same twice).
        progress: a callable taking one line of text (e.g. ``print``), or None.

    Returns:
        ``rows`` (one per r: ``num_recurrences``, ``tasks`` {label: accuracy, centered, loss,
        num_items, mean_recurrences}, ``bundles`` {name: mean_centered, group_mean, groups},
        ``mean_recurrences``), ``tasks`` (each task's description), ``trained_num_recurrences``,
        ``settings`` and provenance."""
    import torch

    from looped_hf.train import versions

    unknown = sorted(set(settings or {}) - set(CALL_SETTINGS))
    if unknown:
        raise EvalError(f"settings {unknown}: unknown; one of {list(CALL_SETTINGS)}")
    settings = {k: (settings or {}).get(k) for k in CALL_SETTINGS}
    grid = check_recurrences(model.config, recurrences, settings["kv_budget"])
    say = progress or (lambda _line: None)
    started = time.time()
    max_length = getattr(model.config, "max_position_embeddings", None)
    prepared, groups, bundle_of = [], {}, {}
    for bundle in bundles:
        for task in bundle.tasks:
            if task.label in bundle_of:
                raise EvalError(
                    f"task label {task.label!r} is in both {bundle_of[task.label]!r} and {bundle.name!r}"
                )
            bundle_of[task.label], groups[task.label] = bundle.name, task.group
            prepared.append(prepare_task(task, tokenizer, max_per_task, max_length))  # once, for every r
    pad = bos_id(tokenizer)
    if prepared:
        say(f"[eval] {len(prepared)} tasks ({sum(len(p.sequences) for p in prepared)} sequences) at r = {grid}")
    rows = []
    for r in grid:
        kwargs = _call_kwargs(settings, r)
        results: dict[str, dict[str, Any]] = {}
        for p in prepared:
            torch.manual_seed(seed)
            t0 = time.time()
            scores = score_sequences(
                model, p.sequences, r, batch_tokens=batch_tokens, call_kwargs=kwargs, pad_id=pad
            )
            results[p.task.label] = {**task_metrics(p, scores), "seconds": round(time.time() - t0, 3)}
            m = results[p.task.label]
            say(
                f"[eval] r={r} {p.task.label}: accuracy {m['accuracy']:.4f}, centered {m['centered']:.4f}, "
                f"loss {m['loss']:.4f}, {m['num_items']} items, {m['seconds']:.1f}s"
            )
        per_bundle = {
            b.name: aggregate({t.label: results[t.label] for t in b.tasks}, groups)
            for b in bundles
            if b.tasks
        }
        rows.append({"num_recurrences": r, "tasks": results, "bundles": per_bundle})
    lm_meta = []
    if lm_eval_tasks:
        from .lm_eval_bridge import run_lm_eval

        lm_rows = run_lm_eval(
            model, tokenizer, lm_eval_tasks, grid, include_path=lm_eval_include, limit=max_per_task or None,
            batch_size=lm_eval_batch_size, call_kwargs={k: v for k, v in settings.items() if v is not None},
            task_manager=lm_eval_manager,
        )  # fmt: skip
        for row in rows:
            found = lm_rows[row["num_recurrences"]]
            for label in found:
                if label in bundle_of:
                    raise EvalError(
                        f"lm-eval task {label!r} has the label of a bundle task of {bundle_of[label]!r}"
                    )
                groups[label] = "lm_eval"
            row["tasks"].update(found)
            row["bundles"]["lm_eval"] = aggregate(found, groups)
            for label, m in found.items():
                say(f"[eval] r={row['num_recurrences']} {label} (lm-eval {m['metric']}): {m['accuracy']:.4f}")
        first = lm_rows[grid[0]]
        lm_meta = [
            {"label": t, "group": "lm_eval", "source": "lm-eval", "metric": first[t]["metric"]} for t in first
        ]
    for row in rows:
        rec = [m["mean_recurrences"] for m in row["tasks"].values() if m.get("mean_recurrences") is not None]
        finite = [x for x in rec if math.isfinite(x)]
        row["mean_recurrences"] = sum(finite) / len(finite) if finite else None
    return {
        "trained_num_recurrences": int(model.config.num_recurrences),
        "recurrences": grid,
        "settings": {**settings, "max_per_task": max_per_task, "batch_tokens": batch_tokens, "seed": seed},
        "adaptive": any(settings.get(k) is not None for k in CALL_SETTINGS)
        or getattr(model.config, "exit_criterion", None) not in (None, "none"),
        "bundles": [{"name": b.name, "path": str(b.path)} for b in bundles],
        "tasks": [{**t.to_meta(), "bundle": b.name} for b in bundles for t in b.tasks] + lm_meta,
        "rows": rows,
        "wall_time_s": round(time.time() - started, 3),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
    }


__all__ = ["CALL_SETTINGS", "evaluate_model", "load_checkpoint"]
