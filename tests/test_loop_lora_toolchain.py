"""Retrofits and the per-loop LoRA model under the transformers toolchain: activation
checkpointing, deep copies, peft's usual targets, TRL, the heads, the loop step and the KV budget.

Every case runs on random weights where the per-loop deltas differ by loop (a retrofit of a random
parent: each loop's deltas are the SVD of its own parent layer's residual), so handing a layer the
wrong loop's deltas changes the result. The loop step is an argument of each layer application
(``loop_lora_looped.py``), so checkpointing replays it, a copy holds its own deltas, and a KV
budget (slots shared across loops) leaves each loop its own deltas.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import tiny_looped_config
from test_retrofit import load_pair, retrofit, tiny_parent

from looped_hf.loop_lora_looped import LoopLoRAConfig, LoopLoRAForCausalLM

#: peft's usual Llama target list (TRL's and most scripts' LoRA recipes).
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Retrofit forms -> CLI flags (on a 4-layer random Llama parent), and the r each is run at.
FORMS = {
    "drop": (["--layers", "1,1,1"], 2),  # default h_0: the truncated normal
    "loop_in_place_zeros": (["--loop-in-place", "--layers", "1,2,1", "--state-init", "zeros"], 2),
    "loop_in_place_prelude": (["--loop-in-place", "--layers", "1,2,1", "--state-init", "prelude"], 2),
    "share": (["--share", "average", "--blocks", "1"], 4),
    "share_lora": (["--share", "average", "--blocks", "1", "--lora-rank", "4"], 4),
    "share_lora_stepwise": (["--share", "stepwise", "--blocks", "2", "--lora-rank", "2"], 2),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("toolchain")
    parent = tiny_parent(base / "parent", "llama", num_layers=4)
    for name, (flags, _) in FORMS.items():
        retrofit(parent, *flags, "--out", base / name)
    return {"parent": parent, **{name: base / name for name in FORMS}}


def _load(folders, form: str):
    return load_pair(folders["parent"], folders[form])[1]


def ids() -> torch.Tensor:
    return torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(1))


def tiny_loop_lora(seed: int = 0, **overrides) -> LoopLoRAForCausalLM:
    """A per-loop LoRA model built from its config, every delta random (so loops differ)."""
    kwargs = dict(loop_lora_rank=3, loop_lora_targets=["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"], loop_lora_loops=6,
                  hidden_act="silu", qk_norm="learnable_before_rope")  # fmt: skip
    kwargs.update(overrides)
    config = LoopLoRAConfig(
        **{k: v for k, v in tiny_looped_config(**kwargs).to_dict().items() if k != "model_type"}
    )
    torch.manual_seed(seed)
    model = LoopLoRAForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.model.loop_lora.parameters():
            p.normal_(0, 0.2)
    return model


def _grads(model, tokens, r: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # a random h_0 draws the same state in both passes
    loss = model(tokens, labels=tokens, num_recurrences=r, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(model, r: int, reentrant: bool) -> None:
    tokens = ids()
    model.train()
    loss, plain = _grads(model, tokens, r)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.model.gradient_checkpointing
    checkpointed_loss, checkpointed = _grads(model, tokens, r)
    torch.testing.assert_close(checkpointed_loss, loss, rtol=1e-6, atol=0)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(plain) == set(checkpointed) == trainable, set(plain) ^ set(checkpointed) ^ trainable
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_gradients_under_activation_checkpointing_equal_the_plain_ones(folders, form, reentrant):
    _assert_same_gradients(_load(folders, form), FORMS[form][1], reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("model_type", ["looped", "looped_loop_lora"])
def test_gradients_under_activation_checkpointing_equal_for_every_model_type(model_type, reentrant):
    from conftest import tiny_looped_model

    model = tiny_looped_model(hidden_act="silu") if model_type == "looped" else tiny_loop_lora()
    assert model.config.model_type == model_type
    _assert_same_gradients(model, 6, reentrant)  # the loop-LoRA model's 6 loops: every delta trains


def test_the_per_loop_deltas_differ_by_loop_so_a_wrong_step_would_show(folders):
    """Guard of the cases above: handing every loop loop 0's deltas changes the logits."""
    model = _load(folders, "share_lora")
    steps = model.model.loop_lora.steps
    with torch.no_grad():
        right = model(ids()).logits
        for step in steps[1:]:
            step.load_state_dict(steps[0].state_dict())
        assert (model(ids()).logits - right).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("model_type", ["looped", "looped_loop_lora"])
def test_a_deep_copy_is_independent_of_its_original(model_type, mode):
    from conftest import tiny_looped_model

    model = tiny_looped_model() if model_type == "looped" else tiny_loop_lora()
    getattr(model, mode)()
    tokens = ids()
    with torch.no_grad():
        before = model(tokens).logits
        twin = copy.deepcopy(model)
        torch.testing.assert_close(twin(tokens).logits, before, rtol=0, atol=0)
        for p in model.parameters():  # the original's weights move: the copy's logits stay
            p.add_(0.05 * torch.randn_like(p))
        moved = model(tokens).logits
        assert (moved - before).abs().max() > 1e-2
        torch.testing.assert_close(twin(tokens).logits, before, rtol=0, atol=0)
        for p in twin.parameters():  # and the other way round
            p.mul_(0.5)
        torch.testing.assert_close(model(tokens).logits, moved, rtol=0, atol=0)


def test_peft_with_the_usual_llama_targets_wraps_the_shared_projections_trains_merges_and_reloads(
    folders, tmp_path
):
    peft = pytest.importorskip("peft")
    model = _load(folders, "share_lora")
    deltas = {name: p.clone() for name, p in model.model.loop_lora.named_parameters()}
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=LLAMA_TARGETS)
    lora = peft.get_peft_model(model, config)
    wrapped = sorted(
        name for name, module in lora.named_modules() if hasattr(module, "lora_A") and name.endswith("proj")
    )
    assert wrapped and not [name for name in wrapped if "loop_lora" in name]
    # Every usual target of every layer (the RRT share has no prelude or coda): the shared block's.
    assert all(".model.recurrent_layers." in name for name in wrapped)
    assert len(wrapped) == len(LLAMA_TARGETS) * model.config.num_recurrent_layers
    tokens = ids()
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    lora.train()
    for _ in range(4):
        optimizer.zero_grad()
        loss = lora(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lora.eval()
    with torch.no_grad():
        unmerged = lora(input_ids=tokens).logits
    lora.save_pretrained(tmp_path / "adapter")
    # The per-loop deltas are not peft's: frozen, untouched.
    for name, p in lora.base_model.model.model.loop_lora.named_parameters():
        assert not p.requires_grad and torch.equal(p, deltas[name]), name
    reloaded = peft.PeftModel.from_pretrained(_load(folders, "share_lora"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, unmerged, rtol=0, atol=0)
        merged = lora.merge_and_unload()
        assert type(merged) is LoopLoRAForCausalLM
        torch.testing.assert_close(merged(tokens).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_a_kv_budget_leaves_each_loop_its_own_deltas(folders):
    """With kv_budget=1 every loop shares block layer j's slot: a prefill's logits are the
    unbudgeted ones (each application attends to its fresh KV), as they are only if loop t runs
    its own deltas; and decoding with the budget runs (the HF model takes it, as vLLM does)."""
    model = _load(folders, "share_lora")
    tokens = ids()
    with torch.no_grad():
        full = model(tokens).logits
        budgeted = model(tokens, kv_budget=1, use_cache=True)
        torch.testing.assert_close(budgeted.logits, full, rtol=1e-5, atol=1e-5)
        out = model.generate(tokens, kv_budget=1, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 13)


def test_the_loop_lora_model_names_generation_mixin_and_has_the_standard_heads(tmp_path):
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        GenerationMixin,
    )

    from looped_hf.loop_lora_looped import (
        LoopLoRAForQuestionAnswering,
        LoopLoRAForSequenceClassification,
        LoopLoRAForTokenClassification,
    )

    assert GenerationMixin in LoopLoRAForCausalLM.__bases__
    lm = tiny_loop_lora()
    lm.save_pretrained(tmp_path / "lm")
    for auto, cls in ((AutoModelForSequenceClassification, LoopLoRAForSequenceClassification),
                      (AutoModelForTokenClassification, LoopLoRAForTokenClassification),
                      (AutoModelForQuestionAnswering, LoopLoRAForQuestionAnswering)):  # fmt: skip
        head = auto.from_pretrained(tmp_path / "lm", num_labels=3).eval()
        assert type(head) is cls
        # The trunk's deltas load from the causal LM's checkpoint: the head runs each loop's own.
        torch.testing.assert_close(head.model.loop_lora.steps[2][1]["q_proj_delta"].A,
                                   lm.model.loop_lora.steps[2][1]["q_proj_delta"].A, rtol=0, atol=0)  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(head.model(ids()).last_hidden_state, lm.model(ids()).last_hidden_state,
                                       rtol=0, atol=0)  # fmt: skip


def test_a_config_written_before_loop_lora_loops_reads_its_loops_from_max_recurrences():
    old = tiny_looped_config(max_recurrences=4).to_dict()
    old.update(model_type="looped_loop_lora", loop_lora_rank=2, loop_lora_targets=["mlp.up_proj"])
    config = LoopLoRAConfig.from_dict(old)
    assert config.loop_lora_loops == 4 and config.max_recurrences == 4
    model = LoopLoRAForCausalLM(config)
    assert len(model.model.loop_lora.steps) == 4
    # max_recurrences keeps its one meaning: lowering the ceiling leaves the layout (and the weights).
    lower = LoopLoRAConfig.from_dict({**old, "loop_lora_loops": 4, "max_recurrences": 3})
    assert len(LoopLoRAForCausalLM(lower).model.loop_lora.steps) == 4
    with pytest.raises(ValueError, match=r"num_recurrences=4: exceeds this model's ceiling of 3"):
        lower.resolve_num_recurrences(4)


def test_the_recurrence_ceiling_is_what_resolve_num_recurrences_accepts():
    """Without max_recurrences the looped ceiling (64 x r) would pass the loops with a LoRA: the loop-LoRA
    config's ceiling (which the depth sampler clamps to) stops at ``loop_lora_loops``, as
    ``resolve_num_recurrences`` does."""
    config = LoopLoRAConfig(**{k: v for k, v in tiny_looped_config(num_recurrences=2).to_dict().items()
                               if k != "model_type"}, loop_lora_rank=2, loop_lora_targets=["mlp.up_proj"],
                            loop_lora_loops=5)  # fmt: skip
    assert config.max_recurrences is None and config.recurrence_ceiling == 5
    assert config.resolve_num_recurrences(5) == 5
    with pytest.raises(ValueError, match=r"num_recurrences=6: a per-loop LoRA model runs at most its 5"):
        config.resolve_num_recurrences(6)
    config.max_recurrences = 3
    assert config.recurrence_ceiling == 3


@pytest.mark.parametrize("beta", [None, 0.1])
def test_an_exit_gate_no_loss_trains_is_frozen_with_one_log_line(beta, caplog):
    from looped_hf import LoopedForCausalLM

    config = tiny_looped_config(exit_gate=True, exit_gate_entropy_beta=beta, num_coda_layers=0)
    with caplog.at_level(logging.INFO, logger="looped_hf.modeling_looped"):
        model = LoopedForCausalLM(config)
    gate = model.model.exit_gate
    lines = [r.getMessage() for r in caplog.records if "exit_gate" in r.getMessage()]
    if beta is None:
        assert not any(p.requires_grad for p in gate.parameters())
        assert len(lines) == 1 and "frozen" in lines[0]
    else:  # Ouro's loss trains it
        assert all(p.requires_grad for p in gate.parameters()) and lines == []
    model.train()
    tokens = ids()
    model(tokens, labels=tokens).loss.backward()
    untrained = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert untrained == []


def test_trl_sft_with_the_usual_lora_targets_trains_a_loop_lora_model_under_checkpointing(folders, tmp_path):
    """TRL's SFT trainer with peft's usual Llama targets and gradient checkpointing on: the shared
    projections get the adapter (the per-loop deltas are not targets), and the loss falls."""
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from datasets import Dataset
    from transformers import AutoTokenizer

    model = _load(folders, "share_lora")
    tokenizer = AutoTokenizer.from_pretrained(folders["share_lora"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    config = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=4,
                           logging_steps=1, report_to="none", gradient_checkpointing=True, max_length=32,
                           learning_rate=1e-2, save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                           disable_tqdm=True)  # fmt: skip
    trainer = trl.SFTTrainer(model=model, args=config, processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"text": ["abcdefghij klmnop " * 3] * 16}),
                             peft_config=peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                         target_modules=LLAMA_TARGETS))  # fmt: skip
    trainer.train()
    wrapped = [
        name
        for name, module in trainer.model.named_modules()
        if hasattr(module, "lora_A") and name.endswith("proj")
    ]
    assert len(wrapped) == len(LLAMA_TARGETS) and not [name for name in wrapped if "loop_lora" in name]
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 3 and losses[-1] < losses[0]
