"""Is phi identified by these runs? The diagnosis behind ``fit.report()``'s verdict line.

phi is read off the gap between the r levels at equal compute, so it is only as good as the
sweep's placement and the objective's curvature. :func:`diagnose` collects what a reader needs
to judge that, all JSON-safe:

- ``budgets``: per compute budget, the tokens per (unique, non-embedding) parameter across its
  widths; for each r the width with the lowest loss and whether that minimum is *interior* (an
  IsoFLOP minimum: the widths straddle the compute-optimal size) or at an *edge*; and the
  compute-optimal size the fitted law puts at that budget (:func:`compute_optimal`);
- ``at_bound``: fitted parameters on a bound of the search box (the box is not a prior: a
  parameter there is not estimated, it is clipped);
- ``profile``: the profile-likelihood interval of phi and the LR statistic at phi = 0 and 1
  (:mod:`.profile`);
- ``bootstrap``: the share of kept resamples with phi (or any parameter) on a bound, and the
  fit checks (``checks``: resamples refitted, dropped, and why);
- ``verdict``: identified or not, and the reasons in words a user can act on (an identified
  phi can still carry placement advice: widths on one side of the optimum make the law
  extrapolate there).

phi counts as identified when no fitted parameter sits on a bound and the trusted 95% interval
is closed inside the search box and no wider than :data:`~.trust.PHI_WIDTH_IDENTIFIED`. Which of
the two intervals (profile, bootstrap) is trusted is the one rule of :mod:`.trust`, the same the
comparison of a probe uses; when they answer differently the verdict says so.

:class:`SizeFamily` describes the sweep's models at one r as functions of their size, so that
the law can be evaluated off the sweep's grid (compute-optimal sizes here, IsoFLOP curves in
``looped_hf.plotting``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from scipy.optimize import nnls

from .formatting import OPTIMAL_VS_WIDTHS as OPTIMAL_VS_WIDTHS  # the sweep card reads it here
from .formatting import flop_budget, interval, si
from .law import BOUNDS, NATURAL_NAMES, PARAM_NAMES, PHI, effective_params, natural_loss
from .trust import PHI_WIDTH_IDENTIFIED, Interval, phi_measured, trusted_interval

if TYPE_CHECKING:
    from .result import ScalingLawFit
    from .runs import Runs

#: Compute-optimal sizes are searched this factor below the smallest and above the largest model.
SEARCH_FACTOR = 100.0
_NATURAL = {"a": "A", "alpha": "alpha", "b": "B", "beta": "beta", "e": "E", "phi": "phi"}


@dataclass(frozen=True)
class SizeFamily:
    """The sweep's models at one r as functions of unique parameters ``N = N_once + N_rec``.

    Iso-depth sweeps scale every part of the model with the width, so ``N_once / N`` is about
    constant (its median over the runs at r), and the training FLOPs per token are
    ``c_N N + c_d sqrt(N)``: 6 per applied parameter (``c_N``) plus the head and attention,
    which grow with the width ``d ~ sqrt(N)`` (``c_d``); both fitted to the runs at r by
    non-negative least squares (so the family reproduces the runs' own FLOP counts).
    """

    r: float
    frac_once: float
    c_n: float
    c_d: float

    def split(self, n: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """``(N_once, N_rec)`` of the family's model with ``n`` unique parameters."""
        n = np.asarray(n, float)
        return self.frac_once * n, (1.0 - self.frac_once) * n

    def flops_per_token(self, n: np.ndarray | float) -> np.ndarray:
        n = np.asarray(n, float)
        return self.c_n * n + self.c_d * np.sqrt(n)

    def tokens(self, budget: float | np.ndarray, n: np.ndarray | float) -> np.ndarray:
        """Tokens a model of ``n`` parameters trains on with ``budget`` FLOPs."""
        return np.asarray(budget, float) / self.flops_per_token(n)


def size_family(runs: Runs, r: float) -> SizeFamily:
    """The :class:`SizeFamily` of the runs at recurrence ``r``."""
    m = runs.num_recurrences == r
    if not m.any():
        raise ValueError(f"no runs with num_recurrences = {r:g}")
    n = runs.params[m]
    fpt = runs.flops[m] / runs.tokens[m]
    frac_once = float(np.median(runs.n_once[m] / n))
    if len(np.unique(n)) >= 2:
        (c_n, c_d), _ = nnls(np.stack([n, np.sqrt(n)], axis=1) / fpt[:, None], np.ones_like(fpt))
    else:  # one size: all FLOPs proportional to N
        c_n, c_d = float(np.median(fpt / n)), 0.0
    if c_n <= 0 and c_d <= 0:
        c_n = float(np.median(fpt / n))
    return SizeFamily(float(r), frac_once, float(c_n), float(c_d))


def law_loss(params: dict[str, Any], family: SizeFamily, budget: float, n: np.ndarray) -> np.ndarray:
    """The law's loss for the family's models of size ``n`` trained with ``budget`` FLOPs."""
    n_once, n_rec = family.split(n)
    n_eff = effective_params(n_once, n_rec, family.r, params.get("phi"))
    return natural_loss(params, n_eff, family.tokens(budget, n))


def compute_optimal(
    params: dict[str, Any], family: SizeFamily, budget: float, lo: float, hi: float, points: int = 600
) -> dict[str, Any]:
    """The size with the lowest law loss at ``budget`` among the family's models in ``[lo, hi]``.

    Returns ``n`` (unique parameters), ``n_eff``, ``tokens``, ``loss`` and ``edge`` (``"low"`` /
    ``"high"`` when the minimum is at the end of the search range, i.e. beyond it; else ``None``).
    """
    sizes = np.geomspace(lo, hi, points)
    loss = law_loss(params, family, budget, sizes)
    i = int(np.argmin(loss))
    n_once, n_rec = family.split(sizes[i])
    n_eff = float(effective_params(n_once, n_rec, family.r, params.get("phi")))
    return {
        "n": float(sizes[i]),
        "n_eff": n_eff,
        "tokens": float(family.tokens(budget, sizes[i])),
        "loss": float(loss[i]),
        "edge": "low" if i == 0 else ("high" if i == points - 1 else None),
    }


def _model_name(runs: Runs, i: int) -> str:
    if runs.width is not None:
        return f"d={runs.width[i]:g}"
    return f"N={si(float(runs.params[i]))}"


def budget_table(fit: ScalingLawFit) -> list[dict[str, Any]]:
    """Per budget: tokens per parameter, the best width for each r, where it sits, the law's
    compute-optimal size (see the module docstring). Empty without a ``budget`` column."""
    runs = fit.runs
    if runs is None or runs.budget is None:
        return []
    n_all = runs.params
    families = {float(r): size_family(runs, r) for r in np.unique(runs.num_recurrences)}
    lo, hi = float(n_all.min()) / SEARCH_FACTOR, float(n_all.max()) * SEARCH_FACTOR
    out = []
    for budget in np.unique(runs.budget):
        mb = runs.budget == budget
        tpp = runs.tokens[mb] / runs.params[mb]
        per_r = []
        for r in np.unique(runs.num_recurrences[mb]):
            idx = np.flatnonzero(mb & (runs.num_recurrences == r))
            idx = idx[np.argsort(runs.params[idx], kind="stable")]
            best = int(np.argmin(runs.loss[idx]))
            k = len(idx)
            position = (
                "single width"
                if k == 1
                else ("smallest" if best == 0 else ("largest" if best == k - 1 else "interior"))
            )
            opt = compute_optimal(fit.params, families[float(r)], float(budget), lo, hi)
            smallest, largest = float(runs.params[idx[0]]), float(runs.params[idx[-1]])
            law_side = "below" if opt["n"] < smallest else ("above" if opt["n"] > largest else "inside")
            per_r.append({
                "r": float(r),
                "widths": [_model_name(runs, int(i)) for i in idx],
                "losses": [float(runs.loss[i]) for i in idx],
                "best": _model_name(runs, int(idx[best])),
                "best_params": float(runs.params[idx[best]]),
                "position": position,
                "tokens_per_param": [float(runs.tokens[i] / runs.params[i]) for i in idx],
                "optimal_params": opt["n"],
                "optimal_tokens_per_param": opt["tokens"] / opt["n"],
                "optimal_edge": opt["edge"],
                "optimal_vs_widths": law_side,
            })  # fmt: skip
        out.append({
            "budget": float(budget),
            "n_runs": int(mb.sum()),
            "tokens_per_param": [float(tpp.min()), float(tpp.max())],
            "per_r": per_r,
        })  # fmt: skip
    return out


def _budget_finding(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(kind, sentence)`` for one budget: kind ``"above"`` / ``"below"`` / ``"few"`` / None."""
    per_r = row["per_r"]
    b = flop_budget(row["budget"])
    if all(p["position"] == "single width" for p in per_r) or max(len(p["widths"]) for p in per_r) < 3:
        return "few", (
            f"budget {b} has fewer than 3 widths per r: no IsoFLOP minimum can be located there; "
            "use at least 3 widths that straddle the compute-optimal size"
        )
    n = len(per_r)
    small = sum(p["position"] == "smallest" for p in per_r)
    large = sum(p["position"] == "largest" for p in per_r)
    base = next((p for p in per_r if p["r"] == 1), per_r[0])
    law_note = (
        f" (the fitted law puts the r = {base['r']:g} optimum at {si(base['optimal_params'])} parameters, "
        f"{base['optimal_tokens_per_param']:.3g} tokens per parameter; these widths train on "
        f"{row['tokens_per_param'][0]:.2g}-{row['tokens_per_param'][1]:.2g})"
    )
    if 2 * small >= n and small > large:
        return "above", (
            f"the widths of budget {b} are all above the compute-optimal size (the smallest has the lowest loss "
            f"for {small} of {n} values of r): add smaller widths{law_note}"
        )
    if 2 * large >= n and large > small:
        return "below", (
            f"the widths of budget {b} are all below the compute-optimal size (the largest has the lowest loss "
            f"for {large} of {n} values of r): add larger widths{law_note}"
        )
    return None, None


def parameters_at_bound(
    theta: np.ndarray, free: np.ndarray | None = None, tol: float = 1e-6
) -> list[dict[str, Any]]:
    """The fitted coordinates of ``theta`` on a bound of :data:`~.law.BOUNDS`."""
    out = []
    for i, (name, (lo, hi)) in enumerate(zip(PARAM_NAMES, BOUNDS)):
        if free is not None and not free[i]:
            continue
        side = "lower" if abs(theta[i] - lo) < tol else ("upper" if abs(theta[i] - hi) < tol else None)
        if side is None:
            continue
        natural = _NATURAL[name]
        value = math.exp(theta[i]) if name in ("a", "b", "e") else float(theta[i])
        coord = (
            f"log {natural} = {theta[i]:.3g}" if name in ("a", "b", "e") else f"{natural} = {theta[i]:.3g}"
        )
        out.append({"name": natural, "side": side, "value": value, "bound": lo if side == "lower" else hi,
                    "text": f"{natural} = {value:.4g} sits on its {side} bound ({coord})"})  # fmt: skip
    return out


NO_R1_LINE = (
    "No r = 1 run: this phi compares the r > 1 runs with each other only, not a recurrence with a "
    "unique layer of a non-looped model; fit a probe with its base's r = 1 runs (looped-hf fit BASE "
    "--compare PROBE)."
)
_E_LOW = (
    "the runs cannot separate the irreducible loss E from the data term: the sweep needs models near "
    "their compute-optimal size and a wider compute range"
)
_ALPHA_LOW = "the loss does not fall with model size: the capacity term (and with it phi) is not measured"
_BOUND_ADVICE = {
    ("E", "lower"): _E_LOW,
    ("E", "upper"): "the law puts almost all of the loss in E: the runs barely improve with size or data",
    ("alpha", "lower"): _ALPHA_LOW,
    ("beta", "lower"): "the loss does not fall with tokens: the data term is not measured",
}


def _profile_summary(fit: ScalingLawFit) -> dict[str, Any] | None:
    prof = fit.profile
    if prof is None:
        return None
    lr = prof.lr

    def at(x: float) -> float | None:
        if not (prof.phi.min() <= x <= prof.phi.max()):
            return None
        return float(np.interp(x, prof.phi, lr))

    lo, hi = (None if x is None else float(x) for x in prof.interval)
    return {
        "interval": [lo, hi],
        "cut": prof.cut,
        "lr_phi0": at(0.0),
        "lr_phi1": at(1.0),
        "width": None if lo is None or hi is None else hi - lo,
    }


def _bootstrap_summary(fit: ScalingLawFit) -> dict[str, Any] | None:
    boot = fit.bootstrap_samples
    if boot is None or not len(boot):
        return None
    col = dict(zip(NATURAL_NAMES, boot.T))
    # Back to the internal coordinates (log A, alpha, log B, beta, log E, phi) to test the bounds.
    theta = np.stack(
        [np.log(col["A"]), col["alpha"], np.log(col["B"]), col["beta"], np.log(col["E"]), col["phi"]], 1
    )
    lo = np.array([b[0] for b in BOUNDS])
    hi = np.array([b[1] for b in BOUNDS])
    on = (np.abs(theta - lo) < 1e-6) | (np.abs(theta - hi) < 1e-6)
    if fit.params.get("phi") is None or fit.fixed_phi is not None:
        on[:, PHI] = False
    return {
        "n": int(len(boot)),
        "method": fit.settings.get("bootstrap_method_used", fit.settings.get("bootstrap_method")),
        "phi_at_bound": float(on[:, PHI].mean()),
        "any_at_bound": float(on.any(axis=1).mean()),
        "at_bound_by_param": {
            _NATURAL[n]: float(on[:, i].mean()) for i, n in enumerate(PARAM_NAMES) if on[:, i].any()
        },
        # Resample fits refitted / dropped by the fit checks (None: a fit saved before the checks).
        "checks": fit.bootstrap_checks,
    }


def verdict(fit: ScalingLawFit, budgets: list[dict[str, Any]], at_bound: list[dict[str, Any]],
            profile: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """Identified or not, the reasons (most actionable first) and one line that says it."""
    if fit.kind != "looped" or not fit.phi_identifiable or fit.params.get("phi") is None:
        reason = "no run has r > 1 and N_rec > 0: add looped runs"
        return {"identified": False, "reasons": [reason], "line": f"phi is NOT identified: {reason}."}
    if fit.fixed_phi is not None:
        return {
            "identified": None,
            "reasons": [],
            "line": f"phi is held at {fit.fixed_phi:g} (not measured).",
        }
    phi = float(fit.params["phi"])
    reasons: list[str] = []
    short: list[str] = []  # the same findings, briefly, for the one-line verdict
    placement: dict[str, list[str]] = {"above": [], "below": [], "few": []}
    for row in budgets:
        kind, sentence = _budget_finding(row)
        if kind is not None and sentence is not None:
            reasons.append(sentence)
            placement[kind].append(flop_budget(row["budget"]))
    for kind, advice in (("above", "are all above the compute-optimal size: add smaller widths"),
                         ("below", "are all below the compute-optimal size: add larger widths"),
                         ("few", "have fewer than 3 widths per r: add widths around the optimum")):  # fmt: skip
        if placement[kind]:
            which = placement[kind]
            names = which[0] if len(which) == 1 else ", ".join(which[:-1]) + " and " + which[-1]
            short.append(f"the widths of budget{'s' if len(which) > 1 else ''} {names} {advice}")
    for b in at_bound:
        advice = _BOUND_ADVICE.get((b["name"], b["side"]))
        reasons.append(b["text"] + (f": {advice}" if advice else ""))
        short.append(f"{b['name']} sits on its {b['side']} bound")
    ok = not at_bound
    lo_b, hi_b = BOUNDS[PHI]
    intervals: list[tuple[str, Interval]] = []
    if profile is not None:
        intervals.append(("profile", tuple(profile["interval"])))
    ci = fit.ci.get("phi")
    if ci is not None:
        # A percentile end on the search box is an open end: the box clipped it, nothing measured it.
        intervals.append(
            ("bootstrap", (None if ci[0] <= lo_b + 1e-3 else ci[0], None if ci[1] >= hi_b - 1e-3 else ci[1]))
        )
    named = dict(intervals)
    checks = fit.bootstrap_checks or {}
    trust = trusted_interval(named.get("profile"), named.get("bootstrap"), phi_measured,
                             n_resamples=checks.get("n"), n_dropped=checks.get("dropped"),
                             describe=lambda m: "measures phi" if m else "does not measure phi")  # fmt: skip
    judged = list(intervals)  # the intervals the verdict rests on
    if trust.suspect == "dropped":
        # Dropped resamples are failed fits, not evidence; but many of them mean many resamples
        # leave phi (or another parameter) unbounded, so the kept ones understate the spread. The
        # verdict then rests on the profile alone (and fails without one).
        n_drop, n_all = checks["dropped"], checks["n"]
        reasons.append(f"{n_drop} of {n_all} bootstrap resamples could not be fitted (on a bound, not converged "
                       "or a local optimum, even from more starts) and were dropped: the bootstrap interval "
                       "understates the uncertainty; trust the profile interval")  # fmt: skip
        short.append(f"{n_drop} of {n_all} bootstrap resamples failed to fit (read the profile interval)")
        judged = [(name, iv) for name, iv in intervals if name != "bootstrap"]
    elif trust.disagree is not None:
        # The two intervals answer differently: the verdict follows the trusted one, and says so.
        judged = [(name, iv) for name, iv in intervals if name == trust.trusted]
        reasons.append(trust.disagree)
        short.append(f"the profile and bootstrap intervals disagree; the {trust.trusted} one is trusted")
    if not judged:
        ok = False
        reasons.append("no interval for phi: fit with checks (profile) or a bootstrap")
        short.append("no interval for phi")
    for name, (lo, hi) in judged:
        if lo is None or hi is None:
            ok = False
            side = " and ".join(s for s, e in (("below", lo), ("above", hi)) if e is None)
            reasons.append(f"the {name} interval is open {side}: the runs do not bound phi within the search box "
                           f"[{lo_b:g}, {hi_b:g}]")  # fmt: skip
            short.append(f"the {name} interval is open {side}")
        elif hi - lo > PHI_WIDTH_IDENTIFIED:
            ok = False
            reasons.append(f"the {name} 95% interval {interval((lo, hi))} is {hi - lo:.2g} wide "
                           f"(a measurement needs <= {PHI_WIDTH_IDENTIFIED:g})")  # fmt: skip
            short.append(f"the {name} interval is {hi - lo:.2g} wide")
    if not ok and not any(placement.values()):
        rms = float(np.sqrt(np.mean(fit.residuals**2)))
        advice = (f"the widths straddle the optimum, so phi is loose for want of data: add runs (more budgets, "
                  f"widths or seeds; the residual RMS is {100 * rms:.2g}%)")  # fmt: skip
        reasons.append(advice)
        short.append(advice)
    shown = ", ".join(f"{n} {interval(iv)}" for n, iv in intervals)
    anchored = fit.runs is None or bool(fit.runs.non_looped.any())
    if ok:
        # Narrow, closed intervals: phi is measured. Widths on one side of the optimum still mean
        # the law extrapolates there (a precise phi need not be an accurate one): say so.
        what = "phi is identified" if anchored else "phi is identified among the r > 1 runs only"
        line = f"{what}: {phi:.3f}, 95% CI {shown}" + (f"; but {short[0]}." if short else ".")
    else:
        line = f"phi is NOT identified ({phi:.3f}, 95% CI {shown}): " + "; ".join(short[:2]) + "."
    out: dict[str, Any] = {"identified": ok, "reasons": reasons, "line": line}
    if not anchored:
        # Say what such a fit measures before anyone reads it as the study's phi of a probe (the
        # fit's notes say it at length). The key only where it is False: fits with r = 1 runs
        # serialise as before.
        out["line"] = f"{line} {NO_R1_LINE}"
        out["r1_anchor"] = False
    return out


def diagnose(fit: ScalingLawFit) -> dict[str, Any]:
    """The identifiability diagnosis of ``fit`` (JSON-safe; see the module docstring)."""
    theta = fit.theta
    free = np.ones(len(BOUNDS), bool)
    if fit.params.get("phi") is None or fit.fixed_phi is not None:
        free[PHI] = False
    at_bound = parameters_at_bound(theta, free)
    budgets = budget_table(fit) if fit.kind == "looped" or fit.runs is not None else []
    profile = _profile_summary(fit)
    return {
        "budgets": budgets,
        "at_bound": at_bound,
        "profile": profile,
        "bootstrap": _bootstrap_summary(fit),
        "verdict": verdict(fit, budgets, at_bound, profile),
    }
