"""The architecture family a plan ranges over: width -> the model's own accounting, per r (see the
package docstring)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from looped_hf.fileio import read_json, write_text_atomic
from looped_hf.scaling import ScalingLawFit

if TYPE_CHECKING:
    from looped_hf.sweep import SweepPlan

#: Widths (multiples of the head dim) where the family measures the model: three for the exact
#: quadratic, a fourth to check it.
_FIT_MULTIPLES = (1, 2, 3)
_CHECK_MULTIPLE = 7
_PRECISION_FLAGS = ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")
#: The name the sweep saves its recipe under beside results.jsonl (``looped_hf.sweep.RECIPE_COPY``,
#: repeated here because importing the sweep package imports torch; a test checks they agree).
RECIPE_COPY = "sweep.yaml"

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
        per file and modification time in memory, and on disk per recipe text and accounting code
        (:func:`family_cache_dir`)."""
        if isinstance(recipe, Mapping):
            text = json.dumps(recipe, sort_keys=True, default=str)
            return _disk_cached(text, "<recipe mapping>", lambda: _family_from_recipe(dict(recipe), "<recipe mapping>"))
        path = Path(recipe).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"recipe={str(recipe)!r}: no such file")
        return _cached_family(str(path), path.stat().st_mtime_ns)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the disk cache's)."""
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "members"},
            "members": [
                {k: (dataclasses.asdict(v) if isinstance(v, Quadratic) else v) for k, v in vars(m).items()}
                for m in self.members.values()
            ],
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], source: str) -> ArchitectureFamily:
        """Inverse of :meth:`to_dict` (``source`` replaces the stored one: the cache is per text)."""
        members = {}
        for m in obj["members"]:
            fields = {k: (Quadratic(**v) if isinstance(v, dict) else v) for k, v in m.items()}
            members[int(fields["r"])] = FamilyMember(**fields)
        tuples = ("sweep_budgets", "sweep_widths", "sweep_recurrences")
        rest = {k: (tuple(v) if k in tuples else v) for k, v in obj.items() if k not in ("members", "source")}
        return cls(members=members, source=source, **rest)


@functools.lru_cache(maxsize=8)
def _cached_family(path: str, _mtime_ns: int) -> ArchitectureFamily:
    def measure() -> ArchitectureFamily:
        from looped_hf.arguments import load_yaml

        return _family_from_recipe(load_yaml(path), path)

    return _disk_cached(Path(path).read_text(encoding="utf-8"), path, measure)


#: Sources whose code decides a family's numbers (the recipe parser, the sweep plan, the model's
#: accounting): a change to any of them makes every cached family stale.
_ACCOUNTING_SOURCES = (
    "arguments.py", "run_arguments.py", "configuration_looped.py", "config_rules_looped.py", "modeling_looped.py", "interface_looped.py",
    "generation_looped.py", "accounting_looped.py", "recurrent_block_looped.py", "decoder_layers_looped.py", "parcae_looped.py", "sweep",
    "planner/family.py", "loop_attention_looped.py",
)  # fmt: skip
_FAMILY_FORMAT = "looped_hf.family/1"


def family_cache_dir() -> Path | None:
    """Where measured families are kept: ``$LOOPED_HF_CACHE/families`` (``LOOPED_HF_CACHE=""``
    turns the disk cache off), else ``$XDG_CACHE_HOME/looped_hf/families`` (``~/.cache``).

    Why a disk cache: measuring a family builds the recipe's models on torch's meta device, which
    imports torch and transformers (~3.5 s) and takes seconds more; the numbers depend only on the
    recipe text and the accounting code, so ``looped-hf plan`` on a recipe it has measured before
    is numpy only.
    """
    env = os.environ.get("LOOPED_HF_CACHE")
    if env == "":
        return None
    root = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "looped_hf"
    return root / "families"


def _accounting_key(recipe_text: str) -> str:
    """sha256 of the recipe text and of every source file the family's numbers come from."""
    digest = hashlib.sha256(recipe_text.encode("utf-8"))
    package = Path(__file__).resolve().parents[1]
    for name in _ACCOUNTING_SOURCES:
        target = package / name
        files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        for path in files:
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(path.read_bytes() if path.is_file() else b"<missing>")
    return digest.hexdigest()


def _disk_cached(recipe_text: str, source: str, measure: Any) -> ArchitectureFamily:
    """The family of ``recipe_text`` from the disk cache, else ``measure()`` and store it."""
    root = family_cache_dir()
    if root is None:
        return measure()
    path = root / f"{_accounting_key(recipe_text)}.json"
    try:
        obj = read_json(path)
        if obj.get("format") == _FAMILY_FORMAT:
            return ArchitectureFamily.from_dict(obj["family"], source)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, unreadable or from another version: measure again
    family = measure()
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"format": _FAMILY_FORMAT, "family": family.to_dict()}))
    except OSError:
        pass  # a read-only cache only costs the next run the measurement
    return family


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
    # One budget far above any run (so no width falls under one optimizer step), yet low enough
    # that the run's step counts fit the recipe's 64-bit integers; one seed, every r; per-r
    # learning rates are a training matter (and need every r listed): not the plan's.
    probe["sweep"] = {
        **{k: v for k, v in data["sweep"].items() if k != "learning_rate_by_r"},
        "budgets": [1e24], "widths": measure, "recurrences": rs, "seeds": [0],
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
    from looped_hf.accounting_looped import (
        inference_flops_per_token,
        num_scaling_params,
        training_flops_per_token,
    )
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
        counts = num_scaling_params(model)
        inf_r = inference_flops_per_token(model, plan.seq_len, r)
        rows.append((
            counts["once"], counts["recurrent"], training_flops_per_token(model, plan.seq_len), inf_r,
            inference_flops_per_token(model, plan.seq_len, r + 1) - inf_r,
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
