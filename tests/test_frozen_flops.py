"""The training FLOPs of a model with frozen weights (a frozen backbone, peft LoRA) are what its
backward runs: torch's FlopCounterMode over one training step of the model as `train` builds it
(accounting_looped's frozen-parameter section; docs/conventions.md)."""

from __future__ import annotations

import pytest
import torch
from test_retrofit_train import _recipe, looped_folder  # noqa: F401 - a tiny retrofit folder (fixture)

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import LoopedTrainingArguments
from looped_hf.optim import peft_base
from looped_hf.recurrent_block_looped import LoopedRecurrentBlock
from looped_hf.train import what_trains

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, D, T, R = 64, 32, 16, 3  # vocab (a multiple of 64: no padded head rows), width, tokens, recurrences
P, K, C = 1, 2, 1  # prelude, block, coda layers


def _model(backprop_recurrences: int | None) -> LoopedForCausalLM:
    """A retrofit's shape: linear [e; h] adapter, pre-norm layers; eager attention, whose matmuls the
    counter sees at full T as the formula counts them."""
    config = LoopedConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_attention_heads=2, num_key_value_heads=2,
        num_prelude_layers=P, num_recurrent_layers=K, num_coda_layers=C, num_recurrences=R,
        backprop_recurrences=backprop_recurrences, input_injection="linear",
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return LoopedForCausalLM(config).train()


def _measured(model: torch.nn.Module) -> float:
    """FLOPs per token of one forward + backward, as torch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, V, (2, T))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return counter.get_total_flops() / ids.numel()


@pytest.fixture
def concatenated_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model computes the adapter's W_e e once per forward (`injection_split`); the study's
    count, which the library keeps, is one [e; h] matmul per recurrence: what the model runs
    without the split (as it does under LoRA)."""
    monkeypatch.setattr(LoopedRecurrentBlock, "injection_split", lambda self, e: None)


# A layer's two norm scales (D each) count as weights in the study's convention (2N forward, 2N
# for their input's gradient where it flows, 2N for their own if they train); the counter sees
# no matmul there. That, and nothing else, is the difference below.
NORMS = 2 * D


@pytest.mark.usefixtures("concatenated_adapter")
@pytest.mark.parametrize("backprop", [None, 2])
def test_frozen_backbone_flops_are_what_its_backward_runs(backprop: int | None, tmp_path) -> None:
    model = what_trains(
        _model(backprop), LoopedTrainingArguments(output_dir=str(tmp_path), freeze_backbone=True)
    )
    r_nograd = 0 if backprop is None else R - backprop
    # Nothing trains below the adapter: the prelude and the forward-only steps run forward only;
    # every layer application after the first trained step's adapter passes gradient back.
    norms = 2 * NORMS * (P + K * r_nograd) + 4 * NORMS * (K * (R - r_nograd) + C)
    counted = model.training_flops_per_token(T)
    assert counted == _measured(model) + norms
    everything = _model(backprop).training_flops_per_token(T)
    assert counted < 0.75 * everything  # no weight gradient but the adapter's, no backward below it


@pytest.mark.parametrize("backprop", [None, 2])
def test_lora_flops_are_what_its_backward_runs(backprop: int | None, tmp_path) -> None:
    args = LoopedTrainingArguments(output_dir=str(tmp_path), lora_rank=4, lora_alpha=8)
    model = what_trains(_model(backprop), args)
    r_nograd = 0 if backprop is None else R - backprop
    # The first layer's input norm reads the embedding, which does not train: no input gradient
    # there; its LoRA on q/k/v makes everything after it need gradient.
    norms = 2 * D + 4 * D + 2 * NORMS * K * r_nograd + 4 * NORMS * (K * (R - r_nograd) + C)
    counted = peft_base(model).training_flops_per_token(T)
    assert counted == _measured(model) + norms
    assert counted < _model(backprop).training_flops_per_token(T)


@pytest.mark.usefixtures("concatenated_adapter")
def test_frozen_embedding_and_first_norm_spare_the_first_projections_input_gradient() -> None:
    model = _model(None)
    everything = model.training_flops_per_token(T)
    base = model.model
    for module in (base.embed_tokens, base.embedding_norm, base.prelude_layers[0].input_layernorm):
        module.requires_grad_(False)
    # Gradient flows into the first layer's q/k/v (they train) but not out of them, nor into the
    # frozen norm before them (a trained scale there would need q/k/v's input gradient).
    counted = model.training_flops_per_token(T)
    assert counted == _measured(model) + 2 * D + 6 * D + 6 * NORMS * (K * R + C)
    assert counted == everything - 2 * (3 * D * D) - 4 * D


@pytest.mark.parametrize("mode", [{"freeze_backbone": True}, {"lora_rank": 4, "learning_rate": 1e-2}])
def test_frozen_and_lora_runs_report_the_frozen_count(
    mode,
    tiny_recipe,
    looped_folder,  # noqa: F811 - the fixture imported above
    tmp_path,
) -> None:
    """The compute callback's `train_flops` and the planned FLOPs per token of the run record are
    the model's count as it trained, frozen weights and all."""
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train

    model_args, data_args, training_args = parse_recipe(
        _recipe(tiny_recipe, looped_folder, max_steps=2, output_dir=str(tmp_path / "run"), **mode)
    )
    config = LoopedConfig.from_pretrained(looped_folder, num_recurrences=4, backprop_recurrences=2)
    with torch.device("meta"):
        as_trained = peft_base(what_trains(LoopedForCausalLM(config), training_args))
    expected = as_trained.training_flops_per_token(data_args.seq_len)
    assert expected < LoopedForCausalLM(config).training_flops_per_token(data_args.seq_len)
    record = train(model_args, data_args, training_args)
    assert record["status"] == "ok", record.get("traceback")
    assert record["train_flops_per_token"] == expected
    assert record["train_flops"] == record["tokens"] * expected
