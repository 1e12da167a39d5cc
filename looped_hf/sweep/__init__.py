"""Iso-depth sweeps: plan (budget x width x r), run resumably, append one record per run.

    looped-hf sweep recipes/iso_depth_tiny.yaml --dry-run     # the plan as a table; writes nothing
    looped-hf sweep recipes/iso_depth_tiny.yaml               # runs it; kill it, rerun, it resumes
    looped-hf sweep recipes/iso_depth_tiny.yaml --jobs 2      # two runs at once (default: cores // threads)

A sweep recipe is a training recipe (flat model / data / training fields, applied to every run)
plus a `sweep:` section (`SweepArguments`). For each budget C, width d (in that budget's list)
and r, the planner builds the study's iso-depth model (every r has the same effective depth L):

    r = 1:  prelude 0, block L x 1, coda 0, injection "none"      (a plain decoder; arch "base")
    r > 1:  prelude P, block (L - P - C) / r, coda C, injection  (arch "loop<r>")

and trains it for D = C / training_flops_per_token tokens (the model's own count, obtained on
the meta device), i.e. steps = ceil(D / tokens_per_step): never under budget, over by less than one
step; the run record holds the actual tokens and FLOPs. Variants: "truncated" (backprop through
the last k = ceil(r/2) recurrences) and "hyperconnection" (lanes at loop boundaries); their
r = 1 runs are the plain decoder, so each results file can be fitted on its own.

Sweep directory: `sweep.yaml` (the recipe), `plan.json`, `results.jsonl` (one JSON line per run,
appended atomically under a lock), `<run_id>/` run directories (see `looped_hf.train`; each
also gets `train.log`, the run's whole output, and `progress.json`), `worker-<i>.log`.
Resuming: runs already in results.jsonl are skipped; a finished run whose line is missing is
appended from its run_record.json; an interrupted run continues from its last checkpoint.
`--jobs N` keeps N runs in flight (local executor: N persistent worker processes, each dying
with the sweep); every run trains under an exclusive lock on its directory, so a run is never
trained by two processes at once and every run_id is in results.jsonl exactly once, whatever
was killed when. The console shows one live progress line (one line per finished run when
stdout is not a terminal); `--verbose` also prints the runs' logs.

Where the code is: `results` (results.jsonl: atomic appends, tolerant reads), `plan` (the sweep:
section, the runs), `execution` (one run: in process, worker processes, commands, submitit's
`run_job`), `console` (the progress line), `runner` (`run_sweep`, `default_jobs`), `cli` (`main`).
"""

from __future__ import annotations

from looped_hf.arguments import RecipeError as RecipeError

from .cli import main
from .execution import LOCK_NAME as LOCK_NAME
from .execution import LOG_NAME as LOG_NAME
from .execution import _read_lock_free as _read_lock_free
from .execution import _run_inprocess as _run_inprocess
from .execution import _try_lock as _try_lock
from .execution import _unlock as _unlock
from .execution import _worker_env as _worker_env
from .execution import _worker_main as _worker_main
from .execution import run_job, train_command
from .plan import EXECUTORS, VARIANTS, PlannedRun, SweepArguments, SweepPlan, make_plan
from .plan import parse_sweep_section as parse_sweep_section
from .results import RESULTS_NAME as RESULTS_NAME
from .results import append_jsonl, read_jsonl
from .runner import PLAN_NAME as PLAN_NAME
from .runner import RECIPE_COPY as RECIPE_COPY
from .runner import available_cores, default_jobs, run_sweep

__all__ = [
    "EXECUTORS",
    "PlannedRun",
    "SweepArguments",
    "SweepPlan",
    "VARIANTS",
    "append_jsonl",
    "available_cores",
    "default_jobs",
    "main",
    "make_plan",
    "read_jsonl",
    "run_job",
    "run_sweep",
    "train_command",
]
