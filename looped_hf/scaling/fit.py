"""Fitting the looped scaling law: point estimate, phi profile, bootstrap, diagnosis.

(A probe against its base, delta phi: :mod:`.compare`.)

``fit_scaling_law`` returns a :class:`~.result.ScalingLawFit` in the style of lmfit's result objects
(``.params``, ``.ci``, ``.report()``, ``.predict()``, JSON round trip; plots are
:func:`looped_hf.plotting.plot_fit`, which depends on this module, never the reverse).

Uncertainty, two ways (both 95%), and a verdict that needs both:

- the profile-likelihood interval of phi (:mod:`.profile`): phi held on a grid, every other
  parameter refitted, the drop in the objective put on the likelihood-ratio scale;
- a percentile bootstrap (:mod:`.resample`). ``bootstrap_method="cell"`` (the default, the
  study's) resamples (budget, r) cells: runs in one cell share a budget and a width grid, so
  their errors are correlated (a learning rate that suits one width less, say) and resampling
  whole cells keeps that. ``"run"`` resamples runs (Besiroglu et al. 2024), ``"residual"``
  redraws the losses on the fixed design (right when errors are independent; too narrow when
  they are not).

What makes the bootstrap honest where the objective is flat (a weakly identified design):

1. every resample is refitted with a real multistart (the point estimate, the profile's valley
   floor at phi spread over the box, the point fit's other local optima and screened random
   starts, all descended together), not warm-started from the point estimate: from there
   L-BFGS-B stops on the first flat stretch and the interval comes out too narrow;
2. percentile intervals: they stay inside the search box and follow any monotone
   reparametrisation; the basic (reflected) interval ``2 phi_hat - q`` leaves the box when the
   bootstrap distribution is skewed by a flat direction, and BCa's acceleration, estimated by
   the jackknife, is unstable on such multi-modal distributions;
3. every resample's fit is checked (:func:`~.resample.refit_checked`): it must have converged,
   sit at no parameter bound and reach an objective no worse than the descent of that resample
   from the full-data optimum. A failing one is refitted from four times the starts; one that
   still fails is a failure of the optimiser (a flat direction run onto the box, a local
   optimum), not evidence about phi, and is dropped. How many were refitted and dropped is in
   ``bootstrap_checks`` (JSON) and in the report, so that a bootstrap that had to drop many
   resamples is read as the weak evidence it is (the profile interval does not depend on it).

The coverage of both intervals is validated on synthetic sweeps with random truth, for the
study's design and for a weakly identified one, by ``scripts/validate_phi_coverage.py``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Literal

import numpy as np

from . import law
from .diagnose import diagnose
from .law import LawData
from .optimize import Polished, chinchilla_grid, multistart, polish, random_starts, single_threaded_blas
from .profile import PhiProfile, profile_phi
from .resample import RESAMPLE_METHODS, RefitStatus, cell_groups, refit_checked, resample_problems
from .result import ScalingLawFit
from .runs import Runs, load_runs

BootstrapMethod = Literal["cell", "run", "residual"]
StartMethod = Literal["auto", "random", "grid"]

NATURAL_NAMES = law.NATURAL_NAMES
#: What a fit of looped runs without any r = 1 run measures, and what it does not.
NO_R1_NOTE = (
    "no r = 1 run: phi is identified only from how the r > 1 runs compare with each other, and E, A, "
    "alpha, B, beta are fitted to looped runs alone, so nothing anchors the law to a non-looped model "
    "(the 'performs like a non-looped model' sizes are extrapolations to r = 1). This is not the "
    "study's phi of a probe, which is fitted with the base sweep's r = 1 runs: "
    "`looped-hf fit BASE --compare PROBE`, or add the base's r = 1 rows to this file"
)


def _law_data(runs: Runs, phi_identifiable: bool) -> LawData:
    """Arrays for the objective. Without an identifiable phi the model is Chinchilla's on
    ``N = N_once + N_rec`` (``n_rec = 0``, ``log r = 0`` make the phi term inert)."""
    if runs.kind == "looped" and phi_identifiable:
        n_once, n_rec, log_r = runs.n_once, runs.n_rec, np.log(runs.num_recurrences)
    else:
        n_once, n_rec, log_r = runs.params, np.zeros(len(runs)), np.zeros(len(runs))
    return LawData(n_once, n_rec, log_r, np.log(runs.tokens), np.log(runs.loss))


def phi_is_identifiable(runs: Runs) -> bool:
    """phi enters only through runs with ``r > 1`` and ``N_rec > 0``."""
    return runs.kind == "looped" and bool(np.any((runs.num_recurrences > 1) & (runs.n_rec > 0)))


def _r2(y: np.ndarray, yhat: np.ndarray) -> float:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - yhat) ** 2)) / ss_tot if ss_tot > 0 else float("nan")


# --------------------------------------------------------------------------------- fitting
def _free_mask(phi_free: bool) -> np.ndarray:
    return np.array([True, True, True, True, True, phi_free])


def _starts(
    rng: np.random.Generator, method: StartMethod, kind: str, n_starts: int, fixed: dict[int, float]
) -> np.ndarray:
    if method == "grid" or (method == "auto" and kind == "plain"):
        return chinchilla_grid(fixed)
    return random_starts(rng, n_starts, fixed)


def _refit(
    data: LawData,
    warm: list[np.ndarray],
    free: np.ndarray,
    fixed: dict[int, float],
    rng: np.random.Generator,
    weights: np.ndarray | None,
    n_random: int,
) -> np.ndarray:
    """Polish from the warm starts plus ``n_random`` screened random starts; best theta."""
    starts = [np.asarray(w, float) for w in warm]
    if n_random > 0:
        cand = random_starts(rng, 16 * n_random, fixed)
        f0 = law.objective_value(cand, data, weights)
        starts += list(cand[np.argsort(f0)[:n_random]])
    best = None
    for s in starts:
        s = s.copy()
        for i, v in fixed.items():
            s[i] = v
        p = polish(s, data, weights, free)
        if np.isfinite(p.fun) and (best is None or p.fun < best.fun):
            best = p
    if best is None:
        raise RuntimeError("every start ended at a non-finite objective")
    return best.theta


def _distinct_optima(polished: list[Polished], limit: int) -> list[np.ndarray]:
    """Up to ``limit`` polished points that differ from each other by more than 1e-3 somewhere."""
    out: list[np.ndarray] = []
    for p in polished:
        if all(np.max(np.abs(p.theta - q)) > 1e-3 for q in out):
            out.append(p.theta)
        if len(out) == limit:
            break
    return out


def _natural_row(theta: np.ndarray) -> np.ndarray:
    a, alpha, b, beta, e, phi = theta
    return np.array([math.exp(e), math.exp(a), alpha, math.exp(b), beta, phi])


def fit_scaling_law(
    runs: Any,
    *,
    bootstrap: int = 0,
    seed: int = 0,
    fix_phi: float | None = None,
    bootstrap_method: BootstrapMethod = "cell",
    starts: StartMethod = "auto",
    n_starts: int = 500,
    n_polish: int = 32,
    bootstrap_starts: int = 16,
    variant: str | None = None,
    checks: bool = True,
) -> ScalingLawFit:
    """Fit ``L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta`` (or Chinchilla's form).

    Args:
        runs: a ``.jsonl`` / ``.csv`` path, a pandas DataFrame or a list of dicts with ``loss``,
            ``tokens`` and either ``n_once``, ``n_rec``, ``num_recurrences`` or ``params``
            (see :func:`looped_hf.scaling.load_runs`).
        bootstrap: number of bootstrap resamples (0: no intervals).
        seed: seeds the starts and the resamples; the same seed gives the same fit.
        fix_phi: hold phi at this value (e.g. 0 or 1) instead of fitting it.
        bootstrap_method: ``"cell"`` resamples (budget, r) cells (the study's; falls back to
            ``"run"`` with a note when there is no ``budget`` column), ``"run"`` resamples runs,
            ``"residual"`` redraws the losses on the fixed design (see the module docstring).
        starts: ``"random"`` (``n_starts`` uniform starts in :data:`law.BOUNDS`, the study's),
            ``"grid"`` (Chinchilla's 4500-point grid), ``"auto"`` (grid for plain runs, random
            for looped ones).
        n_starts: random starts screened with the batched objective.
        n_polish: best screened starts polished with L-BFGS-B (analytic gradient).
        bootstrap_starts: starts descended per resample: the point estimate, the profile's
            valley, the point fit's other optima, then screened random ones (1: the point
            estimate alone, the old, too-narrow scheme).
        variant: keep only runs of this ``variant`` (required for files that mix variants).
        checks: also run the phi = 0 / phi = 1 restricted fits, the leave-one-budget-out check
            and the phi profile (used by :meth:`ScalingLawFit.report`); the profile also runs
            whenever there is a bootstrap, which starts from its valley.

    Returns:
        A :class:`ScalingLawFit`.

    Raises:
        ValueError: bad input (naming row and column), or fewer runs than free parameters.
    """
    if bootstrap_method not in RESAMPLE_METHODS:
        raise ValueError(f"bootstrap_method must be one of {RESAMPLE_METHODS}, got {bootstrap_method!r}")
    if bootstrap_starts < 1:
        raise ValueError(f"bootstrap_starts must be >= 1, got {bootstrap_starts}")
    if starts not in ("auto", "random", "grid"):
        raise ValueError(f"starts must be 'auto', 'random' or 'grid', got {starts!r}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")
    if fix_phi is not None:
        lo, hi = law.BOUNDS[law.PHI]
        if isinstance(fix_phi, bool) or not isinstance(fix_phi, (int, float)) or not lo <= fix_phi <= hi:
            raise ValueError(
                f"fix_phi={fix_phi!r}: must be a finite number in the search box [{lo:g}, {hi:g}]"
            )
    data_runs = load_runs(runs, variant=variant)
    if len(data_runs) and np.ptp(data_runs.loss) == 0:
        raise ValueError(f"{data_runs.where}column 'loss': all {len(data_runs)} runs have the same loss "
                         f"({data_runs.loss[0]:g}): a law cannot be fitted to a constant")  # fmt: skip
    with single_threaded_blas():
        return _fit(
            data_runs,
            bootstrap,
            seed,
            fix_phi,
            bootstrap_method,
            starts,
            n_starts,
            n_polish,
            bootstrap_starts,
            variant,
            checks,
        )


def _fit(
    data_runs: Runs,
    bootstrap: int,
    seed: int,
    fix_phi: float | None,
    bootstrap_method: BootstrapMethod,
    starts: StartMethod,
    n_starts: int,
    n_polish: int,
    bootstrap_starts: int,
    variant: str | None,
    checks: bool,
) -> ScalingLawFit:
    notes = list(data_runs.notes)
    if data_runs.kind == "plain" and fix_phi is not None:
        raise ValueError("fix_phi needs looped runs (n_once, n_rec, num_recurrences); these have 'params'")
    identifiable = phi_is_identifiable(data_runs)
    if data_runs.kind == "looped" and not identifiable:
        notes.append(
            "phi is not identifiable: no run has r > 1 and n_rec > 0; fitted the Chinchilla form "
            "on N = n_once + n_rec"
        )
    elif identifiable and not data_runs.non_looped.any():
        notes.append(NO_R1_NOTE)
    phi_free = identifiable and fix_phi is None
    n_free = 5 + int(phi_free)
    if len(data_runs) < n_free:
        raise ValueError(
            f"{len(data_runs)} run(s) but the law has {n_free} free parameters: need at least {n_free}"
        )
    if data_runs.budget is not None and len(np.unique(data_runs.budget)) == 1:
        warnings.warn(
            "all runs share one compute budget: A, alpha and B, beta trade off along the iso-FLOP line "
            "and the fit is poorly constrained; sweep several budgets",
            stacklevel=3,  # the user -> fit_scaling_law -> _fit
        )

    fixed: dict[int, float] = (
        {} if phi_free else {law.PHI: float(fix_phi) if (fix_phi is not None and identifiable) else 0.0}
    )
    if fix_phi is not None and not identifiable:
        notes.append(f"fix_phi={fix_phi} has no effect: phi is not identifiable from these runs")
    free = _free_mask(phi_free)
    data = _law_data(data_runs, identifiable)
    rng = np.random.default_rng(seed)

    start_pts = _starts(rng, starts, data_runs.kind, n_starts, fixed)
    best, ordered, polished = multistart(data, start_pts, free, n_polish=n_polish)
    theta = best.theta
    fun = best.fun
    optima = _distinct_optima(polished[1:], limit=3)

    # The profile over phi (also the valley of starts for the bootstrap, see below).
    profile: PhiProfile | None = None
    if phi_free and (checks or bootstrap > 0):
        prng = np.random.default_rng([seed, 2])
        residuals = data.log_l - law.predict_log_loss(theta, data)[0]
        profile = profile_phi(data, theta, residuals, prng, extra=optima)
        if profile.f_min < fun * (1 - 1e-7):  # (not mere polishing noise)
            # A profile point beat the multistart: the point fit missed the global optimum.
            # Free phi again from the best profile point and redo the profile around it.
            p = polish(profile.thetas[int(np.argmin(profile.objective))], data, None, free)
            if p.fun < fun:
                notes.append(
                    f"the phi profile found a lower objective ({p.fun:.6g}) than the {len(start_pts)}-start "
                    f"multistart ({fun:.6g}); the point estimate is the profile's"
                )
                optima = [theta, *optima][:3]
                theta, fun = p.theta, p.fun
                residuals = data.log_l - law.predict_log_loss(theta, data)[0]
                profile = profile_phi(data, theta, residuals, prng, extra=optima)

    pred = law.predict_log_loss(theta, data)[0]
    residuals = data.log_l - pred
    params = law.to_natural(theta, phi_identifiable=identifiable)
    if fix_phi is not None and identifiable:
        params["phi"] = float(fix_phi)

    fit = ScalingLawFit(
        params=params,
        ci={},
        r2=_r2(data_runs.loss, np.exp(pred)),
        objective=fun,
        residuals=residuals,
        kind=data_runs.kind,
        phi_identifiable=identifiable,
        fixed_phi=None if fix_phi is None else float(fix_phi),
        runs=data_runs,
        profile=profile,
        notes=notes,
        settings={
            "seed": seed,
            "starts": starts,
            "n_starts": int(len(start_pts)),
            "n_polish": n_polish,
            "bootstrap": bootstrap,
            "bootstrap_method": bootstrap_method,
            "bootstrap_starts": bootstrap_starts,
            "huber_delta": law.HUBER_DELTA,
            "bounds": [list(b) for b in law.BOUNDS],
            "variant": variant,
        },
    )
    warm = [theta] + [ordered[i] for i in range(min(2, len(ordered)))]

    if bootstrap > 0:
        _bootstrap(fit, data, free, bootstrap_method, bootstrap, seed, bootstrap_starts, optima)

    if checks and data_runs.kind == "looped" and identifiable:
        for value in (0.0, 1.0):
            if fix_phi is not None and value == fix_phi:
                continue
            fx = {law.PHI: value}
            th = _refit(data, [np.r_[w[:5], value] for w in warm], _free_mask(False), fx, rng, None, 4)
            p = law.predict_log_loss(th, data)[0]
            f = float(law.objective_value(th, data)[0])
            fit.restricted[f"phi={value:g}"] = {
                "r2": _r2(data_runs.loss, np.exp(p)),
                "objective": f,
                "params": law.to_natural(th),
            }
    if checks and data_runs.budget is not None and len(np.unique(data_runs.budget)) >= 3:
        fit.holdout = _leave_largest_budget_out(data_runs, data, warm, free, fixed, rng)
    fit.diagnostics = diagnose(fit)
    return fit


def _bootstrap(
    fit: ScalingLawFit,
    data: LawData,
    free: np.ndarray,
    method: BootstrapMethod,
    n_resamples: int,
    seed: int,
    n_starts: int,
    optima: list[np.ndarray],
) -> None:
    """Resample, refit every resample with a multistart, set ``fit.bootstrap_samples`` and ``fit.ci``."""
    runs = fit.runs
    assert runs is not None
    theta = fit.theta
    groups = cell_groups(runs.budget, runs.num_recurrences) if method == "cell" else None
    if method == "cell" and groups is None:
        fit.notes.append("no 'budget' column: bootstrap resamples runs instead of (budget, r) cells")
        method = "run"
    fit.settings.update(bootstrap=n_resamples, bootstrap_method_used=method, bootstrap_starts=n_starts)
    brng = np.random.default_rng([seed, 1])  # separate stream: bootstrap draws do not move with n_starts
    problems = resample_problems(method, n_resamples, brng, data, theta, groups, int(free.sum()))
    # Starts of every resample: the point estimate, the profile's valley floor at phi spread over
    # the box, the point fit's other local optima, then screened random starts.
    extra = (fit.profile.valley() if fit.profile is not None else []) + optima
    thetas, _, status = refit_checked(data, problems, theta, free, brng, n_starts=n_starts, extra=extra)
    _set_bootstrap(fit, thetas, free, status)


def _set_bootstrap(fit: ScalingLawFit, thetas: np.ndarray, free: np.ndarray, status: RefitStatus) -> None:
    """Store the resampled fits ``thetas`` that passed the fit checks as ``fit.bootstrap_samples``,
    their percentile CIs, and what the checks found (``fit.bootstrap_checks``)."""
    fit.bootstrap_checks = status.to_dict()
    kept = thetas[~status.failed]
    if not len(kept):
        raise RuntimeError(f"no bootstrap resample could be fitted: {status.summary()}")
    fit.bootstrap_samples = np.array([_natural_row(th) for th in kept])
    lo, hi = np.percentile(fit.bootstrap_samples, [2.5, 97.5], axis=0)
    fit.ci = {}
    for j, name in enumerate(NATURAL_NAMES):
        if name == "phi" and not free[law.PHI]:
            continue
        fit.ci[name] = (float(lo[j]), float(hi[j]))


def rebootstrap(
    fit: ScalingLawFit,
    bootstrap: int = 200,
    *,
    bootstrap_method: BootstrapMethod = "cell",
    seed: int | None = None,
    bootstrap_starts: int = 16,
) -> ScalingLawFit:
    """A copy of ``fit`` with a new bootstrap (another method, more resamples), same point fit.

    The intervals, bootstrap draws, settings and diagnostics of the copy are replaced; the point
    estimate, profile, restricted fits and hold-out check are kept. Needs the fit's runs.
    """
    if fit.runs is None:
        raise ValueError("rebootstrap needs the fit's runs (fit.runs is None)")
    if bootstrap_method not in RESAMPLE_METHODS:
        raise ValueError(f"bootstrap_method must be one of {RESAMPLE_METHODS}, got {bootstrap_method!r}")
    if bootstrap < 1:
        raise ValueError(f"bootstrap must be >= 1, got {bootstrap}")
    if bootstrap_starts < 1:
        raise ValueError(f"bootstrap_starts must be >= 1, got {bootstrap_starts}")
    out = dataclasses.replace(
        fit, ci={}, notes=list(fit.notes), settings=dict(fit.settings), bootstrap_checks=None
    )
    out.settings["bootstrap_method"] = bootstrap_method
    phi_free = fit.phi_identifiable and fit.fixed_phi is None and fit.kind == "looped"
    data = _law_data(fit.runs, fit.phi_identifiable)
    with single_threaded_blas():
        _bootstrap(out, data, _free_mask(phi_free), bootstrap_method, bootstrap,
                   int(fit.settings.get("seed", 0)) if seed is None else seed, bootstrap_starts, [])  # fmt: skip
    out.diagnostics = diagnose(out)
    return out


def _leave_largest_budget_out(
    runs: Runs,
    data: LawData,
    warm: list[np.ndarray],
    free: np.ndarray,
    fixed: dict[int, float],
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Fit without the largest budget and predict it: an honest extrapolation check."""
    assert runs.budget is not None
    top = float(runs.budget.max())
    train = (runs.budget < top).astype(float)
    held = runs.budget == top
    # Zero weights drop the held-out runs from the objective without rebuilding the arrays.
    th = _refit(data, warm, free, fixed, rng, train, 4)
    pred = np.exp(law.predict_log_loss(th, data)[0])
    rel = (pred[held] - runs.loss[held]) / runs.loss[held]
    return {
        "held_out_budget": top,
        "n_held_out": int(held.sum()),
        "mean_rel_error": float(np.mean(rel)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "max_abs_rel_error": float(np.max(np.abs(rel))),
        "phi_without": float(th[law.PHI]) if free[law.PHI] else None,
    }
