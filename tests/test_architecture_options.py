"""The architecture options published looped LMs need, on tiny models: each does what its field says,
each is counted in N_once / N_rec where it sits, and the defaults build today's layer (the study-parity
and 0.1.0-checkpoint tests pin the defaults' logits bit for bit)."""

from __future__ import annotations

import pytest
import torch

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.modeling_looped import DECODER_LAYERS, LoopedDecoderLayer

TINY = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, intermediate_size=64, num_prelude_layers=1,
            num_recurrent_layers=1, num_coda_layers=1, num_recurrences=2, max_position_embeddings=32)  # fmt: skip


def _model(**kwargs) -> LoopedForCausalLM:
    torch.manual_seed(0)
    model = LoopedForCausalLM(LoopedConfig(**{**TINY, **kwargs})).eval()
    with torch.no_grad():  # norm scales away from 1, so a norm applied twice or not at all shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


IDS = torch.tensor([[3, 14, 15, 9, 2, 6]])


def test_the_default_placement_is_todays_pre_norm_layer() -> None:
    layer = _model().model.recurrent_layers[0]
    assert type(layer) is LoopedDecoderLayer
    assert sorted(n for n, _ in layer.named_children() if "norm" in n) == ["input_layernorm", "post_attention_layernorm"]


@pytest.mark.parametrize("placement", DECODER_LAYERS)
def test_each_norm_placement_builds_its_norms_and_counts_them_with_the_layer(placement: str) -> None:
    model = _model(norm_placement=placement)
    layer = model.model.recurrent_layers[0]
    assert isinstance(layer, LoopedDecoderLayer) and type(layer) is DECODER_LAYERS[placement]
    assert sorted(layer.norm_names) == sorted(n for n, _ in layer.named_children() if n.endswith("norm"))
    assert len(layer.norm_names) == {"pre": 2, "sandwich": 4, "sublayer_output": 2, "pre_and_output": 4}[placement]
    params = model.num_scaling_params()
    assert params["recurrent"] == sum(p.numel() for p in layer.parameters()) + model.model.injection.weight.numel()
    assert model(IDS).logits.isfinite().all()


def test_placements_differ_in_the_forward() -> None:
    logits = {p: _model(norm_placement=p)(IDS).logits for p in DECODER_LAYERS}
    values = list(logits.values())
    assert all(not torch.allclose(a, b) for i, a in enumerate(values) for b in values[i + 1:])


def test_embedding_multiplier_scales_looked_up_and_given_embeddings_alike() -> None:
    model = _model(embedding_multiplier=4.0, embedding_norm=False)
    embeds = model.model.embed_tokens(IDS)
    with torch.no_grad():
        a, b = model(IDS).logits, model(inputs_embeds=embeds).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    plain = _model(embedding_norm=False)
    with torch.no_grad():
        assert not torch.allclose(plain(IDS).logits, a)
        torch.testing.assert_close(plain(inputs_embeds=4.0 * embeds).logits, a, rtol=0, atol=0)


def test_post_loop_norm_own_is_a_parameter_of_n_once_and_runs_before_the_coda() -> None:
    model = _model(post_loop_norm="own")
    base = model.model
    assert base.post_loop_norm is not None and base.loop_norms()[1] is base.post_loop_norm
    with_norm = model.num_scaling_params()["once"]
    assert with_norm == _model().num_scaling_params()["once"] + TINY["hidden_size"]
    # Elementwise: FLOPs unchanged by it.
    assert model.inference_flops_per_token(8) == _model().inference_flops_per_token(8)
    before = model(IDS).logits
    with torch.no_grad():
        base.post_loop_norm.weight.mul_(2.0)
    assert not torch.allclose(before, model(IDS).logits)


def test_post_loop_norm_final_shares_the_final_norm() -> None:
    model = _model(post_loop_norm="final")
    base = model.model
    assert base.post_loop_norm is None and base.loop_norms()[1] is base.norm
    assert model.num_scaling_params() == _model().num_scaling_params()
    hidden = []
    base.coda_layers[0].register_forward_pre_hook(lambda _, args: hidden.append(args[0]))
    with torch.no_grad():
        out = model(IDS, output_recurrent_states=True)
    torch.testing.assert_close(hidden[0], base.norm(out.recurrent_states[-1]), rtol=0, atol=0)


def test_a_recurrence_norm_that_is_the_final_norm_runs_once_at_the_end_of_a_coda_free_loop() -> None:
    model = _model(recurrence_norm_weight="final", num_coda_layers=0, num_prelude_layers=0,
                   input_injection="none", state_init="prelude", embedding_norm=False)  # fmt: skip
    base = model.model
    assert base.recurrence_norm is None and base.loop_norms() == (base.norm, None, None)
    with torch.no_grad():
        out = model.model(IDS, output_recurrent_states=True)
    # The last recurrence's normed state IS the output (Ouro's per-loop logits come from it directly).
    torch.testing.assert_close(out.last_hidden_state, out.recurrent_states[-1], rtol=0, atol=0)
    assert model.num_scaling_params()["once"] == TINY["hidden_size"]  # the one norm
    with_coda = _model(recurrence_norm_weight="final")
    assert with_coda.model.loop_norms()[2] is with_coda.model.norm  # after a coda the final norm runs again


def test_recurrence_norm_weight_needs_a_recurrence_norm() -> None:
    with pytest.raises(ValueError, match="recurrence_norm_weight='final': names the recurrence norm's weight"):
        LoopedConfig(**TINY, recurrence_norm=False, recurrence_norm_weight="final")


def test_qk_bias_and_the_whole_projection_qk_norm_are_attention_parameters() -> None:
    model = _model(qk_bias=True, qk_norm="learnable_projection_before_rope", num_key_value_heads=1)
    attn = model.model.recurrent_layers[0].self_attn
    assert attn.q_proj.bias.shape == (32,) and attn.k_proj.bias.shape == (16,) and attn.v_proj.bias is None
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)
    before = model(IDS).logits
    with torch.no_grad():
        attn.k_proj.bias.add_(1.0)
    assert not torch.allclose(before, model(IDS).logits)


def test_the_truncated_normal_state_keeps_its_distribution_in_a_compilable_draw() -> None:
    """``state_init="truncated_normal"``: N(0, std) cut at +-3 std, times embedding_multiplier, drawn by
    the inverse CDF (no rejection loop, so fullgraph compile traces it). 204,800 draws against the exact
    moments and CDF of the standard normal truncated to [-3, 3], tolerances from their standard errors."""
    import math

    std, scale, n = 0.05, 2.0, 204_800
    model = _model(state_init="truncated_normal", state_init_std=std, embedding_multiplier=scale)
    torch.manual_seed(0)
    h = model.model.initial_state_rule(model.config, torch.zeros(4, n // 128, 32))
    x = h.flatten().double() / (std * scale)  # the standard truncated normal, if right
    assert x.numel() == n
    # Exact moments of N(0, 1) on [-3, 3] (symmetric, so the odd ones are 0), on a fine grid.
    grid = torch.linspace(-3, 3, 600_001, dtype=torch.float64)
    pdf = torch.exp(-(grid**2) / 2)
    pdf /= torch.trapezoid(pdf, grid)
    var = torch.trapezoid(grid**2 * pdf, grid).item()
    fourth = torch.trapezoid(grid**4 * pdf, grid).item()
    assert math.isclose(var, 1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)), rel_tol=1e-9)
    assert abs(x.mean().item()) < 5 * math.sqrt(var / n)
    assert abs(x.var().item() - var) < 5 * math.sqrt((fourth - var**2) / n)
    # Bounds: none past the cut; the last 1% of each tail is drawn (about 18 expected, P(none) ~ e^-18).
    assert x.abs().max().item() <= 3 + 1e-6 and (x > 2.97).any() and (x < -2.97).any()
    # The whole CDF: Kolmogorov-Smirnov distance under its 1e-6 critical value, sqrt(ln(2e6) / 2n).
    xs = x.sort().values
    cdf = (torch.erf(xs / math.sqrt(2)) / math.erf(3 / math.sqrt(2)) + 1) / 2
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    distance = torch.maximum(ranks - cdf, cdf - (ranks - 1 / n)).max().item()
    assert distance < math.sqrt(math.log(2e6) / (2 * n))
    # std 0 is Huginn's deterministic zero state; other dtypes get the same draw, cast.
    assert h.dtype == torch.float32
    assert model.model.initial_state_rule(model.config, torch.zeros(2, 3, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
