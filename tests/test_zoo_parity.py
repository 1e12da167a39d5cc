"""Huginn-0125 and the two retrofitted-recurrence variants, converted, give their original code's outputs.

The references are ``tests/fixtures/zoo/{huginn-tiny, retrofit-llama-tiny, retrofit-olmo-tiny}`` (see
``tests/fixtures/zoo/PROVENANCE.md``): tiny ``RavenForCausalLM`` checkpoints saved by each model's own
code, with that code's logits at r = 1, 2, 4, 8 from the zero initial state (``init_scale=0.0``), the
latent state after the loop, and 8 greedy tokens at r = 4, for two unpadded prompts (7 and 12 tokens).

Measured in float32 on CPU (torch 2.13, transformers 5.24), max |delta| over both prompts and every r:

    model                 logits     latent state
    huginn-tiny           1.04e-5    8.0e-6
    retrofit-llama-tiny   4.3e-6     6.7e-6
    retrofit-olmo-tiny    7.3e-6     1.5e-5

The tests hold them to ``TOLERANCE`` = 5e-5, inside the issue's 1e-4: what is left is float32 rounding
of differently ordered sums (a fused RMSNorm, the adapter's swapped column blocks, the split Wqkv).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fixture_path, run_without_looped_hf
from safetensors.torch import load_file, save_file

from looped_hf.convert import ConversionError, main
from looped_hf.convert.huginn_raven import (
    convert_raven,
    detect_variant,
    interleaved_to_half_order,
    permute_heads,
    raven_to_looped,
)
from looped_hf.generation_looped import KVSlotPlan

DATA = fixture_path("zoo")
MODELS = {"huginn-tiny": "huginn", "retrofit-llama-tiny": "llama", "retrofit-olmo-tiny": "olmo"}
FORMATS = {"huginn-tiny": "huginn", "retrofit-llama-tiny": "retrofit", "retrofit-olmo-tiny": "retrofit"}
R_VALUES = (1, 2, 4, 8)
PROMPTS = ("p0", "p1")
TOLERANCE = 5e-5


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture through ``looped-hf convert`` (its named format) into a folder of its own."""
    root = tmp_path_factory.mktemp("zoo")
    folders = {}
    for name in MODELS:
        out = root / name
        assert main([FORMATS[name], str(DATA / name), "--out", str(out)]) == 0
        folders[name] = out
    return folders


def _load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("looped_hf"), type(model).__module__
    return model


def _reference(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / name / "reference.npz") as ref:
        return {key: ref[key] for key in ref.files}


# --------------------------------------------------------------------------------------------
# 1. Parity: logits at every r, the state after the loop, greedy tokens
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_converted_logits_and_latent_state_equal_the_originals_at_every_r(name: str, converted: dict) -> None:
    model, ref = _load(converted[name]), _reference(name)
    worst_logits = worst_state = 0.0
    for prompt in PROMPTS:
        ids = torch.from_numpy(ref[f"{prompt}_input_ids"])
        for r in R_VALUES:
            with torch.no_grad():
                out = model(ids, num_recurrences=r, output_recurrent_states=True)
            assert len(out.recurrent_states) == r
            expected = torch.from_numpy(ref[f"{prompt}_r{r}_logits"])
            assert out.logits.shape == expected.shape
            worst_logits = max(worst_logits, (out.logits - expected).abs().max().item())
            # Huginn's latent_states is ln_f of the loop's output (the post-loop norm), the retrofits'
            # the output itself: in both, the coda's input.
            state = out.recurrent_states[-1]
            if model.config.post_loop_norm is not None:
                state = model.model.loop_norms()[1](state)
            worst_state = max(worst_state, (state - torch.from_numpy(ref[f"{prompt}_r{r}_latent_states"])).abs().max().item())
    assert worst_logits <= TOLERANCE, (name, worst_logits)
    assert worst_state <= TOLERANCE, (name, worst_state)
    # The references differ a lot between r values: a model that ignored r could not pass.
    assert np.abs(ref["p0_r1_logits"] - ref["p0_r8_logits"]).max() > 1.0


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_is_token_equal_to_the_originals(name: str, converted: dict) -> None:
    """8 greedy tokens at r = 4 with the per-recurrence KV cache, equal to the original's argmax of a
    full forward per token (and to its own generate(), which the references found equal)."""
    model, ref = _load(converted[name]), _reference(name)
    for prompt in PROMPTS:
        ids = torch.from_numpy(ref[f"{prompt}_input_ids"])
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=8, do_sample=False, num_recurrences=4)
        assert torch.equal(tokens, torch.from_numpy(ref[f"{prompt}_greedy_r4_nocache"]))
        assert torch.equal(tokens, torch.from_numpy(ref[f"{prompt}_greedy_r4_hf_generate"]))


@pytest.mark.slow
def test_converted_folders_load_as_remote_code_without_looped_hf(converted: dict, tmp_path: Path) -> None:
    """``AutoModelForCausalLM(trust_remote_code=True)`` in a process where looped_hf cannot be imported:
    the shipped modeling code alone gives the originals' logits (r = 4 and 8)."""
    refs = {name: str(DATA / name / "reference.npz") for name in MODELS}
    folders = {name: str(folder) for name, folder in converted.items()}
    script = f"""
    import json, numpy as np, torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    worst = {{}}
    for name, folder in {json.dumps(folders)}.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ref = np.load({json.dumps(refs)}[name])
        diffs = []
        for p in ("p0", "p1"):
            for r in (4, 8):
                with torch.no_grad():
                    logits = model(torch.from_numpy(ref[p + "_input_ids"]), num_recurrences=r).logits
                diffs.append((logits - torch.from_numpy(ref[f"{{p}}_r{{r}}_logits"])).abs().max().item())
        worst[name] = max(diffs)
    print("WORST" + json.dumps(worst))
    """
    worst = json.loads(run_without_looped_hf(script, tmp_path).split("WORST", 1)[1])
    assert set(worst) == set(MODELS) and all(v <= TOLERANCE for v in worst.values()), worst


# --------------------------------------------------------------------------------------------
# 2. What the conversion maps, and that it is exact
# --------------------------------------------------------------------------------------------
def test_interleaved_rope_equals_rotate_half_on_permuted_rows() -> None:
    """The reparametrisation in one head, in float64: rotating interleaved pairs (2i, 2i+1) then
    permuting equals permuting then rotating halves (i, i + hd/2), at every position."""
    hd, positions = 8, torch.arange(5, dtype=torch.float64)
    x = torch.randn(5, hd, dtype=torch.float64)
    inv_freq = 1.0 / (50000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angle = positions[:, None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    pairs = x.unflatten(-1, (-1, 2))
    interleaved = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin,
                               pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1).flatten(-2)  # fmt: skip
    order = interleaved_to_half_order(hd)
    y = x[:, order]
    half = torch.cat([-y[:, hd // 2 :], y[:, : hd // 2]], dim=-1)
    rotated = y * torch.cat([cos, cos], -1) + half * torch.cat([sin, sin], -1)
    assert torch.allclose(rotated, interleaved[:, order], atol=1e-12, rtol=0)
    # Rows of a projection (and a bias) move the same way, head by head.
    w = torch.arange(2 * hd, dtype=torch.float32)
    assert permute_heads(w, 2, hd).tolist() == [*order.tolist(), *(order + hd).tolist()]


@pytest.mark.parametrize("name", MODELS)
def test_the_settings_each_model_maps_to(name: str) -> None:
    model, source = raven_to_looped(DATA / name)
    c, variant = model.config, MODELS[name]
    assert source["variant"] == variant and c.model_type == "looped"
    expected = {
        "huginn": dict(norm_placement="sandwich", post_loop_norm="final", embedding_multiplier=8.0, qk_bias=True,
                       qk_norm="none", tie_word_embeddings=True, num_key_value_heads=2),
        "llama": dict(norm_placement="pre", post_loop_norm=None, embedding_multiplier=1.0, qk_bias=False,
                      qk_norm="none", tie_word_embeddings=False, num_key_value_heads=1),
        "olmo": dict(norm_placement="sublayer_output", post_loop_norm=None, embedding_multiplier=1.0, qk_bias=False,
                     qk_norm="learnable_projection_before_rope", tie_word_embeddings=False, num_key_value_heads=2),
    }[variant]  # fmt: skip
    assert {key: getattr(c, key) for key in expected} == expected
    assert (c.input_injection, c.state_init, c.embedding_norm, c.recurrence_norm, c.logit_softcap) == (
        "linear", "zeros", False, False, None)  # fmt: skip
    assert (c.num_prelude_layers, c.num_recurrent_layers, c.num_coda_layers, c.num_recurrences) == (1, 2, 1, 4)
    assert c.hidden_act == "silu" and c.backprop_recurrences == 2
    rope = c.rope_parameters
    if variant == "huginn":
        assert rope == {"rope_type": "default", "rope_theta": 50000.0}
    elif variant == "llama":
        # rope_theta (10000), not rope_base (500000): the fixture sets them apart on purpose.
        assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 10000.0 and rope["factor"] == 4.0
        inv_freq = model.model.rotary_emb.inv_freq
        assert torch.allclose(inv_freq, torch.from_numpy(_reference(name)["rope_inv_freq"]), rtol=1e-6, atol=0)
    else:
        assert rope == {"rope_type": "default", "rope_theta": 500000.0}
    assert detect_variant(load_file(DATA / name / "model.safetensors")) == variant


@pytest.mark.parametrize("name", MODELS)
def test_n_once_and_n_rec_count_what_the_original_has(name: str) -> None:
    """N_once = prelude + coda + ln_f, N_rec = the core block + adapter, embedding and head apart:
    exactly the original's tensors (freqs_cis is a buffer), the sandwich norms, the q/k biases and
    QK-norm scales with their layers, the shared ln_f once."""
    model, _ = raven_to_looped(DATA / name)
    native = load_file(DATA / name / "model.safetensors")
    count = lambda *prefixes: sum(t.numel() for k, t in native.items() if k.startswith(prefixes))  # noqa: E731
    params = model.num_scaling_params()
    assert params["once"] == count("transformer.prelude.", "transformer.coda.", "transformer.ln_f.")
    assert params["recurrent"] == count("transformer.core_block.", "transformer.adapter.")
    assert params["embedding"] == count("transformer.wte.")
    assert params["lm_head"] == count("lm_head.")
    assert params["total"] == sum(t.numel() for k, t in native.items() if k != "freqs_cis")
    # FLOPs: 2 (N_once + N_head + r N_rec) + attention, the model-level ln_f left out (elementwise).
    c = model.config
    n_head, d = c.padded_vocab_size * c.hidden_size, c.hidden_size
    attention = 4 * c.num_attention_heads * c.head_dim * 16 * c.num_layer_applications(4)
    expected = 2 * (params["once"] - d + n_head) + 2 * 4 * params["recurrent"] + attention
    assert model.inference_flops_per_token(16, 4) == expected


def test_huginn_state_init_is_a_truncated_normal_times_the_embedding_scale() -> None:
    """``state_init="truncated_normal"``: N(0, std) cut at +-3 std, times embedding_multiplier (8 here);
    std 0 is the deterministic zero state the references use."""
    from looped_hf.recurrent_block_looped import LoopedRecurrentBlock

    model, _ = raven_to_looped(DATA / "huginn-tiny", state_init="truncated_normal")
    c = model.config
    assert c.state_init == "truncated_normal" and math.isclose(c.state_init_std, 0.07905694150420949)
    plan = KVSlotPlan.for_call(c, 4)
    block = LoopedRecurrentBlock(model.model, plan, {}, 0)
    e = torch.zeros(4, 2000, c.hidden_size)
    torch.manual_seed(0)
    h = block.initial_state(e)
    bound = 3 * c.state_init_std * c.embedding_multiplier
    assert h.abs().max().item() <= bound + 1e-6 and h.abs().max().item() > 0.9 * bound
    assert math.isclose(h.std().item(), c.state_init_std * c.embedding_multiplier * 0.9866, rel_tol=0.02)
    c.state_init_std = 0.0
    assert torch.equal(block.initial_state(e), torch.zeros_like(e))


# --------------------------------------------------------------------------------------------
# 3. The command: formats, detection, default folder, refusals (one line, nothing written)
# --------------------------------------------------------------------------------------------
def _copy(name: str, tmp_path: Path) -> Path:
    src = tmp_path / name
    shutil.copytree(DATA / name, src)
    for file in src.iterdir():
        file.chmod(0o644)
    return src


def test_convert_detects_the_variant_and_writes_beside_the_checkpoint_by_default(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    src = _copy("retrofit-olmo-tiny", tmp_path)
    core = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", model_max_length=128).save_pretrained(src)
    assert main(["huginn_raven", str(src)]) == 0
    out = tmp_path / "retrofit-olmo-tiny-looped"
    assert f"wrote {out}" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_looped.py", "README.md", "tokenizer_config.json"} <= names
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "variant: olmo" in card and "retrofitting-recurrence" in card
    assert json.loads((out / "config.json").read_text())["norm_placement"] == "sublayer_output"


@pytest.mark.parametrize(("fmt", "name", "message"), [
    ("huginn", "retrofit-llama-tiny", "the weights are the llama variant, not huginn"),
    ("retrofit", "huginn-tiny", "the weights are the huginn variant, not retrofit"),
    ("retrofit-llama", "retrofit-olmo-tiny", "the weights are the olmo variant, not retrofit-llama"),
])  # fmt: skip
def test_a_named_variant_that_the_weights_contradict_is_refused(fmt, name, message, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert main([fmt, str(DATA / name), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("huginn-tiny", {"bias": True}, "config.json bias=True"),
    ("huginn-tiny", {"test_time_noise": 0.1}, "config.json test_time_noise=0.1"),
    ("huginn-tiny", {"rope_scaling": {"rope_type": "llama3"}}, "config.json rope_scaling={'rope_type': 'llama3'}"),
    ("retrofit-llama-tiny", {"rope_scaling": {"rope_type": "spiral"}}, "rope_scaling.rope_type='spiral': unknown"),
    ("retrofit-llama-tiny", {"rope_theta": None}, "config.json rope_theta=None"),
    ("huginn-tiny", {"num_key_value_heads": 1}, "qk_bias=True with num_key_value_heads=1"),
    ("retrofit-olmo-tiny", {"qk_bias": True}, "qk_bias=True in the OLMo variant"),
    ("huginn-tiny", {"model_type": "llama"}, "model_type='llama'"),
    ("huginn-tiny", {"n_layers_in_coda": "two"}, "n_layers_in_coda='two'"),
    ("huginn-tiny", {"rope_base": 10000}, "freqs_cis differs from the RoPE table of rope_base=10000.0"),
])  # fmt: skip
def test_an_unknown_value_is_refused_by_name_and_nothing_is_written(name, edit, message, tmp_path, capsys) -> None:
    src = _copy(name, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **edit}), encoding="utf-8")
    assert main(["huginn_raven", str(src)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / f"{name}-looped").exists()


def test_a_bfloat16_checkpoint_converts_in_bfloat16_weight_for_weight(tmp_path: Path) -> None:
    """Huginn-0125 ships bf16 weights: the folder keeps them in bf16, every tensor moved, never rounded."""
    src = _copy("huginn-tiny", tmp_path)
    native = {k: t.to(torch.bfloat16) for k, t in load_file(src / "model.safetensors").items()}
    save_file(native, src / "model.safetensors")
    out = convert_raven(src, tmp_path / "out")
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.embed_tokens.weight"], native["transformer.wte.weight"])
    assert torch.equal(weights["model.recurrent_layers.1.mlp.down_proj.weight"],
                       native["transformer.core_block.1.mlp.proj.weight"])  # fmt: skip
    model = _load(out)
    assert model.dtype == torch.float32  # loaded as asked; the bf16 values upcast exactly
    assert model.config.rope_table_dtype == "bfloat16"  # Huginn's table was saved in bf16 too: rounded alike
    ref = _reference("huginn-tiny")
    with torch.no_grad():
        logits = model(torch.from_numpy(ref["p0_input_ids"]), num_recurrences=4).logits
    # bf16 weights: near the fp32 reference, not equal (the point is the dtype, not the values).
    assert (logits - torch.from_numpy(ref["p0_r4_logits"])).abs().max().item() < 1.0


def test_an_unknown_weight_or_a_flag_of_another_format_is_refused(tmp_path: Path, capsys) -> None:
    src = _copy("retrofit-llama-tiny", tmp_path)
    weights = load_file(src / "model.safetensors")
    save_file({**weights, "transformer.core_block.0.attn.gate.weight": torch.zeros(2)}, src / "model.safetensors")
    with pytest.raises(ConversionError, match=r"keys the llama variant does not have: \['transformer.core_block.0.attn.gate"):
        convert_raven(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["retrofit", str(DATA / "retrofit-llama-tiny"), "--step", "3", "--out", str(tmp_path / "o")]) == 2
    assert "--step='3': not an option of the retrofit format" in capsys.readouterr().err
    assert main(["nanochat", str(DATA), "--state-init", "zeros", "--out", str(tmp_path / "o")]) == 2
    assert "--state-init='zeros': not an option of the nanochat format" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
