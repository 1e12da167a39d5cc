"""The paper recipes plan every run as the study's own code does.

tests/fixtures/study_plan/study_plan.csv holds, for all 308 runs of the study's three paper grids, the
numbers its scripts/base_train.py and nanochat/gpt.py derive (made by running them at
kschwethelm/looped-lm-scaling @ ad7d8f3; see the PROVENANCE.md beside it). The planner must give the same
N_once, N_rec, FLOPs per token, target tokens, steps, tokens, D_REF and peak lrs, to 1e-6.

One deliberate difference is kept and named here (test_norm_and_hyperconnection_lrs_scale_with_the_batch):
looped_hf batch-scales every lr; the study only the matrix, embedding and lm_head lrs.
At the paper recipes' 262,144 tokens per step the two agree.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from conftest import fixture_path

from looped_hf.arguments import LoopedTrainingArguments, RecipeError, parse_recipe, steps_for_tokens
from looped_hf.optim import HYPERP_BATCH_REF, hyperp_learning_rates
from looped_hf.sweep.plan import make_plan

STUDY_PLAN = fixture_path("study_plan", "study_plan.csv")
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PAPER = {
    "base": "iso_depth_paper.yaml",
    "truncated": "iso_depth_paper_truncated.yaml",
    "hyperconnection": "iso_depth_paper_hyperconnection.yaml",
}
REL = 1e-6
GPU_ONLY = ("bf16", "tf32")  # TrainingArguments refuses them on a machine without a GPU


@pytest.fixture(scope="module")
def plans():
    return {variant: make_plan(RECIPES / name) for variant, name in PAPER.items()}


@pytest.fixture(scope="module")
def study_rows():
    with STUDY_PLAN.open(newline="") as f:
        return list(csv.DictReader(f))


def _study_arch(run) -> str:
    """The study's name of a run's architecture: ours is "base" for r = 1, its "noloop"."""
    return "noloop" if run.num_recurrences == 1 else run.arch


def _ours(run) -> dict[str, float]:
    """The planner's numbers for one run, under the study_plan.csv column names."""
    lrs = run.learning_rates
    out = {
        "n_once": run.n_once,
        "n_rec": run.n_rec,
        "n_eff_train_r": run.n_once + run.num_recurrences * run.n_rec,
        "flops_per_token": run.flops_per_token,
        "target_tokens": int(run.target_tokens),
        "num_iterations": run.steps,
        "total_tokens": run.tokens,
        "d_ref": lrs["reference_tokens"],
        "matrix_lr": lrs["matrix"],
        "embedding_lr": lrs["embedding"],
        "lm_head_lr": lrs["lm_head"],
        "norm_lr": lrs["norm"],
    }
    if run.input_injection == "hyperconnection":
        out["hyperconnection_lr"] = lrs["hyperconnection"]
    return out


def test_every_paper_run_is_planned_as_the_study_plans_it(plans, study_rows):
    by_cell = {
        (variant, r.num_recurrences, r.hidden_size, r.budget): r
        for variant, plan in plans.items()
        for r in plan.runs
    }
    assert len(study_rows) == 308 and len(by_cell) == 308
    seen, wrong = set(), []
    for row in study_rows:
        key = (row["variant"], int(row["r"]), int(row["width"]), float(row["budget"]))
        run = by_cell.get(key)
        assert run is not None, f"the study runs {key}; the plan does not"
        seen.add(key)
        assert _study_arch(run) == row["arch"] and (run.backprop_recurrences or run.num_recurrences) == int(
            row["bptt_k"]
        )
        for column, ours in _ours(run).items():
            theirs = float(row[column])
            if abs(ours - theirs) > REL * abs(theirs):
                wrong.append(f"{run.run_id} {column}: plan {ours!r}, study {theirs!r}")
        if run.input_injection != "hyperconnection":
            assert row["hyperconnection_lr"] == "", run.run_id
    assert seen == set(by_cell), "the plan has runs the study does not"
    assert not wrong, f"{len(wrong)} numbers differ from the study's plan:\n" + "\n".join(wrong[:20])


def test_d_ref_is_the_reference_counted_at_the_runs_r(plans, study_rows):
    # base_train.py get_scaling_params reads the training model's num_recur for the reference too.
    d_ref = {}
    for row in study_rows:
        d_ref.setdefault(row["arch"], set()).add(int(float(row["d_ref"])))
    assert {arch: len(v) for arch, v in d_ref.items()} == {"noloop": 1, "loop2": 1, "loop4": 1, "loop8": 1}
    planned = {_study_arch(r): r.learning_rates["reference_tokens"] for r in plans["base"].runs}
    assert planned == {arch: v.pop() for arch, v in d_ref.items()}
    assert planned["loop2"] < planned["loop4"] < planned["loop8"]


def test_paper_runs_use_the_studys_padded_vocabulary_and_bf16_rope(plans):
    for plan in plans.values():
        for run in plan.runs[:: max(1, len(plan.runs) // 7)]:
            model_args, _, training_args = parse_recipe(
                {k: v for k, v in run.recipe.items() if k not in GPU_ONLY}
            )
            assert training_args.train_steps_rounding == "nearest"
            config = model_args.to_config(plan.vocab_size, plan.seq_len)
            assert config.pad_vocab_size_to_multiple_of == 64 and config.rope_table_dtype == "bfloat16"
            assert (config.vocab_size, config.padded_vocab_size) == (32001, 32064)
            # Nearest whole step, as the study: |tokens - budget / flops_per_token| <= half a step.
            assert abs(run.tokens - run.budget / run.flops_per_token) <= plan.tokens_per_step / 2


def test_steps_round_up_by_default_and_to_the_nearest_on_request():
    assert steps_for_tokens(10.2 * 64, 64, "train_tokens", 1) == 11
    assert steps_for_tokens(10.2 * 64, 64, "train_tokens", 1, rounding="nearest") == 10
    assert steps_for_tokens(10.7 * 64, 64, "train_tokens", 1, rounding="nearest") == 11
    with pytest.raises(ValueError, match="rounding='down'"):
        steps_for_tokens(640, 64, "train_tokens", 1, rounding="down")
    with pytest.raises(
        RecipeError, match=r"train_flops_budget=5: buys 63 tokens, less than one optimizer step"
    ):
        steps_for_tokens(63, 64, "train_flops_budget", 5, rounding="nearest")
    with pytest.raises(
        RecipeError, match=r"train_steps_rounding='floor': must be one of \['up', 'nearest'\]"
    ):
        LoopedTrainingArguments(output_dir="unused", train_steps_rounding="floor")


def test_norm_and_hyperconnection_lrs_scale_with_the_batch(plans, tmp_path):
    """The deliberate difference: at B = 2 B_REF the study's norm and hyperconnection lrs stay at
    0.005 and 0.01 x (d / 640)^-0.5 (setup_optimizer sets them unscaled); ours are x 2^0.558 too."""
    plan = plans["hyperconnection"]
    run = next(r for r in plan.runs if r.hidden_size == 640)
    model_args, _, _ = parse_recipe({k: v for k, v in run.recipe.items() if k not in GPU_ONLY})
    config = model_args.to_config(plan.vocab_size, plan.seq_len)
    # The recipe's reference lrs (a run's own recipe carries its planned lrs with lr_scaling none).
    shared = {k: v for k, v in plan.base_recipe.items() if k not in GPU_ONLY and k != "sweep"}
    _, _, args = parse_recipe(dict(shared, output_dir=str(tmp_path)))
    assert args.lr_scaling == "hyperp" and args.hyperconnection_learning_rate == 0.01
    at_ref = hyperp_learning_rates(args, config, tokens_per_step=HYPERP_BATCH_REF, train_tokens=1e9)
    doubled = hyperp_learning_rates(args, config, tokens_per_step=2 * HYPERP_BATCH_REF, train_tokens=1e9)
    assert (at_ref.norm, at_ref.hyperconnection) == pytest.approx((0.005, 0.01), rel=REL)  # = the study's
    scale = 2**0.558
    for group in ("matrix", "embedding", "lm_head", "norm", "hyperconnection"):
        assert getattr(doubled, group) == pytest.approx(scale * getattr(at_ref, group), rel=REL), group
    assert not math.isclose(doubled.norm, 0.005, rel_tol=0.1)  # the study's value at this batch
