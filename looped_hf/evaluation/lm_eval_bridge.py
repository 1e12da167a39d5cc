"""lm-evaluation-harness tasks at every r, through lm-eval's own HF model class.

``LoopedHFLM`` is lm-eval's ``HFLM`` around an already-loaded ``LoopedForCausalLM``; it adds the
looped settings of a pass (``num_recurrences``, and the exit / KV-budget settings) to every
forward lm-eval makes (log-likelihoods) and to ``generate`` (generation tasks), and counts the
recurrences the model reports running. :func:`run_lm_eval` runs the tasks once per r and returns
rows in the shape of the bundle results, so both fill the same table.

lm-eval is an optional dependency (``pip install 'looped_hf[eval]'``); only this module imports it.
Tasks come from lm-eval's registry or from YAML files in ``include_path`` (a local task with a
local JSON dataset runs offline).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

PathLike = str | os.PathLike[str]

#: Which lm-eval metric fills the table's accuracy column, in order of preference.
PREFERRED_METRICS = ("acc", "exact_match", "acc_norm", "mcc", "f1", "bleu")


def _require_lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "--lm-eval needs lm-evaluation-harness: pip install 'looped_hf[eval]' (or pip install lm-eval)"
        ) from err
    return lm_eval


def make_lm(model: Any, tokenizer: Any, batch_size: int = 8) -> Any:
    """A ``LoopedHFLM`` (lm-eval's ``HFLM`` subclass) around ``model``; set ``call_kwargs`` per pass."""
    _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    class LoopedHFLM(HFLM):
        """lm-eval's HF model class with the looped settings added to every model call."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.call_kwargs: dict[str, Any] = {}
            self.recurrences_run = 0.0  # summed over every position of every call
            self.positions_run = 0

        def _count(self, out: Any, default_r: int, positions: int) -> None:
            used = getattr(out, "recurrences_used", None)
            self.recurrences_run += float(used.sum()) if used is not None else float(default_r * positions)
            self.positions_run += positions

        def _model_call(self, inps: Any, attn_mask: Any = None, labels: Any = None) -> Any:
            import torch

            with torch.no_grad():
                out = self.model(input_ids=inps, **self.call_kwargs)
            self._count(
                out, self.call_kwargs.get("num_recurrences", self.model.config.num_recurrences), inps.numel()
            )
            return out.logits

        def _model_generate(
            self, context: Any, max_length: int, stop: list[str], **generation_kwargs: Any
        ) -> Any:
            return super()._model_generate(context, max_length, stop, **generation_kwargs, **self.call_kwargs)

    device = next(model.parameters()).device
    return LoopedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(device))


def pick_metric(task_result: Mapping[str, Any]) -> tuple[str, float]:
    """(name, value) of the metric that fills the accuracy column: the first of
    ``PREFERRED_METRICS`` the task reports, else its first numeric metric."""
    numeric = {
        key.split(",")[0]: float(value)
        for key, value in task_result.items()
        if "," in key
        and "_stderr" not in key
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }
    for name in PREFERRED_METRICS:
        if name in numeric:
            return name, numeric[name]
    if not numeric:
        raise ValueError(f"lm-eval reported no numeric metric: {sorted(task_result)}")
    name = next(iter(numeric))
    return name, numeric[name]


def task_manager_for(tasks: Sequence[str], include_path: PathLike | None = None) -> Any:
    """lm-eval's `TaskManager` that knows every one of `tasks`; raises `ValueError` naming the
    unknown ones (and the closest known names), before anything is scored."""
    import difflib

    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path:
        if not os.path.isdir(include_path):
            raise ValueError(f"--lm-eval-include {str(include_path)!r}: no such directory")
        # Indexing lm-eval's own thousands of task YAMLs takes seconds; skip it when the local
        # folder has every task asked for.
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not set(tasks) <= set(manager.all_tasks):
            manager = None
    if manager is None:
        manager = TaskManager(include_path=str(include_path) if include_path else None)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        close = sorted({m for t in unknown for m in difflib.get_close_matches(t, sorted(known), n=3)})
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"--lm-eval {','.join(unknown)}: not lm-eval task(s){hint}")
    return manager


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    recurrences: Sequence[int],
    *,
    include_path: PathLike | None = None,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    call_kwargs: Mapping[str, Any] | None = None,
    task_manager: Any = None,
) -> dict[int, dict[str, dict[str, Any]]]:
    """lm-eval ``tasks`` at each r: ``{r: {task: {accuracy, centered, loss, num_items,
    mean_recurrences, metric}}}``. ``centered`` equals the metric (lm-eval has no random-baseline
    table); ``loss`` is None (lm-eval reports no continuation loss); ``mean_recurrences`` is over
    every position lm-eval ran (context included). ``limit``: at most this many documents per task
    (lm-eval's first ones); ``include_path``: a folder of task YAMLs to register; ``task_manager``:
    the one `task_manager_for` returned (else it is built here)."""
    _require_lm_eval()
    import lm_eval
    import torch

    manager = task_manager if task_manager is not None else task_manager_for(tasks, include_path)
    lm = make_lm(model, tokenizer, batch_size)
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for r in recurrences:
        lm.call_kwargs = {"num_recurrences": int(r), **dict(call_kwargs or {})}
        lm.recurrences_run, lm.positions_run = 0.0, 0
        torch.manual_seed(0)
        result = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
            log_samples=False, verbosity="WARNING",
        )  # fmt: skip
        rows: dict[str, dict[str, Any]] = {}
        for name, task_result in result["results"].items():
            if name not in tasks:  # a group's member tasks are reported too; keep what was asked
                continue
            metric, value = pick_metric(task_result)
            samples = (result.get("n-samples") or {}).get(name) or {}
            rows[name] = {
                "accuracy": value,
                "centered": value,
                "loss": None,
                "num_items": samples.get("effective"),
                "mean_recurrences": lm.recurrences_run / lm.positions_run if lm.positions_run else math.nan,
                "metric": metric,
            }
        out[int(r)] = rows
    return out


__all__ = ["PREFERRED_METRICS", "make_lm", "pick_metric", "run_lm_eval", "task_manager_for"]
