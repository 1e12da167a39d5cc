"""Optimizers and the study's learning-rate schedule, in the form `Trainer(optimizers=...)` takes.

- `"adamw"` (default): `torch.optim.AdamW` over every parameter (hyperconnection gains at their
  own lr, the study's 0.01).
- `"muon"`: the study's split (nanochat): `torch.optim.Muon` for the 2-D weight matrices inside
  the layers (attention, MLP, the linear injection adapter), AdamW for the rest (embedding,
  lm_head, norms, hyperconnection gains). Muon orthogonalises 2-D updates only, which is why the
  embedding and head (lookup tables / classifiers in the study) stay on AdamW.
- Schedule "study": `warmup_steps` (the study: 0) then linear decay to `final_lr_ratio` (0.1) of
  the peak at `max_steps`.

`CombinedOptimizer` lets one `Trainer` drive both optimizers: it shares their param-group dicts
(so one LR scheduler scales every group) and checkpoints both states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from looped_hf.arguments import LoopedTrainingArguments


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one (for Trainer / accelerate, which take a single one).

    `param_groups` are the inner optimizers' own group dicts, so schedulers and gradient
    clipping act on all of them; `state_dict` nests the inner states by position.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        groups = [group for opt in self.optimizers for group in opt.param_groups]
        super().__init__(groups, {})
        # Optimizer.__init__ re-adds the same dicts; keep the exact objects shared with the inners.
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict["optimizers"]
        if len(inner) != len(self.optimizers):
            raise ValueError(
                f"checkpoint has {len(inner)} optimizer states, this run has {len(self.optimizers)}"
            )
        for opt, sd in zip(self.optimizers, inner):
            opt.load_state_dict(sd)


def _split_parameters(model: torch.nn.Module) -> tuple[list, list, list]:
    """(matrices inside layers, hyperconnection gains, everything else), each param once."""
    base = model.model
    layer_modules = [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers]
    if getattr(base, "injection", None) is not None:
        layer_modules.append(base.injection)
    matrices, seen = [], set()
    for module in layer_modules:
        for p in module.parameters():
            if p.requires_grad and p.ndim == 2 and id(p) not in seen:
                matrices.append(p)
                seen.add(id(p))
    hyper = []
    if getattr(base, "hyperconnection", None) is not None:
        for p in base.hyperconnection.parameters():
            if p.requires_grad and id(p) not in seen:
                hyper.append(p)
                seen.add(id(p))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    return matrices, hyper, rest


def build_optimizer(model: torch.nn.Module, args: LoopedTrainingArguments) -> torch.optim.Optimizer:
    """The optimizer `args.optimizer` names, with the study's parameter split."""
    matrices, hyper, rest = _split_parameters(model)
    adam_kwargs = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    hyper_group = (
        [{"params": hyper, "lr": args.hyperconnection_learning_rate, "weight_decay": 0.0}] if hyper else []
    )
    if args.optimizer == "adamw":
        # Weight decay on matrices (and the embedding / head) only, not on norm scales: the usual split.
        decay = [p for p in matrices + rest if p.ndim >= 2]
        no_decay = [p for p in matrices + rest if p.ndim < 2]
        groups = [
            {"params": decay, "lr": args.learning_rate, "weight_decay": args.weight_decay},
            {"params": no_decay, "lr": args.learning_rate, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]] + hyper_group, **adam_kwargs)
    if args.optimizer == "muon":
        muon = torch.optim.Muon(matrices, lr=args.muon_learning_rate, weight_decay=args.weight_decay)
        adam = torch.optim.AdamW(
            [{"params": rest, "lr": args.learning_rate, "weight_decay": 0.0}] + hyper_group, **adam_kwargs
        )
        return CombinedOptimizer([muon, adam])
    raise ValueError(f"LoopedTrainingArguments.optimizer={args.optimizer!r}: must be 'adamw' or 'muon'")


def study_schedule(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_steps: int = 0, final_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup over `warmup_steps` (the study: none), then linear decay from the peak to
    `final_lr_ratio` x peak at `max_steps`."""
    max_steps = max(1, int(max_steps))
    warmup_steps = int(warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 1.0 - (1.0 - final_lr_ratio) * progress

    return LambdaLR(optimizer, factor)


def build_optimizer_and_scheduler(
    model: torch.nn.Module, args: LoopedTrainingArguments, max_steps: int
) -> tuple[torch.optim.Optimizer | None, Any]:
    """`(optimizer, scheduler)` for `Trainer(optimizers=...)`; `(None, None)` leaves both to the
    Trainer (AdamW with `lr_schedule="trainer"`)."""
    if args.optimizer == "adamw" and args.lr_schedule == "trainer":
        return None, None
    optimizer = build_optimizer(model, args)
    if args.lr_schedule == "trainer":
        from transformers.optimization import get_scheduler

        scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=args.get_warmup_steps(max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
    else:
        scheduler = study_schedule(
            optimizer, max_steps, args.get_warmup_steps(max_steps), args.final_lr_ratio
        )
    return optimizer, scheduler


__all__ = ["CombinedOptimizer", "build_optimizer", "build_optimizer_and_scheduler", "study_schedule"]
