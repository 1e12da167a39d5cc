"""The planner: compute-optimal (width, r, tokens) from a fitted law and the model's accounting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from looped_hf.planner import (
    ArchitectureFamily,
    FamilyMember,
    Quadratic,
    family_for_fit,
    main,
    model_at,
    plan,
)
from looped_hf.scaling import ScalingLawFit

REPO = Path(__file__).resolve().parents[1]
DEMO_FIT = REPO / "model_cards" / "iso_depth_tiny" / "fit.json"
TINY = REPO / "recipes" / "iso_depth_tiny.yaml"
PAPER = REPO / "recipes" / "iso_depth_paper.yaml"
#: Chinchilla's law as Epoch AI refit it (Besiroglu et al. 2024; looped-method.md section 4).
EPOCH = {"E": 1.817, "A": 482.01, "alpha": 0.3478, "B": 2085.43, "beta": 0.3658}


def law_fit(params: dict, *, kind: str = "looped", samples: np.ndarray | None = None) -> ScalingLawFit:
    """A fit result carrying only a law (no runs): what a published law gives a planner."""
    return ScalingLawFit(
        params=dict(params), ci={}, r2=float("nan"), objective=float("nan"), residuals=np.array([]),
        kind=kind, phi_identifiable=kind == "looped", bootstrap_samples=samples,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_family() -> ArchitectureFamily:
    return ArchitectureFamily.from_recipe(TINY)


@pytest.fixture(scope="module")
def paper_family() -> ArchitectureFamily:
    return ArchitectureFamily.from_recipe(PAPER)


@pytest.fixture(scope="module")
def demo_fit() -> ScalingLawFit:
    return ScalingLawFit.from_json(DEMO_FIT)


def _fit_without_its_sweep(tmp_path: Path) -> Path:
    """The demo fit, its results file named in a folder with no sweep.yaml (after `make demo`,
    runs/iso_depth_tiny/ holds one beside the committed fit's source, so that path cannot serve)."""
    data = json.loads(DEMO_FIT.read_text())
    data["runs"]["source"] = str(tmp_path / "elsewhere" / "results.jsonl")
    path = tmp_path / "fit_without_sweep.json"
    path.write_text(json.dumps(data))
    return path


def _brute_force(params: dict, family: ArchitectureFamily, r: int, budget: float) -> tuple[int, float, float]:
    """Every width of the family up to 400 head dims x 6,000 token counts; the feasible point
    (training FLOPs <= budget) with the lowest loss of the law: (width, tokens, loss)."""
    m = family.members[r]
    widths = family.width_step * np.arange(1, 401, dtype=float)
    fpt = np.array([m.train_flops(w) for w in widths])
    tokens = np.geomspace(1e2, budget / fpt.min(), 6000)
    n_eff = np.array([m.n_once(w) + r ** params["phi"] * m.n_rec(w) for w in widths])
    loss = params["E"] + params["A"] * n_eff[:, None] ** -params["alpha"] + params["B"] * tokens[None, :] ** -params["beta"]
    loss = np.where(fpt[:, None] * tokens[None, :] <= budget, loss, np.inf)
    i, j = np.unravel_index(np.argmin(loss), loss.shape)
    return int(widths[i]), float(tokens[j]), float(loss[i, j])


@pytest.mark.parametrize("budget", [3e10, 1.2e12, 5e13])
def test_optimum_equals_brute_force_grid_search(demo_fit, tiny_family, budget):
    """For every r, the planner's width is the brute-force optimum over widths x token counts; the
    planner spends the whole budget, so its loss is at most the grid's (and within its step)."""
    p = plan(demo_fit, [budget], family=tiny_family, resamples=0)
    for r in (1, 2, 4, 8):
        width, tokens, loss = _brute_force(demo_fit.params, tiny_family, r, budget)
        e = p.entry(budget, r)
        assert e.width == width, (r, e.width, width)
        assert e.loss <= loss + 1e-12
        assert loss - e.loss < 2e-4
        assert e.tokens * e.train_flops_per_token == pytest.approx(budget, rel=1e-12)
        assert 1.0 <= e.tokens / tokens < 1.01


def test_every_resample_plans_its_own_optimum(demo_fit, tiny_family):
    """A fit whose 'resamples' are one other law: the band is that law's own optimum (another width),
    not the point estimate's model re-scored."""
    other = dict(demo_fit.params, alpha=0.9 * demo_fit.params["alpha"])
    row = [other[k] for k in ("E", "A", "alpha", "B", "beta", "phi")]
    fit = law_fit(demo_fit.params, samples=np.array([row, row]))
    budget = 1.2e12
    e = plan(fit, [budget], family=tiny_family, recurrences=[4]).entry(budget, 4)
    width, _, loss = _brute_force(other, tiny_family, 4, budget)
    assert e.loss_band == pytest.approx((loss, loss), abs=2e-4)
    assert e.width_band == (width, width) and width != e.width


def test_accounting_is_the_models_at_any_width(tiny_family):
    """N_once, N_rec and FLOPs per token at a width the family was not measured at are the model's."""
    import torch

    from looped_hf import LoopedForCausalLM
    from looped_hf.arguments import load_yaml, parse_recipe
    from looped_hf.sweep import make_plan

    data = load_yaml(TINY)
    data["sweep"] = {**data["sweep"], "budgets": [1e15], "widths": [4 * 37], "recurrences": [4],
                     "learning_rate_by_r": {4: 0.03}}  # fmt: skip
    planned = make_plan(data)
    (run,) = planned.runs
    model_args, _, _ = parse_recipe(run.recipe)
    with torch.device("meta"):
        model = LoopedForCausalLM(model_args.to_config(planned.vocab_size, planned.seq_len))
    m = tiny_family.member(4)
    assert round(m.n_once(148)) == run.n_once and round(m.n_rec(148)) == run.n_rec
    assert m.train_flops(148) == pytest.approx(run.flops_per_token, rel=1e-12)
    assert m.inference_flops(148) == pytest.approx(model.inference_flops_per_token(planned.seq_len), rel=1e-12)
    # Mean recurrences of adaptive exit: inference FLOPs are linear in r.
    assert m.inference_flops(148) - 2 * m.inference_flops_per_recurrence(148) == pytest.approx(
        model.inference_flops_per_token(planned.seq_len, 2), rel=1e-12
    )


def test_study_example_from_its_law_and_family(paper_family):
    """The study's sentence (phi = 0.46, loop4 = 2-4x4-2 of recipes/iso_depth_paper.yaml). The
    grid width nearest its "410M" is 2048 (16 heads of 128): 411.1M unique non-embedding parameters.
    The ratios to the unique count do not depend on the width (N_once : N_rec = 48 : 50 d^2), so the
    study's 410M model performs like 410M x 1.455 = 597M non-looped ("about 580M": +2.9%), and its
    non-looped iso-depth sibling (0-20x1-0, the same width and depth) has 410M x 2.449 = 1.004B
    ("1B"), at a training cost per token within 3% of the looped model's. The non-looped model of
    exactly equal training FLOPs per token is 1.037B at width 2048 (the injection adapter, 4 x 2 d^2,
    makes the loop 2.7% dearer than its sibling): the study's "costs like" is the iso-depth reading."""
    fit = law_fit({**EPOCH, "phi": 0.46})
    e = model_at(fit, 2048, 4, budget=1e20, family=paper_family)
    assert e.unique_params == pytest.approx(410e6, rel=0.003)
    assert e.performs_like == pytest.approx(598.2e6, rel=1e-3)
    assert 410e6 * e.performs_like / e.unique_params == pytest.approx(580e6, rel=0.03)
    assert 410e6 * e.same_width_nonlooped / e.unique_params == pytest.approx(1e9, rel=0.03)
    assert e.same_width_nonlooped == pytest.approx(1.007e9, rel=1e-3)
    assert e.same_width_nonlooped_flops_ratio == pytest.approx(1.0, abs=0.03)
    assert e.costs_like == pytest.approx(1.037e9, rel=0.002)
    assert paper_family.member(1).train_flops.solve(e.train_flops_per_token) > 2048
    # KV cache: 2 + 4 x 4 + 2 = 20 layer applications x K, V x 16 heads x 128 x 2 bytes; a budget of
    # one recurrence keeps 2 + 4 + 2.
    e = model_at(fit, 2048, 4, budget=1e20, family=paper_family, kv_budget=1)
    assert e.kv_bytes_per_token == 20 * 2 * 16 * 128 * 2
    assert e.kv_bytes_per_token_budget == 8 * 2 * 16 * 128 * 2


def _chinchilla_family(layers: int = 100) -> ArchitectureFamily:
    """A plain family with Chinchilla's count: N = 12 L d^2, training FLOPs exactly 6 N per token."""
    zero = Quadratic(0.0, 0.0, 0.0)
    n = Quadratic(0.0, 0.0, 12.0 * layers)
    member = FamilyMember(1, 0, layers, 0, zero, n, Quadratic(0.0, 0.0, 72.0 * layers), zero, zero, zero)
    return ArchitectureFamily(width_step=1, seq_len=1, members={1: member}, source="6N")


@pytest.mark.parametrize("budget", [1e19, 1e21, 1e23])
def test_plain_optimum_matches_chinchilla_closed_form(budget):
    """r = 1 and 6 N D FLOPs: N_opt = G (C/6)^(beta/(alpha+beta)), D_opt = G^-1 (C/6)^(alpha/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)), up to the width grid (d ~ 1e3-5e3 here)."""
    a, b = EPOCH["alpha"], EPOCH["beta"]
    G = (a * EPOCH["A"] / (b * EPOCH["B"])) ** (1 / (a + b))
    n_opt, d_opt = G * (budget / 6) ** (b / (a + b)), (budget / 6) ** (a / (a + b)) / G
    e = plan(law_fit({**EPOCH, "phi": None}, kind="plain"), [budget], family=_chinchilla_family()).entry(budget, 1)
    step = 2.0 / e.width  # relative change of N between neighbouring widths
    assert e.unique_params == pytest.approx(n_opt, rel=step)
    assert e.tokens == pytest.approx(d_opt, rel=step)


def test_lifetime_and_target_decisions(demo_fit, tiny_family):
    """With T = 0 the cheapest way to the best loss at C is C itself; with T > 0 totals are training
    + T x inference; a target below the law's floor is said to be out of reach."""
    c = 1.2e11
    p = plan(demo_fit, [c], family=tiny_family, inference_tokens=0.0)
    (life,) = p.lifetime
    assert life.best_r == p.decisions[0].best_r
    best = next(x for x in life.entries if x.r == life.best_r)
    assert best.total_flops == pytest.approx(c, rel=1e-9)
    assert all(x.total_flops >= c * (1 - 1e-9) for x in life.entries)

    p = plan(demo_fit, [c], family=tiny_family, inference_tokens=1e10, inference_recurrences={8: 3.0})
    for x in p.lifetime[0].entries:
        m = tiny_family.member(x.r)
        r_inf = 3.0 if x.r == 8 else x.r
        per_token = m.inference_flops(x.width) + (r_inf - x.r) * m.inference_flops_per_recurrence(x.width)
        assert x.inference_flops == pytest.approx(1e10 * per_token, rel=1e-9)
        assert x.total_flops == pytest.approx(x.train_flops + x.inference_flops, rel=1e-12)

    target = plan(demo_fit, [], family=tiny_family, target_loss=2.3).target
    assert target.best_r is not None and all(x.reachable for x in target.entries)
    x = target.entries[0]
    assert demo_fit.predict(tokens=x.tokens, n_once=tiny_family.member(x.r).n_once(x.width),
                            n_rec=tiny_family.member(x.r).n_rec(x.width), num_recurrences=x.r) == pytest.approx(2.3)  # fmt: skip
    floor = plan(demo_fit, [], family=tiny_family, target_loss=demo_fit.params["E"] - 0.01).target
    assert floor.best_r is None and "does not reach" in floor.sentence()


def test_extrapolation_is_marked(demo_fit, tiny_family):
    p = plan(demo_fit, [1.2e11, 1.2e13], family=tiny_family, recurrences=[1, 4])
    assert not p.entry(1.2e11, 4).extrapolation.any
    far = p.entry(1.2e13, 4).extrapolation
    assert far.budget == pytest.approx(100.0) and "100x" in far.text()


def test_outputs_round_trip(demo_fit, tiny_family):
    p = plan(demo_fit, [1.2e11], family=tiny_family, kv_budget=2)
    d = json.loads(p.to_json())
    assert d["format"] == "looped_hf.plan/1" and len(d["entries"]) == 4
    assert d["entries"][0]["loss_band"] is not None and d["sentences"]
    md = p.to_markdown()
    assert md.startswith("| budget | r | width") and "95% band" in md and "kv_budget 2" in md


def test_bad_input_names_field_and_value(demo_fit, tiny_family, paper_family, tmp_path):
    with pytest.raises(ValueError, match=r"budgets\[1\]=0"):
        plan(demo_fit, [1e12, 0], family=tiny_family)
    with pytest.raises(ValueError, match=r"budgets\[0\]=-1"):
        plan(demo_fit, [-1.0], family=tiny_family)
    with pytest.raises(ValueError, match=r"recurrences: r=3 .*possible: 1, 2, 4, 8, 16"):
        plan(law_fit({**EPOCH, "phi": 0.46}), [1e20], family=paper_family, recurrences=[1, 3])
    with pytest.raises(ValueError, match=r"inference_recurrences\[4\]=5"):
        plan(demo_fit, [1e12], family=tiny_family, inference_tokens=1e9, inference_recurrences={4: 5})
    with pytest.raises(ValueError, match=r"kv_budget=0"):
        plan(demo_fit, [1e12], family=tiny_family, kv_budget=0)
    with pytest.raises(ValueError, match=r"recurrences: this fit has no phi"):
        plan(law_fit({**EPOCH, "phi": None}, kind="plain"), [1e20], family=paper_family, recurrences=[4])
    # A fit whose results file has no sweep.yaml beside it, and no recipe given.
    with pytest.raises(ValueError, match=r"recipe: the fit records no sweep recipe \(runs.source="):
        family_for_fit(ScalingLawFit.from_json(_fit_without_its_sweep(tmp_path)))
    # A recipe whose models are not the fitted runs.
    with pytest.raises(ValueError, match=r"recipe: .*does not describe the fitted runs"):
        family_for_fit(demo_fit, PAPER)


def test_cli(tmp_path, capsys):
    assert main([str(DEMO_FIT), "--budget", "1.2e11", "1.2e12", "--recipe", str(TINY), "--json",
                 "--inference-tokens", "1e9", "--inference-recurrences", "8=3"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert [e["r"] for e in out["entries"]] == [1, 2, 4, 8, 1, 2, 4, 8] and len(out["lifetime"]) == 2
    assert main([str(DEMO_FIT), "--budget", "1.2e11", "--recipe", str(TINY)]) == 0
    assert "best in" in capsys.readouterr().out
    assert main([str(DEMO_FIT), "--budget", "0", "--recipe", str(TINY)]) == 2
    assert "budgets[0]=0" in capsys.readouterr().err
    assert main([str(_fit_without_its_sweep(tmp_path)), "--budget", "1e12"]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main([str(DEMO_FIT), "--budget", "1e12", "--recipe", str(TINY), "--recurrences", "3"]) == 2
    assert "r=3" in capsys.readouterr().err


def test_sweep_card_section_what_this_phi_means(demo_fit, tiny_family, tmp_path):
    """The sweep card's section: the plan at the sweep's largest budget, 10x and 100x (marked as
    extrapolation), and the frontier plot, rendered by the sweep template."""
    from looped_hf.cards.sweep import PLAN_PLOT, plan_section, render_sweep_card
    from looped_hf.fileio import append_jsonl

    section = plan_section(demo_fit, TINY, tmp_path / "plots")
    assert (tmp_path / "plots" / PLAN_PLOT).stat().st_size > 10_000
    top = float(demo_fit.runs.budget.max())
    for c in (top, 10 * top, 100 * top):
        assert f"| {c:.3g} | 8 |" in section
    assert "budget 10x the sweep's largest" in section and "budget 100x the sweep's largest" in section
    assert str(REPO) not in section  # no machine-local paths in a card
    for rec in demo_fit.runs.to_records():
        append_jsonl(tmp_path / "results.jsonl", {**rec, "status": "ok", "run_id": rec["label"]})
    card = render_sweep_card(tmp_path, demo_fit, [], commands=["x"], plan=section).content
    assert "## What this phi means for you" in card and f"(plots/{PLAN_PLOT})" in card
    assert "## What this phi means for you" not in render_sweep_card(tmp_path, demo_fit, [], commands=["x"]).content


def test_a_plan_on_an_unidentified_phi_says_so(demo_fit, tiny_family):
    # The plan reads the fit's verdict (the one rule for "identified"), not an interval of its own.
    import dataclasses

    assert not any("phi is NOT" in n for n in plan(demo_fit, [1.2e11], family=tiny_family).notes)
    d = demo_fit.diagnostics
    bad = {**d, "verdict": {**d["verdict"], "identified": False, "line": "phi is NOT identified (x)."}}
    loose = dataclasses.replace(demo_fit, diagnostics=bad)
    notes = plan(loose, [1.2e11], family=tiny_family).notes
    assert any(n.startswith("phi is NOT identified (x). Every choice of r > 1") for n in notes)
    assert not any("phi is NOT" in n for n in plan(loose, [1.2e11], family=tiny_family, recurrences=[1]).notes)
