"""IQuest LoopCoder converted by ``looped-hf convert iquest`` gives the references' outputs, at any r.

The fixture is ``tests/fixtures/zoo2/iquest-loopcoder-tiny`` (its PROVENANCE.md): a 2-layer, width-64
IQuest LoopCoder checkpoint (GQA 4/2 heads, loop_num 2, loop_window_size 4) with random weights in
the release's layout, and logits computed by mlx-lm's IQuest model at loop 2 (loops 1 and 3 by a
torch re-implementation of the Hub code's prefill only), plus greedy tokens with and without
mlx-lm's cache. Measured max |delta| (float32, CPU, torch 2.13, one thread): <= 1.9e-6 at every
loop count, against the references' own cross-implementation spread of 1.9e-6.

Shapes the fixture does not have (more heads per KV head, head_dim != hidden / heads, other loop
counts, windows and seeds, gates stored inside each layer) are checked against ``reference_logits``
below, the design written out with explicit loops over positions, independent of the model's code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_path
from transformers import AutoModelForCausalLM
from zoo_helpers import load_converted, load_reference, max_delta, remote_code_results

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.convert import main
from looped_hf.convert.iquest import convert_iquest, iquest_config, iquest_to_looped

DATA = fixture_path("zoo2", "iquest-loopcoder-tiny")
PROMPTS = ("p0", "p1")
TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_reference(DATA)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return convert_iquest(DATA, tmp_path_factory.mktemp("iquest") / "iquest-tiny-looped")


@pytest.fixture(scope="module")
def model(folder: Path) -> LoopedForCausalLM:
    return load_converted(folder)


# --- an independent statement of the design ------------------------------------------------------
def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of (tokens, heads, head_dim) at positions 0..T-1."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_logits(cfg: dict, w: dict[str, torch.Tensor], ids: list[int], loops: int,
                     qk_norm_after_rope: bool = False) -> torch.Tensor:  # fmt: skip
    """IQuest LoopCoder's forward (one unpadded sequence) from the native config and weights, with
    explicit loops over query positions: loop 1 causal; later loops g * attn(q, K1, V1, causal) +
    (1 - g) * attn(q, K, V, the last `window` positions), g = sigmoid(q . W_h + b_h) per head.
    `qk_norm_after_rope`: q and k RMS-normed per head after RoPE, no weight (the study's QK-norm,
    which the release does not have), before the attention and the gate read q."""
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta, window = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["loop_window_size"]
    x = w["model.embed_tokens.weight"][ids]
    t = len(ids)
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(q, k, v, keys):  # q (heads, hd); k, v (T, kv, hd); keys: the visible positions
        out = []
        for h in range(heads):
            kh, vh = k[keys, h // (heads // kv)], v[keys, h // (heads // kv)]
            out.append(torch.softmax(kh @ q[h] / hd**0.5, -1) @ vh)
        return torch.stack(out)

    for loop in range(loops):
        for j in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{j}."
            n = _rms(x, w[p + "input_layernorm.weight"], eps)
            q = _rope((n @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, hd), theta)
            k = _rope((n @ w[p + "self_attn.k_proj.weight"].T).view(t, kv, hd), theta)
            if qk_norm_after_rope:
                q, k = _rms(q, torch.ones(hd), eps), _rms(k, torch.ones(hd), eps)
            v = (n @ w[p + "self_attn.v_proj.weight"].T).view(t, kv, hd)
            rows = []
            for i in range(t):
                if loop == 0:
                    rows.append(attend(q[i], k, v, list(range(i + 1))))
                    continue
                k1, v1 = first[j]
                glob = attend(q[i], k1, v1, list(range(i + 1)))
                loc = attend(q[i], k, v, list(range(max(0, i - window + 1), i + 1)))
                gw, gb = w[f"model.gate_projections.{j}.weight"], w[f"model.gate_projections.{j}.bias"]
                g = torch.sigmoid((q[i] * gw).sum(-1) + gb)[:, None]
                rows.append(g * glob + (1 - g) * loc)
            if loop == 0:
                first[j] = (k, v)
            x = x + torch.stack(rows).reshape(t, heads * hd) @ w[p + "self_attn.o_proj.weight"].T
            n = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            mlp = F.silu(n @ w[p + "mlp.gate_proj.weight"].T) * (n @ w[p + "mlp.up_proj.weight"].T)
            x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def make_checkpoint(folder: Path, *, seed: int, heads: int = 4, kv: int = 2, head_dim: int = 16, hidden: int = 48,
                    layers: int = 2, loop_num: int = 2, window: int = 3, gates_in_layers: bool = False) -> tuple[dict, dict]:  # fmt: skip
    """An IQuest LoopCoder folder in the release's layout with seeded random weights (norms 1 + 0.1 randn,
    gate biases 0.5 randn so the gate is far from 1/2); returns (config, weights in the release's names)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    cfg = json.loads((DATA / "config.json").read_text())
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_size=hidden,
               num_hidden_layers=layers, loop_num=loop_num, loop_window_size=window, intermediate_size=64)  # fmt: skip
    vocab = cfg["vocab_size"]

    def lin(o, i):
        return torch.randn(o, i, generator=gen) / i**0.5

    def norm(d):
        return 1 + 0.1 * torch.randn(d, generator=gen)

    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen), "model.norm.weight": norm(hidden),
         "lm_head.weight": lin(vocab, hidden)}  # fmt: skip
    for j in range(layers):
        p = f"model.layers.{j}."
        w |= {p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
              p + "self_attn.q_proj.weight": lin(heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": lin(kv * head_dim, hidden),
              p + "self_attn.v_proj.weight": lin(kv * head_dim, hidden),
              p + "self_attn.o_proj.weight": lin(hidden, heads * head_dim),
              p + "mlp.gate_proj.weight": lin(64, hidden), p + "mlp.up_proj.weight": lin(64, hidden),
              p + "mlp.down_proj.weight": lin(hidden, 64),
              f"model.gate_projections.{j}.weight": torch.randn(heads, head_dim, generator=gen) / head_dim**0.5,
              f"model.gate_projections.{j}.bias": 0.5 * torch.randn(heads, generator=gen)}  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    stored = dict(w)
    if gates_in_layers:
        for j in range(layers):
            for part in ("weight", "bias"):
                stored[f"model.layers.{j}.self_attn.gate_projection.{part}"] = stored.pop(
                    f"model.gate_projections.{j}.{part}"
                )
    save_file({k: v.contiguous() for k, v in stored.items()}, folder / "model.safetensors")
    return cfg, w


# --- the fixture ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loops", [1, 2, 3])
def test_logits_at_every_loop_count_the_fixture_holds_match_the_references(model, ref, loops: int) -> None:
    suffix = "_logits" if loops == 2 else "_logits_torch_reference_only"
    for p in PROMPTS:
        with torch.no_grad():
            logits = model(ref[p + "_input_ids"], num_recurrences=loops).logits
        assert max_delta(logits, ref[f"{p}_loop{loops}{suffix}"]) <= TOLERANCE, (p, loops)
    assert model.config.num_recurrences == 2 and model.config.loop_window_size == 4


@pytest.mark.parametrize("use_cache", [False, True])
def test_greedy_tokens_equal_mlx_lms_with_and_without_the_cache(model, ref, use_cache: bool) -> None:
    for p in PROMPTS:
        out = model.generate(ref[p + "_input_ids"], max_new_tokens=8, do_sample=False, use_cache=use_cache)
        assert torch.equal(out, ref[p + "_greedy_cache" if use_cache else p + "_greedy_nocache"]), p


def test_the_window_and_the_gate_decide_the_logits(model, ref) -> None:
    """The fixture's prompts are longer than the window, and the gate is far from constant: a model
    reading the whole prefix locally, or one branch only, is measurably wrong (so the parity above
    checks both)."""
    ids, expected = ref["p1_input_ids"], ref["p1_loop2_logits"]
    wide = AutoModelForCausalLM.from_pretrained(
        model.name_or_path, loop_window_size=64, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert max_delta(wide(ids).logits, expected) > 0.1
        for bias in (30.0, -30.0):  # g = 1 (global only), g = 0 (local only)
            saved = [gate.bias.clone() for gate in model.model.gate_projections]
            for gate in model.model.gate_projections:
                gate.bias.fill_(bias)
            try:
                assert max_delta(model(ids).logits, expected) > 0.1
            finally:
                for gate, b in zip(model.model.gate_projections, saved, strict=True):
                    gate.bias.copy_(b)


def test_the_converted_folder_loads_as_remote_code_with_the_same_logits(
    folder: Path, ref, tmp_path: Path
) -> None:
    out = remote_code_results(folder, DATA / "reference.npz", """
for p in ("p0", "p1"):
    ids = torch.from_numpy(ref[p + "_input_ids"])
    out[p] = (m(ids).logits - torch.from_numpy(ref[p + "_loop2_logits"])).abs().max().item()
    g = m.generate(ids, max_new_tokens=8, do_sample=False, num_recurrences=3)
    out[p + "_r3_tokens"] = g[0, -8:].tolist()
""", tmp_path)
    assert max(out["p0"], out["p1"]) <= TOLERANCE, out
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p in PROMPTS:
        tokens = model.generate(ref[p + "_input_ids"], max_new_tokens=8, do_sample=False, num_recurrences=3)
        assert tokens[0, -8:].tolist() == out[p + "_r3_tokens"]


# --- shapes the fixture does not have ------------------------------------------------------------
SHAPES = [
    dict(seed=1, heads=4, kv=1, head_dim=8, hidden=40, layers=2, loop_num=2, window=2),
    dict(seed=2, heads=6, kv=3, head_dim=12, hidden=48, layers=1, loop_num=3, window=5, gates_in_layers=True),
    dict(seed=3, heads=2, kv=2, head_dim=16, hidden=32, layers=3, loop_num=4, window=1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"seed{s['seed']}")
def test_unseen_shapes_match_the_design_at_r_1_to_4_and_decode_as_they_prefill(tmp_path: Path, shape) -> None:
    cfg, w = make_checkpoint(tmp_path / "src", **shape)
    model = iquest_to_looped(tmp_path / "src")
    ids = torch.randint(0, cfg["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(shape["seed"]))
    for r in (1, 2, 3, 4):
        with torch.no_grad():
            full = model(ids, num_recurrences=r).logits
        expected = reference_logits(cfg, w, ids[0].tolist(), r)
        assert max_delta(full[0], expected) <= TOLERANCE, r
        # Decoding over the cache: a 4-token prefill, then one token at a time, then a 3-token chunk.
        with torch.no_grad():
            out = model(ids[:, :4], num_recurrences=r, use_cache=True)
            steps, cache = [out.logits], out.cache
            for i in range(4, 8):
                out = model(ids[:, i : i + 1], num_recurrences=r, cache=cache, use_cache=True)
                steps.append(out.logits)
            steps.append(model(ids[:, 8:], num_recurrences=r, cache=cache, use_cache=True).logits)
        assert max_delta(torch.cat(steps, 1), full) <= TOLERANCE, r
        # Later loops keep only the window's last positions in their cache slots.
        if r > 1:
            later = cache.layers[model.config.num_recurrent_layers]
            assert later.keys.shape[-2] == min(shape["window"] - 1, 11) and later.get_seq_length() == 11


def test_the_loop_attention_with_the_studys_qk_norm_matches_the_design_and_decodes_as_it_prefills(
    tmp_path: Path,
) -> None:
    # Not in the release; the phi probe keeps the base's QK-norm, so the later loops' global and
    # local reads and the gate must see the normed q and k as loop 1 does.
    cfg, w = make_checkpoint(tmp_path / "src", seed=4, heads=4, kv=2, head_dim=8, hidden=32, window=3)
    converted = iquest_to_looped(tmp_path / "src")
    config = converted.config.to_dict() | {"qk_norm": "after_rope"}
    config.pop("model_type")
    model = LoopedForCausalLM(LoopedConfig(**config)).eval()
    model.load_state_dict(converted.state_dict())
    ids = torch.randint(0, cfg["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(4))
    for r in (1, 2, 3):
        with torch.no_grad():
            full = model(ids, num_recurrences=r).logits
            out = model(ids[:, :5], num_recurrences=r, use_cache=True)
            steps, cache = [out.logits], out.cache
            for i in range(5, 9):
                steps.append(model(ids[:, i : i + 1], num_recurrences=r, cache=cache, use_cache=True).logits)
        assert max_delta(full[0], reference_logits(cfg, w, ids[0].tolist(), r, qk_norm_after_rope=True)) <= TOLERANCE
        assert max_delta(torch.cat(steps, 1), full) <= TOLERANCE, r
    # The norm changes the logits (the test would pass vacuously if it were skipped).
    assert max_delta(full[0], reference_logits(cfg, w, ids[0].tolist(), 3)) > 1e-3


def test_a_left_padded_batch_generates_each_rows_own_tokens(tmp_path: Path) -> None:
    """A padded row's window holds as many real tokens as the unpadded row's (counted over the
    tokens it may attend to, not cache indices), so batching changes no token."""
    make_checkpoint(tmp_path / "src", seed=5, window=3)
    model = iquest_to_looped(tmp_path / "src")
    rows = [[5, 9, 11, 200, 31, 7, 99], [17, 3, 250]]
    pad = 0
    batch = torch.tensor([rows[0], [pad] * 4 + rows[1]])
    mask = torch.tensor([[1] * 7, [0] * 4 + [1] * 3])
    for r in (2, 3):
        together = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, num_recurrences=r,
                                  pad_token_id=pad)  # fmt: skip
        for i, row in enumerate(rows):
            alone = model.generate(torch.tensor([row]), max_new_tokens=6, do_sample=False, num_recurrences=r)
            assert together[i, -6:].tolist() == alone[0, -6:].tolist(), (r, i)


# --- refusals ------------------------------------------------------------------------------------
def _copy(tmp_path: Path, **changes) -> Path:
    src = tmp_path / "src"
    shutil.copytree(DATA, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize(("changes", "message"), [
    ({"flux_capacitor": 3}, "config.json flux_capacitor=3: unknown IQuest LoopCoder config key"),
    ({"loop_num": 10**9}, "config.json loop_num=1000000000: above the ceiling"),
    ({"loop_num": 0}, "loop_num=0"),
    ({"loop_window_size": 0}, "loop_window_size=0"),
    ({"loop_window_size": "64"}, "loop_window_size='64'"),
    ({"hidden_act": "relu2"}, "config.json hidden_act='relu2': must be one of"),
    ({"pretraining_tp": 2}, "config.json pretraining_tp=2"),
    ({"model_type": "llama"}, "config.json model_type='llama': not an IQuest LoopCoder config"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"vocab_size": 300}, "model.embed_tokens.weight"),
])  # fmt: skip
def test_the_cli_refuses_a_hostile_checkpoint_in_one_line_and_writes_nothing(
    tmp_path, capsys, changes, message
):
    src, out = _copy(tmp_path, **changes), tmp_path / "out"
    assert main(["iquest", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-hf convert: error: ") and message in err and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda w: w.update({"model.layers.0.mystery.weight": torch.zeros(3)}), "unknown IQuest LoopCoder weight "
                                                                             "'model.layers.0.mystery.weight'"),
    (lambda w: w.update({"model.layers.1.self_attn.gate_projection.bias": torch.zeros(4)}), "a gate stored twice"),
    (lambda w: w.pop("model.gate_projections.1.bias"), "model.gate_projections.1.bias"),
    (lambda w: w.update({"model.gate_projections.0.weight": torch.zeros(16, 4)}), "model.gate_projections.0.weight"),
])  # fmt: skip
def test_a_weight_file_that_does_not_fit_is_refused_by_name(tmp_path: Path, capsys, edit, message) -> None:
    from safetensors.torch import load_file, save_file

    src, out = _copy(tmp_path), tmp_path / "out"
    weights = load_file(src / "model.safetensors")
    edit(weights)
    save_file(weights, src / "model.safetensors")
    assert main(["iquest", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not out.exists()


@pytest.mark.parametrize(("fields", "message"), [
    (dict(loop_window_size=4), "loop_window_size=4: needs loop_attention"),
    (dict(loop_attention="gated_global_local"), "loop_attention='gated_global_local': needs loop_window_size"),
    (dict(loop_attention="gated_global_local", loop_window_size=4, kv_budget=1), "kv_budget=1: refused"),
    (dict(loop_attention="gated_global_local", loop_window_size=4, exit_criterion="kl"), "exit_criterion='kl'"),
    (dict(loop_attention="sliding", loop_window_size=4), "loop_attention='sliding': must be one of"),
])  # fmt: skip
def test_the_config_refuses_what_the_loop_attention_cannot_run_in_one_line(fields, message) -> None:
    with pytest.raises(ValueError, match=None) as err:
        LoopedConfig(**fields)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_per_call_settings_the_loop_attention_cannot_run_are_refused_in_one_line(model, ref) -> None:
    ids = ref["p0_input_ids"]
    for kwargs, message in (({"kv_budget": 1, "num_recurrences": 3}, "kv_budget=1: refused"),
                            ({"exit_criterion": "kl"}, "exit_criterion='kl'"),
                            ({"num_recurrences": 10**6}, "num_recurrences=1000000: exceeds")):  # fmt: skip
        with pytest.raises(ValueError) as err:
            model(ids, **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    # A cache that keeps positions at fixed places, and assisted decoding (it crops the cache back).
    for kwargs, message in (({"cache_implementation": "static"}, "StaticLayer cache slot cannot hold"),
                            ({"draft_num_recurrences": 1}, "cannot be cropped")):  # fmt: skip
        with pytest.raises(ValueError) as err:
            model.generate(ref["p1_input_ids"], max_new_tokens=6, do_sample=False, **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_cli_writes_a_folder_with_a_card_the_code_and_the_config(tmp_path: Path, capsys) -> None:
    out = tmp_path / "converted"
    assert main(["iquest", str(DATA), "--out", str(out)]) == 0
    assert "[convert] wrote" in capsys.readouterr().out
    assert (out / "loop_attention_looped.py").is_file()
    card = (out / "README.md").read_text()
    assert "format: iquest" in card and "last 4 positions" in card
    config = json.loads((out / "config.json").read_text())
    assert (config["loop_attention"], config["loop_window_size"], config["num_recurrences"]) == (
        "gated_global_local",
        4,
        2,
    )
    assert iquest_config(json.loads((DATA / "config.json").read_text())).num_recurrent_layers == 2


# --- any r downstream: test-time, eval, the card -------------------------------------------------
def test_test_time_and_eval_at_1_to_4_loops_and_the_card_shows_the_curve(tmp_path: Path, monkeypatch) -> None:
    import lzma

    from conftest import REPO
    from zoo_helpers import save_char_tokenizer

    from looped_hf.cli import main as cli
    from looped_hf.evaluation.report import RESULTS_JSON
    from looped_hf.recurrence_curves import CURVE_JSON

    monkeypatch.setenv("LOOPED_HF_CACHE", str(tmp_path / "cache"))
    src, out = tmp_path / "src", tmp_path / "converted"
    shutil.copytree(DATA, src)
    save_char_tokenizer(src, 256)
    assert main(["iquest", str(src), "--out", str(out)]) == 0
    heldout = tmp_path / "heldout.jsonl"
    with lzma.open(REPO / "looped_hf" / "assets" / "corpus.jsonl.xz", "rt", encoding="utf-8") as corpus:
        rows = [json.loads(line)["text"][:600] for _, line in zip(range(8), corpus, strict=False)]
    heldout.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows), encoding="utf-8")

    argv = [
        "test-time",
        str(out),
        "--data",
        str(heldout),
        "--seq-len",
        "24",
        "--eval-blocks",
        "2",
        "--max-factor",
        "2",
    ]
    assert cli(argv) == 0
    curve = json.loads((out / CURVE_JSON).read_text())
    assert [row["num_recurrences"] for row in curve["rows"]] == [1, 2, 3, 4]
    losses = [row["loss"] for row in curve["rows"]]
    assert len(set(losses)) == 4 and all(np.isfinite(losses))
    card = (out / "README.md").read_text()
    assert "## Test-time scaling" in card and "| 4 |" in card and "format: iquest" in card
    assert cli(argv) == 0  # measured again: the card's section is replaced, not appended
    assert (out / "README.md").read_text().count("## Test-time scaling") == 1

    evaluated = tmp_path / "eval"
    assert cli(["eval", str(out), "--bundle", "builtin", "--builtin-examples", "6", "--device", "cpu", "--tasks",
                "addition_2d", "--out", str(evaluated), "--recurrences", "1", "2", "3", "4"]) == 0  # fmt: skip
    results = json.loads((evaluated / RESULTS_JSON).read_text())
    assert results["recurrences"] == [1, 2, 3, 4]
    assert len({row["tasks"]["addition_2d"]["loss"] for row in results["rows"]}) == 4


@pytest.mark.parametrize("damage", ["truncated", "pickle_only", "missing_shard"])
def test_the_loaders_refusals_reach_the_iquest_converter_in_one_line(
    tmp_path: Path, capsys, damage: str
) -> None:
    """The classes every format refuses (through the one loader): a truncated weight file, a folder with
    only a pickled ``pytorch_model.bin``, an index naming a shard that is not there."""
    src, out = _copy(tmp_path), tmp_path / "out"
    weights = src / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif damage == "pickle_only":
        weights.rename(src / "pytorch_model.bin")
    else:
        index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
        weights.rename(src / "model-00001-of-00002.safetensors")
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["iquest", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-hf convert: error: ") and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_the_released_40b_loop_config_maps_onto_the_config() -> None:
    """IQuest-Coder-V1-40B-Loop's config.json keys and values (as its published copies list them):
    80 layers looped twice, GQA 40/8 heads of 128, window 64, three EOS ids. Built on the meta device."""
    native = {
        "architectures": ["IQuestLoopCoderForCausalLM"], "model_type": "iquestloopcoder", "attention_bias": False,
        "attention_dropout": 0.0, "eos_token_id": [2, 75864, 75869], "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 27648, "loop_num": 2,
        "loop_window_size": 64, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 40,
        "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 76800,
    }  # fmt: skip
    config = iquest_config(native)
    assert (config.num_recurrent_layers, config.num_recurrences, config.loop_window_size) == (80, 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (40, 8, 128)
    assert config.rope_parameters["rope_theta"] == 500000 and config.eos_token_id == [2, 75864, 75869]
    with torch.device("meta"):
        model = LoopedForCausalLM(config)
    assert tuple(model.model.gate_projections[79].weight.shape) == (40, 128)
    assert model.num_scaling_params()["recurrent"] > 20e9  # the 80 shared layers (~20B parameters) loop twice
    # An MLX-quantised copy of it is refused by name: its weights are not the checkpoint's floats.
    with pytest.raises(Exception, match="quantization"):
        iquest_config({**native, "quantization": {"group_size": 64, "bits": 4}})


# --- the design as a phi probe: recipes/iso_depth_tiny_iquest.yaml ------------------------------
def test_the_probe_recipe_plans_iquests_design_with_the_local_read_counted_by_hand() -> None:
    """``looped-hf sweep recipes/iso_depth_tiny_iquest.yaml --dry-run``: two seeds per cell; for d = 12
    the whole-stack loop with the gated loop attention and the base's QK-norm. N_rec holds the four
    layers and their gates; the FLOPs add the local read of every loop after the first, over the
    16-position window, to the global read at full T."""
    from conftest import REPO

    from looped_hf.arguments import parse_recipe
    from looped_hf.sweep.plan import make_plan

    vocab, seq, d, window = 258, 64, 12, 16
    runs = {run.run_id: run for run in make_plan(REPO / "recipes" / "iso_depth_tiny_iquest.yaml").runs}
    assert len(runs) == 72 and {"loop2-w12-b0-s0", "loop2-w12-b0-s1"} <= set(runs)
    layer = 12 * d * d + 2 * d  # q, k, v, o and the squared-ReLU MLP (d -> 4d -> d), two norm scales
    gates = 3 * 4 + 3  # heads x head_dim weights and a bias per head, one gate per block layer
    hq = d  # heads x head_dim
    for r, block in ((2, 4), (4, 2), (8, 1)):
        run = runs[f"loop{r}-w12-b0-s0"]
        assert (run.num_prelude_layers, run.num_recurrent_layers, run.num_coda_layers) == (0, block, 0)
        assert (run.n_once, run.n_rec) == (d, block * (layer + gates))
        global_read = 12 * hq * seq * r * block
        local_read = 12 * hq * window * (r - 1) * block
        assert run.flops_per_token == 6 * vocab * d + 6 * r * run.n_rec + global_read + local_read
        model_args, data_args, _ = parse_recipe(dict(run.recipe))
        config = model_args.to_config(vocab, data_args.seq_len)
        assert (config.loop_attention, config.loop_window_size, config.qk_norm) == (
            "gated_global_local", window, "after_rope")
        torch.manual_seed(0)
        model = LoopedForCausalLM(config)
        assert model.training_flops_per_token(seq) == run.flops_per_token
        # Inference: the same reads, forward only.
        assert model.inference_flops_per_token(seq) == 2 * vocab * d + 2 * r * run.n_rec + (
            4 * hq * seq * r * block + 4 * hq * window * (r - 1) * block)
    plain = runs["base-w12-b0-s0"]  # r = 1: no later loop, no local read
    assert plain.flops_per_token == 6 * vocab * d + 6 * plain.n_rec + 12 * hq * seq * 8
