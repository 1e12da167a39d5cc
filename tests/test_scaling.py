"""Tests of looped_hf.scaling: the fitter, its uncertainty, its input checks and its CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import fixture_path
from scipy.optimize import check_grad

from looped_hf.scaling import (
    ScalingLawFit,
    compare_fits,
    fit_scaling_law,
    law,
    load_chinchilla_svg,
    load_runs,
)
from looped_hf.scaling.cli import main as cli_main
from looped_hf.scaling.diagnose import compute_optimal, parameters_at_bound, size_family
from looped_hf.scaling.fit import _law_data, rebootstrap
from looped_hf.scaling.optimize import (
    batched_descent,
    multistart,
    polish,
    random_starts,
    single_threaded_blas,
)
from looped_hf.scaling.profile import huber_lr_scale, profile_interval
from looped_hf.scaling.resample import cell_groups, refit_many, resample_problems
from looped_hf.scaling.synthetic import BUDGETS, TINY_V0, TRUE_PARAMS, design_runs, sample_truth, study_runs

REPO = Path(__file__).resolve().parents[1]
#: Epoch AI's extraction of Chinchilla's figure (tests/fixtures/chinchilla/PROVENANCE.md).
CHINCHILLA_CSV = fixture_path("chinchilla", "chinchilla_svg_extracted.csv")

# Besiroglu et al. 2024 (arXiv:2404.10102), Table 1: refit of Chinchilla Approach 3.
EPOCH = {"E": 1.817, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658}
EPOCH_CI = {
    "E": (1.769, 1.871),
    "A": (285, 744),
    "B": (1042, 5810),
    "alpha": (0.317, 0.373),
    "beta": (0.331, 0.415),
}

def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chinchilla_rows() -> list[dict]:
    return load_chinchilla_svg(CHINCHILLA_CSV)


@pytest.fixture(scope="module")
def chinchilla_fit(chinchilla_rows: list[dict]) -> ScalingLawFit:
    # Epoch resample points (not cells): "run" bootstrap, 200 resamples (they used 4000).
    return fit_scaling_law(chinchilla_rows, bootstrap=200, seed=0, bootstrap_method="run")


@pytest.fixture(scope="module")
def synthetic_fit() -> ScalingLawFit:
    return fit_scaling_law(study_runs(seed=0), bootstrap=40, seed=0)


@pytest.fixture(scope="module")
def weak_runs() -> list[dict]:
    """The v0.1 tiny demo's design (every width far above the optimum) under a law from its prior."""
    return design_runs(TINY_V0, sample_truth(TINY_V0, np.random.default_rng(0)), seed=0)


@pytest.fixture(scope="module")
def weak_fit(weak_runs: list[dict]) -> ScalingLawFit:
    return fit_scaling_law(weak_runs, bootstrap=40, seed=0)


# ----------------------------------------------------------------------------- the math
def test_analytic_gradient_matches_finite_differences() -> None:
    runs = load_runs(study_runs(seed=3))
    data = _law_data(runs, phi_identifiable=True)
    rng = np.random.default_rng(0)
    weights = rng.integers(0, 3, size=data.n).astype(float)
    points = [
        np.array([6.2, 0.35, 7.6, 0.37, 0.6, 0.46]),  # near the truth: Huber's quadratic part active
        np.array([4.0, 0.20, 9.0, 0.50, 0.2, -0.8]),  # far: linear part, negative phi
        np.array([12.0, 0.9, 3.0, 0.1, 1.2, 2.2]),
    ]
    for theta in points:
        for w in (None, weights):

            def f(x, w=w):
                return float(law.objective(x[None], data, w)[0][0])

            def g(x, w=w):
                return law.objective(x[None], data, w)[1][0]

            err = check_grad(f, g, theta, epsilon=1e-7)
            assert err <= 1e-5 * max(1.0, float(np.linalg.norm(g(theta)))), (theta, err)
            # The single-start fast path used by the L-BFGS-B polish is the same function.
            f1, g1 = law.objective_single(theta, data, w)
            assert f1 == pytest.approx(f(theta), rel=1e-12)
            np.testing.assert_allclose(g1, g(theta), rtol=1e-10, atol=1e-14)


def test_objective_is_a_sum_not_a_mean() -> None:
    # Doubling every run's weight doubles the objective (a mean would leave it unchanged).
    data = _law_data(load_runs(study_runs(seed=0)), phi_identifiable=True)
    theta = np.array([[6.0, 0.3, 7.0, 0.3, 0.5, 0.4]])
    f1 = law.objective(theta, data)[0][0]
    f2 = law.objective(theta, data, np.full(data.n, 2.0))[0][0]
    assert f2 == pytest.approx(2 * f1)


# ----------------------------------------------------------------------------- reference data
def test_chinchilla_refit_reproduces_besiroglu_point_estimate(chinchilla_fit: ScalingLawFit) -> None:
    p = chinchilla_fit.params
    assert len(chinchilla_fit.residuals) == 240
    assert chinchilla_fit.kind == "plain" and p["phi"] is None
    for name in ("E", "alpha", "beta"):
        assert p[name] == pytest.approx(EPOCH[name], rel=0.01), name
    for name in ("A", "B"):
        assert p[name] == pytest.approx(EPOCH[name], rel=0.05), name


def test_chinchilla_bootstrap_intervals_close_to_besiroglu(chinchilla_fit: ScalingLawFit) -> None:
    ci = chinchilla_fit.ci
    for name in ("E", "alpha", "beta"):
        lo, hi = EPOCH_CI[name]
        assert ci[name][0] == pytest.approx(lo, abs=0.015), name
        assert ci[name][1] == pytest.approx(hi, abs=0.015), name
    for name in ("A", "B"):
        lo, hi = EPOCH_CI[name]
        assert ci[name][0] == pytest.approx(lo, rel=0.2), name
        assert ci[name][1] == pytest.approx(hi, rel=0.2), name


def test_screening_finds_the_exhaustive_optimum(
    chinchilla_rows: list[dict], chinchilla_fit: ScalingLawFit
) -> None:
    # Polishing 4x more of the 4500 grid starts must not find a better optimum.
    wide = fit_scaling_law(chinchilla_rows, n_polish=128, checks=False)
    assert wide.objective >= chinchilla_fit.objective * (1 - 1e-9)
    assert wide.params["alpha"] == pytest.approx(chinchilla_fit.params["alpha"], rel=1e-4)


def test_fit_accepts_a_dataframe_with_params_tokens_loss(chinchilla_rows: list[dict]) -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(chinchilla_rows)[["params", "tokens", "loss"]]
    fit = fit_scaling_law(df, checks=False)
    assert fit.params["E"] == pytest.approx(EPOCH["E"], rel=0.01)


# ----------------------------------------------------------------------------- synthetic recovery
def test_noise_free_study_design_recovers_every_parameter() -> None:
    fit = fit_scaling_law(study_runs(noise=0.0, seed=0), checks=False)
    for name, true in TRUE_PARAMS.items():
        assert fit.params[name] == pytest.approx(true, rel=2e-3), name
    assert fit.r2 > 0.99999


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_phi_recovered_within_003_at_half_percent_noise(seed: int) -> None:
    fit = fit_scaling_law(study_runs(noise=0.005, seed=seed), seed=seed, checks=False)
    assert abs(fit.params["phi"] - TRUE_PARAMS["phi"]) < 0.03


def test_bootstrap_interval_and_restricted_fits(synthetic_fit: ScalingLawFit) -> None:
    lo, hi = synthetic_fit.ci["phi"]
    assert lo < synthetic_fit.params["phi"] < hi
    assert lo < TRUE_PARAMS["phi"] < hi
    assert synthetic_fit.settings["bootstrap_method_used"] == "cell"
    # The data were made with phi = 0.46: both restricted fits must be clearly worse.
    for key in ("phi=0", "phi=1"):
        res = synthetic_fit.restricted[key]
        assert res["r2"] < synthetic_fit.r2 - 0.005
        assert res["objective"] > 2 * synthetic_fit.objective
    assert synthetic_fit.holdout is not None
    assert synthetic_fit.holdout["mean_abs_rel_error"] < 0.01


def test_bootstrap_is_reproducible_with_a_seed() -> None:
    runs = study_runs(seed=4)
    a = fit_scaling_law(runs, bootstrap=5, seed=7, checks=False)
    b = fit_scaling_law(runs, bootstrap=5, seed=7, checks=False)
    c = fit_scaling_law(runs, bootstrap=5, seed=8, checks=False)
    np.testing.assert_array_equal(a.bootstrap_samples, b.bootstrap_samples)
    assert not np.array_equal(a.bootstrap_samples, c.bootstrap_samples)


def test_cell_bootstrap_falls_back_to_runs_without_budget_and_says_so() -> None:
    rows = [{k: v for k, v in r.items() if k != "budget"} for r in study_runs(seed=0)]
    fit = fit_scaling_law(rows, bootstrap=3, checks=False)
    assert fit.settings["bootstrap_method_used"] == "run"
    assert any("budget" in n for n in fit.notes)


def test_fix_phi_holds_phi() -> None:
    fit = fit_scaling_law(study_runs(seed=0), fix_phi=1.0, checks=False)
    assert fit.params["phi"] == 1.0 and fit.fixed_phi == 1.0
    free = fit_scaling_law(study_runs(seed=0), checks=False)
    assert fit.objective > free.objective


# ----------------------------------------------------------------------------- identifiability
def test_many_failed_resamples_make_the_verdict_rest_on_the_profile(synthetic_fit: ScalingLawFit) -> None:
    """Failed resample fits are not evidence: past 5% dropped, the bootstrap interval stops
    counting, and a narrow profile interval still identifies phi (a wide bootstrap would not)."""
    from looped_hf.scaling.diagnose import verdict

    d = synthetic_fit.diagnostics
    wide = dataclasses.replace(
        synthetic_fit, ci={**synthetic_fit.ci, "phi": (0.05, 0.95)},
        bootstrap_checks={"n": 20, "refitted": 3, "dropped": 3},
    )  # fmt: skip
    v = verdict(wide, d["budgets"], d["at_bound"], d["profile"])
    assert v["identified"] is True and "3 of 20 bootstrap resamples failed to fit" in v["line"]
    assert any("trust the profile interval" in r for r in v["reasons"])
    # One dropped resample: the bootstrap's fits count, but a 0.9-wide interval around a narrow
    # profile reaches far beyond it (a flat direction): the intervals disagree, and the verdict
    # says so and follows the profile (the rule the comparison of a probe follows too).
    kept = dataclasses.replace(wide, bootstrap_checks={"n": 20, "refitted": 1, "dropped": 1})
    v = verdict(kept, d["budgets"], d["at_bound"], d["profile"])
    assert v["identified"] is True and "intervals disagree; the profile one is trusted" in v["line"]
    assert any("reaches far beyond the profile interval" in r for r in v["reasons"])
    # A profile as wide as the box's middle and a narrow bootstrap that passed its checks: the
    # bootstrap is trusted (it keeps the cell correlation), and the disagreement is said.
    loose = {**d["profile"], "interval": [-0.2, 0.9]}
    v = verdict(synthetic_fit, d["budgets"], d["at_bound"], loose)
    assert v["identified"] is True and "the bootstrap one is trusted" in v["line"]
    assert any("profile [-0.2, 0.9]: does not measure phi" in r for r in v["reasons"])
    no_profile = verdict(wide, d["budgets"], d["at_bound"], None)
    assert no_profile["identified"] is False and "no interval for phi" in no_profile["line"]


def test_all_r1_runs_make_phi_not_identifiable() -> None:
    rows = study_runs(seed=0, recurrences=(1,))
    fit = fit_scaling_law(rows, checks=False)
    assert fit.params["phi"] is None and not fit.phi_identifiable
    assert "not identifiable" in fit.report()
    with pytest.raises(ValueError, match="not identifiable"):
        fit.effective_params(n_once=1e8, n_rec=1e8, num_recurrences=4)
    # The Chinchilla form on N = n_once + n_rec: predictions still work.
    assert np.isfinite(fit.predict(tokens=1e10, n_once=1e8, n_rec=0.0))


def test_zero_n_rec_makes_phi_not_identifiable() -> None:
    rows = study_runs(seed=0)
    for r in rows:
        r["n_once"], r["n_rec"] = r["n_once"] + r["n_rec"], 0.0
    fit = fit_scaling_law(rows, checks=False)
    assert fit.params["phi"] is None
    assert any("not identifiable" in n for n in fit.notes)


def test_one_budget_warns() -> None:
    rows = [r for r in study_runs(seed=0) if r["budget"] == 1e19]
    with pytest.warns(UserWarning, match="one compute budget"):
        fit_scaling_law(rows, checks=False)


def test_several_budgets_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit_scaling_law(study_runs(seed=0), checks=False)


# ----------------------------------------------------------------------------- bad input
def _bad(rows: list[dict], i: int, **change) -> list[dict]:
    rows = [dict(r) for r in rows]
    for k, v in change.items():
        if v is KeyError:
            del rows[i][k]
        else:
            rows[i][k] = v
    return rows


@pytest.mark.parametrize(
    ("change", "column"),
    [
        ({"loss": float("nan")}, "loss"),
        ({"loss": float("inf")}, "loss"),
        ({"tokens": 0}, "tokens"),
        ({"loss": -1.0}, "loss"),
        ({"n_rec": -5.0}, "n_rec"),
        ({"num_recurrences": 0}, "num_recurrences"),
        ({"n_once": KeyError}, "n_once"),
        ({"tokens": "many"}, "tokens"),
    ],
)
def test_bad_values_name_the_line_and_the_column(tmp_path: Path, change: dict, column: str) -> None:
    path = write_jsonl(tmp_path / "results.jsonl", _bad(study_runs(seed=0), 6, **change))
    with pytest.raises(ValueError, match=rf"line 7: column '{column}'"):
        fit_scaling_law(path)


def test_dataframe_errors_name_the_index() -> None:
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame(_bad(study_runs(seed=0), 3, loss=float("nan")), index=range(100, 216))
    with pytest.raises(ValueError, match=r"index 103: column 'loss'"):
        fit_scaling_law(df)


def test_list_errors_name_the_row() -> None:
    with pytest.raises(ValueError, match=r"row 5: column 'tokens'"):
        fit_scaling_law(_bad(study_runs(seed=0), 5, tokens=-3.0))


def test_csv_errors_name_the_file_line(tmp_path: Path) -> None:
    rows = study_runs(seed=0)
    cols = ["loss", "tokens", "n_once", "n_rec", "num_recurrences", "budget"]
    lines = [",".join(cols)] + [",".join(str(r[c]) for c in cols) for r in rows]
    lines[10] = lines[10].replace(str(rows[9]["loss"]), "nan", 1)  # data row 9 is file line 11
    path = tmp_path / "runs.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"line 11: column 'loss'"):
        fit_scaling_law(path)


def test_missing_model_columns_are_named() -> None:
    with pytest.raises(ValueError, match=r"'n_once', 'n_rec', 'num_recurrences'.*'params'"):
        fit_scaling_law([{"loss": 3.0, "tokens": 1e9}] * 10)


def test_duplicate_runs_are_rejected_naming_both_rows() -> None:
    rows = study_runs(seed=0)
    rows.append(dict(rows[2]))
    with pytest.raises(ValueError, match=r"row 116: duplicate run: same 'n_once'.*'tokens'.*as row 2"):
        fit_scaling_law(rows)


def test_fewer_runs_than_parameters_is_an_error() -> None:
    with pytest.raises(ValueError, match="5 run.*6 free parameters"):
        fit_scaling_law(study_runs(seed=0)[5:10])  # five r = 2 runs: phi is free


def test_failed_runs_are_ignored_with_a_note() -> None:
    rows = study_runs(seed=0)
    rows[4] = {**rows[4], "status": "failed", "loss": None}
    fit = fit_scaling_law(rows, checks=False)
    assert len(fit.residuals) == 115
    assert "row 4" in fit.report() and "status" in fit.report()


def test_mixed_variants_need_a_choice() -> None:
    rows = study_runs(seed=0, variant="base") + study_runs(seed=1, variant="hyperconnection")
    with pytest.raises(ValueError, match=r"mix variants \['base', 'hyperconnection'\].*variant="):
        fit_scaling_law(rows)
    fit = fit_scaling_law(rows, variant="hyperconnection", checks=False)
    assert len(fit.residuals) == 116
    with pytest.raises(ValueError, match="no runs with variant 'truncated_bptt'"):
        fit_scaling_law(rows, variant="truncated_bptt")


def test_invalid_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="bootstrap_method"):
        fit_scaling_law(study_runs(seed=0), bootstrap_method="block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fix_phi needs looped runs"):
        fit_scaling_law(
            [{"params": 1e8 * (i + 1), "tokens": 1e9 * (i + 1), "loss": 3.0 + 0.01 * i} for i in range(8)], fix_phi=1.0
        )


# ----------------------------------------------------------------------------- the result object
def test_predict_and_effective_params_follow_the_law(synthetic_fit: ScalingLawFit) -> None:
    p = synthetic_fit.params
    n_eff = synthetic_fit.effective_params(n_once=1e8, n_rec=3e8, num_recurrences=4)
    assert n_eff == pytest.approx(1e8 + 4 ** p["phi"] * 3e8)
    loss = synthetic_fit.predict(tokens=2e9, n_once=1e8, n_rec=3e8, num_recurrences=4)
    assert loss == pytest.approx(p["E"] + p["A"] * n_eff ** -p["alpha"] + p["B"] * 2e9 ** -p["beta"])
    # A plain model of size N_eff is the same prediction.
    assert synthetic_fit.predict(tokens=2e9, params=n_eff) == pytest.approx(loss)
    # The stored residuals are log L - log(predict) on the runs.
    runs = synthetic_fit.runs
    pred = synthetic_fit.predict(
        tokens=runs.tokens, n_once=runs.n_once, n_rec=runs.n_rec, num_recurrences=runs.num_recurrences
    )
    np.testing.assert_allclose(np.log(runs.loss) - np.log(pred), synthetic_fit.residuals, atol=1e-12)
    eq = synthetic_fit.equivalence(1e8, 3e8, 4)
    assert eq["unique"] == 4e8 and eq["performs_like"] == pytest.approx(n_eff) and eq["costs_like"] == 1.3e9


def test_report_contains_the_studys_sentence(synthetic_fit: ScalingLawFit) -> None:
    text = synthetic_fit.report()
    assert "at r = 4 a looped model of" in text and "performs like a non-looped model of" in text
    assert "phi=0" in text and "phi=1" in text and "leave-one-budget-out" in text


def test_json_round_trip(tmp_path: Path, synthetic_fit: ScalingLawFit) -> None:
    path = tmp_path / "fit.json"
    text = synthetic_fit.to_json(path)
    assert json.loads(path.read_text()) == json.loads(text)
    for back in (ScalingLawFit.from_json(text), ScalingLawFit.from_json(path)):
        assert back.params == synthetic_fit.params
        assert back.ci == synthetic_fit.ci
        np.testing.assert_array_equal(back.residuals, synthetic_fit.residuals)
        np.testing.assert_array_equal(back.bootstrap_samples, synthetic_fit.bootstrap_samples)
        assert back.runs.labels == synthetic_fit.runs.labels
        np.testing.assert_array_equal(back.runs.loss, synthetic_fit.runs.loss)
        assert back.predict(tokens=1e9, params=1e8) == synthetic_fit.predict(tokens=1e9, params=1e8)
        assert back.report() == synthetic_fit.report()


# ----------------------------------------------------------------------------- comparing sweeps
def test_compare_detects_a_higher_phi() -> None:
    probe_law = {**TRUE_PARAMS, "phi": 0.65}
    cmp = compare_fits(study_runs(seed=10), study_runs(seed=11, params=probe_law), bootstrap=20, seed=0)
    assert cmp.delta_phi == pytest.approx(0.19, abs=0.04)
    assert cmp.ci[0] > 0.0 and cmp.ci[0] < cmp.delta_phi < cmp.ci[1]
    assert "delta phi" in cmp.report()


def test_compare_of_two_samples_of_one_law_includes_zero() -> None:
    cmp = compare_fits(study_runs(seed=12), study_runs(seed=13), bootstrap=20, seed=0)
    assert cmp.ci[0] < 0.0 < cmp.ci[1]


# ----------------------------------------------------------------------------- CLI and plots
def _png_is_nontrivial(path: Path) -> bool:
    from matplotlib.image import imread

    img = imread(path)
    return path.stat().st_size > 10_000 and img.shape[0] > 200 and float(img[..., :3].std()) > 0.05


def test_cli_writes_fit_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = write_jsonl(tmp_path / "results.jsonl", study_runs(seed=0))
    out, plots = tmp_path / "fit.json", tmp_path / "plots"
    rc = cli_main([str(results), "--bootstrap", "20", "--out", str(out), "--plots", str(plots)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "verdict: phi is identified" in printed and "IsoFLOP placement" in printed
    fit = ScalingLawFit.from_json(out)
    assert abs(fit.params["phi"] - TRUE_PARAMS["phi"]) < 0.03 and "phi" in fit.ci
    names = sorted(p.name for p in plots.iterdir())
    assert names == [
        "isoflop.png",
        "loss_vs_flops.png",
        "phi_bootstrap.png",
        "phi_profile.png",
        "residuals.png",
    ]
    assert all(_png_is_nontrivial(plots / n) for n in names)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_cli_compare_reports_the_phi_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write_jsonl(tmp_path / "base.jsonl", study_runs(seed=20))
    probe = write_jsonl(tmp_path / "probe.jsonl", study_runs(seed=21, params={**TRUE_PARAMS, "phi": 0.38}))
    out = tmp_path / "fit.json"
    rc = cli_main([str(base), "--compare", str(probe), "--bootstrap", "20", "--out", str(out)])
    assert rc == 0
    assert "delta phi (probe - base)" in capsys.readouterr().out
    obj = json.loads(out.read_text())
    assert obj["comparison"]["delta_phi"] == pytest.approx(-0.08, abs=0.04)


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _bad(study_runs(seed=0), 11, loss=float("nan"))
    results = write_jsonl(tmp_path / "results.jsonl", rows)
    out, plots = tmp_path / "fit.json", tmp_path / "plots"
    rc = cli_main([str(results), "--out", str(out), "--plots", str(plots)])
    assert rc == 2
    assert "line 12: column 'loss'" in capsys.readouterr().err
    assert not out.exists() and not plots.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def test_plot_functions_return_their_paths(tmp_path: Path, synthetic_fit: ScalingLawFit) -> None:
    from looped_hf import plotting

    p = plotting.plot_loss_vs_flops(synthetic_fit, tmp_path / "a" / "loss.png")
    assert p == tmp_path / "a" / "loss.png" and _png_is_nontrivial(p)
    no_boot = fit_scaling_law(study_runs(seed=0), checks=False)  # no bootstrap, so no profile either
    with pytest.raises(ValueError, match="no bootstrap"):
        plotting.plot_phi_bootstrap(no_boot, tmp_path / "h.png")
    with pytest.raises(ValueError, match="no profile of phi"):
        plotting.plot_phi_profile(no_boot, tmp_path / "p.png")
    assert [q.name for q in plotting.plot_fit(no_boot, tmp_path / "b")] == [
        "isoflop.png",
        "loss_vs_flops.png",
        "residuals.png",
    ]
    for name in ("isoflop.png", "phi_profile.png"):
        q = getattr(plotting, f"plot_{name[:-4]}")(synthetic_fit, tmp_path / name)
        assert q == tmp_path / name and _png_is_nontrivial(q)
    no_budget = fit_scaling_law([{k: v for k, v in r.items() if k != "budget"} for r in study_runs(seed=0)])
    with pytest.raises(ValueError, match="'budget' column"):
        plotting.plot_isoflop(no_budget, tmp_path / "i.png")


def test_scaling_imports_neither_torch_nor_matplotlib_and_plotting_no_pyplot() -> None:
    # A stub parent package keeps the package root (which may import transformers by design)
    # out of the measurement: what is checked is what looped_hf.scaling and .plotting pull in.
    # The fit is numeric: plotting depends on it, never the other way round.
    code = (
        "import sys, types; pkg = types.ModuleType('looped_hf'); pkg.__path__ = [sys.argv[1]];"
        "sys.modules['looped_hf'] = pkg;"
        "import looped_hf.scaling, looped_hf.scaling.cli;"
        "print([m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]);"
        "import looped_hf.plotting;"
        "print([m for m in ('torch', 'transformers', 'matplotlib.pyplot') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "looped_hf")], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["[]", "[]"]


def test_cli_mixed_variants_exit_2_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = study_runs(seed=0, variant="base") + study_runs(seed=1, variant="truncated_bptt")
    results = write_jsonl(tmp_path / "results.jsonl", rows)
    out = tmp_path / "fit.json"
    assert cli_main([str(results), "--out", str(out)]) == 2
    assert "--variant" in capsys.readouterr().err and not out.exists()


# ----------------------------------------------------------------------------- the batched multistart
def test_batched_descent_lowers_every_row_and_reaches_the_lbfgsb_optimum() -> None:
    data = _law_data(load_runs(study_runs(seed=1)), phi_identifiable=True)
    starts = random_starts(np.random.default_rng(0), 64, {})
    free = np.ones(6, bool)
    theta, f = batched_descent(data, starts, free)
    f0 = law.objective(np.clip(starts, *np.array(law.BOUNDS).T), data)[0]
    assert np.all(f <= f0)  # only steps that lower the objective are taken
    lo, hi = np.array(law.BOUNDS).T
    assert np.all((theta >= lo) & (theta <= hi))
    with single_threaded_blas():  # L-BFGS-B's tiny BLAS calls crawl with a thread pool on a busy machine
        best, _, _ = multistart(data, starts, free, n_polish=64, polish_all=True)  # every start, L-BFGS-B
        polished = polish(theta[np.argmin(f)], data, None, free)
    assert polished.fun == pytest.approx(best.fun, rel=1e-6)
    assert polished.theta[5] == pytest.approx(best.theta[5], abs=1e-3)


def test_batched_descent_keeps_held_coordinates_and_per_row_weights() -> None:
    data = _law_data(load_runs(study_runs(seed=1)), phi_identifiable=True)
    starts = random_starts(np.random.default_rng(1), 6, {5: 0.3})
    weights = np.random.default_rng(2).integers(0, 3, size=(6, data.n)).astype(float)
    theta, f = batched_descent(data, starts, np.array([True] * 5 + [False]), weights)
    assert np.all(theta[:, 5] == 0.3)
    for row in range(6):  # each row's objective is its own weighted one
        assert f[row] == pytest.approx(law.objective(theta[row][None], data, weights[row])[0][0], rel=1e-12)


def test_bootstrap_resamples_reach_the_exhaustive_multistart_optimum(weak_runs: list[dict]) -> None:
    # The honest-bootstrap property: each resample is fitted to its own global optimum, not left
    # near the point estimate. Reference: 500 screened starts, 48 polished with L-BFGS-B, per resample.
    runs = load_runs(weak_runs)
    data = _law_data(runs, phi_identifiable=True)
    free = np.ones(6, bool)
    groups = cell_groups(runs.budget, runs.num_recurrences)
    with single_threaded_blas():
        point, _, _ = multistart(data, random_starts(np.random.default_rng(0), 500, {}), free, n_polish=32)
        problems = resample_problems("cell", 4, np.random.default_rng(3), data, point.theta, groups, 6)
        thetas, funs = refit_many(data, problems, point.theta, free, np.random.default_rng(4))
        for b in range(problems.n):
            w = problems.weights[b]
            starts = random_starts(np.random.default_rng(10 + b), 500, {})
            ref, _, _ = multistart(data, starts, free, w, n_polish=32, polish_all=True)
            assert funs[b] <= ref.fun * (1 + 1e-6), b
            assert funs[b] == pytest.approx(law.objective(thetas[b][None], data, w)[0][0], rel=1e-9)


def test_residual_bootstrap_keeps_the_design_and_redraws_the_losses() -> None:
    runs = load_runs(study_runs(seed=2))
    data = _law_data(runs, phi_identifiable=True)
    theta = fit_scaling_law(runs, checks=False).theta
    problems = resample_problems("residual", 5, np.random.default_rng(0), data, theta, None, 6)
    assert problems.weights is None and problems.log_l.shape == (5, data.n)
    pred = law.predict_log_loss(theta, data)[0]
    res = data.log_l - pred
    scaled = (res - res.mean()) * np.sqrt(data.n / (data.n - 6))
    for row in problems.log_l:  # every redrawn residual is one of the scaled, centred residuals
        assert np.all(np.isin(np.round(row - pred, 12), np.round(scaled, 12)))


def test_rebootstrap_keeps_the_point_fit_and_changes_the_method(synthetic_fit: ScalingLawFit) -> None:
    again = rebootstrap(synthetic_fit, 20, bootstrap_method="residual", seed=1)
    assert again.params == synthetic_fit.params and again.profile is synthetic_fit.profile
    assert again.settings["bootstrap_method_used"] == "residual" and len(again.bootstrap_samples) == 20
    lo, hi = again.ci["phi"]
    assert lo < TRUE_PARAMS["phi"] < hi
    assert synthetic_fit.settings["bootstrap_method_used"] == "cell"  # the original is untouched
    with pytest.raises(ValueError, match="bootstrap_method must be one of"):
        rebootstrap(synthetic_fit, 5, bootstrap_method="block")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bootstrap_starts must be >= 1, got 0"):
        fit_scaling_law(study_runs(seed=0), bootstrap=2, bootstrap_starts=0)


# ----------------------------------------------------------------------------- the phi profile
def test_huber_lr_scale_has_the_least_squares_and_least_absolute_limits() -> None:
    rng = np.random.default_rng(0)
    z = rng.standard_normal(100_000)
    n_free = 6
    # Residuals far inside delta: the Huber loss is least squares and kappa = s^2.
    tiny = 1e-5 * z
    s2 = float(np.sum(tiny**2)) / (tiny.size - n_free)
    assert huber_lr_scale(tiny, n_free) == pytest.approx(s2, rel=1e-6)
    # Residuals far outside delta: least absolute deviations and kappa = delta s sqrt(pi / 2).
    wide = 1.0 * z
    s = np.sqrt(float(np.sum(wide**2)) / (wide.size - n_free))
    assert huber_lr_scale(wide, n_free) == pytest.approx(law.HUBER_DELTA * s * np.sqrt(np.pi / 2), rel=1e-3)


def test_profile_interval_interpolates_its_ends_and_reports_open_ones() -> None:
    phi = np.linspace(-3, 3, 61)
    lr = 4.0 * (phi - 0.5) ** 2 / 0.04  # LR = cut at phi = 0.5 +- 0.2 (cut 4)
    lo, hi = profile_interval(phi, lr, 4.0, 0.5)
    assert lo == pytest.approx(0.3, abs=0.01) and hi == pytest.approx(0.7, abs=0.01)
    flat_left = np.where(phi < 0.5, 0.0, lr)
    assert profile_interval(phi, flat_left, 4.0, 0.5) == (None, pytest.approx(0.7, abs=0.01))
    # A second basin under the cut further out belongs to the confidence set: the hull is reported.
    second = np.where(np.abs(phi - 2.0) < 0.15, 1.0, lr)
    assert profile_interval(phi, second, 4.0, 0.5) == (
        pytest.approx(0.3, abs=0.01),
        pytest.approx(2.15, abs=0.06),
    )


def test_profile_is_zero_at_the_estimate_and_brackets_the_truth(synthetic_fit: ScalingLawFit) -> None:
    prof = synthetic_fit.profile
    assert prof is not None
    i = int(np.argmin(np.abs(prof.phi - synthetic_fit.params["phi"])))
    assert prof.lr[i] == pytest.approx(0.0, abs=1e-6) and np.all(prof.lr >= -1e-9)
    lo, hi = prof.interval
    assert lo < TRUE_PARAMS["phi"] < hi and hi - lo < 0.2
    # Held fixed at phi = 0 and 1 the profile is the restricted fits' objective (or better).
    for value in (0.0, 1.0):
        j = int(np.argmin(np.abs(prof.phi - value)))
        assert prof.phi[j] == pytest.approx(value)
        assert prof.objective[j] <= synthetic_fit.restricted[f"phi={value:g}"]["objective"] * (1 + 1e-6)


# ----------------------------------------------------------------------------- identifiability
def test_study_design_is_identified_with_interior_isoflop_minima(synthetic_fit: ScalingLawFit) -> None:
    d = synthetic_fit.diagnostics
    assert d["verdict"]["identified"] is True
    assert d["verdict"]["line"].startswith("phi is identified: 0.4")
    assert d["at_bound"] == []
    positions = [p["position"] for row in d["budgets"] for p in row["per_r"]]
    assert positions.count("interior") >= 0.9 * len(positions)
    assert {row["budget"] for row in d["budgets"]} == set(BUDGETS)
    for row in d["budgets"]:  # the widths bracket 20 tokens per parameter
        assert row["tokens_per_param"][0] < 20 < row["tokens_per_param"][1]
    text = synthetic_fit.report()
    assert "verdict: phi is identified" in text and "profile-likelihood interval" in text


def test_weak_design_is_not_identified_and_says_to_add_smaller_widths(weak_fit: ScalingLawFit) -> None:
    d = weak_fit.diagnostics
    v = d["verdict"]
    assert v["identified"] is False
    assert "are all above the compute-optimal size: add smaller widths" in v["line"]
    for row in d["budgets"]:
        assert [p["position"] for p in row["per_r"]] == ["smallest"] * 4
        assert all(p["optimal_vs_widths"] == "below" for p in row["per_r"])
        assert row["tokens_per_param"][1] < 2  # far under any compute-optimal ratio
    assert sum("widths of budget" in r for r in v["reasons"]) == 3
    report = weak_fit.report()
    assert "phi is NOT identified" in report and "IsoFLOP placement" in report and "smallest" in report


def test_widths_below_the_optimum_say_to_add_larger_widths() -> None:
    runs = study_runs(seed=5, budgets=BUDGETS[2:], width_factors=(0.25, 0.35, 0.5))
    fit = fit_scaling_law(runs, checks=False)
    fit.diagnostics = __import__("looped_hf.scaling.diagnose", fromlist=["diagnose"]).diagnose(fit)
    for row in fit.diagnostics["budgets"]:
        assert [p["position"] for p in row["per_r"]].count("largest") >= 3
    assert "are all below the compute-optimal size: add larger widths" in fit.diagnostics["verdict"]["line"]


def test_parameters_on_a_bound_are_named_in_natural_units() -> None:
    theta = np.array([6.0, 0.3, 7.0, 2.5, -3.0, 0.4])  # beta on its upper bound, log E on its lower
    found = parameters_at_bound(theta)
    assert [(b["name"], b["side"]) for b in found] == [("beta", "upper"), ("E", "lower")]
    assert found[1]["value"] == pytest.approx(np.exp(-3.0)) and "log E = -3" in found[1]["text"]
    assert parameters_at_bound(theta, free=np.array([True, True, True, False, False, True])) == []


def test_size_family_reproduces_the_runs_flops_with_head_and_attention() -> None:
    runs = load_runs(design_runs(TINY_V0, sample_truth(TINY_V0, np.random.default_rng(1)), seed=1))
    for r in (1, 2, 8):
        fam = size_family(runs, r)
        m = runs.num_recurrences == r
        np.testing.assert_allclose(
            fam.flops_per_token(runs.params[m]), runs.flops[m] / runs.tokens[m], rtol=0.01
        )
        assert fam.c_d > 0  # the head and attention grow with the width, not with N


def test_compute_optimal_matches_chinchillas_closed_form() -> None:
    # With FLOPs = 6 N D the optimum is N* = G (C / 6)^(beta / (alpha + beta)), G = (alpha A / (beta B))^(1/(a+b)).
    p = {k: TRUE_PARAMS[k] for k in ("E", "A", "alpha", "B", "beta")} | {"phi": None}
    rows = [
        {"params": n, "tokens": 1e21 / (6 * n), "loss": 2.0, "train_flops": 1e21} for n in (1e9, 3e9, 1e10)
    ]
    fam = size_family(load_runs(rows), 1.0)
    assert fam.c_n == pytest.approx(6.0) and fam.c_d == pytest.approx(0.0, abs=1e-9)
    a, b = p["alpha"], p["beta"]
    for budget in (1e20, 1e22):
        expect = (a * p["A"] / (b * p["B"])) ** (1 / (a + b)) * (budget / 6) ** (b / (a + b))
        opt = compute_optimal(p, fam, budget, 1e6, 1e13)
        assert opt["n"] == pytest.approx(expect, rel=0.03) and opt["edge"] is None


def test_diagnostics_and_profile_survive_the_json_round_trip(weak_fit: ScalingLawFit) -> None:
    back = ScalingLawFit.from_json(weak_fit.to_json())
    assert back.diagnostics == json.loads(json.dumps(weak_fit.diagnostics))
    np.testing.assert_array_equal(back.profile.phi, weak_fit.profile.phi)
    np.testing.assert_array_equal(back.profile.objective, weak_fit.profile.objective)
    assert back.profile.interval == weak_fit.profile.interval
    assert back.report() == weak_fit.report()


def test_coverage_script_scores_every_interval_of_one_dataset() -> None:
    # scripts/validate_phi_coverage.py is validation, not a test; this keeps it runnable.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "validate_phi_coverage", REPO / "scripts" / "validate_phi_coverage.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.one(("tiny_v0", 7, 10, ("cell", "residual")))
    assert set(out["intervals"]) == {"profile", "cell", "residual"}
    assert out["truth"] == sample_truth(TINY_V0, np.random.default_rng(7))
    for iv in out["intervals"].values():
        assert law.BOUNDS[5][0] <= iv["lo"] <= iv["hi"] <= law.BOUNDS[5][1]
    lines = mod.summarise([out], ["profile", "cell", "residual"])
    assert lines[0].split()[:2] == ["interval", "coverage"] and len(lines) == 4


def test_effective_params_is_one_function_for_fit_plan_and_plots(synthetic_fit: ScalingLawFit) -> None:
    from looped_hf.scaling.law import NATURAL_NAMES, PHI, effective_params

    assert effective_params(10.0, 4.0, 4, 0.5) == pytest.approx(18.0)  # 10 + 4^0.5 * 4
    assert effective_params(10.0, 4.0, 4, None) == pytest.approx(14.0)  # a plain fit: every parameter once
    grid = effective_params(np.array([[1.0, 2.0]]), np.array([[1.0, 1.0]]), 4.0, np.array([[0.0], [1.0]]))
    np.testing.assert_allclose(grid, [[2.0, 3.0], [5.0, 6.0]])  # parameter sets x widths
    phi = synthetic_fit.params["phi"]
    assert synthetic_fit.effective_params(1e6, 2e6, 4) == pytest.approx(1e6 + 4**phi * 2e6)
    assert NATURAL_NAMES[PHI] == "phi"
    if synthetic_fit.bootstrap_samples is not None:
        lo, hi = synthetic_fit.ci["phi"]
        draws = synthetic_fit.bootstrap_samples[:, PHI]
        assert lo <= np.median(draws) <= hi
