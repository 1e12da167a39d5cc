"""Training with a sampled r (Huginn's Poisson-lognormal): the draw, the Trainer hook, recipes, records."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import RandomBlocks
from transformers import Trainer, TrainingArguments

from looped_hf import LoopedComputeCallback, LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import RecipeError, parse_recipe
from looped_hf.recurrence import (
    RecurrenceSamplingCallback,
    sample_num_recurrences,
    sampled_recurrences_summary,
)
from looped_hf.scaling import load_runs
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ, BATCH, ACCUM = 16, 2, 2


def test_poisson_lognormal_has_the_recipe_mean_and_is_at_least_one():
    draws = np.array([sample_num_recurrences(4, step, seed=0) for step in range(20_000)])
    assert draws.min() >= 1
    # E[r] = 4 exactly; the standard error of the mean of 20k draws is ~0.017.
    assert abs(draws.mean() - 4) < 0.07
    # Poisson-lognormal is over-dispersed: variance above a Poisson's (= mean - 1 for 1 + Poisson).
    assert draws.var() > 1.5 * 3
    assert sample_num_recurrences(4, 7, seed=0, scheme="fixed") == 4


def test_the_draw_depends_only_on_seed_and_step_not_on_global_rng_state():
    first = [sample_num_recurrences(8, step, seed=3) for step in range(50)]
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    torch.rand(100)
    np.random.rand(100)
    assert [sample_num_recurrences(8, step, seed=3) for step in range(50)] == first  # every rank agrees
    assert [sample_num_recurrences(8, step, seed=4) for step in range(50)] != first
    assert len(set(first)) > 3


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"mean": 4, "step": 0, "seed": 0, "scheme": "uniform"}, "recurrence_sampling='uniform'"),
        ({"mean": 1, "step": 0, "seed": 0}, "num_recurrences=1"),
        ({"mean": 4, "step": -1, "seed": 0}, "step=-1"),
    ],
)
def test_bad_sampler_arguments_are_named(kwargs, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        sample_num_recurrences(**kwargs)


def test_summary_counts_every_step():
    summary = sampled_recurrences_summary(4, 30, seed=0)
    assert summary["steps"] == 30 and sum(summary["counts"].values()) == 30
    assert summary["min"] >= 1 and summary["min"] <= summary["mean"] <= summary["max"]


# --- with the Trainer ------------------------------------------------------------------------
def _model(backprop_recurrences: int | None = 2, r: int = 4, injection: str = "linear") -> LoopedForCausalLM:
    torch.manual_seed(0)
    config = LoopedConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_prelude_layers=1, num_recurrent_layers=1,
        num_coda_layers=1, num_recurrences=r, backprop_recurrences=backprop_recurrences,
        max_position_embeddings=SEQ, input_injection=injection,
    )  # fmt: skip
    return LoopedForCausalLM(config)


def _trainer(tmp_path, model, callbacks, max_steps: int, **overrides) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        max_steps=max_steps, logging_steps=1, report_to="none", disable_tqdm=True, learning_rate=1e-3,
        use_cpu=True, dataloader_num_workers=0, seed=5, **{"save_strategy": "no", **overrides},
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=RandomBlocks(64, 64, SEQ), callbacks=callbacks)


def test_every_micro_batch_of_a_step_runs_that_steps_sampled_r_and_flops_follow_it(tmp_path):
    model = _model()
    seen: list[tuple[int, int]] = []  # (global step, r) of every training forward, after the sampler's hook

    def spy(module, args, kwargs):
        if module.training:
            seen.append((trainer.state.global_step, kwargs.get("num_recurrences")))

    model.register_forward_pre_hook(spy, with_kwargs=True)
    steps = 8
    sampler = RecurrenceSamplingCallback(seed=5)
    # Listed after the compute callback on purpose: the sampler's hook still runs first.
    trainer = _trainer(tmp_path, model, [LoopedComputeCallback(), sampler], steps)
    trainer.train()

    expected = [sample_num_recurrences(4, step, seed=5) for step in range(steps)]
    assert len(set(expected)) > 1  # the seed gives a run whose r actually varies
    assert seen == [(step, expected[step]) for step in range(steps) for _ in range(ACCUM)]
    assert sampler.history == dict(enumerate(expected))
    # The FLOP count follows the r each step ran: a cumulative sum, not tokens x fpt(mean r).
    step_tokens = BATCH * ACCUM * SEQ
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert len(entries) == steps
    for step, entry in enumerate(entries, start=1):
        want = sum(model.training_flops_per_token(SEQ, r) * step_tokens for r in expected[:step])
        assert entry["train_tokens"] == step * step_tokens
        assert entry["train_flops"] == pytest.approx(want, rel=1e-12)
    # After training the model is left as it was: plain calls run at the configured r again.
    seen.clear()
    model.train()
    model(torch.zeros(1, SEQ, dtype=torch.long))
    assert seen == [(steps, None)]


def test_resumed_sampled_run_counts_the_same_flops_as_an_uninterrupted_one(tmp_path):
    steps = 6
    full = _trainer(tmp_path / "full", _model(), [RecurrenceSamplingCallback(seed=5), LoopedComputeCallback()],
                    steps, save_strategy="steps", save_steps=3)  # fmt: skip
    full.train()
    total = full.state.log_history[-1]["train_flops"]
    want = sum(_model().training_flops_per_token(SEQ, sample_num_recurrences(4, s, 5)) for s in range(steps))
    assert total == pytest.approx(want * BATCH * ACCUM * SEQ, rel=1e-12)

    checkpoint = tmp_path / "full" / "out" / "checkpoint-3"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]
    assert saved["LoopedComputeCallback"]["attributes"]["_counted_tokens"] == 3 * BATCH * ACCUM * SEQ
    resumed = _trainer(tmp_path / "full", _model(), [RecurrenceSamplingCallback(seed=5), LoopedComputeCallback()],
                       steps)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.log_history[-1]["train_flops"] == pytest.approx(total, rel=1e-12)


def test_sampling_refuses_an_r_locked_model(tmp_path):
    trainer = _trainer(tmp_path, _model(None, injection="hyperconnection"), [RecurrenceSamplingCallback()], 1)
    with pytest.raises(ValueError, match="recurrence_sampling='poisson_lognormal'.*hyperconnection"):
        trainer.train()


# --- recipes and run records -----------------------------------------------------------------
def test_recipe_field_is_validated_and_sets_the_variant(tiny_recipe):
    with pytest.raises(RecipeError, match="recurrence_sampling='huginn'"):
        parse_recipe({**tiny_recipe, "recurrence_sampling": "huginn"})
    _, _, args = parse_recipe({**tiny_recipe, "recurrence_sampling": "poisson_lognormal"})
    assert args.variant == "sampled_r"
    with pytest.raises(RecipeError, match="variant='truncated'"):
        parse_recipe({**tiny_recipe, "recurrence_sampling": "poisson_lognormal", "variant": "truncated"})
    _, _, args = parse_recipe({**tiny_recipe, "recurrence_sampling": "poisson_lognormal",
                               "variant": "truncated_sampled_r"})  # fmt: skip
    assert args.variant == "truncated_sampled_r"
    _, _, args = parse_recipe(tiny_recipe)
    assert args.recurrence_sampling == "fixed" and args.variant == "base"


def test_train_records_a_sampled_run_apart_from_the_fixed_sweep(tiny_recipe, tmp_path):
    results = tmp_path / "results.jsonl"
    recipe = {**tiny_recipe, "num_recurrences": 3, "backprop_recurrences": 2, "results_file": str(results)}
    sampled = train(*parse_recipe({**recipe, "recurrence_sampling": "poisson_lognormal",
                                   "output_dir": str(tmp_path / "sampled")}))  # fmt: skip
    fixed = train(*parse_recipe({**recipe, "output_dir": str(tmp_path / "fixed")}))
    assert sampled["status"] == "ok" and fixed["status"] == "ok"
    assert sampled["variant"] == "sampled_r" and sampled["recurrence_sampling"] == "poisson_lognormal"
    assert fixed["variant"] == "base" and fixed["recurrence_sampling"] == "fixed"
    steps = tiny_recipe["max_steps"]
    rs = [sample_num_recurrences(3, s, seed=tiny_recipe["seed"]) for s in range(steps)]
    assert sampled["sampled_recurrences"]["counts"] == {str(r): rs.count(r) for r in sorted(set(rs))}
    config = LoopedConfig.from_dict(sampled["config"])
    with torch.device("meta"):
        meta = LoopedForCausalLM(config)
    step_tokens = sampled["tokens_per_step"]
    want = sum(meta.training_flops_per_token(sampled["seq_len"], r) for r in rs) * step_tokens
    assert sampled["train_flops"] == pytest.approx(want, rel=1e-12)
    assert sampled["train_flops_per_token"] == pytest.approx(want / sampled["tokens"], rel=1e-12)
    # The fit never mixes them: the default refuses a mixed file, variant= picks one.
    with pytest.raises(ValueError, match="mix variants"):
        load_runs(results)
    assert len(load_runs(results, variant="base").loss) == 1


def test_train_refuses_sampling_for_a_hyperconnection_model(tiny_recipe):
    recipe = {**tiny_recipe, "input_injection": "hyperconnection", "recurrence_sampling": "poisson_lognormal"}
    with pytest.raises(RecipeError, match="r-locked"):
        train(*parse_recipe(recipe))
