"""Downstream evaluation at every r: the study's bundle format, its scoring, and lm-eval.

    looped-hf eval runs/tiny --bundle builtin --recurrences 1 2 4 8

Does the loop help on tasks? A looped model runs its block any number of times; this scores a
checkpoint on evaluation bundles at each r exactly as the study's ``nanochat/core_eval.py`` does
(few-shot prompts, lowest mean continuation loss for multiple choice / schema, greedy match for
language modelling, centered scores, CORE and group means), in batches, and runs
lm-evaluation-harness tasks at each r through lm-eval's HF model class.

By concern: ``bundle`` (reading and checking bundles), ``builtin`` (the built-in reasoning
primitives, generated from seeds), ``scoring`` (prompts, batched forwards, task numbers),
``runner`` (load a checkpoint, evaluate at every r), ``lm_eval_bridge`` (lm-eval, optional),
``report`` (JSON, markdown, plot) and ``cli`` (``looped-hf eval``). See ``docs/evaluation.md``.
"""

from __future__ import annotations

from .builtin import write_builtin_bundle as write_builtin_bundle
from .bundle import Bundle as Bundle
from .bundle import BundleError as BundleError
from .bundle import Task as Task
from .bundle import load_bundle as load_bundle
from .report import RESULTS_JSON as RESULTS_JSON
from .report import RESULTS_MD as RESULTS_MD
from .report import RESULTS_PNG as RESULTS_PNG
from .report import load_results as load_results
from .report import markdown_tables as markdown_tables
from .report import plot_scores as plot_scores
from .report import write_results as write_results
from .runner import evaluate_model as evaluate_model
from .runner import load_checkpoint as load_checkpoint
from .scoring import EvalError as EvalError
from .scoring import centered_score as centered_score
from .scoring import prepare_task as prepare_task
from .scoring import score_sequences as score_sequences

__all__ = [
    "RESULTS_JSON",
    "RESULTS_MD",
    "RESULTS_PNG",
    "Bundle",
    "BundleError",
    "EvalError",
    "Task",
    "centered_score",
    "evaluate_model",
    "load_bundle",
    "load_checkpoint",
    "load_results",
    "markdown_tables",
    "plot_scores",
    "prepare_task",
    "score_sequences",
    "write_builtin_bundle",
    "write_results",
]
