"""Probe comparisons whose intervals mean something: every resample fit checked, delta phi with a
joint-fit profile interval, on synthetic probes shaped like the study's truncated-backprop probe
(base at phi 0.46 on the 116-run design; probe at phi 0.35, 4 budgets, r in {2, 4, 8}, 8 runs
missing; loss noise 0.0004-0.002 nats)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from looped_hf.scaling import compare_fits, fit_scaling_law, load_runs
from looped_hf.scaling.fit import _free_mask, _law_data
from looped_hf.scaling.law import BOUNDS
from looped_hf.scaling.profile import PhiProfile, delta_profile
from looped_hf.scaling.resample import Problems, RefitStatus, fit_failures, refit_checked
from looped_hf.scaling.synthetic import TRUE_PARAMS, base_runs_nats, probe_runs

PROBE_PHI = 0.35
TRUE_DELTA = PROBE_PHI - TRUE_PARAMS["phi"]


def _sweeps(seed: int, noise: float) -> tuple[list[dict], list[dict]]:
    return base_runs_nats(seed=seed, noise_nats=noise), probe_runs(seed=seed, phi=PROBE_PHI, noise_nats=noise)


def test_probe_design_is_shaped_like_the_studys() -> None:
    runs = probe_runs(seed=3)
    r = np.array([x["num_recurrences"] for x in runs])
    budgets = {x["budget"] for x in runs}
    assert set(r) == {2, 4, 8} and len(budgets) == 4
    assert len(runs) == 72 - 8  # 8 of the design's runs missing
    # Different seeds drop different runs: the missing ones are not a fixed pattern.
    other = probe_runs(seed=4)
    key = lambda xs: {(x["budget"], x["num_recurrences"], x["hidden_size"]) for x in xs}  # noqa: E731
    assert key(runs) != key(other)


def test_fit_failures_flags_a_bound_a_worse_optimum_and_an_unconverged_fit() -> None:
    runs = load_runs(base_runs_nats(seed=0, noise_nats=0.001))
    data = _law_data(runs, True)
    fit = fit_scaling_law(runs, checks=False, n_starts=100, n_polish=4)
    good = fit.theta
    at_bound = good.copy()
    at_bound[5] = BOUNDS[5][0]  # phi = -3
    off = good.copy()
    off[0] += 0.5  # far from the optimum: a large gradient
    thetas = np.stack([good, at_bound, off])
    problems = Problems(3)
    funs = np.array([fit.objective, fit.objective, fit.objective])
    # The warm start reached a lower objective than the second and third "answers".
    f_warm = np.array([fit.objective, 0.5 * fit.objective, 0.5 * fit.objective])
    failed, why = fit_failures(data, problems, thetas, funs, f_warm, _free_mask(True))
    assert failed.tolist() == [False, True, True]
    assert why["at a bound"].tolist() == [False, True, False]
    assert why["worse than a warm start"].tolist() == [False, True, True]
    assert why["not converged"][2] and not why["not converged"][0]


def test_refit_checked_drops_a_resample_whose_optimum_is_on_a_bound() -> None:
    runs = load_runs(base_runs_nats(seed=1, noise_nats=0.001))
    data = _law_data(runs, True)
    fit = fit_scaling_law(runs, checks=False, n_starts=100, n_polish=4)
    # Problem 1: the runs' own losses (fits fine). Problem 2: losses of a law whose floor E = 0.01
    # lies below the box (log E >= -3): its best fit sits on that bound, from any start.
    low_e = {**TRUE_PARAMS, "E": 0.01}
    n_eff = runs.n_once + runs.num_recurrences ** low_e["phi"] * runs.n_rec
    y2 = np.log(
        low_e["E"] + low_e["A"] * n_eff ** -low_e["alpha"] + low_e["B"] * runs.tokens ** -low_e["beta"]
    )
    problems = Problems(2, log_l=np.stack([data.log_l, y2]))
    thetas, funs, status = refit_checked(
        data, problems, fit.theta, _free_mask(True), np.random.default_rng(0)
    )
    assert status.refitted == 1 and status.reasons["at a bound"] == 1
    assert status.failed.tolist() == [False, True]
    assert thetas[1, 4] == pytest.approx(BOUNDS[4][0])  # log E on its lower bound
    np.testing.assert_allclose(funs[0], fit.objective, rtol=1e-6)
    assert "1 of 2 resamples failed to fit (at a bound: 1) and were refitted" in status.summary()
    assert "1 still failed and was dropped" in status.summary()
    back = RefitStatus.from_dict(json.loads(json.dumps(status.to_dict())))
    assert back.refitted == 1 and back.failed.tolist() == [False, True]


def test_delta_profile_combines_two_profiles_exactly() -> None:
    """Two quadratic profiles: the joint LR of delta is quadratic with the summed variance."""
    grid = np.linspace(-3, 3, 601)

    def prof(center: float, sd: float) -> PhiProfile:
        obj = 0.5 * ((grid - center) / sd) ** 2  # kappa = 1: LR = 2 f
        return PhiProfile(grid, obj, 0.0, 1.0, 3.9, (None, None))

    d = delta_profile(prof(0.46, 0.03), prof(0.35, 0.04), n_runs=10_000, n_free=12)
    half = np.sqrt(d.cut) * np.hypot(0.03, 0.04)
    assert d.estimate == pytest.approx(-0.11, abs=2e-3)
    assert d.interval[0] == pytest.approx(-0.11 - half, abs=3e-3)
    assert d.interval[1] == pytest.approx(-0.11 + half, abs=3e-3)


def _check_comparison(seed: int, noise: float, n_boot: int) -> tuple[bool, bool, list[float]]:
    base, probe = _sweeps(seed, noise)
    fb = fit_scaling_law(base, seed=seed, checks=False)
    c = compare_fits(fb, probe, bootstrap=n_boot, seed=seed)
    assert c.profile is not None and c.checks is not None
    lo, hi = c.ci
    plo, phi_ = c.profile.interval
    assert plo is not None and phi_ is not None
    ends = [lo, hi, plo, phi_, c.base.params["phi"] - 0.0, c.probe.params["phi"] - 0.0]
    return lo <= TRUE_DELTA <= hi, plo <= TRUE_DELTA <= phi_, [lo - TRUE_DELTA, hi - TRUE_DELTA,
                                                              plo - TRUE_DELTA, phi_ - TRUE_DELTA, *ends[4:]]  # fmt: skip


@pytest.mark.parametrize(("seed", "noise"), [(0, 0.0004), pytest.param(1, 0.002, marks=pytest.mark.slow)])
def test_probe_comparison_reports_both_intervals_checks_and_a_verdict(seed: int, noise: float) -> None:
    base, probe = _sweeps(seed, noise)
    fb = fit_scaling_law(base, seed=seed, checks=False)
    c = compare_fits(fb, probe, bootstrap=12, seed=seed)
    text = c.report()
    assert "95% bootstrap CI" in text and "95% profile-likelihood CI" in text
    assert "resamples (pairs of fits)" in text  # the fit-check line
    assert text.splitlines()[-1].startswith("verdict: decides: delta phi < 0")
    obj = json.loads(json.dumps(c.to_dict()))
    assert obj["bootstrap_checks"]["n"] == 12
    assert obj["n_bootstrap"] == 12 - obj["bootstrap_checks"]["dropped"]
    assert obj["verdict"]["sign"] == -1 and obj["verdict"]["decides"] is True
    # The probe fit made here carries the paired draws and their checks into its own JSON.
    assert c.probe.bootstrap_checks is not None and c.probe.bootstrap_checks["n"] == 12
    # The joint-fit profile interval covers the true delta; no endpoint is far from it.
    lo, hi = obj["profile"]["interval"]
    assert lo < TRUE_DELTA < hi
    assert max(abs(x - TRUE_DELTA) for x in (lo, hi, *c.ci)) < 0.5


@pytest.mark.slow
def test_probe_comparison_coverage_over_seeded_truths() -> None:
    """Coverage >= 90% for delta phi over 20 seeded sweeps (noise 0.0004-0.002 nats), and no
    reported endpoint more than 0.5 from the truth."""
    covered_boot, covered_prof, worst = 0, 0, 0.0
    seeds = range(20)
    for seed in seeds:
        noise = float(np.random.default_rng(seed).uniform(0.0004, 0.002))
        boot_ok, prof_ok, errs = _check_comparison(100 + seed, noise, 200)
        covered_boot += boot_ok
        covered_prof += prof_ok
        worst = max(worst, *(abs(e) for e in errs[:4]))
    print(f"delta phi coverage over {len(seeds)} seeded sweeps: bootstrap {covered_boot}, profile {covered_prof}; "
          f"largest endpoint error {worst:.3f}")  # fmt: skip
    assert covered_boot >= 0.9 * len(seeds), covered_boot
    assert covered_prof >= 0.9 * len(seeds), covered_prof
    assert worst < 0.5, worst


def _verdict(ci: tuple[float, float], prof: tuple[float | None, float | None], dropped: int = 0) -> dict:
    from types import SimpleNamespace

    from looped_hf.scaling.compare import comparison_verdict
    from looped_hf.scaling.profile import DeltaProfile

    failed = np.zeros(200, bool)
    failed[:dropped] = True
    checks = RefitStatus(dropped, failed, {"at a bound": dropped})
    profile = DeltaProfile(np.zeros(1), np.zeros(1), 3.9, -0.1, prof)
    return comparison_verdict(SimpleNamespace(ci=ci, profile=profile, checks=checks))  # type: ignore[arg-type]


def test_verdict_trusts_the_profile_over_a_bootstrap_dragged_by_degenerate_resamples() -> None:
    # The study's truncated probe as first reported: bootstrap [-2.327, +0.194], profile ~[-0.16, -0.01].
    v = _verdict((-2.327, 0.194), (-0.16, -0.01))
    assert v["trusted"] == "profile" and v["decides"] and v["sign"] == -1
    assert "reaches far beyond the profile interval" in v["line"]
    v = _verdict((-0.2, 0.01), (-0.16, -0.01), dropped=20)  # 10% of resamples dropped
    assert v["trusted"] == "profile" and "dropped 10% of its resamples" in v["line"]


def test_verdict_trusts_a_clean_bootstrap_and_says_when_nothing_is_decided() -> None:
    v = _verdict((-0.12, -0.08), (-0.13, 0.01))
    assert v["trusted"] == "bootstrap" and v["sign"] == -1 and v["line"].startswith("decides: delta phi < 0")
    v = _verdict((-0.05, 0.04), (-0.06, 0.05))
    assert v["trusted"] == "both" and not v["decides"] and v["line"].startswith("does not decide")
    v = _verdict((0.05, 0.3), (0.04, 0.28))
    assert v["trusted"] == "both" and v["sign"] == 1
