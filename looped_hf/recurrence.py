"""Training with a sampled number of recurrences (Huginn's scheme), through the vanilla Trainer.

A model trained at one r tends to degrade at others; Huginn (Geiping et al. 2025) trains with a
new r drawn every optimizer step so that the loop learns to be run for as long as the user wants.
Its draw (seal-rg/recurrent-pretraining, `randomized_iteration_sampler`, scheme
"poisson-lognormal-filling") is a Poisson-lognormal count shifted by one:

    lambda ~ LogNormal(mu, sigma = 1/2),   r = 1 + Poisson(lambda),

with backprop through the last min(k, r) recurrences only (their ``k = min(s, p)``, ``n = p - k``
steps without gradient), k = ``backprop_recurrences`` here: the model's own truncated backprop.

One deliberate difference: Huginn sets mu = log(r_mean) - sigma^2/2, so E[lambda] = r_mean and
E[r] = r_mean + 1 (its "mean_recurrence = 32" trains at 33 on average). A recipe here says
``num_recurrences: 4`` and means the average r actually run, so ``poisson_lognormal`` uses
mu = log(r_mean - 1) - sigma^2/2 and E[r] = r_mean exactly (r_mean >= 2).

Reproducibility: r is a pure function of (run seed, optimizer step) (`sample_num_recurrences`),
as Huginn's lock-step draw seeded from the step number. So every data-parallel rank and every
micro-batch of one optimizer step run the same r, a resumed run draws the same sequence as an
uninterrupted one, and the global RNG (dropout, data order) is untouched.

Use it with any `Trainer`:

    Trainer(model, args, ..., callbacks=[RecurrenceSamplingCallback(seed=args.seed),
                                         LoopedComputeCallback()])

`LoopedComputeCallback` then counts the FLOPs of the r each step actually ran.

Curriculum over the mean r (McLeish et al. 2025, "Teaching pretrained language models to think
deeper with retrofitted recurrence", arXiv 2511.07384; their `train.py`, `mean_recurrence_schedule`).
A retrofitted model starts close to its dense parent at r = 1; jumping straight to a deep loop
throws that away, so the mean r grows during training. Their code reads the mean from transformers'
`warmup_stable_decay` schedule (`_get_wsd_scheduler_lambda`) with the peak at ``max``, no decay,
stepped once per optimizer step, rounded up and floored at ``start``. With W = ceil(fraction x
max_steps) warm-up steps and s finished optimizer steps (the Trainer's ``global_step``):

    p = s / W                                 (progress through the warm-up; 1 once s >= W)
    f = p                                     (shape "linear")
    f = 1 - sqrt(1 - p)                       (shape "1-sqrt": slow at first, fast at the end)
    mean r(s) = max(start, ceil(max x f))     (max = the recipe's num_recurrences)

The paper's recipe is start 1, max 4, fraction 0.75, "1-sqrt" (shells/llama.sh, tinyllama.sh); it
draws each step's r around that mean with the Poisson-lognormal sampler above and backprops through
the last k. Here the draw is ``recurrence_sampling``'s: ``poisson_lognormal`` draws around the
step's mean (a mean of 1 runs r = 1: the only r >= 1 with mean 1), ``fixed`` runs the mean itself.
(Their draw has E[r] = mean + 1, see above; here E[r] = mean.) `RecurrenceCurriculum` is the
formula; `RecurrenceSamplingCallback(curriculum=...)` applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .configuration_looped import MAX_NUM_RECURRENCES

#: Values of the recipe field ``recurrence_sampling``.
RECURRENCE_SAMPLINGS = ("fixed", "poisson_lognormal")
#: Shapes of the recipe field ``recurrence_curriculum`` ("none": no curriculum).
CURRICULUM_SHAPES = ("none", "linear", "1-sqrt")
#: Huginn's lognormal sigma (raven_modeling_minimal.py / model_dynamic.py: ``sigma = 0.5``).
HUGINN_SIGMA = 0.5
#: Mixed into the seed so that this stream never coincides with another (seed, step) stream.
_STREAM_SALT = 0x10095


def sample_num_recurrences(
    mean: int, step: int, seed: int, scheme: str = "poisson_lognormal", sigma: float = HUGINN_SIGMA
) -> int:
    """The r of optimizer step ``step`` of a run with seed ``seed``: a pure function of its arguments.

    ``fixed`` returns ``mean``. ``poisson_lognormal`` returns 1 + Poisson(lambda) with
    lambda ~ LogNormal(log(mean - 1) - sigma^2 / 2, sigma), so E[r] = mean and r >= 1 (see the
    module docstring for how this relates to Huginn's draw). Raises ``ValueError`` naming the
    argument for a scheme it does not know, mean < 2 (sampling needs room below the mean),
    a negative step or seed, or sigma <= 0.
    """
    if scheme not in RECURRENCE_SAMPLINGS:
        raise ValueError(f"recurrence_sampling={scheme!r}: must be one of {RECURRENCE_SAMPLINGS}")
    if scheme == "fixed":
        return int(mean)
    if int(mean) != mean or mean < 2:
        raise ValueError(
            f"num_recurrences={mean!r}: recurrence_sampling={scheme!r} needs an integer mean r >= 2 "
            "(r = 1 + Poisson(lambda) has mean 1 only when it is always 1)"
        )
    if step < 0 or seed < 0:
        raise ValueError(f"step={step}, seed={seed}: both must be >= 0")
    if not sigma > 0:
        raise ValueError(f"sigma={sigma!r}: must be > 0")
    # A fresh generator per (seed, step): no state to save in checkpoints, identical on every rank.
    rng = np.random.default_rng([_STREAM_SALT, int(seed), int(step)])
    mu = math.log(mean - 1) - sigma**2 / 2
    rate = rng.lognormal(mean=mu, sigma=sigma)
    return 1 + int(rng.poisson(rate))


@dataclass(frozen=True)
class RecurrenceCurriculum:
    """The mean r of every optimizer step: `start` to `maximum` over the first `fraction` of
    `max_steps`, shaped `linear` or `1-sqrt` (the paper's formula: see the module docstring)."""

    shape: str
    start: int
    maximum: int
    fraction: float
    max_steps: int

    def __post_init__(self) -> None:
        if self.shape not in CURRICULUM_SHAPES[1:]:
            raise ValueError(f"recurrence_curriculum={self.shape!r}: must be one of {CURRICULUM_SHAPES[1:]}")
        if not 1 <= self.start <= self.maximum:
            raise ValueError(
                f"curriculum_start={self.start}: must be >= 1 and <= num_recurrences={self.maximum}"
            )
        if not 0 < self.fraction <= 1:
            raise ValueError(f"curriculum_fraction={self.fraction!r}: must be in (0, 1]")
        if self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}: must be >= 1")

    @property
    def warmup_steps(self) -> int:
        """W = ceil(fraction x max_steps): the steps over which the mean rises (the paper's rounding)."""
        return math.ceil(self.fraction * self.max_steps)

    def mean_at(self, step: int) -> int:
        """The mean r of optimizer step ``step`` (0-based: the steps finished before it)."""
        progress = min(1.0, step / max(1, self.warmup_steps))
        factor = progress if self.shape == "linear" else 1.0 - math.sqrt(1.0 - progress)
        # The paper rounds up, so the max is reached a little before the warm-up ends; the
        # 1e-9 keeps 4 x 0.75 = 3.0000000000000004 at 3 rather than 4.
        return max(self.start, math.ceil(self.maximum * factor - 1e-9))

    def to_dict(self) -> dict[str, Any]:
        """The recipe's view of it (kept in the run record)."""
        return {"shape": self.shape, "start": self.start, "max": self.maximum, "fraction": self.fraction,
                "warmup_steps": self.warmup_steps}  # fmt: skip


def draw_num_recurrences(mean: int, step: int, seed: int, scheme: str, ceiling: int | None = None) -> int:
    """`sample_num_recurrences`, and r = 1 for a mean of 1 (a curriculum's first steps): the only
    draw with r >= 1 and mean 1; clamped to ``ceiling`` (the model's: ``config.recurrence_ceiling``,
    which ``resolve_num_recurrences`` refuses any r above). The Poisson-lognormal draw has no upper
    bound, so without the clamp a run would die at the first step that draws past it."""
    r = 1 if mean == 1 and scheme != "fixed" else sample_num_recurrences(mean, step, seed, scheme)
    return r if ceiling is None else min(r, ceiling)


def sampled_recurrences_summary(
    mean: int,
    steps: int,
    seed: int,
    scheme: str = "poisson_lognormal",
    curriculum: RecurrenceCurriculum | None = None,
    ceiling: int | None = None,
) -> dict[str, Any]:
    """What a run of ``steps`` optimizer steps ran: mean, min, max of r and how often each r came up;
    with a curriculum also the curriculum and the r of every step (``per_step``); with a
    ``ceiling``, it and the steps whose draw it clamped (``clamped``).

    Computed from the sampler itself (r is a function of the step), so it covers the steps
    trained before a resume too.
    """
    means = [mean if curriculum is None else curriculum.mean_at(step) for step in range(steps)]
    raw = [draw_num_recurrences(m, step, seed, scheme) for step, m in enumerate(means)]
    draws = raw if ceiling is None else [min(r, ceiling) for r in raw]
    if not draws:
        return {"scheme": scheme, "steps": 0}
    values, counts = np.unique(draws, return_counts=True)
    out = {
        "scheme": scheme,
        "steps": steps,
        "mean": float(np.mean(draws)),
        "min": int(values[0]),
        "max": int(values[-1]),
        "counts": {str(int(v)): int(c) for v, c in zip(values, counts)},
    }
    if ceiling is not None:
        out.update(ceiling=ceiling, clamped=sum(r > ceiling for r in raw))
    if curriculum is not None:
        out.update(curriculum=curriculum.to_dict(), per_step=draws)
    return out


class RecurrenceSamplingCallback(TrainerCallback):
    """Runs every training forward at the r of the current optimizer step (see the module docstring).

    A forward pre-hook on the model sets ``num_recurrences=`` in the call's keyword arguments for
    training-mode forwards that do not set it themselves; evaluation (eval mode) runs at the
    model's configured r. The hook is placed first among the model's pre-hooks, so hooks that
    read the call (``LoopedComputeCallback``'s FLOP count) see the r that runs.

    Args:
        seed: the run seed (use ``TrainingArguments.seed``); with the step it fixes r.
        scheme: ``poisson_lognormal`` (default) or ``fixed`` (a no-op without a curriculum, for
            symmetric code; with one, every step runs the curriculum's mean).
        mean: the mean r; ``None`` = the model's ``config.num_recurrences``.
        curriculum: a `RecurrenceCurriculum`: step s draws around ``curriculum.mean_at(s)`` instead
            of ``mean``.

    Every draw is clamped to the model's ceiling (``config.recurrence_ceiling``: ``max_recurrences``,
    the loops of a per-loop LoRA retrofit, else 64 x the trained r), read at the start of training:
    the sampler has no upper bound, and the model refuses any r above it. ``summary`` records the
    ceiling and how many steps it clamped.
    """

    def __init__(
        self,
        seed: int = 0,
        scheme: str = "poisson_lognormal",
        mean: int | None = None,
        curriculum: RecurrenceCurriculum | None = None,
    ) -> None:
        if scheme not in RECURRENCE_SAMPLINGS:
            raise ValueError(f"recurrence_sampling={scheme!r}: must be one of {RECURRENCE_SAMPLINGS}")
        self.seed = int(seed)
        self.scheme = scheme
        self.mean = mean
        self.curriculum = curriculum
        self._state: TrainerState | None = None
        self._hook: Any = None
        self._model: torch.nn.Module | None = None
        #: The model's ceiling on r (``config.recurrence_ceiling``), read at the start of training.
        self.ceiling: int | None = None
        #: r of every optimizer step trained in this process (step -> r), for logs and tests.
        self.history: dict[int, int] = {}

    def num_recurrences_at(self, step: int) -> int:
        """The r that optimizer step ``step`` runs."""
        if self.mean is None:
            raise RuntimeError(
                "RecurrenceSamplingCallback: mean r unknown before training starts (pass mean=)"
            )
        mean = self.mean if self.curriculum is None else self.curriculum.mean_at(step)
        return draw_num_recurrences(mean, step, self.seed, self.scheme, self.ceiling)

    def _hook_fn(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not module.training or self._state is None or kwargs.get("num_recurrences") is not None:
            return None
        # global_step counts finished optimizer steps: constant over the micro-batches of a step.
        step = int(self._state.global_step)
        r = self.num_recurrences_at(step)
        self.history[step] = r
        kwargs["num_recurrences"] = r
        return args, kwargs

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model=None, **kwargs
    ):
        # The Trainer replaces its TrainerState when it resumes, before this event: keep this one.
        self._state = state
        if model is None or model is self._model:
            return
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "num_recurrences"):
            raise TypeError(
                f"RecurrenceSamplingCallback needs a looped model (config.num_recurrences); got {type(model).__name__}"
            )
        if getattr(config, "is_recurrence_locked", False) and (self.scheme != "fixed" or self.curriculum):
            raise ValueError(
                f"recurrence_sampling={self.scheme!r}: this model uses input_injection="
                f"{config.input_injection!r}, whose parameters are indexed by recurrence step; it can only "
                f"train at num_recurrences={config.num_recurrences}"
            )
        if self.mean is None:
            self.mean = int(config.num_recurrences)
        self.ceiling = int(getattr(config, "recurrence_ceiling", None) or MAX_NUM_RECURRENCES)
        top = self.mean if self.curriculum is None else self.curriculum.maximum
        if top > self.ceiling:  # the mean itself is past the ceiling: refused before step 0, not clamped
            raise ValueError(f"num_recurrences={top}: the mean r is above this model's ceiling of {self.ceiling} "
                             "recurrences (config.recurrence_ceiling)")  # fmt: skip
        self.num_recurrences_at(0)  # a bad mean fails here, before the first step
        self._remove_hook()
        self._model = model
        self._hook = model.register_forward_pre_hook(self._hook_fn, with_kwargs=True, prepend=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._remove_hook()
        self._model = None

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def summary(self, steps: int) -> dict[str, Any]:
        """`sampled_recurrences_summary` of the first ``steps`` optimizer steps of this run."""
        if self.mean is None:
            raise RuntimeError("RecurrenceSamplingCallback.summary: mean r unknown (training never started)")
        return sampled_recurrences_summary(
            self.mean, steps, self.seed, self.scheme, self.curriculum, self.ceiling
        )


__all__ = [
    "CURRICULUM_SHAPES",
    "HUGINN_SIGMA",
    "RecurrenceCurriculum",
    "RECURRENCE_SAMPLINGS",
    "RecurrenceSamplingCallback",
    "draw_num_recurrences",
    "sample_num_recurrences",
    "sampled_recurrences_summary",
]
