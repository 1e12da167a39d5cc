"""Looped-aware compute logging for the vanilla `transformers.Trainer`.

`Trainer(..., callbacks=[LoopedComputeCallback()])` adds to EVERY log entry (so to `log_history`
and to every `report_to` backend):

- `train_tokens`: training tokens processed so far, summed over processes and exact under
  gradient accumulation. It is the Trainer's own `num_input_tokens_seen` (gathered across
  processes every micro-batch and saved in checkpoints, so it survives `resume_from_checkpoint`);
  the callback switches `include_num_input_tokens_seen` on if it was off.
- `train_flops`: `model.training_flops_per_token(seq_len) x train_tokens`, from the model's own
  accounting (loop applications, truncated backprop and attention included). The Trainer's
  `total_flos` (6 x tokens x unique non-embedding params) undercounts a looped model by ~r; it is
  left untouched and reported next to ours as `trainer_total_flos` in `summary()`.

and records `n_once`, `n_rec`, `num_recurrences`, `effective_num_layers` and
`backprop_recurrences` (in the final training log entry and in `summary()`).

Why it reorders callbacks: `Trainer.log` copies `logs` into `log_history` BEFORE calling the
callbacks, and the integration (reporter) callbacks come first in the list, so editing `logs` in
an ordinary `on_log` reaches neither. This callback (a) moves itself to the front of the
Trainer's callback list, so reporters receive the dict after it has been completed, and (b)
updates the `log_history` entry that `Trainer.log` has just appended. The callback list is found
through the caller's frame (`CallbackHandler.call_event`), because callbacks are never handed
the Trainer; `attach(trainer)` does the same explicitly.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

logger = logging.getLogger(__name__)


class LoopedComputeCallback(TrainerCallback):
    """Adds `train_flops` and `train_tokens` to every Trainer log entry (see the module docstring).

    Args:
        seq_len: Sequence length used for the attention term of the FLOP count. `None` (default):
            read from the training batches (a forward pre-hook sees each micro-batch's shape).
    """

    def __init__(self, seq_len: int | None = None) -> None:
        self.seq_len = seq_len
        self._model: torch.nn.Module | None = None
        self._hook: Any = None
        self._handler_found = False
        # Per-process sums over training micro-batches seen by the hook, used for the mean
        # FLOPs per token (exact for packed, equal-length blocks; a token-weighted mean otherwise).
        self._local_tokens = 0
        self._local_flops = 0.0
        self._fpt_cache: dict[int, float] = {}
        self.static: dict[str, Any] = {}
        self.last: dict[str, Any] = {}

    # --- wiring ---------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> LoopedComputeCallback:
        """Register with `trainer` (if not already) and put this callback first. Optional:
        `Trainer(callbacks=[cb])` finds the callback list by itself."""
        if self not in trainer.callback_handler.callbacks:
            trainer.callback_handler.callbacks.insert(0, self)
        self._move_first(trainer.callback_handler)
        return self

    def _move_first(self, handler: CallbackHandler) -> None:
        # Removing self and re-inserting at 0 keeps the index of every callback after self, so a
        # `for callback in self.callbacks` loop in progress visits each remaining one exactly once.
        callbacks = handler.callbacks
        if callbacks and callbacks[0] is not self and self in callbacks:
            callbacks.remove(self)
            callbacks.insert(0, self)
        self._handler_found = True

    def _find_handler(self) -> None:
        if self._handler_found:
            return
        frame = inspect.currentframe()
        try:
            for _ in range(8):
                frame = frame.f_back if frame is not None else None
                if frame is None:
                    break
                candidate = frame.f_locals.get("self")
                if isinstance(candidate, CallbackHandler) and self in candidate.callbacks:
                    self._move_first(candidate)
                    return
        finally:
            del frame
        logger.warning(
            "LoopedComputeCallback could not find the Trainer's callback list; train_flops reaches "
            "log_history but reporters listed before it miss it. Call callback.attach(trainer)."
        )
        self._handler_found = True

    def _setup(self, args: TrainingArguments, model: torch.nn.Module | None) -> None:
        self._find_handler()
        if args.include_num_input_tokens_seen in ("no", False):
            # The Trainer reads this flag every micro-batch; "all" makes it count (and gather
            # across processes) the tokens the FLOP count multiplies.
            args.include_num_input_tokens_seen = "all"
        if model is not None and model is not self._model:
            if not hasattr(model, "training_flops_per_token") or not hasattr(model, "num_scaling_params"):
                raise TypeError(
                    f"LoopedComputeCallback needs a model with training_flops_per_token() and "
                    f"num_scaling_params() (LoopedForCausalLM); got {type(model).__name__}"
                )
            self._remove_hook()
            self._model = model
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
            self.static = self._static_fields(model)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @staticmethod
    def _static_fields(model: torch.nn.Module) -> dict[str, Any]:
        config = model.config
        params = model.num_scaling_params()
        return {
            "n_once": int(params["once"]),
            "n_rec": int(params["recurrent"]),
            "num_recurrences": int(config.num_recurrences),
            "effective_num_layers": int(config.effective_num_layers),
            "backprop_recurrences": config.backprop_recurrences,
        }

    def _flops_per_token(self, seq_len: int) -> float:
        if seq_len not in self._fpt_cache:
            self._fpt_cache[seq_len] = float(self._model.training_flops_per_token(seq_len))
        return self._fpt_cache[seq_len]

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # Training micro-batches only (evaluation runs the model in eval mode).
        if not module.training:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            if ids is None:
                return
            ids = ids[..., 0]
        seq_len = self.seq_len or int(ids.shape[-1])
        n = int(ids.numel())
        self._local_tokens += n
        self._local_flops += n * self._flops_per_token(seq_len)

    # --- values ---------------------------------------------------------------------------------
    def flops_per_token(self) -> float:
        """Training FLOPs per token: the token-weighted mean over the micro-batches seen."""
        if self._local_tokens:
            return self._local_flops / self._local_tokens
        if self.seq_len is not None and self._model is not None:
            return self._flops_per_token(self.seq_len)
        return math.nan

    def current(self, state: TrainerState) -> dict[str, Any]:
        """`train_tokens` and `train_flops` now (cumulative, all processes)."""
        tokens = int(state.num_input_tokens_seen)
        fpt = self.flops_per_token()
        flops = 0.0 if tokens == 0 else tokens * fpt
        return {"train_tokens": tokens, "train_flops": flops}

    def summary(self, state: TrainerState) -> dict[str, Any]:
        """Everything the run record needs from training: tokens, FLOPs (ours and the Trainer's)."""
        out = dict(self.static)
        out.update(self.current(state))
        out["train_flops_per_token"] = self.flops_per_token()
        out["trainer_total_flos"] = float(state.total_flos)
        return out

    # --- events ---------------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._setup(args, kwargs.get("model"))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._setup(args, kwargs.get("model"))

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ):
        if logs is None:
            return
        extra = self.current(state)
        if "train_loss" in logs:
            # The end-of-training summary entry: also the static description of the loop.
            extra.update({k: v for k, v in self.static.items() if v is not None})
        logs.update(extra)
        # Trainer.log appended {**logs, "step": ...} to log_history just before calling us.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
        self.last = dict(extra)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.last = self.summary(state)
        self._remove_hook()


__all__ = ["LoopedComputeCallback"]
