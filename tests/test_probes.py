"""The study's probe sweeps: a probe without r = 1 runs is fitted with the base's r = 1 runs,
compared with a paired bootstrap, and the recipes' written workflow runs as written."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from looped_hf.scaling import compare_fits, fit_scaling_law, load_runs
from looped_hf.scaling.cli import main as fit_cli
from looped_hf.scaling.compare import _match_rows, _paired_units
from looped_hf.scaling.fit import ScalingLawFit
from looped_hf.scaling.law import LawData
from looped_hf.scaling.resample import paired_resample_problems
from looped_hf.scaling.runs import share_base_r1
from looped_hf.scaling.synthetic import TRUE_PARAMS, study_runs
from looped_hf.sweep.results import append_jsonl

REPO = Path(__file__).resolve().parents[1]
PROBE_PHI = 0.35
# The study's probe figure shows four budgets: they keep these tests fast.
BUDGETS = (4.64e17, 1.0e18, 2.15e18, 4.64e18)


def _base(seed: int = 0) -> list[dict]:
    return study_runs(seed=seed, variant="base", budgets=BUDGETS)


def _probe(seed: int = 1, variant: str = "truncated") -> list[dict]:
    """A truncated-backprop probe of known phi, without r = 1 runs (as the study's)."""
    return study_runs(params={**TRUE_PARAMS, "phi": PROBE_PHI}, seed=seed, recurrences=(2, 4, 8),
                      budgets=BUDGETS, variant=variant, truncated=variant == "truncated")  # fmt: skip


def _r1(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["num_recurrences"] == 1]


N_R1 = len(_r1(_base()))  # 19: five widths per budget, four at the last
SHARED = f"r = 1 runs shared from the base ({N_R1} runs)"


# ----------------------------------------------------------------------------- loading
def test_base_r1_rows_plus_a_probe_load_as_the_studys_probe_sweep() -> None:
    runs = load_runs(_r1(_base()) + _probe())
    assert len(runs) == N_R1 + 3 * N_R1 and runs.n_shared == N_R1 and runs.variant == "truncated"
    assert np.all(runs.non_looped[runs.shared]) and not runs.non_looped[~runs.shared].any()
    assert any(SHARED in note for note in runs.notes)
    # The same from a file holding both whole sweeps, with the probe chosen by name.
    both = load_runs(_base() + _probe(), variant="truncated")
    assert both.n_shared == N_R1 and len(both) == 4 * N_R1
    np.testing.assert_array_equal(np.sort(both.loss), np.sort(runs.loss))


def test_variants_that_are_not_the_probe_layout_still_refuse_to_mix() -> None:
    # A looped base run in the file: two sweeps, not a probe with shared r = 1 runs.
    with pytest.raises(ValueError, match="mix variants"):
        load_runs(_base() + _probe())
    # A probe with r = 1 runs of its own shares nothing.
    own = study_runs(
        params={**TRUE_PARAMS, "phi": PROBE_PHI}, seed=2, variant="hyperconnection", budgets=BUDGETS
    )
    with pytest.raises(ValueError, match="mix variants"):
        load_runs(_r1(_base()) + own)
    assert load_runs(_base() + own, variant="hyperconnection").shared is None
    # Two probes and the base's r = 1 runs: which probe is meant must be said.
    with pytest.raises(ValueError, match="mix variants"):
        load_runs(_r1(_base()) + _probe(variant="truncated") + _probe(seed=3, variant="hyperconnection"))


def test_share_base_r1_refuses_what_it_cannot_share() -> None:
    probe, base = load_runs(_probe()), load_runs(_base())
    with pytest.raises(ValueError, match="r = 1 run\\(s\\) of its own"):
        share_base_r1(base, base)
    with pytest.raises(ValueError, match="no r = 1 run to share"):
        share_base_r1(probe, load_runs(_probe(seed=4)))


# ----------------------------------------------------------------------------- single fits
def test_a_fit_without_r1_runs_says_what_is_identified() -> None:
    alone = fit_scaling_law(_probe(), checks=False)
    verdict = alone.diagnostics["verdict"]
    assert verdict["r1_anchor"] is False and "No r = 1 run" in verdict["line"]
    assert any(n.startswith("no r = 1 run") and "--compare" in n for n in alone.notes)
    shared = fit_scaling_law(_r1(_base()) + _probe(), checks=False)
    assert shared.diagnostics["verdict"].get("r1_anchor", True) is True
    assert "No r = 1 run" not in shared.diagnostics["verdict"]["line"]
    assert any(SHARED in n for n in shared.notes) and SHARED in shared.report()


@pytest.mark.slow
def test_an_identified_phi_without_r1_runs_is_called_relative() -> None:
    verdict = fit_scaling_law(_probe()).diagnostics["verdict"]  # with the profile: an interval
    assert verdict["identified"] and "phi is identified among the r > 1 runs only" in verdict["line"]


def test_shared_rows_survive_the_json_round_trip() -> None:
    fit = fit_scaling_law(_r1(_base()) + _probe(), checks=False)
    back = ScalingLawFit.from_json(fit.to_json())
    assert back.runs is not None and back.runs.n_shared == N_R1
    np.testing.assert_array_equal(back.runs.shared, fit.runs.shared)
    assert back.report() == fit.report()


# ----------------------------------------------------------------------------- comparison
@pytest.mark.slow
def test_compare_fits_a_probe_without_r1_runs_with_the_bases() -> None:
    base, probe = _base(), _probe()
    cmp = compare_fits(base, probe, bootstrap=24, seed=0)
    assert cmp.shared_r1 == N_R1 and cmp.probe.runs.n_shared == N_R1
    # The probe's phi is the fit of (base r = 1 runs + probe runs), as a user gets from the file.
    by_hand = fit_scaling_law(_r1(base) + probe, seed=1, checks=False)
    assert cmp.probe.params["phi"] == pytest.approx(by_hand.params["phi"], abs=1e-6)
    true_delta = PROBE_PHI - TRUE_PARAMS["phi"]
    assert cmp.delta_phi == pytest.approx(true_delta, abs=0.03)
    assert cmp.ci[0] < true_delta < cmp.ci[1] < 0.0
    text = cmp.report()
    assert SHARED in text and "paired cell resamples" in text and "excludes 0" in text
    assert cmp.to_dict()["shared_r1"] == N_R1 and cmp.to_dict()["paired"] is True
    # Fits made here carry the marginal of the paired draws as their bootstrap.
    assert cmp.probe.settings["bootstrap_method_used"] == "paired cell"
    assert cmp.probe.ci["phi"][0] < cmp.probe.params["phi"] < cmp.probe.ci["phi"][1]
    # A probe fit made without the r = 1 runs is refitted, not compared as it is.
    alone = fit_scaling_law(probe, bootstrap=2, checks=False)
    again = compare_fits(base, alone, bootstrap=4, seed=0)
    assert again.shared_r1 == N_R1 and again.probe.params["phi"] == pytest.approx(
        by_hand.params["phi"], abs=1e-6
    )


@pytest.mark.slow
def test_probe_with_its_own_r1_runs_stays_an_independent_comparison() -> None:
    own = study_runs(params={**TRUE_PARAMS, "phi": 0.65}, seed=5, budgets=BUDGETS)
    cmp = compare_fits(_base(), own, bootstrap=6, seed=0)
    assert cmp.shared_r1 == 0 and "independent" in cmp.report() and "shared" not in cmp.report()


def _paired_setup(method: str) -> tuple[np.ndarray, ...]:
    base = load_runs(_base())
    probe = share_base_r1(load_runs(_probe()), base)
    match = _match_rows(base, probe)
    units_b, units_p, used = _paired_units(base, probe, match, method)
    assert used == method
    return base, probe, match, units_b, units_p


def test_paired_cell_bootstrap_draws_a_shared_cell_once_for_both_fits() -> None:
    base, probe, match, units_b, units_p = _paired_setup("cell")
    assert (
        (match >= 0).sum() == N_R1 and np.all(match[probe.shared] >= 0) and np.all(match[~probe.shared] < 0)
    )
    # 16 base cells + 12 probe cells, the 4 shared r = 1 cells counted once.
    assert len(np.unique(np.r_[units_b, units_p])) == 16 + 12
    theta = np.zeros(6)
    data = LawData(np.ones(1), np.ones(1), np.zeros(1), np.ones(1), np.zeros(1))  # unused by cell draws
    pb, pp = paired_resample_problems("cell", 50, np.random.default_rng(0), data, data, theta, theta,
                                      units_b, units_p, match, 6)  # fmt: skip
    shared = np.flatnonzero(match >= 0)
    np.testing.assert_array_equal(pp.weights[:, shared], pb.weights[:, match[shared]])
    # Runs of one cell share its count; the probe's own cells vary independently of the base's.
    assert pb.weights.sum(axis=1).std() > 0 and not np.array_equal(pp.weights[:, ~probe.shared][:, 0],
                                                                    pb.weights[:, ~base.non_looped][:, 0])  # fmt: skip


def test_paired_residual_bootstrap_gives_a_shared_run_one_loss() -> None:
    from looped_hf.scaling.fit import _law_data

    base, probe, match, _, _ = _paired_setup("run")
    fb = fit_scaling_law(base, checks=False)
    fp = fit_scaling_law(probe, checks=False)
    pb, pp = paired_resample_problems("residual", 10, np.random.default_rng(1), _law_data(base, True),
                                      _law_data(probe, True), fb.theta, fp.theta, None, None, match, 6)  # fmt: skip
    shared = np.flatnonzero(match >= 0)
    np.testing.assert_array_equal(pp.log_l[:, shared], pb.log_l[:, match[shared]])
    assert not np.allclose(pp.log_l[:, ~probe.shared], np.log(probe.loss[~probe.shared]))


# ----------------------------------------------------------------------------- CLI and recipes
def test_cli_compare_of_a_probe_without_r1_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, probe = tmp_path / "base.jsonl", tmp_path / "probe.jsonl"
    for path, rows in ((base, _base()), (probe, _probe())):
        for row in rows:
            append_jsonl(path, row, unique_key=None)
    out = tmp_path / "fit.json"
    assert fit_cli([str(base), "--compare", str(probe), "--bootstrap", "6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert SHARED in printed and "paired cell resamples" in printed
    import json

    cmp = json.loads(out.read_text())["comparison"]
    assert cmp["shared_r1"] == N_R1 and cmp["probe"]["runs"]["records"][0]["variant"] == "base"


def _workflow(recipe: Path) -> list[str]:
    """The shell commands of a recipe's comment block (``#   looped-hf ...`` / ``#   grep ...``)."""
    lines = [m.group(1) for m in re.finditer(r"^#   (\S.*)$", recipe.read_text(), re.M)]
    assert lines, f"{recipe.name}: no workflow commands in its comments"
    return lines


@pytest.mark.slow  # two fits and a compare with a small bootstrap: 10-16 s on a busy 2-core machine
@pytest.mark.parametrize(
    ("recipe", "variant"),
    [
        ("iso_depth_paper_truncated.yaml", "truncated"),
        ("iso_depth_paper_hyperconnection.yaml", "hyperconnection"),
    ],
)
def test_probe_recipe_workflow_runs_as_written(
    recipe: str, variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe's comment: concatenate the base's r = 1 rows and the probe's results, fit.
    Results files are written as the sweep runner writes them (append_jsonl, one record per
    run, arch 'base' for r = 1); the planning step (`sweep --dry-run`) is not rerun here."""
    commands = _workflow(REPO / "recipes" / recipe)
    stem = Path(recipe).stem
    for name, rows in (("iso_depth_paper", _base()), (stem, _probe(variant=variant))):
        for row in rows:
            append_jsonl(tmp_path / "runs" / name / "results.jsonl", row, unique_key=None)
    fitted = False
    for command in commands:
        if command.startswith("looped-hf sweep"):
            continue
        if command.startswith("looped-hf fit"):
            argv = shlex.split(command)[2:]
            # As written, but fewer bootstrap resamples (the number does not change the workflow).
            argv = [("4" if prev == "--bootstrap" else a) for prev, a in zip(["", *argv], argv)]
            argv = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]
            assert fit_cli(argv) == 0, capsys.readouterr().err
            fitted = True
        else:
            subprocess.run(["bash", "-c", command], cwd=tmp_path, check=True)
    assert fitted
    printed = capsys.readouterr().out
    assert SHARED in printed and "phi is identified" in printed
    assert "delta phi (probe - base)" in printed and "paired cell resamples" in printed
    phi = float(re.search(r"^phi\s+(\S+)", printed, re.M).group(1))
    assert phi == pytest.approx(PROBE_PHI, abs=0.05)


# ----------------------------------------------------------------------------- the study's figure
def test_study_isoflop_curves_find_the_laws_minimum() -> None:
    from looped_hf.plotting import _isoflop_curve
    from looped_hf.scaling.diagnose import compute_optimal, size_family

    fit = fit_scaling_law(study_runs(seed=0, noise=0.0, budgets=BUDGETS), checks=False)
    runs = fit.runs
    for budget in BUDGETS[:3]:
        for r in (1.0, 4.0):
            m = (runs.budget == budget) & (runs.num_recurrences == r)
            grid, loss, (n_star, l_star) = _isoflop_curve(fit, runs, budget, r, m, "parabola")
            assert n_star == grid[np.argmin(loss)] or l_star <= loss.min() + 1e-9
            opt = compute_optimal(fit.params, size_family(runs, r), budget, 1e6, 1e10)
            assert n_star == pytest.approx(opt["n"], rel=0.3) and l_star == pytest.approx(
                opt["loss"], abs=0.01
            )
            _, _, (n_law, _) = _isoflop_curve(fit, runs, budget, r, m, "law")
            assert n_law == pytest.approx(opt["n"], rel=0.02)


def test_sweep_card_draws_the_study_figure_with_a_panel_per_variant(tmp_path: Path) -> None:
    from matplotlib.image import imread

    from looped_hf.cards import write_sweep_card

    sweep = tmp_path / "sweep"
    for row in _base():
        append_jsonl(sweep / "results.jsonl", row, unique_key=None)
    base = fit_scaling_law(sweep / "results.jsonl", checks=False)
    probe = fit_scaling_law(_r1(_base()) + _probe(), checks=False)
    card = write_sweep_card(sweep, base, tmp_path / "card", isoflop_style="study",
                            compare={"truncated backprop": probe})  # fmt: skip
    text = card.read_text()
    assert "IsoFLOP curves as the study draws them" in text and "one panel per variant" in text
    img = imread(card.parent / "plots" / "isoflop.png")
    assert img.shape[1] > 1.8 * img.shape[0] and float(img[..., :3].std()) > 0.05  # two panels side by side
    with pytest.raises(ValueError, match="isoflop_style='study'"):
        write_sweep_card(sweep, base, tmp_path / "card2", compare={"truncated backprop": probe})
    with pytest.raises(ValueError, match="isoflop_style must be one of"):
        write_sweep_card(sweep, base, tmp_path / "card3", isoflop_style="paper")


# ----------------------------------------------------------------------------- one rule for "identified"
def test_the_trust_rule_on_intervals() -> None:
    from looped_hf.scaling.trust import phi_measured, sign_of, trusted_interval

    narrow = (0.30, 0.40)
    # Agreement: both, whichever question is asked.
    assert trusted_interval(narrow, (0.28, 0.41), phi_measured).trusted == "both"
    # A bootstrap 0.95 wide around a 0.1-wide profile runs along a flat direction: the profile.
    wild = trusted_interval(narrow, (-0.2, 0.75), phi_measured)
    assert (wild.answer, wild.trusted) == (True, "profile") and "flat direction" in wild.why
    assert "profile [0.3, 0.4]: True; bootstrap [-0.2, 0.75]: False" in wild.disagree
    # The same bootstrap beside a wide profile passed its checks: it is trusted.
    loose = trusted_interval((-0.3, 0.9), (0.2, 0.5), phi_measured)
    assert (loose.answer, loose.trusted) == (True, "bootstrap")
    # Too many failed resample fits: the profile, and a lone bootstrap is not trusted at all.
    dropped = trusted_interval((0.1, 0.2), (-0.1, 0.3), sign_of, n_resamples=20, n_dropped=2)
    assert (dropped.answer, dropped.trusted) == (1, "profile") and "10%" in dropped.why
    alone = trusted_interval(None, (0.1, 0.3), sign_of, n_resamples=20, n_dropped=2)
    assert (alone.answer, alone.trusted) == (None, "none")
    assert trusted_interval(None, (0.1, 0.3), sign_of, n_resamples=20, n_dropped=1).answer == 1
    # Open ends: a box-clipped interval measures nothing and decides only on its closed side.
    assert not phi_measured((None, 0.3)) and sign_of((None, -0.1)) == -1 and sign_of((None, 0.1)) == 0


def test_fit_report_and_comparison_judge_the_truncated_probe_by_one_rule() -> None:
    """The issue's case on the study's truncated-backprop probe: a 0.95-wide bootstrap of phi
    around a narrow profile. The probe's own verdict and the comparison name the same trusted
    interval, and the fit report says that the two intervals disagree."""
    import dataclasses
    from types import SimpleNamespace

    from looped_hf.scaling.compare import comparison_verdict
    from looped_hf.scaling.diagnose import diagnose

    probe = fit_scaling_law(_r1(_base()) + _probe(), seed=0)  # checks on: the profile of phi
    prof = probe.diagnostics["profile"]["interval"]
    assert prof[1] - prof[0] < 0.2 and probe.diagnostics["verdict"]["identified"]
    phi = probe.params["phi"]
    wide = dataclasses.replace(probe, ci={**probe.ci, "phi": (phi - 0.5, phi + 0.45)},
                               bootstrap_checks={"n": 40, "refitted": 0, "dropped": 0})  # fmt: skip
    v = diagnose(wide)["verdict"]
    assert v["identified"] is True
    assert "the profile and bootstrap intervals disagree; the profile one is trusted" in v["line"]
    assert any("does not measure phi" in r and "flat direction" in r for r in v["reasons"])
    assert "intervals disagree" in dataclasses.replace(wide, diagnostics=diagnose(wide)).report()
    # The comparison of the same probe: a delta bootstrap as wide, a joint profile below 0.
    fake = SimpleNamespace(ci=(-0.55, 0.40), profile=SimpleNamespace(interval=(-0.14, -0.05)), checks=None)
    c = comparison_verdict(fake)
    assert c["trusted"] == "profile" and c["line"].startswith("decides: delta phi < 0")
    assert "the intervals disagree; the profile interval is trusted" in c["line"]


# ----------------------------------------------------------------------------- published designs
# recipes/iso_depth_tiny_sandwich.yaml (Huginn's sandwich block) and iso_depth_tiny_ouro.yaml (Ouro's
# normed whole-stack loop with its exit gate): what the sweep plans for each, counted by hand.
V, T = 258, 64  # byte tokens (256 + 2 specials), seq_len 64


def _tiny_plan(name: str):
    from looped_hf.sweep.plan import make_plan

    return {run.run_id: run for run in make_plan(REPO / "recipes" / f"{name}.yaml").runs}


def _layer(d: int, norms: int) -> int:
    """One decoder layer of the tiny recipes: q, k, v, o (d x d each, no bias, parameter-free
    QK-norm), the squared-ReLU MLP (d -> 4d -> d) and `norms` RMSNorm scales of width d."""
    return 4 * d * d + 8 * d * d + norms * d


@pytest.mark.usefixtures("one_torch_thread")
def test_probe_plans_count_each_designs_parameters_and_flops_by_hand() -> None:
    """`looped-hf sweep RECIPE --dry-run`'s n_once / n_rec / FLOPs per token for d = 12, r = 2,
    written out from the design (heads of 4: h * q = d)."""
    d, attention = 12, 12 * 12 * T  # 12 h q T per layer application with gradient
    base = _tiny_plan("iso_depth_tiny")["loop2-w12-b0"]  # P/K/C 1/4/1, linear injection, pre-norm
    sandwich = _tiny_plan("iso_depth_tiny_sandwich")["loop2-w12-b0"]
    ouro = _tiny_plan("iso_depth_tiny_ouro")
    # Base: prelude + coda layers and three model-level norms (embedding, recurrence, final) once;
    # the block and the d x 2d injection per recurrence.
    assert (base.n_once, base.n_rec) == (2 * _layer(d, 2) + 3 * d, 4 * _layer(d, 2) + 2 * d * d)
    # Sandwich: the same model with two more norm scales in every layer, counted where it sits.
    assert (sandwich.n_once, sandwich.n_rec) == (2 * _layer(d, 4) + 3 * d, 4 * _layer(d, 4) + 2 * d * d)
    assert (sandwich.num_prelude_layers, sandwich.num_recurrent_layers, sandwich.num_coda_layers) == (1, 4, 1)
    # The FLOPs: the study's 6N with the layers' norm scales counted as the study does (model-level
    # norms are not), the head once, attention over P + C + r K applications.
    assert sandwich.flops_per_token == 6 * (2 * _layer(d, 4) + V * d) + 6 * 2 * sandwich.n_rec + attention * (1 + 1 + 2 * 4)
    assert sandwich.flops_per_token - base.flops_per_token == 6 * (2 + 2 * 4) * 2 * d
    # Ouro, r = 2: no prelude or coda (the iso-depth layout with prelude = coda = 0), four norms a
    # layer, the gate (d weights + bias) in N_rec; N_once is the final norm alone, which also closes
    # every loop (one tensor). Training with Ouro's loss reads every step's logits: the head runs r
    # times; the gate runs r - 1 times (the last step takes the remainder).
    loop2 = ouro["loop2-w12-b0"]
    assert (loop2.num_prelude_layers, loop2.num_recurrent_layers, loop2.num_coda_layers) == (0, 4, 0)
    assert loop2.input_injection == "none"
    assert (loop2.n_once, loop2.n_rec) == (d, 4 * _layer(d, 4) + d + 1)
    assert loop2.flops_per_token == 6 * 2 * V * d + 6 * 2 * loop2.n_rec - 6 * (d + 1) + attention * 2 * 4
    # r = 1 (the plain decoder of the sweep, with Ouro's norms and gate): the gate never runs.
    one = ouro["base-w12-b0"]
    assert (one.n_once, one.n_rec) == (d, 8 * _layer(d, 4) + d + 1)
    assert one.flops_per_token == 6 * V * d + 6 * 8 * _layer(d, 4) + attention * 8


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("name", "run_id"), [("iso_depth_tiny_sandwich", "base-w8-b0"),
                                              ("iso_depth_tiny_ouro", "loop2-w8-b0"),
                                              ("iso_depth_tiny_ouro", "loop4-w8-b0")])  # fmt: skip
def test_probe_flop_formula_counts_what_runs(name: str, run_id: str) -> None:
    """The planned FLOPs per token against torch's FlopCounterMode over one training step of the
    run's own model (eager attention: its matmuls are counted at full T, as the formula).
    The counter sees matmuls only; the formula also counts the layers' norm scales as 6N (the
    study's convention) and the gate's bias: that, and nothing else, is the difference. Designs
    without the linear injection (the model computes its W_e e part once; the study counts it r
    times)."""
    from torch.utils.flop_counter import FlopCounterMode

    from looped_hf import LoopedForCausalLM
    from looped_hf.arguments import parse_recipe

    run = _tiny_plan(name)[run_id]
    model_args, data_args, _ = parse_recipe({k: v for k, v in run.recipe.items()})
    config = model_args.to_config(V, data_args.seq_len)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LoopedForCausalLM(config).train()
    ids = torch.randint(0, V, (2, T))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / ids.numel()
    base, r = model.model, run.num_recurrences
    norm_scales = lambda layers: sum(p.numel() for n, p in layers.named_parameters() if "norm" in n)  # noqa: E731
    elementwise = 6 * (norm_scales(base.prelude_layers) + norm_scales(base.coda_layers)) + 6 * r * norm_scales(
        base.recurrent_layers
    )
    if base.exit_gate is not None:
        elementwise += 6 * (r - 1) * base.exit_gate.bias.numel()
    assert run.flops_per_token == measured + elementwise
    assert run.flops_per_token == model.training_flops_per_token(T)


@pytest.mark.usefixtures("one_torch_thread")
def test_probe_recipes_reach_the_model_and_ouro_is_judged_by_its_logits() -> None:
    """The sweep passes the design's fields to every run's config; the held-out loss of a model
    trained with Ouro's objective is the cross-entropy of its returned logits, not the objective."""
    from looped_hf import LoopedForCausalLM
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import heldout_loss

    def config(name: str, run_id: str):
        model_args, data_args, _ = parse_recipe(dict(_tiny_plan(name)[run_id].recipe))
        return model_args.to_config(V, data_args.seq_len)

    sandwich = config("iso_depth_tiny_sandwich", "loop4-w8-b1")
    assert sandwich.norm_placement == "sandwich" and sandwich.input_injection == "linear"
    ouro = config("iso_depth_tiny_ouro", "loop4-w8-b1")
    assert (ouro.norm_placement, ouro.recurrence_norm_weight, ouro.embedding_norm, ouro.exit_gate) == (
        "pre_and_output", "final", False, True
    )
    assert ouro.exit_gate_entropy_beta == 0.1 and ouro.num_prelude_layers == ouro.num_coda_layers == 0
    torch.manual_seed(0)
    model = LoopedForCausalLM(ouro).eval()
    ids = torch.randint(0, V, (4, T))
    with torch.no_grad():
        objective = model(input_ids=ids, labels=ids).loss
        logits = model(input_ids=ids).logits
    cross_entropy = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))
    rows = {"input_ids": ids.tolist()}

    class Blocks:
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, index: list[int]) -> dict:
            return {"input_ids": [rows["input_ids"][i] for i in index]}

    held_out, n = heldout_loss(model, Blocks(), batch_size=2)
    assert n == 4 * (T - 1)
    assert held_out == pytest.approx(cross_entropy.item(), rel=1e-6)
    assert abs(held_out - objective.item()) > 1e-3  # the objective's entropy bonus is not in it


def test_a_bad_design_value_in_a_probe_recipe_is_named() -> None:
    from looped_hf.arguments import parse_recipe
    from looped_hf.field_checks import RecipeError

    with pytest.raises(RecipeError, match="norm_placement.*'sideways'"):
        parse_recipe({"norm_placement": "sideways"})
