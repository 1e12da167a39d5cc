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
  descended together (batched Levenberg-Marquardt), the best distinct end points polished with
  L-BFGS-B and the analytic gradient.
- ``fit + profile + bootstrap``: the point fit, the phi profile and 200 (budget, r)-cell
  resamples, each refitted with a 16-start multistart (target for 36 runs: < 30 s on 2 cores).
- ``... bootstrap_starts=1``: the same with the point estimate as the only start of each
  resample (the old scheme, for its interval: too narrow where the objective is flat).
- ``analytic grad, polish all``: every one of the 500 starts polished (no screening).
- ``naive``: ``scipy.optimize.minimize(method="L-BFGS-B")`` without ``jac`` (finite-difference
  gradients) from every one of the same 500 starts, objective written with ``scipy.special``.

Times are wall-clock seconds (the median of ``--repeats`` for the fast rows; the naive row runs
once). CPU time is printed beside them because a shared machine inflates wall time.

Side by side with another checkout (``--old DIR``, e.g. ``git worktree add /tmp/fit_base HEAD``),
each case run in a fresh subprocess of each checkout, the two interleaved, ``--repeats`` times
(median and min-max spread printed), with the numbers each side reports compared:

- ``looped-hf fit results.jsonl`` end to end (``python -m looped_hf fit``: imports + fit + report);
- ``fit_scaling_law(..., bootstrap=0)`` with its diagnostics, in-process time of the call;
- ``compare_fits`` of a study-shaped truncated probe with ``--compare-bootstrap`` resamples.

    python benchmarks/bench_fit.py --old /tmp/fit_base --repeats 3 --side-by-side-only

Targets (2-core machine): end to end < 2 s, fit + diagnostics < 1 s, comparison < 5 s; the old
and new numbers agree within 1e-6. Measured 2026-12-04 on the shared 2-core box (load 5 from other
jobs, so wall time was about twice CPU time; the fit is single-threaded, so on an idle machine
wall is about CPU), median of 3 (min-max), CPU seconds:

    case                                      old                 new
    looped-hf fit results.jsonl, end to end   8.00 (7.54-8.34)    1.43 (1.41-1.50)
    fit + diagnostics                         2.76 (2.69-2.77)    0.90 (0.90-1.01)
    200-resample probe comparison            10.15 (10.01-10.81)  3.25 (3.25-3.72)

phi, objective, profile interval and the comparison's bootstrap interval agreed within 1e-9.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
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


REPO = Path(__file__).resolve().parents[1]

# Runs inside a checkout (PYTHONPATH) and prints one JSON line: seconds and the numbers reported.
_CASE = r"""
import json, sys, time
case, base, probe, n_boot = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from looped_hf.scaling import compare_fits, fit_scaling_law
if case == "fit":
    t, c = time.perf_counter(), time.process_time()
    fit = fit_scaling_law(base)
    sec, cpu = time.perf_counter() - t, time.process_time() - c
    out = {"phi": fit.params["phi"], "objective": fit.objective, "profile": list(fit.profile.interval),
           "verdict": fit.diagnostics["verdict"]["line"]}
else:
    fb = fit_scaling_law(base, checks=False)
    t, cpu0 = time.perf_counter(), time.process_time()
    c = compare_fits(fb, probe, bootstrap=n_boot, seed=0)
    sec, cpu = time.perf_counter() - t, time.process_time() - cpu0
    out = {"delta": c.delta_phi, "ci": list(c.ci), "probe_phi": c.probe.params["phi"],
           "profile": None if getattr(c, "profile", None) is None else list(c.profile.interval)}
print(json.dumps({"sec": sec, "cpu": cpu, **out}))
"""


def _checkout_env(root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


def side_by_side(old: Path, repeats: int, n_boot: int) -> None:
    """Old and new checkout, each case in fresh subprocesses, interleaved, repeated."""
    from looped_hf.scaling.synthetic import base_runs_nats, probe_runs

    tmp = Path(tempfile.mkdtemp(prefix="bench_fit_"))
    base, probe = tmp / "base.jsonl", tmp / "probe.jsonl"
    base.write_text("".join(json.dumps(r) + "\n" for r in base_runs_nats(seed=0, noise_nats=0.001)))
    probe.write_text("".join(json.dumps(r) + "\n" for r in probe_runs(seed=0, noise_nats=0.001)))
    sides = {"old": old.resolve(), "new": REPO}
    walls: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    numbers: dict[tuple[str, str], dict[str, Any]] = {}
    end_to_end = "looped-hf fit results.jsonl (end to end)"
    for _ in range(repeats):
        for side, root in sides.items():  # interleaved: old, new, old, new, ...
            env = _checkout_env(root)
            t, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([sys.executable, "-m", "looped_hf", "fit", str(base)], env=env, cwd=tmp,
                           check=True, capture_output=True)  # fmt: skip
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            walls.setdefault((end_to_end, side), []).append(time.perf_counter() - t)
            cpus.setdefault((end_to_end, side), []).append(
                c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
            )
            for case, label in (("fit", "fit + diagnostics (in-process)"),
                                ("compare", f"{n_boot}-resample probe comparison (in-process)")):  # fmt: skip
                out = subprocess.run([sys.executable, "-c", _CASE, case, str(base), str(probe), str(n_boot)],
                                     env=env, cwd=tmp, check=True, capture_output=True, text=True)  # fmt: skip
                res = json.loads(out.stdout.strip().splitlines()[-1])
                walls.setdefault((label, side), []).append(res.pop("sec"))
                cpus.setdefault((label, side), []).append(res.pop("cpu"))
                numbers[(label, side)] = res
    print(
        f"command: python benchmarks/bench_fit.py --old {old} --repeats {repeats} --compare-bootstrap {n_boot}"
    )
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load average at the end {os.getloadavg()[0]:.1f} (load inflates wall time; CPU time less)")  # fmt: skip
    print(f"\n{'case':<52} {'side':<4} {'wall med':>9} {'min-max':>12} {'cpu med':>8} {'min-max':>12}")
    for key, ws in walls.items():
        cs = cpus[key]
        print(f"{key[0]:<52} {key[1]:<4} {np.median(ws):>9.2f} {min(ws):>5.2f}-{max(ws):<6.2f} "
              f"{np.median(cs):>8.2f} {min(cs):>5.2f}-{max(cs):<6.2f}")  # fmt: skip
    print("\nnumbers (old vs new):")
    for label in dict.fromkeys(k[0] for k in numbers):
        print(f"  {label}:\n    old {numbers[(label, 'old')]}\n    new {numbers[(label, 'new')]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--starts", type=int, default=500)
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-naive", action="store_true", help="skip the slow naive row")
    ap.add_argument("--old", type=Path, default=None, help="another checkout to time side by side")
    ap.add_argument(
        "--compare-bootstrap", type=int, default=200, help="resamples of the side-by-side comparison"
    )
    ap.add_argument("--side-by-side-only", action="store_true", help="only the side-by-side table")
    args = ap.parse_args()
    if args.old is not None:
        side_by_side(args.old, args.repeats, args.compare_bootstrap)
        if args.side_by_side_only:
            return

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
