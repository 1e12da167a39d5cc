"""Every shipped recipe parses and builds; bad recipes fail before training, naming the field."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from looped_hf import LoopedForCausalLM
from looped_hf.arguments import RecipeError, load_yaml, parse_recipe
from looped_hf.sweep import main as sweep_main
from looped_hf.sweep import make_plan
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


@functools.cache
def _plan(path: Path):
    """make_plan of a shipped recipe, once per session (the paper grids take seconds to plan)."""
    return make_plan(path)


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


@pytest.mark.parametrize("path", [p for p in RECIPES if not _is_sweep(p)], ids=lambda p: p.name)
def test_train_recipe_passes_check(path, capsys):
    """`looped-hf train RECIPE --check` accepts every shipped train recipe and trains nothing."""
    from looped_hf.train import main

    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"recipe {str(path)!r}: valid; nothing was trained.")
    assert "optimizer steps" in out


GPU_ONLY = ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")  # refused on a machine without a GPU


@pytest.mark.parametrize("path", [p for p in RECIPES if _is_sweep(p)], ids=lambda p: p.name)
def test_every_run_of_a_sweep_recipe_passes_check(path):
    """Each planned run's recipe passes the value checks; where its tokenizer ships with the
    package (no Hub download), the whole --check (config, length, optimizer) too. `train --check`
    itself points a sweep recipe to `looped-hf sweep --dry-run`."""
    from looped_hf.train import check_recipe

    with pytest.raises(RecipeError, match="looped-hf sweep RECIPE --dry-run. checks it"):
        check_recipe(path)
    plan = _plan(path)
    local_tokenizer = plan.base_recipe.get("tokenizer") in (None, "embedded", "bytes")
    checked_r: set[int] = set()
    for run in plan.runs:
        recipe = {k: v for k, v in run.recipe.items() if k not in GPU_ONLY}
        if local_tokenizer and run.num_recurrences not in checked_r:  # the whole check: one run per r
            checked_r.add(run.num_recurrences)
            _, resolved = check_recipe(recipe)
            assert resolved.max_steps == run.steps, run.run_id
        else:
            parse_recipe(recipe)


@pytest.mark.parametrize("path", [p for p in RECIPES if _is_sweep(p)], ids=lambda p: p.name)
def test_sweep_recipe_plans_iso_depth_runs_on_budget(path):
    plan = _plan(path)
    depth = plan.sweep.effective_depth
    assert {r.effective_num_layers for r in plan.runs} == {depth}
    nearest = plan.base_recipe.get("train_steps_rounding") == "nearest"  # the paper recipes, as the study
    for run in plan.runs:
        # Whole steps within 1% of the budget: rounded up, never under it; to the nearest, within half a step.
        if nearest:
            assert abs(run.tokens - run.budget / run.flops_per_token) <= plan.tokens_per_step / 2, run.run_id
            assert abs(run.flops - run.budget) <= 0.01 * run.budget, run.run_id
        else:
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
    assert "loop4-w384-b0" in out and "4.64e+17" in out and "2.15e+19" in out
    assert "lr_mat" in out and "held-out set: 34,560 blocks x 2,048 = 70,778,880 tokens" in out


# The study's sizes s per budget (width 64 s), from its shells/scaling_laws/*.sh.
PAPER_SIZES = {
    "iso_depth_paper.yaml": [[6, 8, 10, 12], [6, 8, 10, 12, 14], [8, 10, 12, 14, 16], [10, 12, 14, 16, 18, 20],
                             [12, 16, 18, 20, 24], [18, 24, 28, 34]],
    "iso_depth_paper_truncated.yaml": [[6, 8, 10, 12], [6, 8, 10, 12, 14, 16], [8, 10, 12, 14, 16, 18],
                                       [10, 12, 14, 16, 18, 20, 22], [12, 16, 18, 20, 24, 28], [18, 24, 28, 34, 40]],
    "iso_depth_paper_hyperconnection.yaml": [[6, 8, 10, 12], [6, 8, 10, 12, 14], [8, 10, 12, 14, 16, 18],
                                             [10, 12, 14, 16, 18, 20], [12, 16, 18, 20, 24], [18, 24, 28, 34]],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PAPER_SIZES))
def test_paper_recipes_are_the_studys_grid_and_recipe(name):
    plan = _plan(next(p for p in RECIPES if p.name == name))
    assert plan.sweep.budgets == [4.64e17, 1e18, 2.15e18, 4.64e18, 1e19, 2.15e19]
    assert plan.sweep.widths_for_all() == [[64 * s for s in sizes] for sizes in PAPER_SIZES[name]]
    assert plan.sweep.head_dim == 128 and plan.sweep.effective_depth == 20
    assert plan.tokens_per_step == 262_144 and plan.seq_len == 2048 and plan.eval_blocks == 34_560
    # The probes reuse the base sweep's r = 1 runs, as the study's shells do.
    assert sorted({r.num_recurrences for r in plan.runs}) == (
        [1, 2, 4, 8] if name == "iso_depth_paper.yaml" else [2, 4, 8]
    )
    gpu_only = ("bf16", "tf32")  # TrainingArguments refuses them on a machine without a GPU
    _, _, training_args = parse_recipe({k: v for k, v in plan.runs[0].recipe.items() if k not in gpu_only})
    assert training_args.optimizer == "muonh" and training_args.max_grad_norm == 0
    assert training_args.lr_schedule == "study" and training_args.final_lr_ratio == 0.1
    assert training_args.get_warmup_steps(100) == 0
    # No host-device sync per step for the loss check or the batch copy (pinned, non-blocking).
    assert training_args.logging_nan_inf_filter is False and training_args.accelerator_config.non_blocking
    assert training_args.dataloader_pin_memory
    for run in plan.runs:
        model_args, _, _ = parse_recipe({k: v for k, v in run.recipe.items() if k not in gpu_only})
        config = model_args.to_config(plan.vocab_size, plan.seq_len)
        assert config.init_scheme == "study" and config.qk_norm == "after_rope"
        lrs = run.learning_rates
        # HyperP at B = B_REF: AdamW lrs carry only the width factor; the matrix lr the data factor.
        assert lrs["batch_scale"] == 1.0
        assert lrs["embedding"] == pytest.approx(0.3 * (run.hidden_size / 640) ** -0.5)
        assert lrs["matrix"] == pytest.approx(
            0.014 * (int(run.target_tokens) / lrs["reference_tokens"]) ** -0.32
        )
        assert run.recipe["muon_learning_rate"] == lrs["matrix"] and run.recipe["lr_scaling"] == "none"
    if name == "iso_depth_paper_hyperconnection.yaml":
        assert {r.input_injection for r in plan.runs} == {"hyperconnection"}
        assert all(r.learning_rates["hyperconnection"] == pytest.approx(0.01 * (r.hidden_size / 640) ** -0.5)
                   for r in plan.runs)  # fmt: skip


def test_tiny_sweep_has_enough_runs_for_a_six_parameter_fit():
    plan = make_plan(next(p for p in RECIPES if p.name == "iso_depth_tiny.yaml"))
    assert sorted({r.num_recurrences for r in plan.runs}) == [1, 2, 4, 8]
    assert len(plan.sweep.budgets) >= 3 and all(len(w) >= 3 for w in plan.sweep.widths_for_all())
    assert 30 <= len(plan.runs) <= 40


def test_learning_rate_by_r_gives_each_architecture_its_lr():
    recipe = load_yaml(Path(__file__).parent / "data" / "micro_sweep.yaml")
    recipe["sweep"]["learning_rate_by_r"] = {1: 0.01, 2: 0.03}
    plan = make_plan(recipe)
    for run in plan.runs:
        expected = 0.01 if run.num_recurrences == 1 else 0.03
        assert run.recipe["learning_rate"] == expected
        _, _, training_args = parse_recipe(run.recipe)
        assert training_args.learning_rate == expected  # what the run trains at
    assert "r = 1: 0.01, r = 2: 0.03" in plan.table()
    recipe["sweep"]["learning_rate_by_r"] = {1: 0.01}
    with pytest.raises(RecipeError, match=r"sweep.learning_rate_by_r=.*no learning rate for r = \[2\]"):
        make_plan(recipe)
    recipe["sweep"]["learning_rate_by_r"] = {1: 0.01, 2: -1}
    with pytest.raises(
        RecipeError, match=r"sweep.learning_rate_by_r=\{1: 0.01, 2: -1\}: must be a finite number > 0 \(contains -1\)"
    ):
        make_plan(recipe)


# --- bad recipes ------------------------------------------------------------------------------
def test_recorded_recipe_keeps_accelerator_config(tiny_recipe):
    """accelerator_config is built into an object; the recorded recipe keeps what was set, as a mapping."""
    from looped_hf.arguments import resolved_recipe

    args = parse_recipe(dict(tiny_recipe, accelerator_config={"non_blocking": True}))
    recorded = resolved_recipe(*args)
    assert recorded["accelerator_config"] == {"non_blocking": True}
    assert parse_recipe(recorded)[2].accelerator_config.non_blocking is True
    assert "accelerator_config" not in resolved_recipe(*parse_recipe(tiny_recipe))


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


def test_scan_lr_trains_plan_cells_at_each_lr_and_resumes(small_corpus, data_cache, tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "scan_lr", Path(__file__).parent.parent / "scripts" / "scan_lr.py"
    )
    scan_lr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan_lr)
    recipe = load_yaml(Path(__file__).parent / "data" / "micro_sweep.yaml")
    recipe.update(dataset=str(small_corpus), data_cache_dir=str(data_cache))
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(recipe))
    argv = [str(path), "--budget", "0", "--widths", "32", "--recurrences", "2", "--lrs", "0.001", "0.01",
            "--out", str(tmp_path / "scan")]  # fmt: skip
    assert scan_lr.main(argv) == 0
    lines = (tmp_path / "scan" / "scan.jsonl").read_text().splitlines()
    assert len(lines) == 2
    losses = {rec["learning_rate"]: rec["loss"] for rec in map(json.loads, lines)}
    assert losses[0.001] != losses[0.01]  # the lr reached the run
    table = capsys.readouterr().out
    assert "0.001" in table and "0.01" in table and "*" in table
    assert scan_lr.main(argv) == 0  # a rerun trains nothing new
    assert len((tmp_path / "scan" / "scan.jsonl").read_text().splitlines()) == 2
