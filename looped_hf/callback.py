"""Looped-aware compute logging for the vanilla `transformers.Trainer`.

`Trainer(..., callbacks=[LoopedComputeCallback()])` adds to EVERY log entry (so to `log_history`
and to every `report_to` backend):

- `train_tokens`: training tokens processed so far, summed over processes and exact under
  gradient accumulation. It is the Trainer's own `num_input_tokens_seen` (gathered across
  processes every micro-batch and saved in checkpoints, so it survives `resume_from_checkpoint`);
  the callback switches `include_num_input_tokens_seen` on if it was off.
- `train_flops`: the sum over optimizer steps of `model.training_flops_per_token(seq_len, r_step)`
  x the step's tokens, from the model's own accounting (loop applications, truncated backprop and
  attention included), with r_step the r the step's forwards actually ran (the call's
  `num_recurrences=`, e.g. set by `looped_hf.recurrence.RecurrenceSamplingCallback`, else the
  config's). With a fixed r this is `training_flops_per_token(seq_len) x train_tokens`. The
  Trainer's `total_flos` (6 x tokens x unique non-embedding params) undercounts a looped model by
  ~r; it is left untouched and reported next to ours as `trainer_total_flos` in `summary()`.

and records `n_once`, `n_rec`, `num_recurrences`, `effective_num_layers` and
`backprop_recurrences` (in the final training log entry and in `summary()`).

A distillation teacher (`teacher_flops_per_token=`, `accounting_looped.teacher_flops_per_token`:
its forward only, 2 x its parameters per token plus its attention) is added to every training
token's FLOPs. `log_recurrences=True` (a sampled r or a curriculum) adds `step_num_recurrences`
(the r the last optimizer step ran) and `mean_num_recurrences` (over the steps since the previous
training log entry) to every training log entry. A peft-wrapped model (LoRA) is hooked as given
and counted as its base model, by what its backward runs: the frozen base weights get no weight
gradient (`accounting_looped.training_flops_per_token`; a frozen backbone likewise).

Throughput: every training log entry also carries `tokens_per_second` (all processes) and
`model_flops_per_second` (the looped-aware FLOPs above, all processes) over the optimizer steps
since the previous training log entry, and `mfu` = model FLOPs/s / (num_processes x the device's
dense bf16 peak) where that peak is known (`peak_flops=`, else `looped_hf.hardware.device_peak_flops`
of the training device; no key at all on a CPU or an unlisted GPU). The clock counts training
only: the time of evaluation and checkpoint saving is left out (it stops at the log entry, at
an evaluation's log entry and at `on_save`, and restarts there). The final log entry and
`summary()` carry the run's average (`tokens_per_second`, `model_flops_per_second`, `mfu`,
`peak_flops`, `train_seconds`).

Why it reorders callbacks: `Trainer.log` copies `logs` into `log_history` BEFORE calling the
callbacks, and the integration (reporter) callbacks come first in the list, so editing `logs` in
an ordinary `on_log` reaches neither. This callback (a) moves itself to the front of the
Trainer's callback list, so reporters receive the dict after it has been completed, and (b)
updates the `log_history` entry that `Trainer.log` has just appended. The callback list is found
through the caller's frame (`CallbackHandler.call_event`), because callbacks are never handed
the Trainer; `attach(trainer)` does the same explicitly.

How the FLOPs stay exact: a forward pre-hook sums each training micro-batch's tokens x FLOPs per
token (at its r) in this process; at the end of every optimizer step the step's token-weighted
FLOPs per token multiply the step's tokens counted over all processes (the Trainer's gathered
`num_input_tokens_seen`). That needs the r of a step to be the same on every process, which the
sampler guarantees. The running total is saved in every Trainer checkpoint (this callback is an
`ExportableState`: `trainer_state.json` -> `stateful_callbacks`) and read back when training
resumes, so a resumed run reports the same FLOPs as an uninterrupted one.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler, ExportableState

from looped_hf.accounting_looped import num_scaling_params, training_flops_per_token

logger = logging.getLogger(__name__)


class LoopedComputeCallback(TrainerCallback, ExportableState):
    """Adds `train_flops` and `train_tokens` to every Trainer log entry (see the module docstring).

    Args:
        seq_len: Sequence length used for the attention term of the FLOP count. `None` (default):
            read from the training batches (a forward pre-hook sees each micro-batch's shape).
        peak_flops: Dense bf16 peak of ONE training device in FLOP/s, for `mfu`. `None` (default):
            `looped_hf.hardware.device_peak_flops` of the Trainer's device (None on CPUs and GPUs
            it does not list: then no `mfu` is logged).
        teacher_flops_per_token: Forward FLOPs per token of a distillation teacher
            (`accounting_looped.teacher_flops_per_token`), added to every training token's count.
        log_recurrences: add `step_num_recurrences` and `mean_num_recurrences` to training log entries.
    """

    def __init__(
        self,
        seq_len: int | None = None,
        peak_flops: float | None = None,
        teacher_flops_per_token: float = 0.0,
        log_recurrences: bool = False,
    ) -> None:
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0
                                           and math.isfinite(peak_flops)):  # fmt: skip
            raise ValueError(
                f"LoopedComputeCallback peak_flops={peak_flops!r}: must be a positive number of FLOP/s"
            )
        if not (isinstance(teacher_flops_per_token, (int, float)) and teacher_flops_per_token >= 0
                and math.isfinite(teacher_flops_per_token)):  # fmt: skip
            raise ValueError(
                f"LoopedComputeCallback teacher_flops_per_token={teacher_flops_per_token!r}: must be a number >= 0"
            )
        self.seq_len = seq_len
        self.peak_flops = None if peak_flops is None else float(peak_flops)
        self.teacher_flops_per_token = float(teacher_flops_per_token)
        self.log_recurrences = bool(log_recurrences)
        self._base: torch.nn.Module | None = None  # what is counted: the model, or a peft model's base
        self._step_r: int | None = None  # r of the current optimizer step's micro-batches
        self._window_r: list[int] = []  # r of each optimizer step since the last training log
        self._peak: float | None = self.peak_flops  # the one in use (given, or the device's)
        self._world = 1
        # Training clock (perf_counter): `_clock` is where the current training stretch began;
        # `_window_s` / `_run_s` the training seconds since the last training log / train begin,
        # `_window_start` / `_run_start` the (tokens, FLOPs) there.
        self._clock: float | None = None
        self._window_s = 0.0
        self._run_s = 0.0
        self._window_start: tuple[int, float] = (0, 0.0)
        self._run_start: tuple[int, float] = (0, 0.0)
        self._model: torch.nn.Module | None = None
        self._hook: Any = None
        self._handler_found = False
        # Per-process sums over the training micro-batches of the current optimizer step (the hook
        # adds to them; `on_step_end` turns them into the step's FLOPs per token and resets them).
        self._step_tokens = 0
        self._step_flops = 0.0
        # Cumulative, all processes: FLOPs of the tokens counted so far, and how many tokens that is
        # (state.num_input_tokens_seen at the end of the last step folded in).
        self._flops = 0.0
        self._counted_tokens = 0
        self._last_fpt = math.nan  # FLOPs per token of the last step (for tokens not yet folded in)
        self._last_seq_len: int | None = None  # of the last training micro-batch
        # Tokens of a resumed checkpoint that saved no FLOP total, still to be priced at the
        # configured r once the sequence length is known (seq_len=None: from the first batch).
        self._unpriced_tokens = 0
        self._fpt_cache: dict[tuple[int, int | None], float] = {}
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
        self._world = max(1, int(getattr(args, "world_size", 1) or 1))
        if self.peak_flops is None:
            from looped_hf.hardware import device_peak_flops

            self._peak = device_peak_flops(args.device)
        if args.include_num_input_tokens_seen in ("no", False):
            # The Trainer reads this flag every micro-batch; "all" makes it count (and gather
            # across processes) the tokens the FLOP count multiplies.
            args.include_num_input_tokens_seen = "all"
        if model is not None and model is not self._model:
            # peft's wrapper calls its base model's forward directly (no hooks): hook the wrapper,
            # count the base.
            from looped_hf.optim import peft_base

            base = peft_base(model)
            if not hasattr(base, "training_flops_per_token") or not hasattr(base, "num_scaling_params"):
                raise TypeError(
                    f"LoopedComputeCallback needs a model with training_flops_per_token() and "
                    f"num_scaling_params() (LoopedForCausalLM); got {type(model).__name__}"
                )
            self._remove_hook()
            self._model, self._base = model, base
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)
            self.static = self._static_fields(base)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @staticmethod
    def _static_fields(model: torch.nn.Module) -> dict[str, Any]:
        config = model.config
        params = num_scaling_params(model)
        return {
            "n_once": int(params["once"]),
            "n_rec": int(params["recurrent"]),
            "num_recurrences": int(config.num_recurrences),
            "effective_num_layers": int(config.effective_num_layers),
            "backprop_recurrences": config.backprop_recurrences,
        }

    def _flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        key = (seq_len, num_recurrences)
        if key not in self._fpt_cache:
            student = float(training_flops_per_token(self._base, seq_len, num_recurrences))
            self._fpt_cache[key] = student + self.teacher_flops_per_token
        return self._fpt_cache[key]

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
        r = kwargs.get("num_recurrences")  # what this call runs (None: the config's r)
        self._step_r = int(self._base.config.num_recurrences if r is None else r)
        self._last_seq_len = seq_len
        n = int(ids.numel())
        self._step_tokens += n
        self._step_flops += n * self._flops_per_token(seq_len, None if r is None else int(r))

    # --- values ---------------------------------------------------------------------------------
    def _pending_fpt(self) -> float:
        """FLOPs per token for tokens not yet folded into the total: the current step's micro-batches
        if any were seen, else the last step's, else the configured r's."""
        if self._step_tokens:
            return self._step_flops / self._step_tokens
        if math.isfinite(self._last_fpt):
            return self._last_fpt
        if self.seq_len is not None and self._model is not None:
            return self._flops_per_token(self.seq_len)
        return math.nan

    def flops_per_token(self) -> float:
        """Training FLOPs per token: total FLOPs / total tokens (the configured r's before any step)."""
        if self._counted_tokens and not self._unpriced_tokens:
            return self._flops / self._counted_tokens
        return self._pending_fpt()

    def current(self, state: TrainerState) -> dict[str, Any]:
        """`train_tokens` and `train_flops` now (cumulative, all processes)."""
        self._price_unpriced()
        tokens = int(state.num_input_tokens_seen)
        pending = tokens - self._counted_tokens
        flops = self._flops + (pending * self._pending_fpt() if pending else 0.0)
        if self._unpriced_tokens:  # resumed, no FLOP total saved, no batch seen yet: unknown
            flops = math.nan
        return {"train_tokens": tokens, "train_flops": flops}

    def state(self) -> dict[str, Any]:
        """Saved in every Trainer checkpoint (`ExportableState`), read back on resume."""
        return {
            "args": {"seq_len": self.seq_len},
            "attributes": {"_flops": self._flops, "_counted_tokens": self._counted_tokens},
        }

    def _restore(self, state: TrainerState) -> None:
        """On resume: take the FLOP total saved with the checkpoint, or (a checkpoint from before
        the total was saved) price its tokens at the configured r."""
        tokens = int(state.num_input_tokens_seen)
        if tokens == 0:  # a fresh start (also a second `train()` with the same callback)
            self._flops, self._counted_tokens, self._unpriced_tokens = 0.0, 0, 0
            self._step_tokens, self._step_flops, self._last_fpt = 0, 0.0, math.nan
            return
        if self._counted_tokens == tokens:
            return
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) else saved
        attributes = (saved or {}).get("attributes") or {}
        if attributes.get("_counted_tokens") == tokens:
            self._flops, self._counted_tokens = float(attributes["_flops"]), tokens
            return
        logger.warning(
            "LoopedComputeCallback: the checkpoint carries no FLOP total for its %d tokens; counting them at "
            "the configured num_recurrences (exact unless r varied before the resume)",
            tokens,
        )
        self._flops, self._counted_tokens, self._unpriced_tokens = 0.0, tokens, tokens
        self._price_unpriced()

    def _price_unpriced(self) -> None:
        seq_len = self.seq_len or self._last_seq_len
        if self._unpriced_tokens and seq_len is not None and self._model is not None:
            self._flops += self._unpriced_tokens * self._flops_per_token(seq_len)
            self._unpriced_tokens = 0

    def summary(self, state: TrainerState) -> dict[str, Any]:
        """Everything the run record needs from training: tokens, FLOPs (ours and the Trainer's)."""
        out = dict(self.static)
        out.update(self.current(state))
        out["train_flops_per_token"] = self.flops_per_token()
        out["trainer_total_flos"] = float(state.total_flos)
        out.update(self.run_throughput(state))
        return out

    # --- throughput -----------------------------------------------------------------------------
    def _tick(self, count: bool) -> None:
        """Close the current stretch of the training clock (adding it if `count`) and start another."""
        now = time.perf_counter()
        if count and self._clock is not None:
            self._window_s += now - self._clock
            self._run_s += now - self._clock
        self._clock = now

    def _rates(self, seconds: float, tokens: int, flops: float) -> dict[str, Any]:
        if not seconds > 0:
            return {}
        out: dict[str, Any] = {"tokens_per_second": tokens / seconds}
        if math.isfinite(flops):
            out["model_flops_per_second"] = flops / seconds
            if self._peak is not None:
                out["mfu"] = flops / seconds / (self._peak * self._world)
        return out

    def run_throughput(self, state: TrainerState) -> dict[str, Any]:
        """The run's average since `train()` began, over training time only: `tokens_per_second`,
        `model_flops_per_second`, `mfu` (None where the peak is not known), `peak_flops` (per
        device, None likewise) and `train_seconds`."""
        now = self.current(state)
        tokens, flops = now["train_tokens"] - self._run_start[0], now["train_flops"] - self._run_start[1]
        out = {"tokens_per_second": None, "model_flops_per_second": None, "mfu": None}
        out.update(self._rates(self._run_s, tokens, flops))
        out.update(peak_flops=self._peak, train_seconds=self._run_s)
        return out

    def _window_throughput(self, state: TrainerState, now: dict[str, Any]) -> dict[str, Any]:
        """Rates over the steps since the previous training log entry; the window restarts."""
        tokens = now["train_tokens"] - self._window_start[0]
        flops = now["train_flops"] - self._window_start[1]
        out = self._rates(self._window_s, tokens, flops)
        self._window_s, self._window_start = 0.0, (now["train_tokens"], now["train_flops"])
        return out

    # --- events ---------------------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._setup(args, kwargs.get("model"))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._setup(args, kwargs.get("model"))
        self._restore(state)
        # Trainer._save_checkpoint indexes stateful_callbacks by class name without a default: a
        # state resumed from a checkpoint written without this callback would raise KeyError there.
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        state.stateful_callbacks.setdefault(type(self).__name__, self.state())
        start = self.current(state)
        self._window_start = self._run_start = (start["train_tokens"], start["train_flops"])
        self._window_s = self._run_s = 0.0
        self._tick(count=False)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # Fold this optimizer step in: its tokens over all processes x its FLOPs per token here.
        self._price_unpriced()
        tokens = int(state.num_input_tokens_seen)
        if self._step_tokens:
            self._last_fpt = self._step_flops / self._step_tokens
        if self._step_r is not None:
            self._window_r.append(self._step_r)
            self._step_r = None
        if tokens > self._counted_tokens:
            self._flops += (tokens - self._counted_tokens) * self._pending_fpt()
            self._counted_tokens = tokens
        self._step_tokens, self._step_flops = 0, 0.0
        self._tick(count=True)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._tick(count=False)  # evaluation is not training time

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._tick(count=False)  # nor is writing a checkpoint

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs=None, **kwargs
    ):
        if logs is None:
            return
        extra = self.current(state)
        if "train_loss" in logs:
            # The end-of-training summary entry: also the static description of the loop and the
            # run's average throughput (no mfu key where the peak is unknown).
            extra.update({k: v for k, v in self.static.items() if v is not None})
            self._tick(count=True)
            extra.update({k: v for k, v in self.run_throughput(state).items() if v is not None})
        elif "loss" in logs:
            # A training log entry: rates over the steps since the previous one.
            self._tick(count=True)
            extra.update(self._window_throughput(state, extra))
            if self.log_recurrences and self._window_r:
                extra.update(step_num_recurrences=self._window_r[-1],
                             mean_num_recurrences=sum(self._window_r) / len(self._window_r))  # fmt: skip
            self._window_r = []
        else:
            self._tick(count=False)  # an evaluation's entry: the evaluation was not training time
        logs.update(extra)
        # Trainer.log appended {**logs, "step": ...} to log_history just before calling us.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)
        self.last = dict(extra)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.last = self.summary(state)
        self._remove_hook()


__all__ = ["LoopedComputeCallback"]
