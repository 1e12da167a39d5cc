"""The looped model: Auto registration, remote code, Llama parity, generation, training, accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, run_without_looped_hf, tiny_looped_config, tiny_looped_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import looped_hf
from looped_hf import LoopedConfig, LoopedForCausalLM

VOCAB = TINY_VOCAB
tiny_config = tiny_looped_config
tiny_model = tiny_looped_model


def prompts(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def greedy(model, ids, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)


# --------------------------------------------------------------------------------------------
# Auto API, checkpoints, remote code
# --------------------------------------------------------------------------------------------


def test_auto_classes_are_registered():
    cfg = AutoConfig.for_model("looped", hidden_size=32, num_attention_heads=2, vocab_size=VOCAB)
    assert isinstance(cfg, LoopedConfig)
    assert cfg.effective_num_layers == cfg.num_prelude_layers + cfg.num_recurrences * cfg.num_recurrent_layers + cfg.num_coda_layers
    model = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, LoopedForCausalLM)


def test_save_load_without_trust_remote_code(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py", "interface_looped.py", "generation_looped.py",
            "accounting_looped.py", "recurrent_block_looped.py", "decoder_layers_looped.py", "config_rules_looped.py",
            "parcae_looped.py", "loop_attention_looped.py"} <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_looped.LoopedForCausalLM"
    assert auto_map["AutoConfig"] == "configuration_looped.LoopedConfig"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LoopedForCausalLM
    ids = prompts()
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    # r can be chosen at load time, like any config field.
    deeper = AutoModelForCausalLM.from_pretrained(tmp_path, num_recurrences=6).eval()
    assert deeper.config.num_recurrences == 6 and deeper.config.effective_num_layers == 1 + 6 * 2 + 1
    torch.testing.assert_close(deeper(ids).logits, model(ids, num_recurrences=6).logits, rtol=0, atol=0)


def test_remote_code_loads_in_a_process_without_looped_hf(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    ids = prompts()
    exit_kwargs = dict(exit_criterion="kl", exit_threshold=1e-3)
    exit_out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                              **exit_kwargs)  # fmt: skip
    torch.save({"ids": ids, "logits": model(ids).logits, "gen": greedy(model, ids, num_recurrences=5),
                "exit": exit_out.sequences, "used": exit_out.recurrences_used,
                "gen1": greedy(model, ids[:1], num_recurrences=5)}, tmp_path / "ref.pt")  # fmt: skip
    script = f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(ckpt)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        # the decoder layers come from the shipped decoder_layers_looped.py, loaded as remote code too
        layer_module = type(model.model.recurrent_layers[0]).__module__
        assert layer_module.startswith("transformers_modules") and layer_module.endswith(".decoder_layers_looped")
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        torch.testing.assert_close(model(ref["ids"]).logits, ref["logits"], rtol=0, atol=0)
        gen = model.generate(ref["ids"], max_new_tokens=6, do_sample=False, pad_token_id=0, num_recurrences=5)
        assert torch.equal(gen, ref["gen"])
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        # the test-time features live in the shipped file too
        out = model.generate(ref["ids"], max_new_tokens=6, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, exit_criterion="kl", exit_threshold=1e-3)
        assert torch.equal(out.sequences, ref["exit"]) and torch.equal(out.recurrences_used, ref["used"])
        draft = model.generate(ref["ids"][:1], max_new_tokens=6, do_sample=False, pad_token_id=0, num_recurrences=5,
                               draft_num_recurrences=1)
        assert torch.equal(draft, ref["gen1"])
        print("REMOTE-OK")
        """
    assert "REMOTE-OK" in run_without_looped_hf(script, tmp_path)


def test_tied_embeddings_survive_a_round_trip(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.num_scaling_params()["lm_head"] == 0
    model.save_pretrained(tmp_path)
    loaded = LoopedForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


# --------------------------------------------------------------------------------------------
# Parity with transformers' Llama
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_plain_config_matches_llama(attn):
    llama_cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM._from_config(llama_cfg, attn_implementation=attn).eval()
    cfg = LoopedConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, num_prelude_layers=0, num_recurrent_layers=3, num_coda_layers=0,
        num_recurrences=1, input_injection="none", hidden_act="silu", qk_norm=False, logit_softcap=None,
        embedding_norm=False, recurrence_norm=False, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )
    looped = LoopedForCausalLM._from_config(cfg, attn_implementation=attn).eval()
    state = {k.replace("model.layers.", "model.recurrent_layers."): v for k, v in llama.state_dict().items()}
    missing, unexpected = looped.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    ids = prompts(batch=3, length=11)
    torch.testing.assert_close(looped(ids).logits, llama(ids).logits, rtol=0, atol=1e-5)
    assert torch.equal(greedy(looped, ids), greedy(llama, ids))


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 3, 8])
def test_cached_generation_equals_uncached(r):
    model = tiny_model(num_recurrences=r)
    ids = prompts()
    assert torch.equal(greedy(model, ids), greedy(model, ids, use_cache=False))


def test_generation_with_recurrences_overridden_per_call():
    model = tiny_model(num_recurrences=2)
    ids = prompts()
    for r in (1, 5, 8):
        cached = greedy(model, ids, num_recurrences=r)
        assert torch.equal(cached, greedy(model, ids, num_recurrences=r, use_cache=False))
    # r really changes the computation
    assert not torch.allclose(model(ids, num_recurrences=1).logits, model(ids, num_recurrences=8).logits)


def test_every_layer_application_has_its_own_cache_slot():
    model = tiny_model(num_recurrences=3)
    out = model(prompts(), use_cache=True, num_recurrences=5)
    cfg = model.config
    assert len(out.cache.layers) == cfg.num_layer_applications(5) == 1 + 5 * 2 + 1
    assert all(layer.keys.shape[-2] == 7 for layer in out.cache.layers)
    with pytest.raises(ValueError, match="num_recurrences=3.*filled at num_recurrences=5"):
        model(prompts(length=1), cache=out.cache, num_recurrences=3)


@pytest.mark.parametrize("r", [1, 4])
def test_left_padded_batch_equals_prompts_one_by_one(r):
    model = tiny_model(num_recurrences=r)
    model.generation_config.eos_token_id = None  # compare full continuations
    a = prompts(batch=1, length=9, seed=3)
    b = prompts(batch=1, length=5, seed=4)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], dim=1)])
    mask = (torch.arange(9) >= torch.tensor([[0], [4]])).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0, 9:], greedy(model, a)[0, 9:])
    assert torch.equal(out[1, 9:], greedy(model, b)[0, 5:])


def test_eager_and_sdpa_agree():
    model = tiny_model()
    ids = prompts()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model.set_attn_implementation("eager")
    eager = model(ids, attention_mask=mask).logits
    gen_eager = greedy(model, ids, attention_mask=mask)
    model.set_attn_implementation("sdpa")
    sdpa = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(eager[0], sdpa[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager[1, 3:], sdpa[1, 3:], rtol=1e-5, atol=1e-5)
    assert torch.equal(gen_eager, greedy(model, ids, attention_mask=mask))


def test_bf16_forward_and_generate():
    model = tiny_model()
    ids = prompts()
    ref = model(ids).logits
    model = model.to(torch.bfloat16)
    out = model(ids).logits
    assert out.dtype == torch.float32  # the soft-cap runs in fp32
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.15
    gen = greedy(model, ids, num_recurrences=4)
    assert gen.shape == (2, 13)


def test_recurrent_states_and_hidden_states_for_logit_lens():
    model = tiny_model(num_recurrences=3)
    ids = prompts()
    out = model(ids, output_recurrent_states=True, output_hidden_states=True, num_recurrences=4)
    assert len(out.recurrent_states) == 4
    assert len(out.hidden_states) == model.config.num_layer_applications(4) + 1
    lens = model.logit_lens(out.recurrent_states)
    # The last recurrence, decoded through coda + norm + head, is the model's own output.
    torch.testing.assert_close(lens[-1], out.logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lens[0], lens[-1])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def _train_steps(model, steps: int = 40) -> list[float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = prompts(batch=4, length=16, seed=5)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("injection", ["linear", "add", "hyperconnection"])
def test_loss_decreases(injection):
    losses = _train_steps(tiny_model(input_injection=injection))
    assert losses[-1] < 0.5 * losses[0], losses


def test_hyperconnections_refuse_another_r():
    model = tiny_model(input_injection="hyperconnection", num_recurrences=3)
    with pytest.raises(ValueError, match=r"num_recurrences=4.*hyperconnection.*trained num_recurrences=3"):
        model(prompts(), num_recurrences=4)
    with pytest.raises(ValueError, match="num_recurrences=4"):
        greedy(model, prompts(), num_recurrences=4)


def test_gradient_checkpointing_gives_the_same_gradients():
    if not hasattr(LoopedForCausalLM, "activation_checkpointing_enable"):
        pytest.skip("activation_checkpointing_enable is transformers >= 5.23's API; the next test covers both")
    ids = prompts(batch=2, length=12)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(num_recurrences=3).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_gradient_checkpointing_drops_the_cache_and_keeps_the_gradients():
    """Whichever API this transformers has: a checkpointed layer gets no cache (its backward replay
    would write the KV twice; before 5.20 transformers nulls only ``past_key_values``, so
    ``interface_looped.CheckpointingLayer`` nulls ``cache``), and the gradients are unchanged."""
    ids = prompts(batch=2, length=12)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(num_recurrences=3).train()
        cache = DynamicCache()
        if checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is None:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                enable()
        model(ids, labels=ids, cache=cache, use_cache=True).loss.backward()
        assert (cache.get_seq_length() == 0) == checkpointing
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def _hand_forward(model: LoopedForCausalLM, ids: torch.Tensor, grad_steps: set[int]) -> torch.Tensor:
    """The looped forward written out by hand, recurrence i under grad only if i in grad_steps."""
    base = model.model
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    pe = base.rotary_emb(base.embed_tokens.weight, pos)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]

    def layer(m, h):
        return m(h, attention_mask=mask, position_embeddings=pe)[0]

    h = base.embedding_norm(base.embed_tokens(ids))
    for m in base.prelude_layers:
        h = layer(m, h)
    e = h
    for i in range(model.config.num_recurrences):
        with torch.set_grad_enabled(i in grad_steps):
            h = base.injection(torch.cat([e, h], -1))  # the study's order: [e; h]
            for m in base.recurrent_layers:
                h = layer(m, h)
            h = base.recurrence_norm(h)
    for m in base.coda_layers:
        h = layer(m, h)
    return model.logits_from_hidden(base.norm(h))


def test_truncated_backprop_matches_a_hand_computed_reference():
    r, k = 5, 2
    ids = prompts(batch=2, length=10)
    full = tiny_model(num_recurrences=r).train()
    truncated = tiny_model(num_recurrences=r, backprop_recurrences=k).train()
    truncated.model.set_attn_implementation("eager")
    # Same weights, same forward.
    torch.testing.assert_close(truncated(ids).logits, full(ids).logits)
    loss = truncated(ids, labels=ids).loss
    loss.backward()
    ref_model = tiny_model(num_recurrences=r).train()
    ref_model.set_attn_implementation("eager")
    logits = _hand_forward(ref_model, ids, grad_steps=set(range(r - k, r)))
    ref_loss = ref_model.loss_function(logits=logits, labels=ids, vocab_size=VOCAB)
    torch.testing.assert_close(loss, ref_loss)
    ref_loss.backward()
    ref_grads = dict(ref_model.named_parameters())
    for name, p in truncated.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    # And it really is truncated: full backprop gives different block gradients.
    full(ids, labels=ids).loss.backward()
    block = "model.recurrent_layers.0.mlp.up_proj.weight"
    assert not torch.allclose(dict(full.named_parameters())[block].grad, dict(truncated.named_parameters())[block].grad)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_recurrences": 0}, "num_recurrences=0"),
        ({"num_prelude_layers": -1}, "num_prelude_layers=-1"),
        ({"num_coda_layers": -2}, "num_coda_layers=-2"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "num_attention_heads=4"),
        ({"input_injection": "concat"}, "input_injection='concat'"),
        ({"hidden_act": "tanh"}, "hidden_act='tanh'"),
        ({"backprop_recurrences": 4, "num_recurrences": 3}, "backprop_recurrences=4"),
        ({"backprop_recurrences": 0}, "backprop_recurrences=0"),
        ({"input_injection": "hyperconnection", "backprop_recurrences": 1}, "backprop_recurrences=1"),
        ({"state_init": "random"}, "state_init='random'"),
    ],
)
def test_bad_config_raises_naming_field_and_value(overrides, field):
    with pytest.raises(ValueError, match=f"LoopedConfig.{field}"):
        tiny_config(**overrides)


def test_bad_num_recurrences_at_call_time():
    with pytest.raises(ValueError, match="num_recurrences=0"):
        tiny_model()(prompts(), num_recurrences=0)


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def closed_form_counts(cfg: LoopedConfig) -> dict[str, int]:
    d, f, q = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    attn = d * h * q * 2 + d * kv * q * 2 + (2 * q if cfg.qk_norm == "learnable_before_rope" else 0)
    mlp = (3 if cfg.hidden_act != "relu2" else 2) * d * f
    layer = attn + mlp + 2 * d
    injection = {"linear": 2 * d * d, "add": 0, "none": 0}.get(cfg.input_injection)
    if injection is None:  # hyperconnection: alpha, M, beta per step
        n = cfg.num_hyperconnection_lanes
        injection = cfg.num_recurrences * (n + n * n + n)
    # The study's groups: every model-level norm scale (embedding, recurrence, final) is "once".
    norms = d + (d if cfg.embedding_norm else 0) + (d if cfg.recurrence_norm else 0)
    once = (cfg.num_prelude_layers + cfg.num_coda_layers) * layer + norms
    rec = cfg.num_recurrent_layers * layer + injection
    emb = cfg.vocab_size * d
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    return {"once": once, "recurrent": rec, "embedding": emb, "lm_head": head, "total": once + rec + emb + head}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"hidden_act": "silu", "qk_norm": False, "input_injection": "add", "tie_word_embeddings": True},
        {"num_prelude_layers": 0, "num_coda_layers": 0, "input_injection": "none", "recurrence_norm": False},
        {"input_injection": "hyperconnection", "num_hyperconnection_lanes": 3, "embedding_norm": False},
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "num_recurrent_layers": 3},
        {"qk_norm": "learnable_before_rope", "input_injection": "add"},
    ],
)
def test_num_scaling_params_matches_closed_form(overrides):
    cfg = tiny_config(**overrides)
    with torch.device("meta"):
        model = LoopedForCausalLM(cfg)
    assert model.num_scaling_params() == closed_form_counts(cfg)


def study_loop4(d: int = 768, **overrides) -> LoopedConfig:
    """The study's loop4 shape: 2 + 4x4 + 2 = 20 applications, relu2, head dim 128, no biases."""
    kwargs = dict(vocab_size=32000, hidden_size=d, num_attention_heads=d // 128, num_prelude_layers=2,
                  num_recurrent_layers=4, num_coda_layers=2, num_recurrences=4, input_injection="linear")
    kwargs.update(overrides)
    return LoopedConfig(**kwargs)


def test_study_loop4_counts_at_d768():
    d = 768
    cfg = study_loop4(d)
    assert cfg.effective_num_layers == 20
    with torch.device("meta"):
        counts = LoopedForCausalLM(cfg).num_scaling_params()
    norms_per_layer = 2 * d  # pre-attn, pre-MLP scales; the study's QK-norm has none
    # N_once: prelude + coda + the embedding, recurrence and final norm scales (the study's "scalars").
    assert counts["once"] == 4 * 12 * d * d + 4 * norms_per_layer + 3 * d
    # N_rec: the block + the 2d^2 injection adapter, the study's N(r) = (4 + 16/r) 12 d^2 + 2 d^2 at r = 4.
    assert counts["recurrent"] == 4 * 12 * d * d + 2 * d * d + 4 * norms_per_layer
    assert counts["once"] + counts["recurrent"] - 8 * norms_per_layer - 3 * d == (4 + 16 / 4) * 12 * d * d + 2 * d * d
    assert counts["embedding"] == counts["lm_head"] == 32000 * d


def test_training_flops_follow_the_study_formula():
    d, T = 768, 2048
    V, hq = 32000, 768
    for k in (None, 2):
        cfg = study_loop4(d, backprop_recurrences=k)
        with torch.device("meta"):
            model = LoopedForCausalLM(cfg)
        r_grad = 4 if k is None else k
        r_nograd = 4 - r_grad
        # The study's estimate_flops, term by term: prelude + coda + lm_head at 6x (their layer
        # norms included, the model-level norm scales not), block + injection at 6x / 2x.
        layer = 12 * d * d + 2 * d
        expected = (
            6 * (4 * layer + V * d) + (6 * r_grad + 2 * r_nograd) * (4 * layer + 2 * d * d)
            + 12 * hq * T * (4 + 4 * r_grad) + 4 * hq * T * 4 * r_nograd
        )
        assert model.training_flops_per_token(T) == expected
        # Matches the study's closed form N(r) within the norms' rounding.
        approx = 6 * (4 * 12 * d * d + V * d) + 6 * 4 * (4 * 12 * d * d + 2 * d * d) + 12 * hq * T * 20
        if k is None:
            assert math.isclose(model.training_flops_per_token(T), approx, rel_tol=1e-3)
    # Truncated backprop costs 2x, not 6x, per parameter for the no-grad steps.
    with torch.device("meta"):
        full = LoopedForCausalLM(study_loop4(d))
        trunc = LoopedForCausalLM(study_loop4(d, backprop_recurrences=2))
    saved = full.training_flops_per_token(T) - trunc.training_flops_per_token(T)
    assert saved == 2 * 4 * full.num_scaling_params()["recurrent"] + 2 * 8 * hq * T * 4
    # More recurrences at inference cost more; forward is 1/3 of training with full backprop.
    assert full.inference_flops_per_token(T, 8) > full.inference_flops_per_token(T)
    assert math.isclose(3 * full.inference_flops_per_token(T), full.training_flops_per_token(T))


def test_package_exports():
    assert looped_hf.LoopedConfig is LoopedConfig
    for name in ("LoopedModel", "LoopedPreTrainedModel", "LoopedForCausalLM"):
        assert hasattr(looped_hf, name)
    assert Path(looped_hf.__file__).parent.name == "looped_hf"


def test_train_and_eval_reach_every_module():
    """``train()`` / ``eval()`` are torch's (the Trainer's per-step shortcut lives in LoopedTrainer,
    tests/test_trainer_mode.py): any module in the other mode, and the whole tree is set."""
    model = tiny_looped_model()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())
    model.model.coda_layers[-1].self_attn.eval()  # one module off: train() must set it back
    model.train()
    assert all(m.training for m in model.modules())
    model.eval()
    assert not any(m.training for m in model.modules())
    with pytest.raises(ValueError, match="boolean"):
        model.train("yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_soft_cap_is_the_studys_formula_with_autograds_gradient(dtype) -> None:
    """Logits bit for bit cap * tanh(x / cap) in fp32 (the study's); the one-kernel backward
    gives autograd's gradient of that formula up to rounding, in the input's dtype."""
    from looped_hf.modeling_looped import _SoftCap

    x = (torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 40).to(dtype)
    grad = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(1))
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    reference = 15.0 * torch.tanh(a.float() / 15.0)
    capped = _SoftCap.apply(b, 15.0)
    assert capped.dtype == torch.float32 and torch.equal(capped, reference)
    reference.backward(grad)
    capped.backward(grad)
    assert b.grad.dtype == dtype
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
