"""Plan a training run from a fitted looped scaling law: phi as a decision.

A fit (:class:`looped_hf.scaling.ScalingLawFit`) says what loss a model of ``N_once``, ``N_rec``
trained with ``r`` recurrences on ``D`` tokens reaches. This module answers the question a user
trains for: *with C training FLOPs (and T tokens to serve), which width, r and token count, and
what loss?*

    looped-hf plan FIT.json --budget 1e20 1e21 [--recurrences 1 2 4 8] [--inference-tokens T]
                            [--inference-recurrences 4=2.7] [--kv-budget K] [--target-loss L]
                            [--recipe SWEEP.yaml] [--resamples N] [--json]

>>> from looped_hf.planner import plan                           # doctest: +SKIP
>>> p = plan(fit, [1e20], recipe="recipes/iso_depth_paper.yaml")  # doctest: +SKIP
>>> print(p.to_markdown()); p.to_dict()                           # doctest: +SKIP

The architecture family (prelude / block / coda split per r, head dim, vocabulary, seq_len,
injection) is the sweep recipe's: the one saved beside the fitted ``results.jsonl``
(``sweep.yaml``) or the one passed as ``recipe``. Its N_once, N_rec and FLOPs per token come from
the model's own accounting (``num_scaling_params``, ``training_flops_per_token``,
``inference_flops_per_token`` of ``LoopedForCausalLM`` built on the meta device through the sweep
plan, :func:`looped_hf.sweep.make_plan`). Every count is a polynomial of degree <= 2 in the width
at fixed head dim (layers are ``~12 d^2``, the head ``V d``, attention ``12 d T`` per layer
application, norms ``d``), so the family measures the model at three widths per r, takes the
exact quadratic through them and checks it against the model at a fourth: the numbers at any
width are the model's, without building a model per width.

Widths are multiples of the head dim (the only widths the family has). For a budget C and an r,
the plan spends the whole budget (the law's loss falls with tokens): ``D = C / flops_per_token(d)``,
and the width is the grid point with the lowest predicted loss. Every bootstrap resample of the
fit plans its own optimum, so the 95% band of the loss is the spread of *optimal* losses, not of
the loss at one fixed width.

Decisions:

- best r for a training budget (lowest predicted loss; with the share of resamples where it wins);
- with ``inference_tokens=T``: at the loss the best r reaches with C (or at ``target_loss``), the
  r whose cheapest model has the lowest training + T x inference FLOPs. A checkpoint measured with
  adaptive exit may pass its mean recurrences (``inference_recurrences={4: 2.7}``): inference FLOPs
  are linear in r, so the model's count at r and r + 1 gives any mean;
- with ``target_loss=L``: per r, the cheapest (width, tokens) that reaches L, or a plain
  statement that the law does not (L at or below its floor E, or beyond every width).

KV cache: bytes per token of context = layer applications that write KV x 2 (K and V) x kv_heads
x head_dim x bytes per element; with a KV budget k the block keeps min(k, r) applications instead
of r (``LoopedConfig.kv_budget``); prelude and coda keep theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from looped_hf.scaling import ScalingLawFit

if TYPE_CHECKING:
    from looped_hf.sweep import SweepPlan

PLAN_FORMAT = "looped_hf.plan/1"
#: Widths (multiples of the head dim) where the family measures the model: three for the exact
#: quadratic, a fourth to check it.
_FIT_MULTIPLES = (1, 2, 3)
_CHECK_MULTIPLE = 7
#: The width grid starts at this many head-dim multiples and grows x4 while the optimum sits in
#: its top quarter, up to the cap (head dim 128: 4.2M wide).
_GRID_START = 64
_GRID_CAP = 2**15
_PRECISION_FLAGS = ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")


# ---------------------------------------------------------------------------------------------
# The architecture family: width -> the model's accounting, per r
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Quadratic:
    """``c0 + c1 d + c2 d^2``: one of the model's counts as a function of the width ``d``."""

    c0: float
    c1: float
    c2: float

    def __call__(self, d: np.ndarray | float) -> np.ndarray | float:
        d = np.asarray(d, float)
        out = self.c0 + d * (self.c1 + d * self.c2)
        return float(out) if out.ndim == 0 else out

    @classmethod
    def through(cls, widths: Sequence[float], values: Sequence[float]) -> Quadratic:
        """The quadratic through three (width, value) points (exact for the model's counts)."""
        c2, c1, c0 = np.polyfit(np.asarray(widths, float), np.asarray(values, float), 2)
        return cls(float(c0), float(c1), float(c2))

    def solve(self, y: float) -> float:
        """The positive width where the quadratic equals ``y`` (counts grow with the width)."""
        if self.c2 == 0.0:
            return (y - self.c0) / self.c1
        disc = self.c1 * self.c1 - 4.0 * self.c2 * (self.c0 - y)
        return (-self.c1 + math.sqrt(max(disc, 0.0))) / (2.0 * self.c2)


@dataclass(frozen=True)
class FamilyMember:
    """The family's model at one r: its layer split and its accounting as functions of width.

    ``inference_flops`` is forward FLOPs per token at the family's seq_len with r recurrences;
    ``inference_flops_per_recurrence`` what one more recurrence adds (inference FLOPs are linear
    in r: the model's count at r + 1 minus at r). ``kv_width`` is ``kv_heads x head_dim``.
    """

    r: int
    prelude: int
    block: int
    coda: int
    n_once: Quadratic
    n_rec: Quadratic
    train_flops: Quadratic
    inference_flops: Quadratic
    inference_flops_per_recurrence: Quadratic
    kv_width: Quadratic

    def kv_applications(self, kv_budget: int | None = None) -> int:
        """Layer applications per token that keep KV: P + min(k, r) K + C (k = r without a budget)."""
        k = self.r if kv_budget is None else min(kv_budget, self.r)
        return self.prelude + k * self.block + self.coda


@dataclass(frozen=True)
class ArchitectureFamily:
    """An iso-depth family: one model per r, every count a function of the width.

    Attributes:
        width_step: widths are multiples of it (the head dim).
        seq_len: the context the FLOPs are counted at.
        members: r -> :class:`FamilyMember`; r = 1 (the non-looped model) is always there.
        recurrent_depth: layers the looped members share out as block x r (``r`` must divide it).
        sweep_budgets, sweep_widths, sweep_recurrences: the recipe's sweep (used for the
            extrapolation marks when the fit carries no runs).
        source: where the family came from (a recipe path).
    """

    width_step: int
    seq_len: int
    members: dict[int, FamilyMember]
    recurrent_depth: int | None = None
    sweep_budgets: tuple[float, ...] = ()
    sweep_widths: tuple[int, ...] = ()
    sweep_recurrences: tuple[int, ...] = ()
    source: str = "<memory>"

    def member(self, r: int) -> FamilyMember:
        """The member with ``r`` recurrences; a ValueError naming r and the possible values."""
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or int(r) not in self.members:
            why = (
                f"the recurrent depth {self.recurrent_depth} (effective_depth - prelude - coda) must divide by r"
                if self.recurrent_depth
                else "the family has no model with it"
            )
            raise ValueError(
                f"recurrences: r={r!r} is not in the family of {self.source} ({why}; possible: "
                f"{', '.join(str(k) for k in sorted(self.members))})"
            )
        return self.members[int(r)]

    def widths(self, k_max: int) -> np.ndarray:
        """The first ``k_max`` widths the family can have: width_step x 1 .. k_max."""
        return self.width_step * np.arange(1, k_max + 1, dtype=float)

    @classmethod
    def from_recipe(cls, recipe: str | os.PathLike[str] | Mapping[str, Any]) -> ArchitectureFamily:
        """The family of a sweep recipe (YAML path or mapping with a ``sweep:`` section); cached
        per file and modification time."""
        if isinstance(recipe, Mapping):
            return _family_from_recipe(dict(recipe), "<recipe mapping>")
        path = Path(recipe).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"recipe={str(recipe)!r}: no such file")
        return _cached_family(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_family(path: str, _mtime_ns: int) -> ArchitectureFamily:
    from looped_hf.arguments import load_yaml

    return _family_from_recipe(load_yaml(path), path)


def _family_from_recipe(data: dict[str, Any], where: str) -> ArchitectureFamily:
    """Measure the recipe's models (every r its depth allows) through the sweep plan."""
    from looped_hf.arguments import RecipeError
    from looped_hf.sweep import make_plan, parse_sweep_section

    if "sweep" not in data:
        raise RecipeError(f"recipe {where}: no 'sweep' section; the planner needs a sweep recipe")
    sweep = parse_sweep_section(data["sweep"], f"recipe {where}")
    depth = sweep.effective_depth - sweep.prelude - sweep.coda
    rs = [1] + [r for r in range(2, depth + 1) if depth % r == 0]
    hd = sweep.head_dim
    measure = [hd * k for k in (*_FIT_MULTIPLES, _CHECK_MULTIPLE)]
    probe = dict(data)
    # One budget far above any run (so no width falls under one optimizer step), one seed, every r;
    # per-r learning rates are a training matter (and need every r listed): not the plan's.
    probe["sweep"] = {
        **{k: v for k, v in data["sweep"].items() if k != "learning_rate_by_r"},
        "budgets": [1e30], "widths": measure, "recurrences": rs, "seeds": [0],
    }  # fmt: skip
    plan = make_plan(probe)
    members = {r: _measure_member(plan, r, measure) for r in rs}
    widths = sorted({w for ws in sweep.widths_for_all() for w in ws})
    return ArchitectureFamily(
        width_step=hd,
        seq_len=plan.seq_len,
        members=members,
        recurrent_depth=depth,
        sweep_budgets=tuple(float(b) for b in sweep.budgets),
        sweep_widths=tuple(widths),
        sweep_recurrences=tuple(sweep.recurrences),
        source=where,
    )


def _measure_member(plan: SweepPlan, r: int, widths: list[int]) -> FamilyMember:
    """Build the planned model at each width on the meta device; its counts as quadratics."""
    import torch

    from looped_hf import LoopedForCausalLM
    from looped_hf.arguments import parse_recipe

    rows: list[tuple[float, ...]] = []
    shape: tuple[int, int, int] = (0, 0, 0)
    for width in widths:
        run = next(x for x in plan.runs if x.hidden_size == width and x.num_recurrences == r)
        recipe = {k: v for k, v in run.recipe.items() if k not in _PRECISION_FLAGS}
        model_args, _, _ = parse_recipe(recipe)
        config = model_args.to_config(plan.vocab_size, plan.seq_len)
        with torch.device("meta"):
            model = LoopedForCausalLM(config)
        counts = model.num_scaling_params()
        inf_r = model.inference_flops_per_token(plan.seq_len, r)
        rows.append((
            counts["once"], counts["recurrent"], model.training_flops_per_token(plan.seq_len), inf_r,
            model.inference_flops_per_token(plan.seq_len, r + 1) - inf_r,
            config.num_key_value_heads * config.head_dim,
        ))  # fmt: skip
        shape = (run.num_prelude_layers, run.num_recurrent_layers, run.num_coda_layers)
    values = np.array(rows, float)
    k = len(_FIT_MULTIPLES)
    polys = [Quadratic.through(widths[:k], values[:k, j]) for j in range(values.shape[1])]
    for j, poly in enumerate(polys):
        # The check width: the counts are the model's at every width only if they are quadratic.
        got, want = poly(widths[k]), values[k, j]
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise RuntimeError(
                f"the model's accounting (column {j}) is not quadratic in the width at r={r}: "
                f"{want} at width {widths[k]}, the quadratic gives {got}"
            )
    return FamilyMember(r, *shape, *polys)


def family_for_fit(
    fit: ScalingLawFit, recipe: str | os.PathLike[str] | Mapping[str, Any] | None = None
) -> ArchitectureFamily:
    """The family a fit was made on: ``recipe`` if given, else the ``sweep.yaml`` saved beside the
    fitted ``results.jsonl`` (``fit.runs.source``). Checks that the family's models are the fitted
    runs' (N_once, N_rec at their width and r)."""
    if recipe is None:
        from looped_hf.sweep import RECIPE_COPY

        source = fit.runs.source if fit.runs is not None else None
        candidate = Path(source).parent / RECIPE_COPY if source and source != "<memory>" else None
        if candidate is None or not candidate.is_file():
            raise ValueError(
                f"recipe: the fit records no sweep recipe (runs.source={source!r}"
                + (f" has no {RECIPE_COPY} beside it" if candidate is not None else "")
                + "); pass the sweep recipe its runs were planned from (recipe=..., CLI --recipe SWEEP.yaml)"
            )
        recipe = candidate
    family = ArchitectureFamily.from_recipe(recipe)
    _check_family_matches(fit, family)
    return family


def _check_family_matches(fit: ScalingLawFit, family: ArchitectureFamily) -> None:
    runs = fit.runs
    if runs is None or runs.width is None or runs.kind != "looped":
        return
    for i in range(len(runs)):
        r, d = int(round(runs.num_recurrences[i])), runs.width[i]
        if not np.isfinite(d) or r not in family.members:
            continue
        m = family.members[r]
        want = (runs.n_once[i] + runs.n_rec[i], runs.n_rec[i] if r > 1 else 0.0)
        got = (m.n_once(d) + m.n_rec(d), m.n_rec(d) if r > 1 else 0.0)
        # 1%: fits of synthetic or external runs count norm scales their own way.
        if any(abs(g - w) > 0.01 * max(w, 1.0) for g, w in zip(got, want)):
            raise ValueError(
                f"recipe: {family.source} does not describe the fitted runs: run {runs.labels[i]!r} "
                f"(width {d:g}, r {r}) has n_once + n_rec = {want[0]:,.0f}, n_rec = {runs.n_rec[i]:,.0f}; "
                f"the recipe's model has {got[0]:,.0f}, {m.n_rec(d):,.0f}"
            )


# ---------------------------------------------------------------------------------------------
# The law over a width grid, for the point estimate and every resample at once
# ---------------------------------------------------------------------------------------------
_E, _A, _ALPHA, _B, _BETA, _PHI = range(6)


def _param_sets(fit: ScalingLawFit, resamples: int | None, need_phi: bool) -> np.ndarray:
    """``(S, 6)`` rows ``E, A, alpha, B, beta, phi``: the point estimate, then the resamples."""
    p = fit.params
    phi = p.get("phi")
    if phi is None and need_phi:
        raise ValueError(
            "recurrences: this fit has no phi (a plain fit, or runs that do not identify it): only "
            "r = 1 can be planned"
        )
    point = np.array([[p["E"], p["A"], p["alpha"], p["B"], p["beta"], 0.0 if phi is None else phi]], float)
    boot = fit.bootstrap_samples
    if boot is None or len(boot) == 0 or resamples == 0:
        return point
    boot = np.asarray(boot, float)[: resamples if resamples is not None else None]
    return np.vstack([point, boot])


def _capacity_term(P: np.ndarray, n_once: np.ndarray, n_rec: np.ndarray, r: float) -> np.ndarray:
    """``A N_eff^-alpha`` for every parameter set (rows) and width (columns), in log space."""
    n_eff = n_once[None, :] + np.power(float(r), P[:, _PHI : _PHI + 1]) * n_rec[None, :]
    return np.exp(np.log(P[:, _A : _A + 1]) - P[:, _ALPHA : _ALPHA + 1] * np.log(n_eff))


def _data_term(P: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return np.exp(np.log(P[:, _B : _B + 1]) - P[:, _BETA : _BETA + 1] * np.log(tokens))


def _grid_search(objective: Any, family: ArchitectureFamily) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Minimise ``objective(widths) -> (S, K)`` over the family's width grid.

    The grid grows x4 while the point estimate's optimum (row 0) sits in its top quarter.
    Returns (index per row, value per row, the widths, the grid size)."""
    k_max = _GRID_START
    while True:
        widths = family.widths(k_max)
        values = objective(widths)
        i0 = int(np.argmin(values[0]))
        if i0 < k_max - k_max // 4 or k_max >= _GRID_CAP or not np.isfinite(values[0, i0]):
            if not np.isfinite(values[0, i0]) and k_max < _GRID_CAP:
                k_max *= 4  # unreachable so far: wider models may reach it
                continue
            break
        k_max *= 4
    idx = np.argmin(values, axis=1)
    return idx, values[np.arange(len(idx)), idx], widths, k_max


def _band(values: np.ndarray) -> tuple[float, float] | None:
    """95% percentile band of the resamples (rows 1..), None without resamples."""
    if len(values) < 2:
        return None
    lo, hi = np.percentile(values[1:], [2.5, 97.5])
    return float(lo), float(hi)


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Extrapolation:
    """How far a plan lies outside the fitted sweep (factors > 1 beyond, < 1 below; None inside)."""

    budget: float | None = None
    width: float | None = None
    r: bool = False
    grid_edge: str | None = None

    @property
    def any(self) -> bool:
        return self.budget is not None or self.width is not None or self.r or self.grid_edge is not None

    def text(self) -> str:
        parts = []
        if self.budget is not None:
            parts.append(f"budget {_factor(self.budget)} the sweep's {'largest' if self.budget > 1 else 'smallest'}")
        if self.width is not None:
            parts.append(f"width {_factor(self.width)} its {'widest' if self.width > 1 else 'narrowest'}")
        if self.r:
            parts.append("r not in the sweep")
        if self.grid_edge:
            parts.append(f"optimum at the {self.grid_edge} width searched")
        return "; ".join(parts)


def _factor(x: float) -> str:
    return f"{x:.3g}x" if x > 1 else f"1/{1 / x:.3g}x of"


@dataclass
class PlanEntry:
    """The compute-optimal model for one budget and one r (all counts the model's own)."""

    budget: float
    r: int
    width: int
    n_once: float
    n_rec: float
    tokens: float
    loss: float
    loss_band: tuple[float, float] | None
    width_band: tuple[float, float] | None
    tokens_band: tuple[float, float] | None
    performs_like: float
    costs_like: float
    same_width_nonlooped: float
    """Unique parameters of the non-looped member at the same width and depth (the iso-depth
    sibling: the study's "costs like" reading); its training FLOPs per token relative to this
    model's are ``same_width_nonlooped_flops_ratio``."""
    same_width_nonlooped_flops_ratio: float
    train_flops_per_token: float
    inference_recurrences: float
    inference_flops_per_token: float
    kv_bytes_per_token: float
    kv_bytes_per_token_budget: float | None
    extrapolation: Extrapolation

    @property
    def unique_params(self) -> float:
        return self.n_once + self.n_rec

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.unique_params

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(unique_params=self.unique_params, tokens_per_param=self.tokens_per_param)
        out["extrapolation"] = {**dataclasses.asdict(self.extrapolation), "text": self.extrapolation.text()}
        return out


@dataclass
class CostEntry:
    """The cheapest model at one r that reaches a loss: training (+ T x inference) FLOPs."""

    r: int
    loss: float
    reachable: bool
    width: int | None = None
    tokens: float | None = None
    train_flops: float | None = None
    inference_flops: float | None = None
    total_flops: float | None = None
    total_band: tuple[float, float] | None = None
    share_reaching: float | None = None
    extrapolation: Extrapolation = field(default_factory=Extrapolation)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["extrapolation"] = {**dataclasses.asdict(self.extrapolation), "text": self.extrapolation.text()}
        return out


@dataclass
class CostDecision:
    """Per r, the cheapest way to a loss; the best r and how often each r wins over the resamples."""

    loss: float
    why: str
    budget: float | None
    inference_tokens: float | None
    entries: list[CostEntry]
    best_r: int | None
    share_best: dict[int, float]
    floor: float

    def sentence(self) -> str:
        """The decision in one paragraph."""
        where = f"loss {self.loss:.4g} ({self.why})"
        if self.best_r is None:
            return (
                f"The law does not reach {where} at any r: its floor is E = {self.floor:.4g} and no width up to "
                f"the search cap gets there."
            )
        serve = (
            f" + {self.inference_tokens:.3g} tokens of inference" if self.inference_tokens else ""
        )
        parts = []
        for e in self.entries:
            if e.reachable:
                parts.append(f"r = {e.r}: {e.total_flops:.3g} FLOPs (width {e.width}, {e.tokens:.3g} tokens)")
            else:
                parts.append(f"r = {e.r}: not reached")
        share = self.share_best.get(self.best_r)
        tail = f" It is cheapest in {100 * share:.0f}% of the resamples." if share is not None else ""
        return f"To reach {where} with training{serve}: " + "; ".join(parts) + f". Cheapest: r = {self.best_r}.{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss, "why": self.why, "budget": self.budget, "inference_tokens": self.inference_tokens,
            "entries": [e.to_dict() for e in self.entries], "best_r": self.best_r,
            "share_best": {str(k): v for k, v in self.share_best.items()}, "floor": self.floor,
            "sentence": self.sentence(),
        }  # fmt: skip


@dataclass
class BudgetDecision:
    """Best r for one training budget: lowest predicted loss, and its share of the resamples."""

    budget: float
    best_r: int
    loss: float
    share_best: dict[int, float]
    margins: dict[int, float]

    def sentence(self, entries: Sequence[PlanEntry]) -> str:
        best = next(e for e in entries if e.budget == self.budget and e.r == self.best_r)
        band = f" [{best.loss_band[0]:.4g}, {best.loss_band[1]:.4g}]" if best.loss_band else ""
        others = ", ".join(f"r = {r} +{m:.3g}" for r, m in self.margins.items() if r != self.best_r)
        share = self.share_best.get(self.best_r)
        s = (
            f"With {self.budget:.3g} FLOPs train r = {self.best_r}: width {best.width}, "
            f"{_si(best.unique_params)} unique parameters, {best.tokens:.3g} tokens, loss {best.loss:.4g}{band}"
        )
        if others:
            s += f" ({others} nats)"
        if share is not None:
            s += f"; best in {100 * share:.0f}% of the resamples"
        if best.extrapolation.any:
            s += f" (extrapolated: {best.extrapolation.text()})"
        return s + "."

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget, "best_r": self.best_r, "loss": self.loss,
            "share_best": {str(k): v for k, v in self.share_best.items()},
            "margins": {str(k): v for k, v in self.margins.items()},
        }  # fmt: skip


@dataclass
class Plan:
    """What :func:`plan` returns: one entry per (budget, r) and the decisions.

    ``to_markdown()`` / ``table()`` for people, ``to_dict()`` / ``to_json()`` for scripts."""

    entries: list[PlanEntry]
    decisions: list[BudgetDecision]
    lifetime: list[CostDecision]
    target: CostDecision | None
    params: dict[str, Any]
    n_resamples: int
    family: dict[str, Any]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def entry(self, budget: float, r: int) -> PlanEntry:
        for e in self.entries:
            if e.budget == budget and e.r == r:
                return e
        raise KeyError(f"no plan entry for budget {budget:g}, r {r}")

    def sentences(self) -> list[str]:
        out = [d.sentence(self.entries) for d in self.decisions]
        out += [d.sentence() for d in self.lifetime]
        if self.target is not None:
            out.append(self.target.sentence())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "params": self.params,
            "n_resamples": self.n_resamples,
            "family": self.family,
            "settings": self.settings,
            "entries": [e.to_dict() for e in self.entries],
            "decisions": [d.to_dict() for d in self.decisions],
            "lifetime": [d.to_dict() for d in self.lifetime],
            "target": None if self.target is None else self.target.to_dict(),
            "sentences": self.sentences(),
            "notes": self.notes,
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """JSON text; written atomically to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=True)
        if path is not None:
            from looped_hf.fileio import write_text_atomic

            write_text_atomic(path, text)
        return text

    def _rows(self) -> list[list[str]]:
        kv = self.settings.get("kv_budget")
        rows = []
        for e in self.entries:
            band = f"[{e.loss_band[0]:.4g}, {e.loss_band[1]:.4g}]" if e.loss_band else "-"
            kv_text = _si(e.kv_bytes_per_token, 3) + (
                f" / {_si(e.kv_bytes_per_token_budget, 3)}" if kv is not None else ""
            )
            rows.append([
                f"{e.budget:.3g}", str(e.r), str(e.width), _si(e.unique_params), f"{e.tokens:.3g}",
                f"{e.tokens_per_param:.3g}", f"{e.loss:.4g}", band, _si(e.performs_like), _si(e.costs_like),
                f"{e.inference_flops_per_token:.3g}", kv_text, e.extrapolation.text() or "-",
            ])  # fmt: skip
        return rows

    def _header(self) -> list[str]:
        kv = self.settings.get("kv_budget")
        return [
            "budget", "r", "width", "unique params", "tokens", "tokens/param", "loss", "95% band",
            "performs like", "costs like", "inference FLOPs/token",
            "KV bytes/token" + (f" (/ kv_budget {kv})" if kv is not None else ""), "extrapolation",
        ]  # fmt: skip

    def to_markdown(self) -> str:
        """A markdown table of the entries, then the decisions as sentences."""
        head = self._header()
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in self._rows()]
        lines.append("")
        lines += [f"- {s}" for s in self.sentences()]
        lines.append("")
        lines.append(self.legend())
        return "\n".join(lines)

    def table(self) -> str:
        """Fixed-width console table, the decisions and the legend."""
        head, rows = self._header(), self._rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        lines.append("")
        lines += self.sentences()
        lines += ["", self.legend()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def legend(self) -> str:
        band = (
            f"the 2.5-97.5 percentiles of the optimal loss over {self.n_resamples} bootstrap resamples, each planning "
            "its own optimum" if self.n_resamples else "no band: the fit has no bootstrap resamples"
        )  # fmt: skip
        return (
            f"Law: L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta with phi = {_fmt_phi(self.params)}; family "
            f"{Path(self.family['source']).name} (widths in steps of {self.family['width_step']}, seq_len {self.family['seq_len']}). "
            f"Unique params: N_once + N_rec (no embedding, no head); performs like: N_once + r^phi N_rec; costs like: "
            f"the non-looped member with the same training FLOPs per token; band: {band}. Inference FLOPs per token "
            f"at context {self.family['seq_len']}; KV bytes per token of context at {self.settings['kv_bytes_per_element']:g} "
            "bytes per element."
        )


def _fmt_phi(params: Mapping[str, Any]) -> str:
    phi = params.get("phi")
    return "none (plain fit)" if phi is None else f"{phi:.3g}"


def _si(x: float | None, digits: int = 3) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    for div, unit in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}g}{unit}"
    return f"{x:.{digits}g}"


# ---------------------------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Range:
    budgets: tuple[float, float] | None
    widths: tuple[float, float] | None
    recurrences: frozenset[int]


def _sweep_range(fit: ScalingLawFit, family: ArchitectureFamily) -> _Range:
    runs = fit.runs
    if runs is not None:
        b = runs.budget if runs.budget is not None else runs.flops
        w = runs.width[np.isfinite(runs.width)] if runs.width is not None else np.array([])
        return _Range(
            (float(np.min(b)), float(np.max(b))),
            (float(w.min()), float(w.max())) if len(w) else None,
            frozenset(int(round(x)) for x in np.unique(runs.num_recurrences)),
        )
    return _Range(
        (min(family.sweep_budgets), max(family.sweep_budgets)) if family.sweep_budgets else None,
        (min(family.sweep_widths), max(family.sweep_widths)) if family.sweep_widths else None,
        frozenset(family.sweep_recurrences),
    )


def _outside(x: float, span: tuple[float, float] | None, tol: float = 1e-9) -> float | None:
    if span is None:
        return None
    lo, hi = span
    if x > hi * (1 + tol):
        return x / hi
    if x < lo * (1 - tol):
        return x / lo
    return None


def _extrapolation(rng: _Range, budget: float | None, width: float, r: int, edge: str | None) -> Extrapolation:
    return Extrapolation(
        budget=None if budget is None else _outside(budget, rng.budgets),
        width=_outside(width, rng.widths),
        r=bool(rng.recurrences) and r not in rng.recurrences,
        grid_edge=edge,
    )


def _edge(idx: int, k_max: int) -> str | None:
    if idx == 0:
        return "smallest"
    if idx == k_max - 1:
        return "largest"
    return None


def _check_inputs(
    budgets: Sequence[float],
    inference_tokens: float | None,
    kv_budget: int | None,
    target_loss: float | None,
    kv_bytes_per_element: float,
) -> list[float]:
    out = []
    for i, b in enumerate(budgets):
        try:
            value = float(b)
        except (TypeError, ValueError):
            raise ValueError(f"budgets[{i}]={b!r}: a training budget must be a positive number of FLOPs") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"budgets[{i}]={b!r}: a training budget must be a positive number of FLOPs")
        out.append(value)
    if inference_tokens is not None and not (math.isfinite(inference_tokens) and inference_tokens >= 0):
        raise ValueError(f"inference_tokens={inference_tokens!r}: must be a number of tokens >= 0")
    if kv_budget is not None and (isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 1):
        raise ValueError(f"kv_budget={kv_budget!r}: must be an integer >= 1 (recurrences whose KV is kept)")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"target_loss={target_loss!r}: must be a positive loss (nats/token)")
    if not kv_bytes_per_element > 0:
        raise ValueError(f"kv_bytes_per_element={kv_bytes_per_element!r}: must be > 0 (bf16: 2)")
    return out


def _inference_r(r: int, inference_recurrences: Mapping[int, float] | None) -> float:
    if not inference_recurrences or r not in inference_recurrences:
        return float(r)
    mean = float(inference_recurrences[r])
    if not 1.0 <= mean <= r:
        raise ValueError(
            f"inference_recurrences[{r}]={inference_recurrences[r]!r}: the mean recurrences of adaptive exit "
            f"must lie in [1, {r}] (r is its cap)"
        )
    return mean


def plan(
    fit: ScalingLawFit,
    budgets: Sequence[float] = (),
    *,
    recurrences: Sequence[int] | None = None,
    recipe: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    family: ArchitectureFamily | None = None,
    inference_tokens: float | None = None,
    inference_recurrences: Mapping[int, float] | None = None,
    kv_budget: int | None = None,
    target_loss: float | None = None,
    kv_bytes_per_element: float = 2.0,
    resamples: int | None = None,
) -> Plan:
    """Plan compute-optimal looped models from a fitted law.

    Args:
        fit: the fitted law (its bootstrap resamples give the bands).
        budgets: training FLOP budgets C (may be empty with ``target_loss``).
        recurrences: the r values to compare (default: the fitted runs' r, else the recipe's).
        recipe: the sweep recipe of the family (default: the ``sweep.yaml`` beside the fit's runs).
        family: an :class:`ArchitectureFamily` instead of a recipe.
        inference_tokens: T, tokens to serve: adds the lifetime decision (training + T x inference).
        inference_recurrences: trained r -> mean recurrences at inference (adaptive exit measured
            on a checkpoint), for the inference FLOPs.
        kv_budget: also report the KV bytes with only this many recurrences' KV kept.
        target_loss: also find, per r, the cheapest model that reaches this loss.
        kv_bytes_per_element: KV-cache element size (2: bf16).
        resamples: use at most this many bootstrap resamples (default all; 0: none).

    Raises:
        ValueError: naming the field and value (a budget <= 0, an r the family cannot have, a fit
            without a recipe to take its family from, ...).
    """
    t0 = time.perf_counter()
    budgets = _check_inputs(budgets, inference_tokens, kv_budget, target_loss, kv_bytes_per_element)
    if not budgets and target_loss is None:
        raise ValueError("budgets=[]: give at least one training budget (or a target_loss)")
    if family is None:
        family = family_for_fit(fit, recipe)
    if recurrences is None:
        fitted = sorted({int(round(x)) for x in fit.runs.num_recurrences}) if fit.runs is not None else []
        recurrences = fitted or list(family.sweep_recurrences) or [1]
    rs = [int(family.member(r).r) for r in recurrences]  # validates each r
    if len(set(rs)) != len(rs):
        raise ValueError(f"recurrences={list(recurrences)!r}: each r once")
    P = _param_sets(fit, resamples, need_phi=any(r > 1 for r in rs))
    S = len(P)
    rng = _sweep_range(fit, family)
    base = family.member(1)
    notes: list[str] = []
    if fit.runs is None:
        notes.append("the fit carries no runs: extrapolation is judged against the recipe's sweep")

    entries: list[PlanEntry] = []
    decisions: list[BudgetDecision] = []
    best_loss_per_budget: dict[float, np.ndarray] = {}
    for c in budgets:
        losses = np.empty((S, len(rs)))
        for j, r in enumerate(rs):
            m = family.member(r)

            def objective(d: np.ndarray, m: FamilyMember = m, r: int = r, c: float = c) -> np.ndarray:
                cap = _capacity_term(P, m.n_once(d), m.n_rec(d), r)
                return P[:, _E : _E + 1] + cap + _data_term(P, c / m.train_flops(d))

            idx, loss, widths, k_max = _grid_search(objective, family)
            losses[:, j] = loss
            i = int(idx[0])
            entries.append(_entry(c, r, m, base, P, float(widths[i]), loss, widths[idx], _edge(i, k_max), rng,
                                  inference_recurrences, kv_budget, kv_bytes_per_element))  # fmt: skip
        winners = np.argmin(losses, axis=1)
        best = int(winners[0])
        share = {r: float(np.mean(winners[1:] == j)) for j, r in enumerate(rs)} if S > 1 else {}
        decisions.append(BudgetDecision(
            c, rs[best], float(losses[0, best]), share,
            {r: float(losses[0, j] - losses[0, best]) for j, r in enumerate(rs)},
        ))  # fmt: skip
        best_loss_per_budget[c] = losses.min(axis=1)

    lifetime: list[CostDecision] = []
    if inference_tokens is not None and target_loss is None:
        for c in budgets:
            lifetime.append(_cost_decision(
                best_loss_per_budget[c], f"the best r's loss with {c:.3g} training FLOPs", c, float(inference_tokens),
                rs, family, P, rng, inference_recurrences,
            ))  # fmt: skip
    target = None
    if target_loss is not None:
        target = _cost_decision(
            np.full(S, float(target_loss)), "the target", None, inference_tokens, rs, family, P, rng,
            inference_recurrences,
        )
    return Plan(
        entries=entries,
        decisions=decisions,
        lifetime=lifetime,
        target=target,
        params=dict(fit.params),
        n_resamples=S - 1,
        family={
            "source": family.source, "width_step": family.width_step, "seq_len": family.seq_len,
            "members": {str(r): [family.members[r].prelude, family.members[r].block, family.members[r].coda]
                        for r in rs},
            "sweep_budgets": list(rng.budgets) if rng.budgets else None,
            "sweep_widths": list(rng.widths) if rng.widths else None,
        },  # fmt: skip
        settings={
            "budgets": budgets, "recurrences": rs, "inference_tokens": inference_tokens,
            "inference_recurrences": {str(k): v for k, v in (inference_recurrences or {}).items()},
            "kv_budget": kv_budget, "target_loss": target_loss, "kv_bytes_per_element": kv_bytes_per_element,
            "seconds": time.perf_counter() - t0,
        },  # fmt: skip
        notes=notes,
    )


def _entry(
    c: float,
    r: int,
    m: FamilyMember,
    base: FamilyMember,
    P: np.ndarray,
    d: float,
    loss: np.ndarray,
    boot_widths: np.ndarray | None,
    edge: str | None,
    rng: _Range,
    inference_recurrences: Mapping[int, float] | None,
    kv_budget: int | None,
    kv_bytes: float,
) -> PlanEntry:
    """One model of the family (width ``d``, r) trained with ``c`` FLOPs: the model's numbers, the
    law's loss (row 0) and the resamples' bands (``loss``: one per parameter set)."""
    # The counts are integers at a grid width; the quadratic's float rounding is not.
    n_once, n_rec, fpt = (float(round(q(d))) for q in (m.n_once, m.n_rec, m.train_flops))
    # The non-looped member (r = 1) with the same training FLOPs per token, at the (continuous)
    # width where its count equals this model's.
    d_same = base.train_flops.solve(fpt)
    r_inf = _inference_r(r, inference_recurrences)
    per_app = 2.0 * round(m.kv_width(d)) * kv_bytes  # K and V of one layer application, per token
    inf, per_rec = round(m.inference_flops(d)), round(m.inference_flops_per_recurrence(d))
    return PlanEntry(
        budget=c, r=r, width=int(round(d)), n_once=n_once, n_rec=n_rec, tokens=c / fpt, loss=float(loss[0]),
        loss_band=_band(loss), width_band=None if boot_widths is None else _band(boot_widths),
        tokens_band=None if boot_widths is None else _band(c / m.train_flops(boot_widths)),
        performs_like=n_once + float(r) ** float(P[0, _PHI]) * n_rec,
        costs_like=float(base.n_once(d_same) + base.n_rec(d_same)),
        same_width_nonlooped=float(round(base.n_once(d) + base.n_rec(d))),
        same_width_nonlooped_flops_ratio=float(base.train_flops(d)) / fpt,
        train_flops_per_token=fpt, inference_recurrences=r_inf,
        inference_flops_per_token=float(inf + (r_inf - r) * per_rec),
        kv_bytes_per_token=m.kv_applications() * per_app,
        kv_bytes_per_token_budget=None if kv_budget is None else m.kv_applications(kv_budget) * per_app,
        extrapolation=_extrapolation(rng, c, d, r, edge),
    )  # fmt: skip


def model_at(
    fit: ScalingLawFit,
    width: int,
    r: int,
    *,
    budget: float | None = None,
    tokens: float | None = None,
    recipe: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    family: ArchitectureFamily | None = None,
    inference_recurrences: Mapping[int, float] | None = None,
    kv_budget: int | None = None,
    kv_bytes_per_element: float = 2.0,
    resamples: int | None = None,
) -> PlanEntry:
    """One given model of the family (``width``, ``r``) trained with ``budget`` FLOPs or on ``tokens``
    tokens: the same numbers as a plan entry (the study's sentence: unique, performs like, costs
    like), with the loss band of the resamples at this fixed width."""
    if (budget is None) == (tokens is None):
        raise ValueError(f"budget={budget!r}, tokens={tokens!r}: give exactly one of them")
    if family is None:
        family = family_for_fit(fit, recipe)
    m = family.member(r)
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1 or width % family.width_step:
        raise ValueError(f"width={width!r}: must be a positive multiple of the head dim {family.width_step}")
    d = float(width)
    fpt = float(round(m.train_flops(d)))
    c = float(budget) if budget is not None else float(tokens) * fpt
    _check_inputs([c], None, kv_budget, None, kv_bytes_per_element)
    P = _param_sets(fit, resamples, need_phi=r > 1)
    wd = np.array([d])
    loss = (P[:, _E : _E + 1] + _capacity_term(P, m.n_once(wd), m.n_rec(wd), r) + _data_term(P, c / fpt))[:, 0]
    return _entry(c, r, m, family.member(1), P, d, loss, None, None, _sweep_range(fit, family),
                  inference_recurrences, kv_budget, kv_bytes_per_element)  # fmt: skip


def _cost_decision(
    target: np.ndarray,
    why: str,
    budget: float | None,
    inference_tokens: float | None,
    rs: list[int],
    family: ArchitectureFamily,
    P: np.ndarray,
    rng: _Range,
    inference_recurrences: Mapping[int, float] | None,
) -> CostDecision:
    """Per r, the width and tokens with the lowest training (+ T x inference) FLOPs at loss ``target``
    (one target per parameter set), for the point estimate and every resample."""
    S = len(P)
    T = float(inference_tokens or 0.0)
    totals = np.full((S, len(rs)), np.inf)
    entries: list[CostEntry] = []
    for j, r in enumerate(rs):
        m = family.member(r)
        r_inf = _inference_r(r, inference_recurrences)
        if target[0] <= P[0, _E]:  # at or below the floor: no model reaches it
            entries.append(CostEntry(r, float(target[0]), False, share_reaching=None))
            continue

        def objective(d: np.ndarray, m: FamilyMember = m, r: int = r, r_inf: float = r_inf) -> np.ndarray:
            gap = target[:, None] - P[:, _E : _E + 1] - _capacity_term(P, m.n_once(d), m.n_rec(d), r)
            ok = gap > 0
            # D at which the data term closes the gap: (B / gap)^(1 / beta); none where gap <= 0.
            log_tokens = (np.log(P[:, _B : _B + 1]) - np.log(np.where(ok, gap, 1.0))) / P[:, _BETA : _BETA + 1]
            with np.errstate(over="ignore"):
                train = np.where(ok, m.train_flops(d)[None, :] * np.exp(log_tokens), np.inf)
            inf = T * (m.inference_flops(d) + (r_inf - r) * m.inference_flops_per_recurrence(d))
            return train + inf[None, :]

        idx, cost, widths, k_max = _grid_search(objective, family)
        totals[:, j] = cost
        if not np.isfinite(cost[0]):
            entries.append(CostEntry(r, float(target[0]), False, share_reaching=_share_finite(cost)))
            continue
        i = int(idx[0])
        d = float(widths[i])
        inf_total = T * float(m.inference_flops(d) + (r_inf - r) * m.inference_flops_per_recurrence(d))
        train = float(cost[0]) - inf_total
        finite = cost[1:][np.isfinite(cost[1:])]
        entries.append(CostEntry(
            r=r, loss=float(target[0]), reachable=True, width=int(round(d)), tokens=train / float(m.train_flops(d)),
            train_flops=train, inference_flops=inf_total, total_flops=float(cost[0]),
            total_band=(float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))) if len(finite) else None,
            share_reaching=_share_finite(cost), extrapolation=_extrapolation(rng, train, d, r, _edge(i, k_max)),
        ))  # fmt: skip
    reach = np.isfinite(totals[0])
    best_r = rs[int(np.argmin(totals[0]))] if reach.any() else None
    share: dict[int, float] = {}
    if S > 1:
        rows = np.isfinite(totals[1:]).any(axis=1)
        winners = np.argmin(totals[1:][rows], axis=1)
        share = {r: float(np.mean(winners == j)) if rows.any() else 0.0 for j, r in enumerate(rs)}
    return CostDecision(float(target[0]), why, budget, inference_tokens, entries, best_r, share, float(P[0, _E]))


def _share_finite(cost: np.ndarray) -> float | None:
    return float(np.mean(np.isfinite(cost[1:]))) if len(cost) > 1 else None


def frontier(
    fit: ScalingLawFit,
    budgets: Sequence[float],
    *,
    family: ArchitectureFamily | None = None,
    recipe: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    recurrences: Sequence[int] | None = None,
    resamples: int | None = None,
) -> dict[str, Any]:
    """Predicted loss along each r's compute-optimal frontier, with its 95% band, as plain arrays
    (what :func:`looped_hf.plotting.plot_plan_frontier` draws)."""
    p = plan(fit, budgets, family=family, recipe=recipe, recurrences=recurrences, resamples=resamples)
    out: dict[str, Any] = {"budgets": list(p.settings["budgets"]), "lines": {}, "phi": fit.params.get("phi"),
                           "sweep_budgets": p.family["sweep_budgets"], "n_resamples": p.n_resamples}  # fmt: skip
    for r in p.settings["recurrences"]:
        es = [p.entry(c, r) for c in p.settings["budgets"]]
        out["lines"][r] = {
            "loss": [e.loss for e in es],
            "low": [e.loss_band[0] if e.loss_band else None for e in es],
            "high": [e.loss_band[1] if e.loss_band else None for e in es],
            "width": [e.width for e in es],
        }
    return out


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf plan",
        description="Plan compute-optimal looped models from a fitted law: width, r, tokens, predicted loss.",
    )
    p.add_argument("fit", help="fit.json written by `looped-hf fit --out` (with its bootstrap resamples)")
    p.add_argument("--budget", type=float, nargs="+", default=[], metavar="C", help="training FLOP budgets")
    p.add_argument("--recurrences", type=int, nargs="+", default=None, metavar="R",
                   help="r values to compare (default: the fitted runs')")  # fmt: skip
    p.add_argument("--inference-tokens", type=float, default=None, metavar="T",
                   help="tokens to serve: pick r by training + T x inference FLOPs at equal loss")  # fmt: skip
    p.add_argument("--inference-recurrences", nargs="+", default=None, metavar="R=MEAN",
                   help="mean recurrences at inference per trained r (adaptive exit), e.g. 4=2.7")  # fmt: skip
    p.add_argument("--kv-budget", type=int, default=None, metavar="K", help="also KV bytes with K recurrences kept")
    p.add_argument("--kv-bytes", type=float, default=2.0, metavar="B", help="bytes per KV element (default 2, bf16)")
    p.add_argument("--target-loss", type=float, default=None, metavar="L", help="cheapest model per r reaching L")
    p.add_argument("--recipe", default=None, metavar="SWEEP_YAML",
                   help="the sweep recipe of the fitted runs (default: sweep.yaml beside the fit's results.jsonl)")  # fmt: skip
    p.add_argument("--resamples", type=int, default=None, metavar="N", help="use at most N bootstrap resamples")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _parse_inference_recurrences(items: list[str] | None) -> dict[int, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        try:
            r, mean = item.split("=")
            out[int(r)] = float(mean)
        except ValueError:
            raise ValueError(f"--inference-recurrences {item!r}: expected R=MEAN, e.g. 4=2.7") from None
    return out


def main(argv: list[str] | None = None) -> int:
    """``looped-hf plan``: exit 0 with the plan, 2 on bad input (the message names the field)."""
    args = _parser().parse_args(argv)
    try:
        if not Path(args.fit).is_file():
            raise ValueError(f"fit={args.fit!r}: no such file")
        fit = ScalingLawFit.from_json(args.fit)
        if not args.budget and args.target_loss is None:
            raise ValueError("--budget: give at least one training budget C (or --target-loss L)")
        result = plan(
            fit, args.budget, recurrences=args.recurrences, recipe=args.recipe,
            inference_tokens=args.inference_tokens,
            inference_recurrences=_parse_inference_recurrences(args.inference_recurrences),
            kv_budget=args.kv_budget, target_loss=args.target_loss, kv_bytes_per_element=args.kv_bytes,
            resamples=args.resamples,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        print(f"looped-hf plan: {err}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
