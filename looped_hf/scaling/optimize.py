"""Multi-start L-BFGS-B on the summed Huber objective.

Strategy (why it is fast): a start costs ~80 us per L-BFGS-B iteration and needs ~100
iterations, so polishing 500 (or Chinchilla's 4500) starts one by one takes seconds to minutes.
Most starts are hopeless (``a = 30, alpha = 0`` predicts a loss of e^30), and the batched
objective in :mod:`.law` evaluates all of them in one numpy call. We therefore screen every start
with that call, descend the ``n_polish`` best together with the batched Levenberg-Marquardt
(:func:`batched_descent`, a few numpy calls per iteration for all of them) and polish only the
best few distinct end points with L-BFGS-B (analytic gradient, ``jac=True``); the best polished
point is the answer. ``tests/test_scaling.py`` checks that the screened answer equals the
exhaustive one (every start polished, ``polish_all=True``) on the Chinchilla data.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import minimize

from .law import BOUNDS, HUBER_DELTA, LawData, lse_terms, objective, objective_single

#: Iterations of the batched descent when it only ranks starts (the best are then polished by
#: L-BFGS-B): on the study design the polished objectives after 15, 30 and 60 iterations matched
#: those after 200 within 1e-7 (relative), in a quarter of the time.
DESCENT_ITERS = 25
#: Distinct end points of the multistart's batched descent that L-BFGS-B polishes.
_POLISH_TOP = 4

# Tight tolerances: the objective is ~1e-3 at the optimum and A, B are weakly identified, so
# scipy's defaults (gtol 1e-5) stop visibly early.
_LBFGS_OPTIONS = {"ftol": 1e-15, "gtol": 1e-11, "maxiter": 2000, "maxcor": 20}


_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_")
_GETTERS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads", "scipy_openblas_get_num_threads64_")


def _openblas_handles() -> list[tuple[ctypes.CDLL, str, str]]:
    """(library, getter, setter) for each OpenBLAS loaded in this process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted(
                {ln.split()[-1] for ln in fh if "openblas" in ln.lower() and ln.split()[-1].startswith("/")}
            )
    except OSError:
        return []
    out = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, set_ in zip(_GETTERS, _SETTERS):
            if hasattr(lib, get) and hasattr(lib, set_):
                out.append((lib, get, set_))
                break
    return out


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Run the block with one BLAS thread, then restore.

    Why: scipy's L-BFGS-B calls BLAS/LAPACK on 6x20 matrices every iteration; with OpenBLAS's
    default thread pool each call wakes all threads, and on a busy 2-core machine a 6 ms polish
    took 100-500 ms (measured). threadpoolctl does this properly when installed; otherwise we
    call OpenBLAS's own setter through ctypes, and do nothing where neither is available.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    if threadpool_limits is not None:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
        return
    handles = _openblas_handles()
    saved = []
    for lib, get, set_ in handles:
        try:
            saved.append((lib, set_, int(getattr(lib, get)())))
            getattr(lib, set_)(1)
        except Exception:  # a foreign symbol with another signature: leave that library alone
            continue
    try:
        yield
    finally:
        for lib, set_, n in saved:
            getattr(lib, set_)(n)


@dataclass
class Polished:
    theta: np.ndarray
    fun: float
    success: bool
    nit: int


def random_starts(rng: np.random.Generator, n: int, fixed: dict[int, float]) -> np.ndarray:
    """``n`` uniform starts inside :data:`BOUNDS`; fixed coordinates set to their value."""
    lo = np.array([b[0] for b in BOUNDS])
    hi = np.array([b[1] for b in BOUNDS])
    starts = lo + (hi - lo) * rng.random((n, len(BOUNDS)))
    for i, v in fixed.items():
        starts[:, i] = v
    return starts


def chinchilla_grid(fixed: dict[int, float]) -> np.ndarray:
    """Hoffmann et al.'s Approach 3 grid: alpha, beta in {0, .5, .., 2}, e in {-1, -.5, .., 1},
    a, b in {0, 5, .., 25} (4500 starts); phi (if free) starts at 0.5."""
    halves = np.arange(0.0, 2.01, 0.5)
    grid = np.array(
        [
            (a, alpha, b, beta, e, 0.5)
            for a, alpha, b, beta, e in itertools.product(
                range(0, 30, 5), halves, range(0, 30, 5), halves, np.arange(-1.0, 1.01, 0.5)
            )
        ],
        dtype=float,
    )
    for i, v in fixed.items():
        grid[:, i] = v
    return grid


def polish(theta0: np.ndarray, data: LawData, weights: np.ndarray | None, free: np.ndarray) -> Polished:
    """L-BFGS-B from ``theta0`` over the ``free`` coordinates (analytic gradient)."""
    theta0 = np.clip(np.asarray(theta0, dtype=float), [b[0] for b in BOUNDS], [b[1] for b in BOUNDS])
    base = theta0.copy()
    idx = np.flatnonzero(free)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        th = base.copy()
        th[idx] = x
        f, g = objective_single(th, data, weights)
        return f, g[idx]

    res = minimize(
        fun,
        theta0[idx],
        jac=True,
        method="L-BFGS-B",
        bounds=[BOUNDS[i] for i in idx],
        options=_LBFGS_OPTIONS,
    )
    th = base.copy()
    th[idx] = res.x
    return Polished(th, float(res.fun), bool(res.success), int(res.nit))


def multistart(
    data: LawData,
    starts: np.ndarray,
    free: np.ndarray,
    weights: np.ndarray | None = None,
    n_polish: int = 64,
    *,
    polish_all: bool = False,
) -> tuple[Polished, np.ndarray, list[Polished]]:
    """Screen all ``starts`` with the batched objective, descend the ``n_polish`` best, polish the
    best distinct end points with L-BFGS-B (``polish_all``: every one of the ``n_polish`` starts
    polished with L-BFGS-B from where it starts, the slow exhaustive reference).

    Returns the best polished point, the screened order of starts (best first) and every
    end point (best first), so that callers (the bootstrap) can reuse the local optima.
    """
    f0 = objective(starts, data, weights)[0]
    f0 = np.where(np.isfinite(f0), f0, np.inf)
    order = np.argsort(f0, kind="stable")
    top = order[: max(1, n_polish)]
    if polish_all:
        every = sorted((p for p in (polish(starts[i], data, weights, free) for i in top) if np.isfinite(p.fun)),
                       key=lambda p: p.fun)  # fmt: skip
        if not every:
            raise RuntimeError("no start converged to a finite objective")
        return every[0], starts[order], every
    # The n_polish best screened starts descend together (one batched run instead of n_polish
    # sequential L-BFGS-B runs); L-BFGS-B then polishes the best few distinct end points, which
    # is where the reported optimum comes from.
    th, fd = batched_descent(data, starts[top], free, weights, max_iter=DESCENT_ITERS)
    rank = np.argsort(np.where(np.isfinite(fd), fd, np.inf), kind="stable")
    polished: list[Polished] = []
    done: list[np.ndarray] = []
    for k in rank:
        if len(done) < _POLISH_TOP and all(np.max(np.abs(th[k] - q)) > 1e-3 for q in done):
            done.append(th[k])
            p = polish(th[k], data, weights, free)
            polished.append(
                p if np.isfinite(p.fun) and p.fun <= fd[k] else Polished(th[k], float(fd[k]), False, 0)
            )
        elif np.isfinite(fd[k]):
            polished.append(Polished(th[k], float(fd[k]), False, 0))
    polished = sorted((p for p in polished if np.isfinite(p.fun)), key=lambda p: p.fun)
    if not polished:
        raise RuntimeError("no start converged to a finite objective")
    return polished[0], starts[order], polished


_LO = np.array([b[0] for b in BOUNDS])
_HI = np.array([b[1] for b in BOUNDS])


def _residuals_and_jacobian(theta: np.ndarray, data: LawData) -> tuple[np.ndarray, np.ndarray]:
    """Residuals ``rho = log L - log L_hat`` ``(S, n)`` and ``d rho / d theta`` ``(S, n, 6)``."""
    alpha = theta[:, [1]]
    lne, dlne, e1, e2, e3, tot, rho = lse_terms(*(theta[:, [k]] for k in range(6)), data)
    s1, s2, s3 = e1 / tot, e2 / tot, e3 / tot
    jac = np.stack((-s1, s1 * lne, -s2, s2 * data.log_d, -s3, alpha * s1 * dlne), axis=-1)
    return rho, jac


def _huber(rho: np.ndarray, weights: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Summed weighted Huber objective ``(S,)`` and ``psi(rho) = clip(rho, -delta, delta)``."""
    c = np.clip(rho, -delta, delta)
    return (weights * c * (rho - 0.5 * c)).sum(axis=1), c


def batched_descent(
    data: LawData,
    starts: np.ndarray,
    free: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    max_iter: int = 200,
    rtol: float = 1e-10,
    delta: float = HUBER_DELTA,
) -> tuple[np.ndarray, np.ndarray]:
    """Descend many starts of many problems at once; returns ``(theta (S, 6), objective (S,))``.

    Why: the bootstrap and the phi profile each solve hundreds of small fits, and a one-at-a-time
    L-BFGS-B costs ~90 us per evaluation, mostly interpreter overhead, ~300 evaluations per start.
    Here every start is one row of a batch and each iteration is a handful of numpy calls on
    ``(S, n)`` arrays, so thousands of starts descend together in about a second.

    Method: Levenberg-Marquardt on the Huber objective by iteratively reweighted least squares
    (Huber's IRLS weights ``min(1, delta / |rho|)`` make the quadratic model a majoriser of the
    Huber loss), Marquardt's diagonal scaling (the parameters' scales differ by 100x), a step
    accepted only when it lowers the objective (so every row decreases monotonically). Bounds
    (:data:`BOUNDS`): a coordinate on its bound whose gradient points outward is frozen for the
    step, and steps are clipped into the box. Coordinates with ``free`` false never move.

    The result is an approximate optimum per row; callers polish the rows they keep with
    :func:`polish` (L-BFGS-B), which is what the reported numbers come from.

    Args:
        data: the runs.
        starts: ``(S, 6)`` start vectors (fixed coordinates already set).
        free: ``(6,)`` mask of the coordinates that move.
        weights: ``(S, n)`` per-row run weights (bootstrap counts), ``(n,)`` shared, or ``None``.
        max_iter: iterations at most.
        rtol: a row stops when an accepted step lowers its objective by less than ``rtol`` times it.
        delta: Huber threshold.
    """
    theta = np.clip(np.array(starts, dtype=float, copy=True), _LO, _HI)
    s = theta.shape[0]
    w = np.ones((s, data.n)) if weights is None else np.broadcast_to(np.asarray(weights, float), (s, data.n))
    free = np.asarray(free, bool)
    rho, jac = _residuals_and_jacobian(theta, data)
    f, psi = _huber(rho, w, delta)
    f = np.where(np.isfinite(f), f, np.inf)
    lam = np.full(s, 1e-3)
    running = np.isfinite(f)
    eye = np.eye(6)
    for _ in range(max_iter):
        idx = np.flatnonzero(running)
        if idx.size == 0:
            break
        th, wr, r_, j_ = theta[idx], w[idx], rho[idx], jac[idx]
        jt = j_.transpose(0, 2, 1)  # (S, 6, n): batched matmuls beat einsum here by ~10x
        grad = (jt @ (wr * psi[idx])[..., None])[..., 0]
        irls = wr * np.where(np.abs(r_) <= delta, 1.0, delta / np.maximum(np.abs(r_), delta))
        hess = (jt * irls[:, None, :]) @ j_
        blocked = (~free)[None, :] | ((th <= _LO + 1e-12) & (grad > 0)) | ((th >= _HI - 1e-12) & (grad < 0))
        diag = np.diagonal(hess, axis1=1, axis2=2)
        damped = hess + lam[idx, None, None] * (
            np.maximum(diag, 1e-12 * (1.0 + diag.max(axis=1, keepdims=True)))[:, :, None] * eye
        )
        keep = ~blocked
        # Frozen coordinates: identity rows/columns and a zero right-hand side give a zero step.
        damped = damped * (keep[:, :, None] & keep[:, None, :]) + blocked[:, :, None] * eye
        rhs = np.where(keep, -grad, 0.0)
        try:
            step = np.linalg.solve(damped, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            step = (
                np.linalg.lstsq(damped[0], rhs[0], rcond=None)[0][None]
                if idx.size == 1
                else np.zeros_like(rhs)
            )
        cand = np.clip(th + step, _LO, _HI)
        rho_c, jac_c = _residuals_and_jacobian(
            cand, data if data.log_l.ndim == 1 else replace(data, log_l=data.log_l[idx])
        )
        f_c, psi_c = _huber(rho_c, wr, delta)
        better = np.isfinite(f_c) & (f_c < f[idx])
        acc = idx[better]
        gain = f[acc] - f_c[better]
        theta[acc], rho[acc], jac[acc], psi[acc] = cand[better], rho_c[better], jac_c[better], psi_c[better]
        f_old = f[acc].copy()
        f[acc] = f_c[better]
        lam[acc] = np.maximum(lam[acc] * 0.3, 1e-9)
        rej = idx[~better]
        lam[rej] *= 10.0
        done_acc = acc[gain <= rtol * np.maximum(f_old, 1e-300)]
        running[done_acc] = False
        running[rej[lam[rej] > 1e10]] = False
    return theta, f
