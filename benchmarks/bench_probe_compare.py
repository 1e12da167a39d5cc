"""delta phi of a probe sweep without r = 1 runs, before and after the study's probe fit.

A synthetic base sweep (the study's 116-run design, phi 0.46) and a synthetic truncated-backprop
probe of known phi (r in {2, 4, 8} only, as the study's probe; FLOPs per token of truncated
backprop, so more tokens per budget; the same E, A, alpha, B, beta, so that phi is the only
difference and the true delta is known). For each seed:

- before: ``compare_fits`` of an older looped_hf checkout (``--old DIR``, e.g. a
  ``git worktree add /tmp/old <commit>``), run in a subprocess: the probe fitted without any
  r = 1 run, independent bootstraps;
- after: this checkout's ``compare_fits``: the probe fitted with the base's r = 1 runs, paired
  bootstrap with every resample fit checked; and the joint-fit profile-likelihood interval of
  delta (row ``profile``), the fit-check summary and the verdict.

Prints one row per seed and whether each 95% interval covers the true delta.

    python benchmarks/bench_probe_compare.py --old /tmp/old --seeds 0 1 2 --bootstrap 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from looped_hf.scaling import compare_fits  # noqa: E402
from looped_hf.scaling.synthetic import TRUE_PARAMS, study_runs  # noqa: E402

PROBE_PHI = 0.35  # the study's truncated-backprop phi
# The truncated grid adds one wider size per budget (scaling_laws_truncbptt.sh).
PROBE_WIDTH_FACTORS = (0.55, 0.75, 1.0, 1.35, 1.8, 2.4)

_OLD_SNIPPET = """
import json, sys
from looped_hf.scaling import compare_fits
base, probe, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
c = compare_fits(base, probe, bootstrap=n, seed=seed)
print(json.dumps({"base": c.base.params["phi"], "probe": c.probe.params["phi"], "delta": c.delta_phi,
                  "ci": list(c.ci)}))
"""


def sweeps(seed: int) -> tuple[list[dict], list[dict]]:
    """The base sweep and the probe (no r = 1 runs) of one seed."""
    base = study_runs(seed=seed, variant="base")
    probe = study_runs(
        params={**TRUE_PARAMS, "phi": PROBE_PHI},
        seed=1000 + seed,
        recurrences=(2, 4, 8),
        width_factors=PROBE_WIDTH_FACTORS,
        variant="truncated",
        truncated=True,
    )
    return base, probe


def run_old(old: Path, base: Path, probe: Path, n: int, seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(old), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _OLD_SNIPPET, str(base), str(probe), str(n), str(seed)],
        env=env, capture_output=True, text=True, check=True, cwd=old,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_new(base: list[dict], probe: list[dict], n: int, seed: int) -> dict:
    c = compare_fits(base, probe, bootstrap=n, seed=seed)
    assert c.profile is not None and c.checks is not None
    return {"base": c.base.params["phi"], "probe": c.probe.params["phi"], "delta": c.delta_phi,
            "ci": list(c.ci), "shared": c.shared_r1, "profile": list(c.profile.interval),
            "checks": c.checks.summary("resamples"), "verdict": c.verdict["line"]}  # fmt: skip


def _row(name: str, r: dict, true_delta: float) -> str:
    lo, hi = r["ci"]
    cover = "yes" if lo <= true_delta <= hi else "NO"
    return (f"{name:<7} {r['base']:>7.3f} {r['probe']:>7.3f} {r['delta']:>+8.3f}  [{lo:+.3f}, {hi:+.3f}]"
            f"  {hi - lo:>6.3f}  {cover:>6}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, default=None, help="checkout of the code before (skipped if absent)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--bootstrap", type=int, default=200)
    args = p.parse_args(argv)
    true_delta = PROBE_PHI - TRUE_PARAMS["phi"]
    print(f"true phi: base {TRUE_PARAMS['phi']}, probe {PROBE_PHI}, delta {true_delta:+.3f}; "
          f"{args.bootstrap} cell-bootstrap resamples")  # fmt: skip
    head = f"{'':<7} {'phi_b':>7} {'phi_p':>7} {'delta':>8}  {'95% CI':<18}  {'width':>6}  {'covers':>6}"
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            base, probe = sweeps(seed)
            n_probe_r1 = sum(r["num_recurrences"] == 1 for r in probe)
            print(f"\nseed {seed}: base {len(base)} runs, probe {len(probe)} runs ({n_probe_r1} at r = 1)")
            print(head)
            if args.old is not None:
                paths = []
                for name, rows in (("base", base), ("probe", probe)):
                    path = Path(tmp) / f"{name}-{seed}.jsonl"
                    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
                    paths.append(path)
                t = time.perf_counter()
                old = run_old(args.old, paths[0], paths[1], args.bootstrap, seed)
                print(_row("before", old, true_delta) + f"  ({time.perf_counter() - t:.0f} s)")
            t = time.perf_counter()
            new = run_new(base, probe, args.bootstrap, seed)
            print(_row("after", new, true_delta) + f"  ({time.perf_counter() - t:.0f} s; "
                  f"{new['shared']} r = 1 runs shared from the base)")  # fmt: skip
            plo, phi_ = new["profile"]
            if plo is not None and phi_ is not None:
                print(_row("profile", {**new, "ci": [plo, phi_]}, true_delta) + "  (joint-fit profile likelihood)")
            print(f"  {new['checks']}\n  verdict: {new['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
