"""Every shipped recipe parses and builds; bad recipes fail before training, naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from looped_hf import LoopedForCausalLM
from looped_hf.arguments import RecipeError, parse_recipe
from looped_hf.sweep import main as sweep_main
from looped_hf.sweep import make_plan
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def _is_sweep(path: Path) -> bool:
    return "sweep" in (yaml.safe_load(path.read_text()) or {})


def test_there_are_train_and_sweep_recipes():
    names = {p.name for p in RECIPES}
    assert {"tiny.yaml", "iso_depth_tiny.yaml", "iso_depth_paper.yaml"} <= names
    assert any("truncated" in n for n in names) and any("hyperconnection" in n for n in names)


@pytest.mark.parametrize("path", [p for p in RECIPES if not _is_sweep(p)], ids=lambda p: p.name)
def test_train_recipe_parses_and_builds_on_meta(path):
    from looped_hf.data import load_tokenizer

    model_args, data_args, training_args = parse_recipe(path)
    tokenizer = load_tokenizer(data_args.tokenizer)
    config = model_args.to_config(len(tokenizer), data_args.seq_len)
    with torch.device("meta"):
        model = LoopedForCausalLM(config)
    assert model.training_flops_per_token(data_args.seq_len) > 0


@pytest.mark.parametrize("path", [p for p in RECIPES if _is_sweep(p)], ids=lambda p: p.name)
def test_sweep_recipe_plans_iso_depth_runs_on_budget(path):
    plan = make_plan(path)
    depth = plan.sweep.effective_depth
    assert {r.effective_num_layers for r in plan.runs} == {depth}
    for run in plan.runs:
        # ceil to whole steps: never under budget, over by < 1%
        assert run.budget <= run.flops <= 1.01 * run.budget, run.run_id
        assert run.tokens == run.steps * plan.tokens_per_step
        if run.num_recurrences == 1:
            assert (run.num_prelude_layers, run.num_coda_layers, run.input_injection) == (0, 0, "none")
        else:
            assert run.num_prelude_layers == plan.sweep.prelude and run.num_coda_layers == plan.sweep.coda
        if plan.sweep.variant == "truncated" and run.num_recurrences > 1:
            assert run.backprop_recurrences == math.ceil(run.num_recurrences / 2)
        if plan.sweep.variant == "hyperconnection" and run.num_recurrences > 1:
            assert run.input_injection == "hyperconnection"


def test_paper_dry_run_prints_the_116_run_grid(capsys):
    paper = next(p for p in RECIPES if p.name == "iso_depth_paper.yaml")
    assert sweep_main([str(paper), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "116 runs (base 29, loop2 29, loop4 29, loop8 29)" in out
    assert "loop4-w256-b0" in out and "4.64e+17" in out and "2.15e+19" in out


def test_tiny_sweep_has_enough_runs_for_a_six_parameter_fit():
    plan = make_plan(next(p for p in RECIPES if p.name == "iso_depth_tiny.yaml"))
    assert sorted({r.num_recurrences for r in plan.runs}) == [1, 2, 4, 8]
    assert len(plan.sweep.budgets) >= 3 and all(len(w) >= 3 for w in plan.sweep.widths_for_all())
    assert 30 <= len(plan.runs) <= 40


# --- bad recipes ------------------------------------------------------------------------------
def test_unknown_field_is_named(tiny_recipe):
    with pytest.raises(RecipeError, match="num_recurrence'.*did you mean num_recurrences"):
        parse_recipe(dict(tiny_recipe, num_recurrence=3))


def test_bad_model_value_is_named_before_training(tiny_recipe):
    with pytest.raises(RecipeError, match=r"num_recurrences=0"):
        train(*parse_recipe(dict(tiny_recipe, num_recurrences=0)))
    with pytest.raises(RecipeError, match="optimizer='sgd'"):
        parse_recipe(dict(tiny_recipe, optimizer="sgd"))


def test_budget_below_one_step_is_named(tiny_recipe, tmp_path):
    recipe = dict(tiny_recipe, train_flops_budget=1e6)
    recipe.pop("max_steps")
    with pytest.raises(RecipeError, match="train_flops_budget=1e\\+06.*less than one optimizer step"):
        train(*parse_recipe(recipe))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_two_run_lengths_conflict(tiny_recipe):
    with pytest.raises(RecipeError, match="max_steps and train_tokens"):
        parse_recipe(dict(tiny_recipe, train_tokens=1000))


def _sweep_recipe(tiny_recipe: dict, **sweep) -> dict:
    base = {
        k: v
        for k, v in tiny_recipe.items()
        if k not in ("max_steps", "output_dir") and not k.startswith("num_")
    }
    base.pop("hidden_size")
    base.pop("head_dim")
    section = {"effective_depth": 6, "prelude": 1, "coda": 1, "recurrences": [1, 2, 4], "head_dim": 16,
               "budgets": [5e8], "widths": [32]}  # fmt: skip
    section.update(sweep)
    return {"sweep": section, **base}


def test_r_not_dividing_the_recurrent_depth_is_named(tiny_recipe):
    with pytest.raises(RecipeError, match=r"sweep.recurrences=.*r=3 does not divide.*= 4"):
        make_plan(_sweep_recipe(tiny_recipe, recurrences=[1, 3]))


def test_sweep_budget_too_small_for_one_step_is_named(tiny_recipe):
    with pytest.raises(RecipeError, match=r"sweep.budgets\[0\]=1000.*less than one optimizer step"):
        make_plan(_sweep_recipe(tiny_recipe, budgets=[1e3]))


def test_unknown_sweep_field_and_run_fields_are_named(tiny_recipe):
    with pytest.raises(RecipeError, match="sweep.budget'"):
        make_plan(_sweep_recipe(tiny_recipe, budget=[1e9]))
    with pytest.raises(RecipeError, match="'num_recurrences' is set by the sweep"):
        make_plan(dict(_sweep_recipe(tiny_recipe), num_recurrences=2))
    with pytest.raises(RecipeError, match="sweep.widths=.*multiple of head_dim=16"):
        make_plan(_sweep_recipe(tiny_recipe, widths=[40]))
