"""LoopedTrainer.training_step skips torch's `model.train()` walk when every module is training
already (the Trainer calls it every micro-batch), and sets every module when one is not."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_model
from transformers import TrainingArguments

from looped_hf.trainer import LoopedTrainer, _all_in_mode


@pytest.fixture
def trainer_and_batch(tmp_path):
    model = tiny_looped_model()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = LoopedTrainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which is not run here
    ids = torch.randint(0, TINY_VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return trainer, model, {"input_ids": ids, "labels": ids}


def test_the_step_skips_the_walk_when_everything_is_training(trainer_and_batch, monkeypatch):
    trainer, model, batch = trainer_and_batch
    model.train()
    walked = []
    real = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: walked.append(self) or real(self, mode))
    loss = trainer.training_step(model, batch)
    assert torch.isfinite(loss) and walked == []
    assert "train" not in model.__dict__  # the shadowing attribute is gone after the step
    assert model.train() is model and walked  # outside the step, train() is torch's


def test_a_module_in_eval_mode_is_set_back_to_training(trainer_and_batch, monkeypatch):
    trainer, model, batch = trainer_and_batch
    model.train()
    model.model.coda_layers[-1].self_attn.eval()  # one module off: the step must set it back
    trainer.training_step(model, batch)
    assert all(m.training for m in model.modules())
    model.eval()
    assert _all_in_mode(model, False) and not _all_in_mode(model, True)
    trainer.training_step(model, batch)
    assert _all_in_mode(model, True)


def test_the_attribute_is_removed_when_the_step_raises(trainer_and_batch):
    trainer, model, batch = trainer_and_batch
    model.train()
    with pytest.raises(TypeError, match="bogus"):
        trainer.training_step(model, {"input_ids": batch["input_ids"], "labels": batch["labels"], "bogus": 1})
    assert "train" not in model.__dict__
