"""Nanbeige4.2 converted by ``looped-hf convert nanbeige`` gives the outputs of its reference code.

The references are ``tests/fixtures/zoo2/nanbeige-tiny`` (tests/fixtures/zoo2/PROVENANCE.md): a 2-layer,
width-64 Nanbeige model (GQA 4/2 heads, head_dim 32 != hidden / heads, num_loops 2) with random weights,
and what mlx-lm's ``nanbeige.py`` computed on it in float32: logits at 1, 2 and 3 loops, at 2 loops with
``skip_loop_final_norm``, and greedy tokens with and without its cache.

Checkpoints of other shapes (MHA and GQA, head_dim equal to or different from hidden / heads, 1..4
loops, tied heads, biases, rope scaling, other seeds) are built here in Nanbeige's own layout and
compared with ``nanbeige_reference``, a plain-torch Nanbeige forward written from the architecture
facts, which is first checked against mlx-lm's logits on the fixture (so it is not looped_hf checked
against itself).

Measured max |delta logit| against mlx-lm (float32, CPU, one thread): 2.6e-6 over both prompts, 1..3
loops and the skip case (mlx's own agreement with a torch recomputation is 2.3e-6); against
``nanbeige_reference`` on the built checkpoints, r = 1..4: 3.1e-6 (cached vs uncached: 3.0e-6).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_path
from transformers import AutoModelForCausalLM
from zoo_helpers import load_converted, load_reference, remote_code_results

from looped_hf.convert import ConversionError, main
from looped_hf.convert.nanbeige import convert_nanbeige, nanbeige_config, nanbeige_to_looped
from looped_hf.modeling_looped import LoopedForCausalLM

DATA = fixture_path("zoo2", "nanbeige-tiny")
PROMPTS = ("p0", "p1")
LOOPS = (1, 2, 3)
TOLERANCE = 1e-5  # logits, float32 (measured: 2.6e-6 against mlx, whose torch cross-check is 2.3e-6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------------------------
# An independent Nanbeige forward (plain torch, from the architecture facts; no looped_hf code)
# --------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def nanbeige_reference(
    w: dict[str, torch.Tensor],
    cfg: dict,
    ids: torch.Tensor,
    loops: int | None = None,
    skip: bool | None = None,
) -> torch.Tensor:
    """Nanbeige4.2's logits: a Llama decoder (pre-norm, GQA, rotate-half RoPE, SwiGLU, head_dim from
    the config) whose whole stack runs ``loops`` times; ``model.norm`` replaces the state after each
    loop, or (``skip``) runs once at the end."""
    loops = cfg["num_loops"] if loops is None else loops
    skip = cfg.get("skip_loop_final_norm", False) if skip is None else skip
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    eps, layers = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    batch, seq = ids.shape
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    positions = torch.arange(seq, dtype=torch.float32)
    if cfg.get("rope_scaling"):  # only the linear type is built here
        positions = positions / cfg["rope_scaling"]["factor"]
    angles = torch.outer(positions, inv_freq)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))

    x = w["model.embed_tokens.weight"][ids]
    for _ in range(loops):
        for i in range(layers):
            p = f"model.layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = lin(h, p + "self_attn.q_proj").view(batch, seq, heads, hd).transpose(1, 2)
            k = lin(h, p + "self_attn.k_proj").view(batch, seq, kv, hd).transpose(1, 2)
            v = lin(h, p + "self_attn.v_proj").view(batch, seq, kv, hd).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
            scores = (q @ k.transpose(-1, -2)) * hd**-0.5
            scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
            attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, heads * hd)
            x = x + lin(attn, p + "self_attn.o_proj")
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            x = x + lin(F.silu(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
        if not skip:
            x = _rms(x, w["model.norm.weight"], eps)
    if skip:
        x = _rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def write_nanbeige(folder: Path, seed: int = 0, **changes) -> Path:
    """A Nanbeige checkpoint folder in the published layout (config.json with Nanbeige's keys, Llama
    names in model.safetensors), random weights as the fixture's rule (norms 1 + 0.1 randn)."""
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["NanbeigeForCausalLM"], "model_type": "nanbeige", "vocab_size": 96, "hidden_size": 48,
        "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "tie_word_embeddings": False, "num_loops": 2, "skip_loop_final_norm": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
    }  # fmt: skip
    cfg.update(changes)
    g = torch.Generator().manual_seed(seed)
    d, f, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv, hd = (
        cfg["num_key_value_heads"],
        cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
    )

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    # A tied head reads the embedding: scaled as a head's weight, so the logits are O(1) (float32 ulps).
    scale = 1 / math.sqrt(d) if cfg["tie_word_embeddings"] else 1.0
    w = {"model.embed_tokens.weight": scale * torch.randn(cfg["vocab_size"], d, generator=g),
         "model.norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}  # fmt: skip
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(cfg["vocab_size"], d)
    shapes = {"self_attn.q_proj": (heads * hd, d), "self_attn.k_proj": (kv * hd, d), "self_attn.v_proj": (kv * hd, d),
              "self_attn.o_proj": (d, heads * hd), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
              "mlp.down_proj": (d, f)}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, (rows, cols) in shapes.items():
            w[p + name + ".weight"] = linear(rows, cols)
            if cfg["attention_bias" if name.startswith("self_attn") else "mlp_bias"]:
                w[p + name + ".bias"] = 0.1 * torch.randn(rows, generator=g)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, folder / "model.safetensors")
    return folder


def _weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float = TOLERANCE
) -> float:
    delta = (actual.detach().float() - expected.float()).abs().max().item()
    assert delta <= tolerance, f"{what}: max |delta| {delta:.3g} > {tolerance}"
    return delta


def cached_logits(
    model: LoopedForCausalLM, ids: torch.Tensor, prefix: int, r: int | None = None
) -> torch.Tensor:
    """Logits of ``ids`` from a cached prefill of ``prefix`` tokens, then one token at a time."""
    with torch.no_grad():
        out = model(ids[:, :prefix], use_cache=True, num_recurrences=r)
        pieces, past = [out.logits], out.past_key_values
        for t in range(prefix, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=past, use_cache=True, num_recurrences=r)
            pieces.append(out.logits)
            past = out.past_key_values
    return torch.cat(pieces, dim=1)


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_reference(DATA)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("nanbeige") / "nanbeige-tiny-looped"
    assert main(["nanbeige", str(DATA), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def model(folder: Path) -> LoopedForCausalLM:
    return load_converted(folder)


def _copy(tmp_path: Path, **changes) -> Path:
    src = tmp_path / "nanbeige-src"
    shutil.copytree(DATA, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


# --------------------------------------------------------------------------------------------
# The reference forward is mlx-lm's (so the built checkpoints below are checked against Nanbeige)
# --------------------------------------------------------------------------------------------
def test_the_plain_torch_reference_reproduces_mlx_lms_logits(ref) -> None:
    w, cfg = _weights(DATA)
    for p in PROMPTS:
        for k in LOOPS:
            got = nanbeige_reference(w, cfg, ref[f"{p}_input_ids"], loops=k)
            assert_close(got, ref[f"{p}_loop{k}_logits"], f"reference {p} loops={k}")
        got = nanbeige_reference(w, cfg, ref[f"{p}_input_ids"], skip=True)
        assert_close(got, ref[f"{p}_loop2_skip_loop_final_norm_logits"], f"reference {p} skip")


# --------------------------------------------------------------------------------------------
# The converted fixture against mlx-lm
# --------------------------------------------------------------------------------------------
def test_the_converted_config_is_a_whole_stack_loop_with_the_final_norm_shared(model) -> None:
    c = model.config
    assert (c.num_prelude_layers, c.num_recurrent_layers, c.num_coda_layers, c.num_recurrences) == (
        0,
        2,
        0,
        2,
    )
    assert (c.input_injection, c.state_init, c.embedding_norm, c.norm_placement) == (
        "none",
        "prelude",
        False,
        "pre",
    )
    assert (c.recurrence_norm, c.recurrence_norm_weight, c.post_loop_norm) == (True, "final", None)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.hidden_size) == (32, 4, 2, 64)
    assert (
        not c.tie_word_embeddings and not c.exit_gate and c.hidden_act == "silu" and c.logit_softcap is None
    )
    # One norm tensor: model.norm closes every loop, and no second norm runs before the head.
    assert [k for k in model.state_dict() if "norm" in k and "layers" not in k] == ["model.norm.weight"]
    # Each (loop, layer) application owns its KV-cache slot.
    assert c.num_kv_slots() == 4 and c.num_kv_slots(3) == 6


@pytest.mark.parametrize("loops", LOOPS)
def test_logits_at_each_loop_count_match_mlx_lm(model, ref, loops: int) -> None:
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"], num_recurrences=loops, use_cache=False)
        assert_close(out.logits, ref[f"{p}_loop{loops}_logits"], f"{p} logits at {loops} loops")
    if loops == 2:  # the default call is the config's num_loops
        with torch.no_grad():
            assert_close(model(ref["p0_input_ids"]).logits, ref["p0_loop2_logits"], "default call")


def test_skip_loop_final_norm_converts_to_one_norm_at_the_end_and_matches_mlx_lm(ref, tmp_path: Path) -> None:
    converted = nanbeige_to_looped(_copy(tmp_path, skip_loop_final_norm=True))
    assert not converted.config.recurrence_norm and converted.config.post_loop_norm is None
    for p in PROMPTS:
        with torch.no_grad():
            out = converted(ref[f"{p}_input_ids"])
        assert_close(out.logits, ref[f"{p}_loop2_skip_loop_final_norm_logits"], f"{p} skip_loop_final_norm")
        # and it differs from the shared-norm model (the flag is read)
        assert (out.logits - ref[f"{p}_loop2_logits"]).abs().max() > 1e-2


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_is_token_equal_to_mlx_lms(model, ref, use_cache: bool) -> None:
    for p in PROMPTS:
        tokens = model.generate(ref[f"{p}_input_ids"], max_new_tokens=8, do_sample=False, use_cache=use_cache)
        assert torch.equal(tokens, ref[f"{p}_greedy_nocache"]), p
        assert torch.equal(tokens, ref[f"{p}_greedy_cache"]), p


@pytest.mark.parametrize("loops", (1, 2, 3, 4))
def test_cached_decoding_equals_the_full_forward_at_each_loop_count(model, ref, loops: int) -> None:
    ids = ref["p0_greedy_nocache"]
    with torch.no_grad():
        full = model(ids, num_recurrences=loops, use_cache=False).logits
    assert_close(cached_logits(model, ids, 5, loops), full, f"cached vs uncached at {loops} loops")


def test_the_converted_folder_loads_as_remote_code_with_mlx_lms_logits(folder: Path, tmp_path: Path) -> None:
    deltas = remote_code_results(folder, DATA / "reference.npz", """
for p in ("p0", "p1"):
    ids = torch.from_numpy(ref[p + "_input_ids"])
    for k in (1, 2, 3):
        logits = m(ids, num_recurrences=k).logits
        out[p + str(k)] = (logits - torch.from_numpy(ref[p + "_loop" + str(k) + "_logits"])).abs().max().item()
    tokens = m.generate(ids, max_new_tokens=8, do_sample=False)
    out[p + "greedy"] = 0.0 if torch.equal(tokens, torch.from_numpy(ref[p + "_greedy_cache"])) else 1.0
""", tmp_path)
    assert max(deltas.values()) <= TOLERANCE, deltas


# --------------------------------------------------------------------------------------------
# Checkpoints of other shapes, against the plain-torch reference
# --------------------------------------------------------------------------------------------
SHAPES = {
    "gqa-head_dim-16-of-48": ({}, 0),
    "mqa-loops-3-seed-7": ({"num_key_value_heads": 1, "num_loops": 3}, 7),
    "mha-head_dim-default": ({"num_key_value_heads": 4, "head_dim": None, "hidden_size": 64}, 1),
    "loops-1-tied-skip": ({"num_loops": 1, "tie_word_embeddings": True, "skip_loop_final_norm": True}, 2),
    "biases-rope-linear-3-layers": ({"attention_bias": True, "mlp_bias": True, "num_hidden_layers": 3,
                                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "head_dim": 24}, 3),
    "loop_loss_weights-4-loops": ({"loop_loss_weights": [0.2, 0.3, 0.5], "num_loops": 2}, 4),
}  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES)
def test_built_checkpoints_of_other_shapes_match_the_reference_cached_and_not(
    shape: str, tmp_path: Path
) -> None:
    changes, seed = SHAPES[shape]
    src = write_nanbeige(tmp_path / "src", seed, **changes)
    w, cfg = _weights(src)
    out = convert_nanbeige(src, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    trained = len(cfg["loop_loss_weights"]) + 1 if "loop_loss_weights" in cfg else cfg["num_loops"]
    assert model.config.num_recurrences == trained
    ids = torch.randint(3, cfg["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(seed))
    for r in sorted({1, trained, trained + 1}):
        with torch.no_grad():
            got = model(ids, num_recurrences=r, use_cache=False).logits
        assert_close(got, nanbeige_reference(w, cfg, ids, loops=r), f"{shape} r={r}")
        assert_close(cached_logits(model, ids, 4, r), got, f"{shape} cached r={r}")
    tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, model.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False))


# --------------------------------------------------------------------------------------------
# Any r: generate(), the ceiling
# --------------------------------------------------------------------------------------------
def test_generate_runs_at_one_to_four_loops_and_each_r_decodes_as_its_full_forwards(model, ref) -> None:
    ids = ref["p1_input_ids"]
    outputs = set()
    for r in (1, 2, 3, 4):
        expected = ids
        with torch.no_grad():
            for _ in range(5):
                nxt = (
                    model(expected, num_recurrences=r, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                )
                expected = torch.cat([expected, nxt], dim=1)
        assert torch.equal(
            model.generate(ids, max_new_tokens=5, do_sample=False, num_recurrences=r), expected
        ), r
        outputs.add(tuple(expected.flatten().tolist()))
    assert len(outputs) > 1  # r is read


def test_an_r_above_the_configs_ceiling_is_refused_in_one_line(model, ref) -> None:
    ceiling = model.config.recurrence_ceiling
    with pytest.raises(
        ValueError, match=rf"^num_recurrences={ceiling + 1}: exceeds this model's ceiling of {ceiling}"
    ):
        model.generate(ref["p0_input_ids"], max_new_tokens=2, num_recurrences=ceiling + 1)
    with pytest.raises(ValueError, match=r"^num_recurrences=0") as err:
        model(ref["p0_input_ids"], num_recurrences=0)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------
# Refusals: one line, nothing written
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("changes", "message"), [
    ({"flux_capacitor": 3}, "config.json flux_capacitor=3: unknown Nanbeige config key"),
    ({"model_type": "llama"}, "config.json model_type='llama': not a Nanbeige config"),
    ({"hidden_act": "relu2"}, "config.json hidden_act='relu2': must be one of"),
    ({"num_loops": 0}, "config.json num_loops=0: expected an integer >= 1"),
    ({"num_loops": 10**9}, "config.json num_loops=1000000000: above the ceiling"),
    ({"num_loops": "2"}, "config.json num_loops='2': expected an integer >= 1"),
    ({"num_loops": None}, "config.json num_loops=None: expected an integer >= 1"),
    ({"loop_loss_weights": "half"}, "config.json loop_loss_weights='half': expected a list of numbers"),
    ({"loop_loss_weights": [0.5] * 5000}, "config.json loop_loss_weights=5001: above the ceiling"),
    ({"skip_loop_final_norm": "yes"}, "config.json skip_loop_final_norm='yes': expected true or false"),
    ({"tie_word_embeddings": 1}, "config.json tie_word_embeddings=1: expected true or false"),
    ({"head_dim": 0}, "config.json head_dim=0: expected an integer >= 1"),
    ({"num_hidden_layers": 0}, "config.json num_hidden_layers=0: expected an integer >= 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"pretraining_tp": 2}, "config.json pretraining_tp=2: only 1 is converted"),
    ({"eos_token_id": 999}, "config.json eos_token_id=999: expected a token id in [0, 256)"),
    ({"rope_scaling": {"rope_type": "warp"}}, "config.json rope_scaling.rope_type='warp'"),
    ({"vocab_size": 10**7}, "vocab_size=10000000"),
])  # fmt: skip
def test_the_cli_refuses_a_hostile_config_in_one_line_and_writes_nothing(tmp_path, capsys, changes, message):
    src, out = _copy(tmp_path, **changes), tmp_path / "out"
    assert main(["nanbeige", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-hf convert: error: ") and message in err and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def _edit_weights(tmp_path: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    src = _copy(tmp_path)
    weights = load_file(src / "model.safetensors")
    edit(weights)
    save_file(weights, src / "model.safetensors")
    return src


@pytest.mark.parametrize(("edit", "message"), [
    (lambda w: w.update({"model.layers.0.mystery.weight": torch.zeros(3)}),
     "unknown Nanbeige weight 'model.layers.0.mystery.weight'"),
    (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"), "missing ['model.recurrent_layers.1.mlp.up_proj.weight']"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}), "shape (checkpoint, config)"),
    (lambda w: w.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}), "not in this config"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}), "not in this config"),
])  # fmt: skip
def test_weights_that_do_not_fit_are_refused_in_one_line_and_nothing_is_written(
    tmp_path, capsys, edit, message
):
    src, out = _edit_weights(tmp_path, edit), tmp_path / "out"
    assert main(["nanbeige", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_pickled_or_truncated_checkpoint_is_refused_through_the_loader(tmp_path: Path, capsys) -> None:
    src = _copy(tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert main(["nanbeige", str(src), "--out", str(tmp_path / "out")]) == 2
    assert "model.safetensors" in capsys.readouterr().err and not (tmp_path / "out").exists()
    (src / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, src / "pytorch_model.bin")
    assert main(["nanbeige", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pytorch_model.bin" in err and "\n" not in err and not (tmp_path / "out").exists()


def _shard(folder: Path, parts: int = 2) -> dict[str, str]:
    """``folder``'s model.safetensors split into shards and an index, as save_pretrained lays them out."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    names, weight_map = sorted(weights), {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        save_file({k: weights[k] for k in names[i::parts]}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names[i::parts], file))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return weight_map


def test_a_sharded_checkpoint_converts_to_the_same_logits(ref, tmp_path: Path) -> None:
    src = _copy(tmp_path)
    _shard(src, parts=3)
    converted = nanbeige_to_looped(src)
    with torch.no_grad():
        assert_close(converted(ref["p1_input_ids"]).logits, ref["p1_loop2_logits"], "sharded p1")


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def _write_index(src: Path, index: dict) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_leaves_folder(src: Path) -> None:
    index = _index(src)
    shutil.copyfile(src / "model-00001-of-00002.safetensors", src.parent / "outside.safetensors")
    index["weight_map"] = {key: "../outside.safetensors" for key in index["weight_map"]}
    _write_index(src, index)


def _shard_missing(src: Path) -> None:
    (src / "model-00002-of-00002.safetensors").unlink()


def _key_in_two_shards(src: Path) -> None:
    from safetensors.torch import load_file, save_file

    index = _index(src)
    other = next(k for k, f in index["weight_map"].items() if f.endswith("00002-of-00002.safetensors"))
    first = src / "model-00001-of-00002.safetensors"
    save_file({**load_file(first), other: torch.zeros(1)}, first)


def _empty_shard(src: Path) -> None:
    (src / "model-00001-of-00002.safetensors").write_bytes(b"")


def _index_without_weight_map(src: Path) -> None:
    _write_index(src, {"metadata": {}})


def _config_not_an_object(src: Path) -> None:
    (src / "config.json").write_text("[1, 2]")


def _bad_generation_token(src: Path) -> None:
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 4096}))


def _tokenizer_too_large(src: Path) -> None:
    from zoo_helpers import save_char_tokenizer

    save_char_tokenizer(src, 300)  # more tokens than the model's 256 embeddings


@pytest.mark.parametrize(("hostile", "message"), [
    (_shard_leaves_folder, "outside.safetensors"),
    (_shard_missing, "model-00002-of-00002.safetensors"),
    (_key_in_two_shards, "model-00001-of-00002.safetensors"),
    (_empty_shard, "model-00001-of-00002.safetensors"),
    (_index_without_weight_map, "weight_map"),
    (_config_not_an_object, "config.json"),
    (_bad_generation_token, "generation_config.json eos_token_id=4096"),
    (_tokenizer_too_large, "the tokenizer has 300 tokens, more than the model's vocab_size=256"),
], ids=lambda case: case.__name__.strip("_") if callable(case) else "")  # fmt: skip
def test_hostile_files_are_refused_through_the_loader_in_one_line_and_nothing_is_written(
    tmp_path, capsys, hostile, message
) -> None:
    src, out = _copy(tmp_path), tmp_path / "out"
    _shard(src)
    hostile(src)
    assert main(["nanbeige", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("looped-hf convert: error: ") and message in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_loop_loss_weights_set_the_loop_count_as_mlx_lm_reads_it_and_the_card_says_so(tmp_path: Path) -> None:
    native = json.loads((DATA / "config.json").read_text())
    assert nanbeige_config({**native, "loop_loss_weights": [0.5, 0.5]}).num_recurrences == 3  # mlx-lm: 3
    assert nanbeige_config({**native, "loop_loss_weights": []}).num_recurrences == 1
    assert (
        nanbeige_config(
            {k: v for k, v in native.items() if k != "num_loops"} | {"loop_loss_weights": [1]}
        ).num_recurrences
        == 2
    )
    with pytest.raises(ConversionError, match=r"^config.json has no 'num_loops'"):
        nanbeige_config({k: v for k, v in native.items() if k != "num_loops"})
    out = convert_nanbeige(_copy(tmp_path, loop_loss_weights=[0.5, 0.5]), tmp_path / "out")
    card = (out / "README.md").read_text()
    assert "`len(loop_loss_weights) + 1` = 3" in card and "`num_loops` says 2" in card
    assert "format: nanbeige" in card


def test_a_config_without_a_size_is_refused_by_name_not_given_llamas_default() -> None:
    native = json.loads((DATA / "config.json").read_text())
    for key in ("num_hidden_layers", "intermediate_size", "hidden_size", "num_attention_heads", "vocab_size"):
        with pytest.raises(ConversionError, match=rf"^config.json has no '{key}'$"):
            nanbeige_config({k: v for k, v in native.items() if k != key})
    # head_dim absent is Llama's hidden / heads; num_key_value_heads absent is MHA.
    config = nanbeige_config(
        {k: v for k, v in native.items() if k not in ("head_dim", "num_key_value_heads")}
    )
    assert (config.head_dim, config.num_key_value_heads) == (16, 4)


def test_a_bf16_checkpoint_converts_in_bf16(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = _copy(tmp_path)
    save_file(
        {k: v.bfloat16() for k, v in load_file(src / "model.safetensors").items()}, src / "model.safetensors"
    )
    converted = nanbeige_to_looped(src)
    assert {p.dtype for p in converted.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = converted(torch.tensor([[37, 235, 140, 72]]))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()


# --------------------------------------------------------------------------------------------
# Any r downstream: looped-hf test-time (the card shows the curve) and looped-hf eval at 1..4 loops
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder_with_tokenizer(tmp_path_factory) -> Path:
    """The fixture given a 256-token tokenizer (as a released folder has one), converted by the CLI."""
    from zoo_helpers import save_char_tokenizer

    root = tmp_path_factory.mktemp("nanbeige-downstream")
    shutil.copytree(DATA, root / "native")
    save_char_tokenizer(root / "native", 256)
    assert main(["nanbeige", str(root / "native"), "--out", str(root / "converted")]) == 0
    return root / "converted"


@pytest.fixture(scope="module")
def heldout_text(tmp_path_factory) -> Path:
    import lzma

    from conftest import REPO

    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    with lzma.open(REPO / "looped_hf" / "assets" / "corpus.jsonl.xz", "rt", encoding="utf-8") as src:
        rows = [json.loads(line)["text"][:800] for _, line in zip(range(20), src, strict=False)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows), encoding="utf-8")
    return path


def test_test_time_measures_one_to_four_loops_and_the_card_shows_the_curve(
    folder_with_tokenizer: Path, heldout_text: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from looped_hf.cli import main as cli
    from looped_hf.recurrence_curves import CURVE_HEADING, CURVE_JSON

    monkeypatch.setenv("LOOPED_HF_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "converted"
    shutil.copytree(folder_with_tokenizer, folder)
    argv = ["test-time", str(folder), "--data", str(heldout_text), "--seq-len", "32", "--eval-blocks", "4"]
    # 65 x the trained 2 loops is past the config's ceiling (64 x): refused in one line, nothing measured.
    assert cli([*argv, "--max-factor", "65"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err.startswith("looped-hf test-time: ")
        and "ceiling of 128" in err
        and not (folder / CURVE_JSON).exists()
    )
    assert cli([*argv, "--max-factor", "2"]) == 0
    curve = json.loads((folder / CURVE_JSON).read_text())
    assert [row["num_recurrences"] for row in curve["rows"]] == [1, 2, 3, 4]
    losses = [row["loss"] for row in curve["rows"]]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == 4
    card = (folder / "README.md").read_text()
    assert card.count(CURVE_HEADING) == 1 and "format: nanbeige" in card
    for row in curve["rows"]:  # every r's loss is in the card's table
        assert f"| {row['loss']:.4f} |" in card
    assert "| **2** (trained) |" in card and "![held-out loss vs r](test_time_scaling.png)" in card
    # Measured again (another --max-factor): the section is replaced, not repeated.
    assert cli([*argv, "--max-factor", "1"]) == 0
    card = (folder / "README.md").read_text()
    assert card.count(CURVE_HEADING) == 1 and "| 3 |" not in card and "converted to looped_hf" in card


def test_eval_at_one_to_four_loops_on_the_converted_folder(
    folder_with_tokenizer: Path, tmp_path: Path
) -> None:
    from looped_hf.cli import main as cli
    from looped_hf.evaluation.report import RESULTS_JSON

    out = tmp_path / "eval"
    argv = ["eval", str(folder_with_tokenizer), "--bundle", "builtin", "--builtin-examples", "6", "--device", "cpu",
            "--tasks", "addition_2d", "--out", str(out), "--recurrences", "1", "2", "3", "4"]  # fmt: skip
    assert cli(argv) == 0
    results = json.loads((out / RESULTS_JSON).read_text())
    assert results["recurrences"] == [1, 2, 3, 4]
    losses = [row["tasks"]["addition_2d"]["loss"] for row in results["rows"]]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == 4  # r changes the scores


# --------------------------------------------------------------------------------------------
# The design as a phi probe: recipes/iso_depth_tiny_nanbeige.yaml
# --------------------------------------------------------------------------------------------
def test_the_probe_recipe_plans_nanbeiges_design_counted_by_hand() -> None:
    """``looped-hf sweep recipes/iso_depth_tiny_nanbeige.yaml --dry-run``: two seeds per cell, and for
    d = 12, r = 2 the whole-stack loop with the shared final norm: N_once is that norm alone, N_rec the
    four pre-norm layers, the head runs once; every run's config is the converter's design."""
    from conftest import REPO

    from looped_hf.arguments import parse_recipe
    from looped_hf.convert.nanbeige import NANBEIGE_SETTINGS
    from looped_hf.sweep.plan import make_plan

    vocab, seq, d = 258, 64, 12
    runs = {run.run_id: run for run in make_plan(REPO / "recipes" / "iso_depth_tiny_nanbeige.yaml").runs}
    assert len(runs) == 72 and {"loop2-w12-b0-s0", "loop2-w12-b0-s1"} <= set(runs)
    layer = 12 * d * d + 2 * d  # q, k, v, o and the squared-ReLU MLP (d -> 4d -> d), two norm scales
    loop2 = runs["loop2-w12-b0-s0"]
    assert (loop2.num_prelude_layers, loop2.num_recurrent_layers, loop2.num_coda_layers) == (0, 4, 0)
    assert (loop2.n_once, loop2.n_rec) == (d, 4 * layer)
    assert loop2.flops_per_token == 6 * vocab * d + 6 * 2 * loop2.n_rec + 12 * d * seq * 2 * 4
    model_args, data_args, _ = parse_recipe(dict(loop2.recipe))
    config = model_args.to_config(vocab, data_args.seq_len)
    design = {
        key: getattr(config, key) for key in NANBEIGE_SETTINGS if key not in ("qk_norm", "logit_softcap")
    }
    assert design == {k: v for k, v in NANBEIGE_SETTINGS.items() if k not in ("qk_norm", "logit_softcap")}
    assert (config.recurrence_norm, config.recurrence_norm_weight) == (True, "final")
    torch.manual_seed(0)
    model = LoopedForCausalLM(config)
    assert model.training_flops_per_token(seq) == loop2.flops_per_token
