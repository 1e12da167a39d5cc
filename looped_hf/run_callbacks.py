"""What a run hangs on the Trainer beside the model: the non-finite-loss guard, the progress file a sweep
runner reads, and the compile of the model's `forward` (not the module, so hooks stay eager).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from looped_hf.arguments import (
    LoopedTrainingArguments,
)
from looped_hf.teacher import (  # noqa: F401
    BIDIRECTIONAL_TYPES,
    check_teacher,
    teacher_flops,
)

PROGRESS_NAME = "progress.json"


def compile_forward(model: torch.nn.Module, training_args: LoopedTrainingArguments, sampled: bool) -> bool:
    """`torch_compile: true`: compile the model's `forward` here instead of letting the Trainer
    compile the whole module; returns whether it did (undo with `uncompile_forward`).

    Why not the Trainer's `torch.compile(model)`: that traces the module's forward pre-hooks too, and
    the hooks of `RecurrenceSamplingCallback` (numpy's RNG: graph breaks) and `LoopedComputeCallback`
    (Python counters) belong outside the graph. Compiling `forward` keeps every hook eager and the
    whole loop in one graph (the model is `_can_compile_fullgraph`; r is a Python int, so each r
    is its own graph). A sampled r therefore compiles at most one graph per distinct r: the
    recompile limit is raised so that no r falls back to eager. The recipe still records
    `torch_compile: true`; backend and mode come from `torch_compile_backend` / `_mode`.
    """
    if not training_args.torch_compile:
        return False
    kwargs = {
        "backend": training_args.torch_compile_backend or "inductor",
        "mode": training_args.torch_compile_mode,
    }
    # Switch the Trainer's (accelerate's) own compile off: the flag, and the environment that
    # TrainingArguments.__post_init__ set for accelerate's TorchDynamoPlugin.
    training_args.torch_compile = False
    training_args.torch_compile_backend = training_args.torch_compile_mode = None
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):
        os.environ.pop(name, None)
    if sampled:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    model.forward = torch.compile(model.forward, **kwargs)
    return True


def uncompile_forward(model: torch.nn.Module) -> None:
    """Back to the class's eager forward (held-out evaluation and saving run eagerly)."""
    model.__dict__.pop("forward", None)


class NonFiniteLossGuard(TrainerCallback):
    """Stops training at the first logged non-finite loss (the run is then recorded as failed)."""

    def __init__(self) -> None:
        self.error: str | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.error = f"non-finite training loss {loss} at step {state.global_step}"
            control.should_training_stop = True


class ProgressFileCallback(TrainerCallback):
    """Keeps `<run_dir>/progress.json` ({"step", "max_steps", "loss", "started", "time"}) current, so a sweep
    runner can show every running run's step and latest loss whatever process trains it (in
    process, a worker, `accelerate launch`, a submitit job). Advisory: replaced atomically (a
    reader never sees half a file), not fsynced."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / PROGRESS_NAME
        self.loss: float | None = None
        self.started = time.time()

    def _write(self, state: Any) -> None:
        if not state.is_world_process_zero:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        data = {"step": state.global_step, "max_steps": state.max_steps, "loss": self.loss,
                "started": self.started, "time": time.time()}  # fmt: skip
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.time()
        self._write(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if (logs or {}).get("loss") is not None:
            self.loss = float(logs["loss"])
        self._write(state)
