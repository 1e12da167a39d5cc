"""`DistillingTrainer` under gradient accumulation: GA = 2 on 4 rows equals GA = 1 on 8 rows, in the
loss and the gradients, on every transformers version the package accepts (pyproject: >=5.16.1).
5.16-5.18 decide the division by the accumulation steps from ``model_accepts_loss_kwargs``, 5.19 on
from ``loss_is_scaled_for_ga``; CI runs this file on 5.16.1 too (.ci/run)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.trainer import DistillingTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, ROWS, LENGTH = 64, 8, 12


class _Grads(TrainerCallback):
    """The gradients of the first optimizer step, as the optimizer is about to read them."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = {
                name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
            }


def _step(
    student, teacher, rows, tmp_path, batch: int, accumulation: int
) -> tuple[float, dict[str, torch.Tensor]]:
    grads = _Grads()
    args = TrainingArguments(
        str(tmp_path / f"ga{accumulation}"), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
        max_steps=1, learning_rate=1e-3, max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = DistillingTrainer(model=copy.deepcopy(student), args=args, train_dataset=rows, teacher=teacher,
                                callbacks=[grads], alpha=0.5, temperature=2.0)  # fmt: skip
    output = trainer.train()
    return output.training_loss, grads.grads


def test_gradient_accumulation_gives_the_loss_and_gradients_of_the_whole_batch(tmp_path):
    torch.manual_seed(0)
    student = LoopedForCausalLM(LoopedConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, head_dim=16, intermediate_size=64,
        num_prelude_layers=1, num_recurrent_layers=1, num_coda_layers=1, num_recurrences=2, state_init="zeros",
    ))  # fmt: skip
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, head_dim=16,
                                           intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64))  # fmt: skip
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]  # 8 rows: each run's one step sees all
    whole_loss, whole = _step(student, teacher, rows, tmp_path, batch=ROWS, accumulation=1)
    split_loss, split = _step(student, teacher, rows, tmp_path, batch=ROWS // 2, accumulation=2)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    assert whole and whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)
