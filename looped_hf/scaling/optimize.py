"""Multi-start L-BFGS-B on the summed Huber objective.

Strategy (why it is fast): a start costs ~80 us per L-BFGS-B iteration and needs ~100
iterations, so polishing 500 (or Chinchilla's 4500) starts one by one takes seconds to minutes.
Most starts are hopeless (``a = 30, alpha = 0`` predicts a loss of e^30), and the batched
objective in :mod:`.law` evaluates all of them in one numpy call. We therefore screen every start
with that call and polish only the ``n_polish`` best with L-BFGS-B (analytic gradient,
``jac=True``); the best polished point is the answer. ``tests/test_scaling.py`` checks that the
screened answer equals the exhaustive one on the Chinchilla data.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize

from .law import BOUNDS, LawData, objective, objective_single

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
) -> tuple[Polished, np.ndarray]:
    """Screen all ``starts`` with the batched objective, polish the ``n_polish`` best.

    Returns the best polished point and the screened order of starts (best first) so that
    callers (the bootstrap) can reuse good starts.
    """
    f0 = objective(starts, data, weights)[0]
    f0 = np.where(np.isfinite(f0), f0, np.inf)
    order = np.argsort(f0, kind="stable")
    best: Polished | None = None
    for i in order[: max(1, n_polish)]:
        p = polish(starts[i], data, weights, free)
        if np.isfinite(p.fun) and (best is None or p.fun < best.fun):
            best = p
    if best is None:
        raise RuntimeError("no start converged to a finite objective")
    return best, starts[order]
