"""LoopedTrainer: the vanilla Trainer's logs and results, with less work per step."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import Trainer, TrainerCallback

from looped_hf.arguments import parse_recipe
from looped_hf.train import train
from looped_hf.trainer import LoopedTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class CallCounter:
    """Counts calls of `owner.attr` (class-level wrapper) while the context is open."""

    def __init__(self, owner: type, attr: str) -> None:
        self.owner, self.attr, self.calls = owner, attr, 0

    def __enter__(self) -> CallCounter:
        self.had = self.attr in self.owner.__dict__
        self.original = getattr(self.owner, self.attr)

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        setattr(self.owner, self.attr, counted)
        return self

    def __exit__(self, *exc) -> None:
        if self.had:
            setattr(self.owner, self.attr, self.original)
        else:
            delattr(self.owner, self.attr)


class KeepState(TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        self.log_history = [dict(entry) for entry in state.log_history]
        self.total_flos = state.total_flos
        self.tokens = state.num_input_tokens_seen


def _train(recipe: dict, trainer_class: type[Trainer], tmp_path, name: str) -> tuple[dict, KeepState]:
    keep = KeepState()
    record = train(
        *parse_recipe(recipe, ["--output_dir", str(tmp_path / name)]), callbacks=[keep], trainer_class=trainer_class
    )
    assert record["status"] == "ok", record.get("traceback")
    return record, keep


@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_looped_trainer_logs_what_the_vanilla_trainer_logs(tiny_recipe, tmp_path, max_grad_norm):
    """Same seed, same data: every log entry (loss, grad_norm, tokens seen, our FLOPs), the Trainer's
    total_flos and the held-out loss are identical; without clipping the gradient norm is computed
    on the logging steps only, and the parameters are counted once for total_flos."""
    recipe = dict(tiny_recipe, max_steps=7, logging_steps=3, logging_first_step=True, max_grad_norm=max_grad_norm)
    vanilla, vanilla_state = _train(recipe, Trainer, tmp_path, "vanilla")
    with CallCounter(Accelerator, "clip_grad_norm_") as norms:
        looped, looped_state = _train(recipe, LoopedTrainer, tmp_path, "looped")

    steps = [e["step"] for e in looped_state.log_history if "loss" in e]
    assert steps == [1, 3, 6]  # logging_first_step, then every 3rd step
    drop = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second",
            "tokens_per_second", "model_flops_per_second", "train_seconds"}  # fmt: skip

    def comparable(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in entry.items() if k not in drop} for entry in history]

    assert comparable(looped_state.log_history) == comparable(vanilla_state.log_history)
    assert all("grad_norm" in e for e in looped_state.log_history if "loss" in e)
    assert looped_state.total_flos == vanilla_state.total_flos > 0
    assert looped_state.tokens == vanilla_state.tokens == 7 * 4 * recipe["seq_len"]
    assert looped["loss"] == vanilla["loss"]
    assert looped["train_flops"] == vanilla["train_flops"]
    # clip_grad_norm_: every step when clipping, else only the 3 logged steps.
    assert norms.calls == (7 if max_grad_norm > 0 else 3)


def test_flops_count_walks_the_parameters_once(tiny_recipe, tmp_path):
    """The vanilla floating_point_ops calls num_parameters every micro-batch; LoopedTrainer once."""
    from looped_hf import LoopedForCausalLM

    recipe = dict(tiny_recipe, max_steps=5)
    with CallCounter(LoopedForCausalLM, "num_parameters") as vanilla_count:
        _train(recipe, Trainer, tmp_path, "vanilla")
    with CallCounter(LoopedForCausalLM, "num_parameters") as looped_count:
        _, state = _train(recipe, LoopedTrainer, tmp_path, "looped")
    assert vanilla_count.calls - looped_count.calls == 5 - 1
    assert state.total_flos > 0


def test_no_logging_means_no_grad_norm(tiny_recipe, tmp_path):
    recipe = dict(tiny_recipe, max_steps=4, logging_strategy="no", max_grad_norm=0.0)
    with CallCounter(Accelerator, "clip_grad_norm_") as norms:
        _train(recipe, LoopedTrainer, tmp_path, "quiet")
    assert norms.calls == 0


def test_logs_next_step_follows_the_default_flow_rule(tiny_recipe, tmp_path):
    """Checked against DefaultFlowCallback itself at every step of a run."""
    seen: list[tuple[int, bool, bool]] = []
    trainer_ref: list[LoopedTrainer] = []

    class Probe(LoopedTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainer_ref.append(self)

    class Check(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            self.predicted = trainer_ref[0].logs_next_step()

        def on_step_end(self, args, state, control, **kwargs):
            # Runs after DefaultFlowCallback (which the Trainer puts first): should_log is its verdict.
            seen.append((state.global_step, self.predicted, control.should_log))

    recipe = dict(tiny_recipe, max_steps=9, logging_steps=4, logging_first_step=True)
    keep = KeepState()
    record = train(*parse_recipe(recipe), callbacks=[Check(), keep], trainer_class=Probe)
    assert record["status"] == "ok", record.get("traceback")
    assert [s for s, _, _ in seen] == list(range(1, 10))
    assert all(predicted == actual for _, predicted, actual in seen), seen
    assert [s for s, _, logged in seen if logged] == [1, 4, 8]


def test_without_the_nan_filter_a_non_finite_loss_ends_the_run_at_the_next_log(tiny_recipe, tmp_path):
    """The GPU recipes turn the Trainer's per-step NaN filter (a host-device sync) off: a step with a
    non-finite loss then reaches the log, and the run stops there, recorded as failed."""

    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                with torch.no_grad():
                    next(model.parameters()).fill_(float("nan"))

    recipe = dict(tiny_recipe, max_steps=12, logging_steps=4, logging_nan_inf_filter=False)
    keep = KeepState()
    record = train(*parse_recipe(recipe), callbacks=[Poison(), keep])
    assert record["status"] == "failed"
    assert record["error"] == "non-finite training loss nan at step 4"
    assert [e["step"] for e in keep.log_history if "loss" in e] == [4]


def test_tokens_are_counted_without_a_gather_only_where_batches_are_equal(tiny_recipe, tmp_path):
    """With several processes the count is numel x processes only for rows of one length dealt by
    accelerate's even_batches (`looped_hf.train`'s TokenBlocks); otherwise the Trainer's gather
    stays. (tests/test_distributed.py checks the 2-process count against 1 process.)"""
    from transformers import TrainingArguments

    from looped_hf import LoopedConfig, LoopedForCausalLM
    from looped_hf.data import DataArguments, TokenBlocks, build_datasets, load_tokenizer

    tok = load_tokenizer("bytes")
    args = DataArguments(dataset=tiny_recipe["dataset"], tokenizer="bytes", seq_len=32, eval_blocks=8,
                         data_cache_dir=tiny_recipe["data_cache_dir"])  # fmt: skip
    rows, _ = build_datasets(args, tok)
    model = LoopedForCausalLM(LoopedConfig(vocab_size=len(tok), hidden_size=32, num_attention_heads=2))
    targs = TrainingArguments(str(tmp_path / "t"), report_to="none", use_cpu=True)
    assert LoopedTrainer(model=model, args=targs, train_dataset=TokenBlocks.wrap(rows))._equal_batches_on_every_process()
    assert not LoopedTrainer(model=model, args=targs, train_dataset=rows)._equal_batches_on_every_process()
    uneven = LoopedTrainer(model=model, args=targs, train_dataset=TokenBlocks.wrap(rows))
    uneven.accelerator.even_batches = False
    assert not uneven._equal_batches_on_every_process()
