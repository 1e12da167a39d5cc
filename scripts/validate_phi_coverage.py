"""Does the 95% interval of phi cover the true phi? Coverage on synthetic sweeps with random truth.

    python scripts/validate_phi_coverage.py [--design study tiny_v0] [--datasets 100] [--bootstrap 200]
                                            [--methods cell run residual] [--workers 1] [--out FILE.json]

For each design (:mod:`looped_hf.scaling.synthetic`: ``study``, the reference study's 116 runs,
widths straddling the optimum; ``tiny_v0``, the v0.1 CPU demo's 36 runs, every width far above
the optimum, phi weakly identified) and each dataset: a law is drawn from the design's prior
(:func:`~looped_hf.scaling.synthetic.sample_truth`, phi uniform in [0, 1]), the runs are drawn
around it with the design's noise, the law is fitted, and each interval is checked against the
true phi: the profile-likelihood interval (an open end counts as the search bound) and the
percentile bootstrap interval of every resampling method asked for (each refits every resample
with the fitter's multistart; :func:`looped_hf.scaling.fit.rebootstrap` reuses one point fit).

Printed per design and interval: coverage (target >= 90% at nominal 95%) with its binomial
standard error, misses below / above, the median and mean width, the share of intervals that
reach the search box, and the share of resamples with phi on a bound. ``--out`` writes every
dataset's numbers as JSON. Seeds are deterministic: dataset i of a design uses seed
``first_seed + i`` for its truth, its noise and its fit.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

# The fits run with one BLAS thread (looped_hf.scaling.optimize.single_threaded_blas).
from looped_hf.scaling import fit_scaling_law
from looped_hf.scaling.fit import rebootstrap
from looped_hf.scaling.law import BOUNDS
from looped_hf.scaling.synthetic import DESIGNS, design_runs, sample_truth

PHI_LO, PHI_HI = BOUNDS[5]


def one(job: tuple[str, int, int, tuple[str, ...]]) -> dict[str, Any]:
    """Fit one synthetic dataset; every interval of phi and whether it covers the truth."""
    design_name, seed, bootstrap, methods = job
    design = DESIGNS[design_name]
    truth = sample_truth(design, np.random.default_rng(seed))
    runs = design_runs(design, truth, seed=seed)
    t0 = time.perf_counter()
    # checks=False: no restricted fits / hold-out; the profile is still computed (bootstrap > 0).
    fit = fit_scaling_law(runs, bootstrap=bootstrap, bootstrap_method=methods[0], seed=seed, checks=False)
    out: dict[str, Any] = {
        "design": design_name,
        "seed": seed,
        "truth": truth,
        "phi_hat": fit.params["phi"],
        "identified": fit.diagnostics["verdict"]["identified"],
        "intervals": {},
    }
    assert fit.profile is not None
    lo, hi = fit.profile.interval
    out["intervals"]["profile"] = {
        "lo": PHI_LO if lo is None else lo,
        "hi": PHI_HI if hi is None else hi,
        "open": lo is None or hi is None,
    }
    for k, method in enumerate(methods):
        f = fit if k == 0 else rebootstrap(fit, bootstrap, bootstrap_method=method, seed=seed)
        assert f.bootstrap_samples is not None
        lo_b, hi_b = f.ci["phi"]
        out["intervals"][method] = {
            "lo": lo_b,
            "hi": hi_b,
            "open": lo_b <= PHI_LO + 1e-3 or hi_b >= PHI_HI - 1e-3,
            "phi_at_bound": f.diagnostics["bootstrap"]["phi_at_bound"],
        }
    out["seconds"] = time.perf_counter() - t0
    return out


def summarise(results: list[dict[str, Any]], names: list[str]) -> list[str]:
    """The table for one design."""
    lines = [
        f"{'interval':<10} {'coverage':>15} {'below':>6} {'above':>6} {'median w':>9} {'mean w':>7} "
        f"{'open':>5} {'phi@bound':>9}"
    ]
    for name in names:
        truth = np.array([r["truth"]["phi"] for r in results])
        lo = np.array([r["intervals"][name]["lo"] for r in results])
        hi = np.array([r["intervals"][name]["hi"] for r in results])
        covered = (lo <= truth) & (truth <= hi)
        n, cov = len(covered), float(covered.mean())
        se = np.sqrt(cov * (1 - cov) / n)
        opened = np.mean([r["intervals"][name]["open"] for r in results])
        at_b = [r["intervals"][name].get("phi_at_bound") for r in results]
        at_b_s = "-" if at_b[0] is None else f"{100 * np.mean(at_b):.1f}%"
        lines.append(
            f"{name:<10} {100 * cov:>6.1f}% +- {100 * se:>4.1f} {int((hi < truth).sum()):>6} "
            f"{int((lo > truth).sum()):>6} {np.median(hi - lo):>9.3f} {np.mean(hi - lo):>7.3f} "
            f"{100 * opened:>4.0f}% {at_b_s:>9}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", nargs="+", choices=sorted(DESIGNS), default=["study", "tiny_v0"])
    ap.add_argument("--datasets", type=int, default=100)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--methods", nargs="+", choices=("cell", "run", "residual"), default=["cell"])
    ap.add_argument("--workers", type=int, default=1, help="processes (the fits are single-threaded)")
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--out", default=None, help="write every dataset's numbers here (JSON)")
    args = ap.parse_args()
    if args.datasets < 1 or args.bootstrap < 2 or args.workers < 1:
        ap.error("--datasets and --workers must be >= 1 and --bootstrap >= 2")

    jobs = [
        (d, args.first_seed + i, args.bootstrap, tuple(args.methods))
        for d in args.design
        for i in range(args.datasets)
    ]
    t0 = time.perf_counter()
    if args.workers == 1:
        results = [one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            results = list(pool.map(one, jobs))
    names = ["profile", *args.methods]
    for d in args.design:
        res = [r for r in results if r["design"] == d]
        err = np.array([r["phi_hat"] - r["truth"]["phi"] for r in res])
        ident = np.mean([bool(r["identified"]) for r in res])
        print(
            f"\n{d}: {len(DESIGNS[d].cells)} runs, {len(res)} datasets, true phi ~ U{DESIGNS[d].phi}, "
            f"noise {100 * DESIGNS[d].noise:g}%, {args.bootstrap} resamples; "
            f"{np.mean([r['seconds'] for r in res]):.1f} s per dataset"
        )
        print(
            f"point estimate: bias {err.mean():+.3f}, RMSE {np.sqrt(np.mean(err**2)):.3f}; "
            f"verdict 'identified' in {100 * ident:.0f}% of datasets"
        )
        print("\n".join(summarise(res, names)))
    print(f"\n{len(results)} datasets in {time.perf_counter() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
