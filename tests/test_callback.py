"""LoopedComputeCallback with the vanilla Trainer: exact tokens and looped-aware FLOPs in every log."""

from __future__ import annotations

import pytest
import torch
from conftest import RandomBlocks
from transformers import Trainer, TrainerCallback, TrainingArguments

from looped_hf import LoopedComputeCallback, LoopedConfig, LoopedForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEQ, BATCH, ACCUM, STEPS = 16, 2, 2, 4


class _Reporter(TrainerCallback):
    """Stands in for a report_to integration (tensorboard, wandb...): records what on_log receives."""

    def __init__(self) -> None:
        self.received: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.received.append(dict(logs))


def _model(backprop_recurrences: int | None, r: int = 4) -> LoopedForCausalLM:
    torch.manual_seed(0)
    config = LoopedConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_prelude_layers=1, num_recurrent_layers=1,
        num_coda_layers=1, num_recurrences=r, backprop_recurrences=backprop_recurrences, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LoopedForCausalLM(config)


def _train(tmp_path, model, callbacks, **overrides) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, logging_steps=1, report_to="none", disable_tqdm=True,
        learning_rate=1e-3, use_cpu=True, dataloader_num_workers=0, **{"save_strategy": "no", **overrides},
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=RandomBlocks(64, 64, SEQ), callbacks=callbacks)
    trainer.train()
    return trainer


@pytest.mark.parametrize("backprop_recurrences", [None, 2], ids=["full", "truncated"])
def test_train_flops_is_model_count_times_tokens_in_every_log_entry(tmp_path, backprop_recurrences):
    model = _model(backprop_recurrences)
    reporter = _Reporter()
    compute = LoopedComputeCallback()
    # The reporter comes first, as integration callbacks do: it must still see train_flops.
    trainer = _train(tmp_path, model, [reporter, compute])
    per_token = model.training_flops_per_token(SEQ)
    entries = [e for e in trainer.state.log_history if "loss" in e or "train_loss" in e]
    assert len(entries) == STEPS + 1
    for i, entry in enumerate(entries):
        step = min(i + 1, STEPS)
        assert entry["train_tokens"] == step * BATCH * ACCUM * SEQ  # exact under accumulation
        assert entry["train_flops"] == pytest.approx(per_token * entry["train_tokens"], rel=1e-12)
    assert [r["train_flops"] for r in reporter.received] == [e["train_flops"] for e in entries]
    final = entries[-1]
    assert final["n_rec"] == model.num_scaling_params()["recurrent"]
    assert final["num_recurrences"] == 4 and final["effective_num_layers"] == 6
    summary = compute.summary(trainer.state)
    assert summary["train_flops"] == pytest.approx(per_token * STEPS * BATCH * ACCUM * SEQ)
    # The Trainer's own count (6 x tokens x unique params) undercounts the loop; both are kept.
    assert 0 < summary["trainer_total_flos"] < summary["train_flops"]


def test_truncated_backprop_costs_less_per_token():
    full, truncated = _model(None), _model(1)
    assert truncated.training_flops_per_token(SEQ) < full.training_flops_per_token(SEQ)


def test_callback_added_after_init_still_reaches_reporters(tmp_path):
    model = _model(None, r=2)
    reporter = _Reporter()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=2, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=RandomBlocks(16, 64, SEQ), callbacks=[reporter])
    trainer.add_callback(LoopedComputeCallback())
    trainer.train()
    assert all("train_flops" in logs for logs in reporter.received)
    assert trainer.state.log_history[-1]["train_tokens"] == 2 * BATCH * SEQ


def test_resume_from_a_checkpoint_without_a_saved_flop_total_prices_it_at_the_configured_r(tmp_path):
    import json

    model = _model(None, r=2)
    trainer = _train(tmp_path, model, [LoopedComputeCallback()], save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert (
        state["stateful_callbacks"]["LoopedComputeCallback"]["attributes"]["_counted_tokens"]
        == 2 * BATCH * ACCUM * SEQ
    )
    del state["stateful_callbacks"]["LoopedComputeCallback"]  # as written by looped_hf 0.1.0
    state_file.write_text(json.dumps(state))
    args = trainer.args
    resumed = Trainer(
        model=_model(None, r=2), args=args, train_dataset=RandomBlocks(64, 64, SEQ), callbacks=[LoopedComputeCallback()]
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    tokens = STEPS * BATCH * ACCUM * SEQ
    assert resumed.state.log_history[-1]["train_tokens"] == tokens
    assert resumed.state.log_history[-1]["train_flops"] == pytest.approx(
        model.training_flops_per_token(SEQ) * tokens
    )
