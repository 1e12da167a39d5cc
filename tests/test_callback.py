"""LoopedComputeCallback with the vanilla Trainer: exact tokens and looped-aware FLOPs in every log."""

from __future__ import annotations

import time

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


class _SleepInForward:
    """A forward pre-hook that sleeps `seconds` in training or in evaluation mode (a slow step or a
    slow evaluation, whatever the machine's load)."""

    def __init__(self, seconds: float, training: bool) -> None:
        self.seconds, self.training, self.calls = seconds, training, 0

    def __call__(self, module, args):
        if module.training == self.training:
            self.calls += 1
            time.sleep(self.seconds)


def test_throughput_in_every_training_log_entry_and_no_mfu_without_a_peak(tmp_path):
    model = _model(None)
    sleep = _SleepInForward(0.05, training=True)
    model.register_forward_pre_hook(sleep)
    compute = LoopedComputeCallback()
    trainer = _train(tmp_path, model, [compute])
    per_token = model.training_flops_per_token(SEQ)
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert len(entries) == STEPS
    for entry in entries:
        # Each window is one step of BATCH x ACCUM x SEQ tokens that slept ACCUM x 0.05 s.
        assert 0 < entry["tokens_per_second"] < BATCH * ACCUM * SEQ / (ACCUM * 0.05)
        assert entry["model_flops_per_second"] == pytest.approx(per_token * entry["tokens_per_second"], rel=1e-9)
        assert "mfu" not in entry  # a CPU has no known peak: nothing is logged as MFU
    final = trainer.state.log_history[-1]
    run = compute.summary(trainer.state)
    assert run["mfu"] is None and run["peak_flops"] is None
    assert run["train_seconds"] >= sleep.calls * 0.05
    assert final["tokens_per_second"] == pytest.approx(STEPS * BATCH * ACCUM * SEQ / final["train_seconds"])
    assert run["tokens_per_second"] == pytest.approx(STEPS * BATCH * ACCUM * SEQ / run["train_seconds"])


def test_mfu_against_the_given_or_the_devices_peak_and_evaluation_time_left_out(tmp_path, monkeypatch):
    model = _model(None)
    slow_eval = _SleepInForward(0.3, training=False)
    model.register_forward_pre_hook(slow_eval)
    compute = LoopedComputeCallback(peak_flops=1e9)
    args = TrainingArguments(
        output_dir=str(tmp_path / "eval"), per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
        eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=64, report_to="none", disable_tqdm=True,
        use_cpu=True, dataloader_num_workers=0, save_strategy="no",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=RandomBlocks(64, 64, SEQ),
                      eval_dataset=RandomBlocks(64, 64, SEQ), callbacks=[compute])  # fmt: skip
    trainer.train()
    entries = [e for e in trainer.state.log_history if "loss" in e]
    for entry in entries:
        assert entry["mfu"] == pytest.approx(entry["model_flops_per_second"] / 1e9, rel=1e-9)
    run = compute.summary(trainer.state)
    assert slow_eval.calls == STEPS  # one eval batch per step, 0.3 s each ...
    assert run["train_seconds"] < STEPS * 0.3  # ... none of it counted as training time
    assert run["mfu"] == pytest.approx(run["model_flops_per_second"] / 1e9) and run["peak_flops"] == 1e9
    # Without peak_flops=, the device's dense bf16 peak from looped_hf.hardware (here: faked).
    monkeypatch.setattr("looped_hf.hardware.device_peak_flops", lambda device=None: 2e9)
    auto = LoopedComputeCallback()
    trainer = _train(tmp_path, _model(None), [auto])
    assert all("mfu" in e for e in trainer.state.log_history if "loss" in e)
    assert auto.summary(trainer.state)["peak_flops"] == 2e9


def test_peak_flops_must_be_positive():
    with pytest.raises(ValueError, match="peak_flops"):
        LoopedComputeCallback(peak_flops=0)


def test_checkpoint_card_shows_the_runs_average_throughput_and_mfu_only_when_known():
    from looped_hf.cards.checkpoint import _throughput

    record = {"tokens_per_second": 12345.0, "model_flops_per_second": 4.5e12, "mfu": None, "peak_flops": None}
    assert _throughput(record) == "12.3k tokens/s, 4.5TFLOP/s model FLOPs"
    record.update(mfu=0.382, peak_flops=989.4e12)
    assert _throughput(record).endswith("MFU 38.2% (of 989TFLOP/s bf16 peak per device)")
    assert _throughput({}) is None  # records written before throughput was kept
