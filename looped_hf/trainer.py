"""`LoopedTrainer`: the `transformers.Trainer`, less the per-step host work whose result a run never reads.

`looped_hf.train` runs it; any script may use it in place of `Trainer` (same arguments). It
changes what the Trainer does every optimizer step, never what it logs or saves:

- `floating_point_ops`: the Trainer's `total_flos` (6 x tokens x unique non-embedding
  parameters) walks every parameter each micro-batch (`num_parameters`); the count is taken once.
  The value is the vanilla one (`LoopedComputeCallback` reports the looped-aware count beside it).
- `_get_grad_norm`: without clipping (`max_grad_norm: 0`, the study's recipe) the Trainer still
  runs `clip_grad_norm_(..., inf)` every step, which reads every gradient and multiplies it by 1.0,
  only to log the norm at logging steps. Here the norm is computed on the steps that log
  (`DefaultFlowCallback`'s rule), so every logged `grad_norm` is the one the vanilla Trainer
  logs. (A callback that forces `should_log` on another step gets an entry without
  `grad_norm`.) With clipping the norm is needed every step and nothing changes.
- `training_step`: the Trainer calls `model.train()` before every micro-batch, and torch's walks
  every module and sets its flag, on the training loop's host path. When every module is already
  training (a plain walk, `_all_in_mode`, is much cheaper than torch's) the call is skipped;
  otherwise the vanilla `train()` runs.
- `_track_num_input_tokens`: the vanilla count puts the batch's token count on the device,
  gathers it and reads it back (`.item()`), a host-device sync every micro-batch. With
  `include_num_input_tokens_seen: all` it is a Python sum of the same numbers: in one process,
  and with several when every process's batch is known to hold as many tokens (rows of one
  length, `TokenBlocks`, dealt with accelerate's `even_batches`); otherwise the gather stays.

Host-device syncs per step (on a GPU the host queues kernels ahead, so host time costs only
where it must wait): the vanilla Trainer has three by default, the token count above, the
non-finite-loss check of every micro-batch (`logging_nan_inf_filter`) and the blocking copy of
each batch to the device (`accelerator_config.non_blocking`). The GPU recipes set the last two
off (`recipes/iso_depth_gpu.yaml`, `recipes/iso_depth_paper*.yaml`); what is left is a sync per
logging step (the logged values).

`benchmarks/bench_vs_study.py` times these parts under both classes (its Trainer-cost table).

`DistillingTrainer` is `LoopedTrainer` with a frozen teacher (a retrofit's dense parent) and the
loss of `distillation_loss` (McLeish et al. 2025's later code, `train.py` `distill_fwd_bwd`).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_utils import IntervalStrategy


def _all_in_mode(module: nn.Module, mode: bool) -> bool:
    """Whether `module` and all its submodules have `training == mode` (a plain walk: `modules()`
    builds every module's dotted name on the way)."""
    if module.training is not mode:
        return False
    return all(child is None or _all_in_mode(child, mode) for child in module._modules.values())


class LoopedTrainer(Trainer):
    """`transformers.Trainer` with cheaper per-step bookkeeping (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flops_params: tuple[int, int] | None = None  # (id of the model, its non-embedding parameters)
        self._equal_batches: bool | None = None  # _equal_batches_on_every_process, decided once

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | Any]) -> int:
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._flops_params is None or self._flops_params[0] != id(self.model):
            self._flops_params = (id(self.model), self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main_input].numel() * self._flops_params[1]

    def training_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        if not _all_in_mode(model, True):
            return super().training_step(model, inputs, num_items_in_batch)
        # Every module is training already: the vanilla step's `model.train()` would only walk the
        # tree. An instance attribute shadows the method for this one call (nothing else runs in
        # between on this thread) and is removed after it, whatever happens.
        model.train = MethodType(_already_training, model)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del model.train

    def logs_next_step(self) -> bool:
        """Whether the optimizer step now in progress (global_step + 1) will be logged, by the rule
        `DefaultFlowCallback.on_step_end` applies to it. Epoch logging: always True (the last
        step of an epoch is not known here)."""
        args, state = self.args, self.state
        if args.logging_strategy == IntervalStrategy.NO:
            return False
        if args.logging_strategy != IntervalStrategy.STEPS:
            return True
        step = state.global_step + 1
        if step == 1 and args.logging_first_step:
            return True
        return bool(state.logging_steps) and step % state.logging_steps == 0

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: torch.Tensor | float | None = None):
        if grad_norm is None and not self.logs_next_step():
            return None  # nothing reads it: the Trainer only logs it (same decision on every process)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _track_num_input_tokens(self, inputs: dict[str, torch.Tensor | Any]) -> None:
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self.args.include_num_input_tokens_seen == "all" and main_input in inputs:
            if self.args.world_size == 1:
                self.state.num_input_tokens_seen += int(inputs[main_input].numel())
                return
            if self._equal_batches is None:
                self._equal_batches = self._equal_batches_on_every_process()
            if self._equal_batches:
                self.state.num_input_tokens_seen += int(inputs[main_input].numel()) * self.args.world_size
                return
        super()._track_num_input_tokens(inputs)

    def _equal_batches_on_every_process(self) -> bool:
        """Every process's micro-batch has as many tokens as this one's: rows of one length
        (`TokenBlocks`, what `looped_hf.train` trains on) dealt by accelerate with `even_batches`
        (every process gets full batches of the same size, the last one topped up)."""
        from looped_hf.data import TokenBlocks

        accelerator = self.accelerator
        return (
            isinstance(self.train_dataset, TokenBlocks)
            and bool(accelerator.even_batches)
            and not accelerator.dispatch_batches
            and not accelerator.split_batches
        )


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    ce_loss: torch.Tensor,
    alpha: float = 0.5,
    temperature: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha * ce_loss + (1 - alpha) * T^2 * KL, KL)``, the paper's distillation loss.

    The KL is the paper code's (`_compute_kl_distill_loss`): ``torch.nn.functional.kl_div(
    log_softmax(s / T), softmax(t / T), reduction="batchmean")`` over the positions whose target
    is not -100, i.e. KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)) at
    temperature T, averaged over those positions (batchmean of the gathered rows: a per-token
    mean). Torch's argument order (student's log-probabilities first) is what the issue's
    "KL(student || teacher)" names; the divergence computed is the teacher-weighted (forward) one.
    The T^2 keeps the soft loss's gradients at the scale of the CE's as T changes (Hinton et al.).
    ``labels`` are unshifted (the model's convention): logits at position i are scored against
    the label at i + 1, so the last position and every position before a -100 label are left out.
    """
    shifted = labels[..., 1:]
    valid = shifted != -100
    student = student_logits[..., :-1, :][valid].float() / temperature
    teacher = teacher_logits[..., :-1, :][valid].float() / temperature
    if student.shape[0] == 0:
        kl = student_logits.new_zeros(())
    else:
        kl = torch.nn.functional.kl_div(
            torch.log_softmax(student, dim=-1), torch.softmax(teacher, dim=-1), reduction="batchmean"
        )
    return alpha * ce_loss + (1 - alpha) * temperature**2 * kl, kl


class DistillingTrainer(LoopedTrainer):
    """`LoopedTrainer` whose training loss is `distillation_loss` against a frozen ``teacher``.

    The teacher (a dense transformers causal LM with the student's vocabulary) runs forward only,
    in eval mode, without gradients, on the same input ids; evaluation keeps the plain CE. The loss
    is a mean over each micro-batch's tokens (as the paper's), so the Trainer must divide it by the
    accumulation steps. transformers >= 5.19 reads that from ``loss_is_scaled_for_ga = False``;
    5.16-5.18 divide only when ``model_accepts_loss_kwargs`` is False, and set it True for a model
    whose forward takes ``**kwargs`` (every looped one), which left the loss and the gradients
    GA times too large. Both are set, so every version the package accepts divides once (and
    neither passes ``num_items_in_batch`` to the forward, which this loss does not read). The
    distillation term of the last logged steps is logged as ``distill_kl``.
    """

    def __init__(
        self, *args: Any, teacher: nn.Module, alpha: float = 0.5, temperature: float = 2.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self.alpha, self.temperature = float(alpha), float(temperature)
        self.loss_is_scaled_for_ga = False  # transformers >= 5.19
        self.model_accepts_loss_kwargs = False  # 5.16-5.18 (the class docstring)
        self._kl_sum, self._kl_count = 0.0, 0

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ):
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs)  # the CE as a per-token mean over this micro-batch
        with torch.no_grad():
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            teacher_logits = self.teacher(input_ids=ids, attention_mask=mask).logits
        loss, kl = distillation_loss(
            outputs.logits, teacher_logits, inputs["labels"], outputs.loss, self.alpha, self.temperature
        )
        self._kl_sum += float(kl.detach())
        self._kl_count += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self._kl_count:
            logs["distill_kl"] = self._kl_sum / self._kl_count
            self._kl_sum, self._kl_count = 0.0, 0
        super().log(logs, *args, **kwargs)


def _already_training(model: nn.Module, mode: bool = True) -> nn.Module:
    """`model.train` during a `training_step` whose model is all in training mode already: nothing
    to set for `mode=True`; any other mode goes to the class's own `train`."""
    return model if mode is True else type(model).train(model, mode)


__all__ = ["DistillingTrainer", "LoopedTrainer", "distillation_loss"]
