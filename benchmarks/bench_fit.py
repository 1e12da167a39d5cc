"""Benchmark the phi fit and its bootstrap, and the fit against a naive scipy fit.

    python benchmarks/bench_fit.py [--starts 500] [--bootstrap 200] [--repeats 3] [--skip-naive]

Data: :func:`looped_hf.scaling.synthetic.study_runs` (29 runs x r in {1, 2, 4, 8}, six budgets
4.64e17 .. 2.15e19, iso-depth 20 layers, d = 64 s; r = 1 is a plain decoder with
n_once = 20 * 12 d^2, n_rec = 0; r > 1 has n_once = 4 * 12 d^2, n_rec = (16/r) 12 d^2 + 2 d^2;
D = budget / (6 (n_once + r n_rec)); 0.5% multiplicative noise; true phi = 0.46).

A second design, :data:`looped_hf.scaling.synthetic.TINY_V0` (36 runs: the v0.1 CPU demo's
sweep, every width far above the optimum, so the objective is flat in phi), times the bootstrap
where it is hardest.

Rows:
- ``looped_hf fit``: 500 random starts screened by the batched objective, the best 32
  polished with L-BFGS-B and the analytic gradient (targets: < 2 s).
- ``fit + profile + bootstrap``: the point fit, the phi profile and 200 (budget, r)-cell
  resamples, each refitted with a 16-start multistart (target for 36 runs: < 30 s on 2 cores).
- ``... bootstrap_starts=1``: the same with the point estimate as the only start of each
  resample (the old scheme, for its interval: too narrow where the objective is flat).
- ``analytic grad, polish all``: every one of the 500 starts polished (no screening).
- ``naive``: ``scipy.optimize.minimize(method="L-BFGS-B")`` without ``jac`` (finite-difference
  gradients) from every one of the same 500 starts, objective written with ``scipy.special``.

Times are wall-clock seconds (the median of ``--repeats`` for the fast rows; the naive row runs
once). CPU time is printed beside them because a shared machine inflates wall time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.optimize import minimize
from scipy.special import huber, logsumexp

from looped_hf.scaling import fit_scaling_law, load_runs
from looped_hf.scaling.fit import _law_data
from looped_hf.scaling.law import BOUNDS, HUBER_DELTA
from looped_hf.scaling.optimize import polish, random_starts, single_threaded_blas
from looped_hf.scaling.synthetic import TINY_V0, TRUE_PARAMS, design_runs, sample_truth, study_runs


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, float, Any]:
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return float(np.median(walls)), float(np.median(cpus)), out


def naive_fit(runs: list[dict[str, Any]], starts: np.ndarray) -> tuple[float, float]:
    """What one writes first: a per-run scipy objective, numerical gradients, every start."""
    r = np.array([x["num_recurrences"] for x in runs], float)
    n_once = np.array([x["n_once"] for x in runs], float)
    n_rec = np.array([x["n_rec"] for x in runs], float)
    log_d = np.log([x["tokens"] for x in runs])
    log_l = np.log([x["loss"] for x in runs])

    def obj(t: np.ndarray) -> float:
        a, alpha, b, beta, e, phi = t
        log_n = np.log(n_once + r**phi * n_rec)
        pred = logsumexp(np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_d, e)]), axis=0)
        return float(np.sum(huber(HUBER_DELTA, log_l - pred)))

    best = (np.inf, np.nan)
    for s in starts:
        res = minimize(obj, s, method="L-BFGS-B", bounds=BOUNDS)
        if res.fun < best[0]:
            best = (float(res.fun), float(res.x[5]))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=500)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-naive", action="store_true", help="skip the slow naive row")
    args = ap.parse_args()

    runs = study_runs(seed=0)
    data = _law_data(load_runs(runs), phi_identifiable=True)
    starts = random_starts(np.random.default_rng(0), args.starts, {})
    rows: list[tuple[str, float, float, float, float]] = []

    w, c, fit = timed(lambda: fit_scaling_law(runs, n_starts=args.starts, seed=0, checks=False), args.repeats)
    rows.append(
        (f"looped_hf fit ({args.starts} starts, 32 polished)", w, c, fit.objective, fit.params["phi"])
    )
    fast = w

    w, c, bfit = timed(
        lambda: fit_scaling_law(runs, n_starts=args.starts, seed=0, bootstrap=args.bootstrap, checks=False)
    )
    lo, hi = bfit.ci["phi"]
    rows.append(
        (
            f"fit + profile + bootstrap {args.bootstrap} (cell), 116 runs",
            w,
            c,
            bfit.objective,
            bfit.params["phi"],
        )
    )
    tiny = design_runs(TINY_V0, sample_truth(TINY_V0, np.random.default_rng(0)), seed=0)
    tiny_ci = {}
    for starts_per_resample in (16, 1):
        w, c, tfit = timed(
            lambda k=starts_per_resample: fit_scaling_law(
                tiny, seed=0, bootstrap=args.bootstrap, bootstrap_starts=k, checks=False
            )
        )
        tiny_ci[starts_per_resample] = tfit.ci["phi"]
        suffix = "" if starts_per_resample == 16 else ", bootstrap_starts=1"
        rows.append(
            (
                f"fit + profile + bootstrap {args.bootstrap}, 36 runs{suffix}",
                w,
                c,
                tfit.objective,
                tfit.params["phi"],
            )
        )

    def polish_all() -> tuple[float, float]:
        with single_threaded_blas():
            ps = [polish(s, data, None, np.ones(6, bool)) for s in starts]
        best = min(ps, key=lambda p: p.fun)
        return best.fun, float(best.theta[5])

    w, c, (f_all, phi_all) = timed(polish_all)
    rows.append((f"analytic grad, polish all {args.starts}", w, c, f_all, phi_all))
    if not args.skip_naive:
        with single_threaded_blas():  # same BLAS setting as ours: the comparison is the method
            w, c, (f_naive, phi_naive) = timed(lambda: naive_fit(runs, starts))
        rows.append((f"naive: minimize, numerical grad, all {args.starts}", w, c, f_naive, phi_naive))
        naive = w

    print(f"116-run synthetic study design, true phi = {TRUE_PARAMS['phi']}, 0.5% noise\n")
    print(f"{'method':<58} {'wall s':>8} {'cpu s':>8} {'objective':>12} {'phi':>8}")
    for name, w, c, f, phi in rows:
        print(f"{name:<58} {w:>8.2f} {c:>8.2f} {f:>12.6g} {phi:>8.4f}")
    print(f"\nbootstrap phi 95% CI, 116 runs: [{lo:.3f}, {hi:.3f}]")
    for k, (t_lo, t_hi) in tiny_ci.items():
        print(f"bootstrap phi 95% CI, 36 runs, {k:>2} start(s) per resample: [{t_lo:.3f}, {t_hi:.3f}]")
    if not args.skip_naive:
        print(f"naive / looped_hf fit wall-time ratio: {naive / fast:.1f}x")


if __name__ == "__main__":
    main()
