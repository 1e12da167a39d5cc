"""Many fits at once: the multistart refit behind the bootstrap and the phi profile.

Both need hundreds of fits of the same law to slightly different problems: a bootstrap resample
is the objective with other run weights (or other losses), a profile point is the objective with
phi held at a grid value. :func:`refit_many` fits them all with a real multistart each:

1. starts per problem: the point estimate, any ``extra`` starts (e.g. the point fit's other local
   optima), and the best of ``n_screen`` uniform random starts in :data:`~.law.BOUNDS`, screened
   on *that problem's* objective, ``n_starts`` in all;
2. every start of every problem descends together (:func:`~.optimize.batched_descent`, a batched
   Levenberg-Marquardt);
3. each problem's best point is polished with L-BFGS-B (:func:`~.optimize.polish`), which gives
   the reported numbers (the phi profile, which needs only the optimal objective, instead runs
   the batched descent to convergence: ``batch_polish``).

:func:`refit_checked` adds the checks a bootstrap needs: every fit must have converged, sit at
no parameter bound and be no worse than the descent from the point estimate; a failing fit is
refitted from four times the starts, and one that still fails is reported for dropping.

Why not warm-start from the point estimate alone: where the objective is flat (a weakly
identified design), L-BFGS-B from the point estimate stops at the first nearly-flat spot and the
resampled estimates cluster around the point estimate, so the interval is too narrow. Measured
on the committed v0.1 tiny sweep: the warm start alone ended above the best of an exhaustive
500-start multistart in 12% of resamples; this refit matched it in all of them (within 1e-6).

Resampling schemes (:func:`resample_problems`):

- ``"cell"``: (budget, r) cells drawn with replacement (the study's); a run's weight is the count
  of its cell. Keeps the correlation of runs that share a budget and r.
- ``"run"``: runs drawn with replacement (Besiroglu et al. 2024 on Chinchilla's points).
- ``"residual"``: the design is kept and the losses are redrawn, ``log L* = log L_hat + e*``
  with ``e*`` drawn with replacement from the centred residuals, inflated by
  ``sqrt(n / (n - p))`` (``p`` free parameters) for the degrees of freedom the fit used up
  (Davison & Hinkley 1997, section 6.2.3). A sweep is a designed experiment: the widths, budgets
  and r are chosen, not sampled, so resampling runs or cells changes the very design whose
  information we want to measure (a cell resample of a 12-cell sweep drops a third of its cells).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from . import law
from .law import BOUNDS, LawData
from .optimize import DESCENT_ITERS, batched_descent, polish, random_starts

ResampleMethod = Literal["cell", "run", "residual"]
RESAMPLE_METHODS: tuple[str, ...] = ("cell", "run", "residual")

#: Rows (problems x starts) descended together in one batch. Small enough that the batch's
#: ``(rows, runs, 6)`` Jacobian stays in cache: on 116 runs, 200 resamples x 16 starts took 30%
#: less CPU in chunks of 256-1024 rows than in one of 3200 (the random starts are drawn from one
#: stream either way, so the chunking does not change the result).
_CHUNK_ROWS = 512
#: The descent from the point estimate is polished as well when it ends within this share of the
#: best start's objective: it may be the better basin once both are converged.
_WARM_MARGIN = 1e-2
#: Iterations of the batched descent when it finishes the best starts (``batch_polish``).
_POLISH_ITERS = 400


@dataclass
class Problems:
    """``B`` fitting problems over the same runs: per-problem run weights and/or log losses.

    ``weights`` is ``(B, n)`` (``None``: all ones); ``log_l`` is ``(B, n)`` (``None``: the data's
    own). ``fixed`` maps a coordinate of :data:`~.law.PARAM_NAMES` to its ``(B,)`` held values.
    """

    n: int
    weights: np.ndarray | None = None
    log_l: np.ndarray | None = None
    fixed: dict[int, np.ndarray] | None = None

    def rows(self, sel: np.ndarray) -> Problems:
        return Problems(
            n=len(sel),
            weights=None if self.weights is None else self.weights[sel],
            log_l=None if self.log_l is None else self.log_l[sel],
            fixed=None if self.fixed is None else {k: v[sel] for k, v in self.fixed.items()},
        )


def cell_groups(budget: np.ndarray | None, num_recurrences: np.ndarray) -> np.ndarray | None:
    """Index of each run's (budget, r) cell, or ``None`` without budgets."""
    if budget is None:
        return None
    cells = np.stack([budget, num_recurrences], axis=1)
    return np.unique(cells, axis=0, return_inverse=True)[1].ravel()


def resample_problems(
    method: ResampleMethod,
    n_resamples: int,
    rng: np.random.Generator,
    data: LawData,
    theta_hat: np.ndarray,
    groups: np.ndarray | None,
    n_free: int,
) -> Problems:
    """``n_resamples`` bootstrap problems of the given ``method`` (see the module docstring)."""
    n = data.n
    if method == "run" or (method == "cell" and groups is None):
        w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_resamples).astype(float)
        return Problems(n_resamples, weights=w)
    if method == "cell":
        assert groups is not None
        n_groups = int(groups.max()) + 1
        counts = rng.multinomial(n_groups, np.full(n_groups, 1.0 / n_groups), size=n_resamples).astype(float)
        return Problems(n_resamples, weights=counts[:, groups])
    if method == "residual":
        pred = law.predict_log_loss(theta_hat, data)[0]
        res = data.log_l - pred
        res = (res - res.mean()) * np.sqrt(n / max(1, n - n_free))
        draws = res[rng.integers(0, n, size=(n_resamples, n))]
        return Problems(n_resamples, log_l=pred[None, :] + draws)
    raise ValueError(f"bootstrap_method must be one of {RESAMPLE_METHODS}, got {method!r}")


def paired_resample_problems(
    method: ResampleMethod,
    n_resamples: int,
    rng: np.random.Generator,
    data_base: LawData,
    data_probe: LawData,
    theta_base: np.ndarray,
    theta_probe: np.ndarray,
    units_base: np.ndarray | None,
    units_probe: np.ndarray | None,
    match: np.ndarray,
    n_free: int,
) -> tuple[Problems, Problems]:
    """Joint bootstrap problems of a base sweep and a probe that shares runs with it.

    ``"cell"`` / ``"run"``: ``units_base`` / ``units_probe`` index every run's resampling unit in
    one space (a shared run is in its base unit); each resample draws as many units as there
    are, with replacement, and each fit weights its runs by their unit's count, so a shared unit
    counts the same in both. ``"residual"``: each sweep's losses are redrawn from its own fit's
    residuals, and a shared probe run (``match[j] >= 0``: its index in the base) takes its base
    run's redrawn loss: one simulated data set, fitted twice.
    """
    if method in ("cell", "run"):
        if units_base is None or units_probe is None:
            raise ValueError(f"the {method!r} paired bootstrap needs the resampling units of both sweeps")
        n_units = int(max(units_base.max(), units_probe.max())) + 1
        counts = rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_resamples).astype(float)
        return (Problems(n_resamples, weights=counts[:, units_base]),
                Problems(n_resamples, weights=counts[:, units_probe]))  # fmt: skip
    if method == "residual":
        ys = []
        for data, theta in ((data_base, theta_base), (data_probe, theta_probe)):
            pred = law.predict_log_loss(theta, data)[0]
            res = data.log_l - pred
            res = (res - res.mean()) * np.sqrt(data.n / max(1, data.n - n_free))
            ys.append(pred[None, :] + res[rng.integers(0, data.n, size=(n_resamples, data.n))])
        shared = np.flatnonzero(match >= 0)
        ys[1][:, shared] = ys[0][:, match[shared]]
        return Problems(n_resamples, log_l=ys[0]), Problems(n_resamples, log_l=ys[1])
    raise ValueError(f"bootstrap_method must be one of {RESAMPLE_METHODS}, got {method!r}")


def _with_log_l(data: LawData, log_l: np.ndarray | None) -> LawData:
    return data if log_l is None else replace(data, log_l=log_l)


def refit_many(
    data: LawData,
    problems: Problems,
    theta_hat: np.ndarray,
    free: np.ndarray,
    rng: np.random.Generator,
    *,
    n_starts: int = 16,
    n_screen: int = 64,
    extra: list[np.ndarray] | None = None,
    max_iter: int = DESCENT_ITERS,
    f_warm: np.ndarray | None = None,
    batch_polish: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Fit every problem with a multistart; returns ``(theta (B, 6), objective (B,))``.

    Args:
        data: the runs.
        problems: what differs between the fits (weights, losses, held coordinates).
        theta_hat: the point estimate, always one of the starts.
        free: ``(6,)`` mask of the coordinates fitted (held ones are set from ``problems.fixed``).
        rng: draws the random starts.
        n_starts: starts descended per problem (the point estimate, ``extra``, then screened
            random ones).
        n_screen: random starts screened per problem to pick the random ones.
        extra: further starts shared by every problem.
        max_iter: iterations of the batched descent.
        f_warm: if given, a ``(B,)`` array that receives each problem's objective after the
            descent from ``theta_hat`` alone, polished when it is competitive (the warm-start
            refit :func:`refit_checked` compares the multistart's answer with).
        batch_polish: finish each problem's best start with the batched descent run to
            convergence instead of one L-BFGS-B polish per problem. For callers that need the
            optimal objective rather than the parameters (the phi profile): the objective is
            reached to ~1e-10 relative either way, and one batched run replaces ~90 sequential
            L-BFGS-B runs.
    """
    if n_starts < 1:
        raise ValueError(f"n_starts must be >= 1, got {n_starts}")
    fixed_idx = [int(i) for i in np.flatnonzero(~np.asarray(free, bool))]
    shared = [np.asarray(theta_hat, float)] + [np.asarray(x, float) for x in (extra or [])]
    shared = shared[:n_starts]
    n_random = n_starts - len(shared)
    b_all = problems.n
    thetas = np.empty((b_all, len(BOUNDS)))
    funs = np.empty(b_all)
    chunk = max(1, _CHUNK_ROWS // max(1, n_starts))
    for lo in range(0, b_all, chunk):
        sel = np.arange(lo, min(b_all, lo + chunk))
        sub = problems.rows(sel)
        b = len(sel)
        fixed_vals = {i: (sub.fixed or {}).get(i, np.full(b, float(theta_hat[i]))) for i in fixed_idx}
        starts = np.broadcast_to(np.stack(shared), (b, len(shared), len(BOUNDS))).copy()
        if n_random > 0:
            cand = random_starts(rng, b * n_screen, {}).reshape(b, n_screen, len(BOUNDS))
            for i, v in fixed_vals.items():
                cand[:, :, i] = v[:, None]
            flat_w = None if sub.weights is None else np.repeat(sub.weights, n_screen, axis=0)
            flat_y = None if sub.log_l is None else np.repeat(sub.log_l, n_screen, axis=0)
            f0 = law.objective(cand.reshape(-1, len(BOUNDS)), _with_log_l(data, flat_y), flat_w)[0]
            f0 = np.where(np.isfinite(f0), f0, np.inf).reshape(b, n_screen)
            best = np.argsort(f0, axis=1, kind="stable")[:, :n_random]
            starts = np.concatenate([starts, np.take_along_axis(cand, best[:, :, None], axis=1)], axis=1)
        for i, v in fixed_vals.items():
            starts[:, :, i] = v[:, None]
        k = starts.shape[1]
        rows_w = None if sub.weights is None else np.repeat(sub.weights, k, axis=0)
        rows_y = None if sub.log_l is None else np.repeat(sub.log_l, k, axis=0)
        th, f = batched_descent(
            _with_log_l(data, rows_y), starts.reshape(-1, len(BOUNDS)), free, rows_w, max_iter=max_iter
        )
        th, f = th.reshape(b, k, -1), f.reshape(b, k)
        pick = np.argmin(f, axis=1)
        if batch_polish:
            # The best start of every problem and (for the warm-start check) the descent from
            # theta_hat, both run to convergence in one batch.
            rows = np.arange(b)
            two = 2 if f_warm is not None else 1
            ends = np.concatenate([th[rows, pick], th[:, 0]])[: two * b]
            ys = None if sub.log_l is None else np.concatenate([sub.log_l] * two)
            ws = None if sub.weights is None else np.concatenate([sub.weights] * two)
            t2, f2 = batched_descent(
                _with_log_l(data, ys), ends, free, ws, max_iter=_POLISH_ITERS, rtol=1e-13
            )
            f_before = np.concatenate([f[rows, pick], f[:, 0]])[: two * b]
            f2 = np.where(f2 <= f_before, f2, f_before)
            t2 = np.where((f2 <= f_before)[:, None], t2, ends)
            if f_warm is None:
                thetas[sel], funs[sel] = t2, f2
            else:
                use_warm = f2[b:] < f2[:b]
                thetas[sel] = np.where(use_warm[:, None], t2[b:], t2[:b])
                funs[sel] = np.minimum(f2[b:], f2[:b])
                f_warm[sel] = f2[b:]
            continue
        for j in range(b):
            w = None if sub.weights is None else sub.weights[j]
            d = _with_log_l(data, None if sub.log_l is None else sub.log_l[j])
            cands = [pick[j]]
            if pick[j] != 0 and f[j, 0] <= f[j, pick[j]] * (1.0 + _WARM_MARGIN):
                cands.append(0)  # start 0 is theta_hat
            best_t, best_f, warm = th[j, pick[j]], f[j, pick[j]], f[j, 0]
            for c in cands:
                p = polish(th[j, c], d, w, free)
                ok = np.isfinite(p.fun) and p.fun <= f[j, c]
                t_c, f_c = (p.theta, p.fun) if ok else (th[j, c], f[j, c])
                if c == 0:
                    warm = f_c
                if f_c < best_f or (c == pick[j] and f_c <= best_f):
                    best_t, best_f = t_c, f_c
            thetas[sel[j]], funs[sel[j]] = best_t, best_f
            if f_warm is not None:
                f_warm[sel[j]] = warm
    return thetas, funs


#: A resample's fit fails when its objective exceeds the warm-start refit's by more than this
#: (relative; polishing noise is ~1e-9).
_WORSE_RTOL = 1e-7
#: ... or when its projected gradient exceeds this times its objective (converged fits: < 5e-3).
_GRAD_RTOL = 5e-2
#: ... or when a fitted coordinate is within this share of its range of a bound.
_BOUND_ATOL = 1e-6

_LO = np.array([b[0] for b in BOUNDS])
_HI = np.array([b[1] for b in BOUNDS])
_PARAM = ("log A", "alpha", "log B", "beta", "log E", "phi")


@dataclass
class RefitStatus:
    """What the checks of :func:`refit_checked` found in a batch of fits.

    ``refitted``: fits that failed the first pass and were refitted from more starts
    (``reasons`` counts why; one fit may fail for several reasons); ``failed``: ``(n,)`` mask of
    the fits that still failed after the refit (the bootstrap drops them).
    """

    refitted: int
    failed: np.ndarray
    reasons: dict[str, int]
    refitted_mask: np.ndarray | None = None  # which fits were refitted (not kept in the JSON)

    @property
    def n(self) -> int:
        return int(self.failed.size)

    @property
    def n_dropped(self) -> int:
        return int(self.failed.sum())

    def combine(self, other: RefitStatus, refitted: int) -> RefitStatus:
        """The status of pairs of fits (a paired bootstrap, ``refitted`` pairs with a refit): a
        pair fails when either of its fits does."""
        reasons = dict(self.reasons)
        for k, v in other.reasons.items():
            reasons[k] = reasons.get(k, 0) + v
        both = None
        if self.refitted_mask is not None and other.refitted_mask is not None:
            both = self.refitted_mask | other.refitted_mask
        return RefitStatus(refitted, self.failed | other.failed, reasons, both)

    def summary(self, what: str = "resamples") -> str:
        """``"3 of 200 resamples failed to fit (at a bound 3) and were refitted from more starts;
        1 still failed and was dropped"``, or that every fit passed."""
        if not self.refitted:
            return (
                f"all {self.n} {what} passed the fit checks (converged, off the bounds, "
                "no worse than a refit from the full-data optimum)"
            )
        why = ", ".join(f"{k}: {v}" for k, v in self.reasons.items() if v)
        out = f"{self.refitted} of {self.n} {what} failed to fit ({why}) and were refitted from more starts"
        if self.n_dropped:
            out += f"; {self.n_dropped} still failed and {'was' if self.n_dropped == 1 else 'were'} dropped"
        else:
            out += "; all then passed"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "refitted": self.refitted,
            "dropped": self.n_dropped,
            "reasons": dict(self.reasons),
            "dropped_index": [int(i) for i in np.flatnonzero(self.failed)],
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> RefitStatus:
        failed = np.zeros(int(obj["n"]), bool)
        failed[np.asarray(obj.get("dropped_index", []), int)] = True
        return cls(
            int(obj.get("refitted", 0)), failed, {str(k): int(v) for k, v in obj.get("reasons", {}).items()}
        )


def fit_failures(
    data: LawData,
    problems: Problems,
    thetas: np.ndarray,
    funs: np.ndarray,
    f_warm: np.ndarray,
    free: np.ndarray,
    theta_hat: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Which fits failed: not converged, a fitted coordinate at a bound (one the full-data fit
    ``theta_hat`` is not on itself: a box that binds the data binds its resamples too, and the
    diagnosis reports it already), or an objective worse than the warm-start refit ``f_warm``.
    Returns the failed mask and one mask per reason."""
    free = np.asarray(free, bool)
    span = _HI - _LO
    at_lo = (thetas <= _LO + _BOUND_ATOL * span) & free
    at_hi = (thetas >= _HI - _BOUND_ATOL * span) & free
    if theta_hat is not None:
        at_lo &= ~(np.asarray(theta_hat) <= _LO + _BOUND_ATOL * span)
        at_hi &= ~(np.asarray(theta_hat) >= _HI - _BOUND_ATOL * span)
    at_bound = (at_lo | at_hi).any(axis=1)
    worse = ~np.isfinite(funs) | (funs > f_warm + _WORSE_RTOL * np.abs(f_warm))
    not_conv = np.zeros(len(thetas), bool)
    for j in range(len(thetas)):
        if not np.isfinite(funs[j]):
            not_conv[j] = True
            continue
        w = None if problems.weights is None else problems.weights[j]
        d = _with_log_l(data, None if problems.log_l is None else problems.log_l[j])
        f, g = law.objective_single(thetas[j], d, w)
        g = np.where(free & ~((at_lo[j] & (g > 0)) | (at_hi[j] & (g < 0))), g, 0.0)
        not_conv[j] = not np.isfinite(f) or float(np.max(np.abs(g))) > _GRAD_RTOL * max(abs(f), 1e-8)
    reasons = {"not converged": not_conv, "at a bound": at_bound, "worse than a warm start": worse}
    return not_conv | at_bound | worse, reasons


def refit_checked(
    data: LawData,
    problems: Problems,
    theta_hat: np.ndarray,
    free: np.ndarray,
    rng: np.random.Generator,
    *,
    n_starts: int = 16,
    extra: list[np.ndarray] | None = None,
    retry_factor: int = 4,
) -> tuple[np.ndarray, np.ndarray, RefitStatus]:
    """:func:`refit_many`, then every fit checked (:func:`fit_failures`); a failed one is refitted
    with ``retry_factor`` times the starts and screened candidates, and the better answer kept.

    Why: a resample fit that stopped early, ran onto a bound the full-data fit is not on (a flat
    direction: ``A = e^35``, ``phi = -3``) or settled in a local optimum worse than the full-data optimum's basin is a
    failure of the optimiser, not evidence about phi; a few of them drag a percentile interval to
    nonsense. Returns thetas, objectives and the :class:`RefitStatus` (``status.failed``: the fits
    that still fail; the caller drops them and reports how many).
    """
    f_warm = np.empty(problems.n)
    thetas, funs = refit_many(
        data, problems, theta_hat, free, rng, n_starts=n_starts, extra=extra, f_warm=f_warm
    )
    failed, why = fit_failures(data, problems, thetas, funs, f_warm, free, theta_hat)
    reasons = {k: int(v.sum()) for k, v in why.items()}
    first = failed.copy()
    if failed.any():
        idx = np.flatnonzero(failed)
        sub = problems.rows(idx)
        th2, f2 = refit_many(
            data, sub, theta_hat, free, rng, n_starts=retry_factor * n_starts,
            n_screen=retry_factor * 64, extra=extra, max_iter=400,
        )  # fmt: skip
        take = f2 < funs[idx]
        thetas[idx[take]], funs[idx[take]] = th2[take], f2[take]
        still, _ = fit_failures(data, sub, thetas[idx], funs[idx], f_warm[idx], free, theta_hat)
        failed[idx] = still
    return thetas, funs, RefitStatus(int(first.sum()), failed, reasons, first)
