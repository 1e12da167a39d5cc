"""The study's model conventions (kschwethelm/looped-lm-scaling, nanochat/gpt.py), and 0.1.0 checkpoints.

Each test pins one convention a phi measurement depends on: what every recurrence reads at init,
the hyperconnection update, QK-norm, the initialisation, the accounting; and that checkpoints saved
by looped_hf 0.1.0 (tests/data/v0_1_0, made by that release) still give their saved logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from looped_hf import LoopedConfig, LoopedForCausalLM

VOCAB = 97
V010 = Path(__file__).parent / "data" / "v0_1_0"


def config(**overrides) -> LoopedConfig:
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_prelude_layers=1, num_recurrent_layers=2, num_coda_layers=1, num_recurrences=4,
        max_position_embeddings=128, pad_token_id=0,
    )
    kwargs.update(overrides)
    return LoopedConfig(**kwargs)


def ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))


def block_inputs_and_prelude(model: LoopedForCausalLM, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hook the first recurrent layer: its input at every recurrence, and the prelude output e."""
    seen: list[torch.Tensor] = []
    prelude_out: list[torch.Tensor] = []
    hooks = [
        model.model.recurrent_layers[0].register_forward_pre_hook(
            lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True
        ),
        model.model.prelude_layers[-1].register_forward_hook(lambda m, a, out: prelude_out.append(out[0].detach())),
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    assert len(prelude_out) == 1
    return seen, prelude_out[0]


# --------------------------------------------------------------------------------------------
# 1. Injection: every recurrence reads e at init
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init_scheme", ["hf", "study"])
def test_linear_injection_at_init_feeds_e_to_every_recurrence(init_scheme):
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(input_injection="linear", init_scheme=init_scheme)).eval()
    d = model.config.hidden_size
    torch.testing.assert_close(model.model.injection.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], 1))
    inputs, e = block_inputs_and_prelude(model, ids())
    assert len(inputs) == model.config.num_recurrences
    for step, u in enumerate(inputs):
        torch.testing.assert_close(u, e, rtol=0, atol=1e-6, msg=f"recurrence {step}")
    # 0.1.0's order [h; e] made the same untrained model a passthrough loop (the variant that
    # diverged in the study): from the second recurrence on, the block read its own output.
    model.config.looped_format = 1
    legacy_inputs, _ = block_inputs_and_prelude(model, ids())
    torch.testing.assert_close(legacy_inputs[0], e)
    assert not torch.allclose(legacy_inputs[1], e, atol=1e-3)


def test_linear_injection_reads_e_then_h_in_that_order():
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(input_injection="linear")).eval()
    d = model.config.hidden_size
    with torch.no_grad():  # W = [0 | I]: the block now reads the running state instead
        model.model.injection.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], 1))
    inputs, e = block_inputs_and_prelude(model, ids())
    torch.testing.assert_close(inputs[0], e)  # h_0 = e
    assert not torch.allclose(inputs[1], e, atol=1e-3)


def test_additive_injection_starts_from_zero_state():
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(input_injection="add")).eval()
    assert model.config.state_init == "zeros"
    inputs, e = block_inputs_and_prelude(model, ids())
    torch.testing.assert_close(inputs[0], e)  # e, not 2e
    # Later recurrences read their state plus e: u_i = norm(block(u_{i-1})) + e.
    captured = []
    hook = model.model.recurrence_norm.register_forward_hook(lambda m, a, out: captured.append(out.detach()))
    with torch.no_grad():
        model(ids())
    hook.remove()
    for step in range(1, model.config.num_recurrences):
        torch.testing.assert_close(inputs[step], captured[step - 1] + e)


def test_additive_injection_keeps_an_explicit_state_init():
    # An explicit choice is honoured, not overridden: h_0 = e gives 2e (looped_hf 0.1.0's form).
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(input_injection="add", state_init="prelude")).eval()
    inputs, e = block_inputs_and_prelude(model, ids())
    torch.testing.assert_close(inputs[0], 2 * e)


def test_injection_adapter_is_a_linear_layer_lora_can_target():
    model = LoopedForCausalLM(config())
    assert type(model.model.injection) is torch.nn.Linear
    assert model.model.injection.weight.shape == (32, 64)
    assert "model.injection.weight" in model.state_dict()  # the key 0.1.0 wrote


# --------------------------------------------------------------------------------------------
# 2. Hyperconnections
# --------------------------------------------------------------------------------------------


def test_hyperconnection_update_follows_the_study():
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(input_injection="hyperconnection", num_hyperconnection_lanes=2)).eval()
    hc = model.model.hyperconnection
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = ids()
    base = model.model
    seen, e = block_inputs_and_prelude(model, x)
    # By hand: lanes start as e; u = sum_j alpha_j H_j; H <- M H + beta * norm_recur(block(u)).
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    pe = base.rotary_emb(e, pos)
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        lanes = torch.stack([e, e])
        for step in range(model.config.num_recurrences):
            u = (hc.alpha[step][:, None, None, None] * lanes).sum(0)
            torch.testing.assert_close(u, seen[step], msg=f"block input at recurrence {step}")
            for layer in base.recurrent_layers:
                u = layer(u, attention_mask=mask, position_embeddings=pe)[0]
            s = base.recurrence_norm(u)
            lanes = torch.einsum("ij,jbtd->ibtd", hc.mixing[step], lanes) + hc.beta[step][:, None, None, None] * s
        h = lanes.sum(0)
        for layer in base.coda_layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe)[0]
        expected = model.logits_from_hidden(base.norm(h))
        torch.testing.assert_close(model(x).logits, expected, rtol=1e-5, atol=1e-5)


def test_hyperconnections_refuse_truncated_backprop_but_allow_k_equal_r():
    with pytest.raises(ValueError, match="LoopedConfig.backprop_recurrences=2.*full backprop"):
        config(input_injection="hyperconnection", backprop_recurrences=2)
    assert config(input_injection="hyperconnection", backprop_recurrences=4).backprop_recurrences == 4


# --------------------------------------------------------------------------------------------
# 3. QK-norm
# --------------------------------------------------------------------------------------------


def test_study_qk_norm_has_no_weights_and_equals_the_unit_learnable_form():
    torch.manual_seed(0)
    study = LoopedForCausalLM(config()).eval()
    assert study.config.qk_norm == "after_rope"
    assert not any("q_norm" in n or "k_norm" in n for n, _ in study.named_parameters())
    learnable = LoopedForCausalLM(config(qk_norm="learnable_before_rope")).eval()
    missing, unexpected = learnable.load_state_dict(study.state_dict(), strict=False)
    assert not unexpected and all("q_norm" in k or "k_norm" in k for k in missing) and missing
    # RoPE rotates pairs of dims and so keeps each head's RMS: with unit scales the two placements agree.
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(study(x).logits, learnable(x).logits, rtol=1e-5, atol=1e-5)
        # ... and with a learned scale they differ: the option is real.
        learnable.model.prelude_layers[0].self_attn.q_norm.weight.mul_(torch.linspace(0.5, 2, 8))
        assert not torch.allclose(study(x).logits, learnable(x).logits, atol=1e-4)


def test_study_qk_norm_makes_attention_invariant_to_the_scale_of_q_and_k():
    torch.manual_seed(0)
    model = LoopedForCausalLM(config()).eval()
    x = ids()
    with torch.no_grad():
        before = model(x).logits
        for layer in model.model.prelude_layers:
            layer.self_attn.q_proj.weight.mul_(7.0)
            layer.self_attn.k_proj.weight.mul_(0.2)
        torch.testing.assert_close(model(x).logits, before, rtol=1e-4, atol=1e-4)
        off = LoopedForCausalLM(config(qk_norm="none")).eval()
        off.load_state_dict(model.state_dict())
        assert not torch.allclose(off(x).logits, before, atol=1e-3)


@pytest.mark.parametrize("value, expected", [(True, "after_rope"), (False, "none"), (None, "none")])
def test_qk_norm_accepts_booleans(value, expected):
    assert config(qk_norm=value).qk_norm == expected


def test_bad_qk_norm_and_init_scheme_name_the_field():
    with pytest.raises(ValueError, match="LoopedConfig.qk_norm='after'"):
        config(qk_norm="after")
    with pytest.raises(ValueError, match="LoopedConfig.init_scheme='nanochat'"):
        config(init_scheme="nanochat")


# --------------------------------------------------------------------------------------------
# 4. Initialisation
# --------------------------------------------------------------------------------------------


def _uniform_bound_ok(w: torch.Tensor, std: float) -> None:
    bound = math.sqrt(3) * std
    assert w.abs().max() <= bound + 1e-7
    assert w.abs().max() > 0.95 * bound  # spread up to the bound, not normal
    assert abs(w.std().item() - std) < 0.05 * std


def test_study_init_matches_nanochat():
    torch.manual_seed(0)
    d = 64
    model = LoopedForCausalLM(config(hidden_size=d, num_attention_heads=4, num_key_value_heads=4, init_scheme="study"))
    base = model.model
    emb = base.embed_tokens.weight[1:]  # row 0 is the padding row, zero as in transformers
    assert abs(emb.std().item() - 1.0) < 0.05 and torch.all(base.embed_tokens.weight[0] == 0)
    assert abs(model.lm_head.weight.std().item() - 0.001) < 1e-4
    for layer in [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers]:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp.up_proj):
            _uniform_bound_ok(proj.weight, d**-0.5)
        _uniform_bound_ok(layer.mlp.down_proj.weight, (4 * d) ** -0.5)
        assert torch.all(layer.input_layernorm.weight == 1)
    torch.testing.assert_close(base.injection.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], 1))


def test_hf_init_stays_the_default():
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(hidden_size=64))
    assert model.config.init_scheme == "hf"
    w = model.model.prelude_layers[0].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002 and w.abs().max() > math.sqrt(3) * 0.02  # normal tails
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.002


def test_study_init_survives_a_save_load_and_never_reinitialises_loaded_weights(tmp_path):
    torch.manual_seed(0)
    model = LoopedForCausalLM(config(init_scheme="study"))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


# --------------------------------------------------------------------------------------------
# 5. Checkpoints of looped_hf 0.1.0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["linear", "add", "hyperconnection"])
def test_checkpoint_saved_by_0_1_0_loads_with_identical_logits(variant, tmp_path):
    folder = V010 / variant
    assert "looped_format" not in json.loads((folder / "config.json").read_text())
    expected = load_file(folder / "expected_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.config.looped_format == 1
    assert model.config.qk_norm == "learnable_before_rope"
    with torch.no_grad():
        torch.testing.assert_close(model(expected["input_ids"]).logits, expected["logits"], rtol=0, atol=1e-6)
    # Saved again, it stays format 1 and still gives the same logits.
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["looped_format"] == 1
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(expected["input_ids"]).logits, expected["logits"], rtol=0, atol=1e-6)


def test_new_checkpoints_record_their_format(tmp_path):
    model = LoopedForCausalLM(config())
    assert model.config.looped_format == 2
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["looped_format"] == 2
    assert AutoConfig.from_pretrained(tmp_path).looped_format == 2


def test_unknown_future_format_is_refused():
    with pytest.raises(ValueError, match="LoopedConfig.looped_format=3"):
        config(looped_format=3)


# --------------------------------------------------------------------------------------------
# Accounting for hyperconnections: the study's "equivalent params"
# --------------------------------------------------------------------------------------------


def test_hyperconnection_flops_count_lane_mixing_as_the_study():
    cfg = config(input_injection="hyperconnection", num_hyperconnection_lanes=2)
    plain = config(input_injection="none")
    with torch.device("meta"):
        hc, base = LoopedForCausalLM(cfg), LoopedForCausalLM(plain)
    T, d, n, r = 64, 32, 2, cfg.num_recurrences
    # Same layers; the lanes add (N^2 + 2N) d per recurrence at 6x (gpt.py estimate_flops).
    assert hc.training_flops_per_token(T) - base.training_flops_per_token(T) == 6 * r * (n * n + 2 * n) * d
    assert hc.num_scaling_params()["recurrent"] - base.num_scaling_params()["recurrent"] == r * (n * n + 2 * n)


def test_padded_vocabulary_rows_are_counted_but_never_get_probability_or_gradient():
    torch.manual_seed(0)
    padded = LoopedForCausalLM(config(pad_vocab_size_to_multiple_of=64))
    assert padded.config.padded_vocab_size == 128
    assert padded.lm_head.weight.shape[0] == 128 and padded.model.embed_tokens.weight.shape[0] == 128
    x = ids()
    out = padded(x, labels=x)
    assert out.logits.shape[-1] == VOCAB
    # Cropping first: the logits are exactly those of the first VOCAB rows of the head.
    plain = LoopedForCausalLM(config())
    plain.load_state_dict({k: (v[:VOCAB] if k in ("lm_head.weight", "model.embed_tokens.weight") else v)
                           for k, v in padded.state_dict().items()})  # fmt: skip
    torch.testing.assert_close(plain(x, labels=x).logits, out.logits, rtol=0, atol=0)
    out.loss.backward()
    assert padded.lm_head.weight.grad[VOCAB:].abs().max() == 0
    # Accounting: the padded rows are computed (the study's estimate_flops counts them too).
    d = padded.config.hidden_size
    assert padded.num_scaling_params()["lm_head"] == 128 * d
    diff = padded.training_flops_per_token(16) - plain.training_flops_per_token(16)
    assert diff == 6 * (128 - VOCAB) * d


def test_padding_multiple_and_rope_table_dtype_are_validated():
    with pytest.raises(ValueError, match="LoopedConfig.pad_vocab_size_to_multiple_of=0"):
        config(pad_vocab_size_to_multiple_of=0)
    with pytest.raises(ValueError, match="LoopedConfig.rope_table_dtype='bf16'"):
        config(rope_table_dtype="bf16")


def test_bf16_rope_tables_round_cos_and_sin_as_the_study_keeps_them():
    model = LoopedForCausalLM(config(rope_table_dtype="bfloat16"))
    reference = LoopedForCausalLM(config())
    x = torch.zeros(1, 5, 8)
    pos = torch.arange(100, 105)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    cos_full, sin_full = reference.model.rotary_emb(x, pos)
    assert cos.dtype == torch.float32
    torch.testing.assert_close(cos, cos_full.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_full.bfloat16().float(), rtol=0, atol=0)
    assert (cos - cos_full).abs().max() > 0  # the rounding is real at these positions
