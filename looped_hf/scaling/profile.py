"""The profile of the objective over phi, and the profile-likelihood interval it gives.

Profile: for phi on a grid, every other parameter refitted (a real multistart per grid point,
:func:`~.resample.refit_many`); ``f_prof(phi) - f_min`` says how much worse the law fits when phi
is held there. A flat profile is the plainest picture of a phi the runs do not determine.

Interval. The fit minimises a Huber loss, not a likelihood, so the drop in the objective is put
on the likelihood-ratio scale with the robust "drop-in-dispersion" test of Schrader &
Hettmansperger (1980; Heritier & Ronchetti 1994): for an M-estimator with loss ``H`` and
``psi = H'``,

    LR(phi) = 2 (f_prof(phi) - f_min) / kappa,    kappa = E[psi(e)^2] / E[psi'(e)],

is asymptotically chi^2_1 under the true phi. For the Huber loss ``psi = clip(e, -delta, delta)``
and ``psi' = 1{|e| <= delta}``; we evaluate both expectations for normal errors with the
residuals' scale ``s = sqrt(sum rho^2 / (n - p))``. Checks: with every residual inside delta the
loss is least squares and ``kappa = s^2``, the classical ``(SSR(phi) - SSR) / s^2``; with delta
much smaller than s it is least absolute deviations and ``kappa = delta s sqrt(pi / 2)``.
Because ``s`` is estimated from ``n - p`` degrees of freedom the cut is the F(1, n - p) quantile
rather than chi^2_1 (the small-sample form for least squares). The interval is the hull of the
grid phi with ``LR <= cut``, its ends interpolated between grid points (in ``sqrt(LR)``, see
:func:`_crossing`; a narrow interval is profiled again on a finer grid); an end that reaches
the search box is reported as open (``None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# The F quantile from scipy.special (what scipy.stats.f.ppf calls): importing scipy.stats costs
# ~0.2 s of the fit command's start-up.
from scipy.special import fdtri

from .law import BOUNDS, HUBER_DELTA, LawData, objective_single
from .resample import Problems, refit_many

PHI = 5  # index of phi in the parameter vector


def huber_lr_scale(residuals: np.ndarray, n_free: int, delta: float = HUBER_DELTA) -> float:
    """``kappa = E[psi^2] / E[psi']`` of the Huber loss under normal errors of the residuals' scale."""
    n = residuals.size
    s = math.sqrt(float(np.sum(residuals**2)) / max(1, n - n_free))
    if s <= 0:
        return 0.0
    c = delta / s
    inside = math.erf(c / math.sqrt(2.0))  # P(|e| <= delta)
    density = math.exp(-0.5 * c * c) / math.sqrt(2.0 * math.pi)
    e_psi2 = s * s * (inside - 2.0 * c * density) + delta * delta * (1.0 - inside)
    return e_psi2 / inside


def default_grid(phi_hat: float, step: float = 0.05, half_width: float = 1.0, coarse: int = 25) -> np.ndarray:
    """A fine grid (``step``) within ``half_width`` of the estimate, and a coarse one over the box."""
    lo, hi = BOUNDS[PHI]
    fine = phi_hat + step * np.arange(-round(half_width / step), round(half_width / step) + 1)
    grid = np.concatenate([fine, np.linspace(lo, hi, coarse), [phi_hat]])
    grid = np.unique(np.round(grid[(grid >= lo) & (grid <= hi)], 10))
    return grid


@dataclass
class PhiProfile:
    """The profile of the objective over phi and its interval (see the module docstring)."""

    phi: np.ndarray  # grid
    objective: np.ndarray  # f_prof(phi)
    f_min: float
    kappa: float
    cut: float  # the LR cut (F(1, n - p) quantile)
    interval: tuple[float | None, float | None]  # None: open at the search box
    level: float = 0.95
    thetas: np.ndarray | None = None  # the refitted parameter vector at each grid point (not saved)

    @property
    def lr(self) -> np.ndarray:
        """``2 (f_prof - f_min) / kappa`` on the grid."""
        return (
            2.0 * (self.objective - self.f_min) / self.kappa
            if self.kappa > 0
            else np.full_like(self.objective, np.inf)
        )

    def valley(self, n: int = 7) -> list[np.ndarray]:
        """The refitted vectors at ``n`` grid points spread over the box: starts on the floor of
        the objective's valley for the bootstrap (a resample's optimum lies near that valley, at
        some phi), so each needs only a local descent."""
        if self.thetas is None:
            return []
        targets = np.linspace(self.phi.min(), self.phi.max(), n)
        idx = sorted({int(np.argmin(np.abs(self.phi - t))) for t in targets})
        return [self.thetas[i] for i in idx]

    def to_dict(self) -> dict[str, Any]:
        return {
            "phi": [float(x) for x in self.phi],
            "objective": [float(x) for x in self.objective],
            "f_min": self.f_min,
            "kappa": self.kappa,
            "cut": self.cut,
            "interval": list(self.interval),
            "level": self.level,
        }

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> PhiProfile:
        lo, hi = obj["interval"]
        return cls(
            phi=np.asarray(obj["phi"], float),
            objective=np.asarray(obj["objective"], float),
            f_min=float(obj["f_min"]),
            kappa=float(obj["kappa"]),
            cut=float(obj["cut"]),
            interval=(None if lo is None else float(lo), None if hi is None else float(hi)),
            level=float(obj.get("level", 0.95)),
        )


def _crossing(x0: float, y0: float, x1: float, y1: float, cut: float) -> float:
    """Where the profile crosses ``cut`` between grid points ``(x0, y0)`` and ``(x1, y1)``.

    Interpolated linearly in ``sqrt(LR)`` (the signed root is about linear in phi where the LR is
    about quadratic): straight lines through a convex LR would cross early and make the
    interval too narrow by up to ~20% on a coarse grid.
    """
    r0, r1, rc = math.sqrt(max(y0, 0.0)), math.sqrt(max(y1, 0.0)), math.sqrt(cut)
    return x0 + (rc - r0) * (x1 - x0) / (r1 - r0) if r1 != r0 else x1


def profile_interval(
    phi: np.ndarray, lr: np.ndarray, cut: float, phi_hat: float
) -> tuple[float | None, float | None]:
    """The hull of the grid phi with ``lr <= cut`` (and ``phi_hat``); an end at the box is ``None``.

    The hull, not the piece around ``phi_hat``: where the profile dips under the cut again
    further out (a second basin), those phi are in the confidence set too, and leaving them out
    would understate the uncertainty exactly when the objective is flat.
    """
    inside = np.flatnonzero(lr <= cut)
    i0 = int(np.argmin(np.abs(phi - phi_hat)))
    first = min(int(inside.min()), i0) if inside.size else i0
    last = max(int(inside.max()), i0) if inside.size else i0
    lo_end = None if first == 0 else _crossing(phi[first], lr[first], phi[first - 1], lr[first - 1], cut)
    hi_end = (
        None if last == len(phi) - 1 else _crossing(phi[last], lr[last], phi[last + 1], lr[last + 1], cut)
    )
    return lo_end, hi_end


def profile_phi(
    data: LawData,
    theta_hat: np.ndarray,
    residuals: np.ndarray,
    rng: np.random.Generator,
    *,
    grid: np.ndarray | None = None,
    n_starts: int = 16,
    extra: list[np.ndarray] | None = None,
    level: float = 0.95,
) -> PhiProfile:
    """Profile the objective over phi around the point estimate ``theta_hat`` (free phi fit).

    ``residuals`` are the point fit's (they set the scale of the LR statistic). If a grid point
    fits better than the point estimate, the point fit missed the global optimum; the profile's
    minimum is then used as ``f_min`` (so the LR stays >= 0) and the caller should say so.
    """
    phi_hat = float(theta_hat[PHI])
    grid = default_grid(phi_hat) if grid is None else np.asarray(grid, float)
    free = np.ones(len(BOUNDS), bool)
    free[PHI] = False
    n_free = len(BOUNDS)
    f_hat = objective_single(theta_hat, data)[0]
    kappa = huber_lr_scale(residuals, n_free)
    cut = float(fdtri(1, max(1, residuals.size - n_free), level))

    def run(points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return refit_many(data, Problems(len(points), fixed={PHI: points}), theta_hat, free, rng,
                          n_starts=n_starts, extra=extra, batch_polish=True)  # fmt: skip

    def lr_of(f: np.ndarray, f_min: float) -> np.ndarray:
        return 2.0 * (f - f_min) / kappa if kappa > 0 else np.where(f > f_min, np.inf, 0.0)

    thetas, f = run(grid)
    f_min = float(min(f_hat, float(np.min(f))))
    lo, hi = profile_interval(grid, lr_of(f, f_min), cut, phi_hat)
    # A narrow interval spans few grid points: profile it again on a grid ten times finer.
    step = float(np.min(np.diff(grid))) if grid.size > 1 else 0.0
    if lo is not None and hi is not None and 0 < hi - lo < 10 * step:
        width = hi - lo
        fine = np.linspace(lo - 0.5 * width, hi + 0.5 * width, 21)
        fine = fine[(fine >= BOUNDS[PHI][0]) & (fine <= BOUNDS[PHI][1])]
        th2, f2 = run(fine)
        grid, order = np.unique(np.concatenate([grid, fine]), return_index=True)
        thetas, f = np.concatenate([thetas, th2])[order], np.concatenate([f, f2])[order]
        f_min = float(min(f_hat, float(np.min(f))))
    lr = lr_of(f, f_min)
    return PhiProfile(
        phi=grid,
        objective=f,
        f_min=f_min,
        kappa=kappa,
        cut=cut,
        interval=profile_interval(grid, lr, cut, phi_hat),
        level=level,
        thetas=thetas,
    )


def _signed_root(prof: PhiProfile, x: np.ndarray) -> np.ndarray:
    """``LR`` of ``prof`` at ``x``, interpolated linearly in the signed root
    ``sign(phi - phi_min) sqrt(LR)`` (about linear in phi, so a 0.05 grid gives the LR within a
    few percent where a straight line through the LR itself would be off by up to one unit)."""
    lr = np.maximum(prof.lr, 0.0)
    i_min = int(np.argmin(lr))
    z = np.sqrt(lr) * np.where(np.arange(lr.size) < i_min, -1.0, 1.0)
    zi = np.interp(x, prof.phi, z, left=np.nan, right=np.nan)
    return zi * zi


@dataclass
class DeltaProfile:
    """The profile-likelihood interval of delta phi = phi_probe - phi_base (see :func:`delta_profile`)."""

    delta: np.ndarray  # grid
    lr: np.ndarray  # LR(delta) on the grid
    cut: float
    estimate: float
    interval: tuple[float | None, float | None]  # None: open (a phi profile reaches the box)
    level: float = 0.95

    def to_dict(self) -> dict[str, Any]:
        return {
            "estimate": self.estimate,
            "interval": list(self.interval),
            "cut": self.cut,
            "level": self.level,
            "lr_at_0": float(np.interp(0.0, self.delta, self.lr))
            if self.delta.min() <= 0 <= self.delta.max()
            else None,
        }


def delta_profile(
    base: PhiProfile,
    probe: PhiProfile,
    n_runs: int,
    n_free: int = 12,
    level: float = 0.95,
    step: float = 0.002,
) -> DeltaProfile:
    """The profile-likelihood interval of delta = phi_probe - phi_base from a joint fit.

    The joint fit: the base law on the base runs and the probe law on the probe's runs (with the
    base's r = 1 runs, as the study fits a probe), each with its own E, A, alpha, B, beta, and the
    probe's phi tied to ``phi_base + delta``; its objective is the sum of the two, each on its
    own likelihood-ratio scale (:func:`huber_lr_scale`). Holding delta and minimising over every
    other parameter is then ``min over phi of LR_base(phi) + LR_probe(phi + delta)``: the two
    phi profiles, already refitted at every grid point, combine exactly, with no new fit.

    The two terms are treated as independent. The shared r = 1 runs make the two phi estimates
    positively correlated, which narrows the true spread of their difference, so the interval is
    on the safe (wide) side. The cut is the F(1, ``n_runs`` - ``n_free``) quantile, as for phi.
    """
    lo, hi = BOUNDS[PHI]
    phi = np.arange(lo, hi + 0.5 * step, step)
    lr_b = _signed_root(base, phi)
    lr_p = _signed_root(probe, phi)
    cut = float(fdtri(1, max(1, n_runs - n_free), level))
    # Only base phi with a plausible LR can carry the minimum of a delta near the cut.
    keep = np.flatnonzero(np.isfinite(lr_b) & (lr_b <= cut + 25.0))
    n = phi.size
    offsets = np.arange(-(n - 1), n)  # delta = offset * step
    lr = np.full(offsets.size, np.inf)
    for i in keep:
        j = i + offsets
        ok = (j >= 0) & (j < n)
        cand = lr_b[i] + lr_p[j[ok]]
        lr[ok] = np.fmin(lr[ok], np.where(np.isfinite(cand), cand, np.inf))
    delta = offsets * step
    finite = np.isfinite(lr)
    delta, lr = delta[finite], lr[finite]
    lr = lr - lr.min()
    est = float(delta[int(np.argmin(lr))])
    inside = np.flatnonzero(lr <= cut)
    first, last = int(inside.min()), int(inside.max())
    # The delta grid ends where one of the phi grids does: an interval reaching it is open.
    lo_end = None if first == 0 else _crossing(delta[first], lr[first], delta[first - 1], lr[first - 1], cut)
    hi_end = (
        None
        if last == len(delta) - 1
        else _crossing(delta[last], lr[last], delta[last + 1], lr[last + 1], cut)
    )
    return DeltaProfile(delta, lr, cut, est, (lo_end, hi_end), level)
