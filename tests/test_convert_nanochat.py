"""The study's checkpoints load into transformers: ``looped-hf convert nanochat``.

The references are the study's own outputs (``tests/fixtures/study_checkpoints``, made by the study's
code with scripts/make_study_fixtures.py, see its PROVENANCE.md): logits of ``GPT.forward`` at the
trained r and at other r, and of its KV-cache decode with a ``kv_budget`` (prefill 16 tokens, then one
at a time for t = 16..47). The fixtures are width 32 (2 heads of 16), vocabulary 256 (250 padded to
256 in ``loop4_linear_padvocab``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_path, run_without_looped_hf
from safetensors.torch import load_file

from looped_hf.convert import (
    ConversionError,
    convert_nanochat,
    flip_second_rotary_half,
    load_nanochat_checkpoint,
    main,
    nanochat_config,
    nanochat_to_looped,
)
from looped_hf.publish import PublishError

DATA = fixture_path("study_checkpoints")
FIXTURES = ("loop4_linear", "loop2_additive", "loop8_hyperconnect", "noloop", "loop4_linear_trunc",
            "loop4_linear_padvocab")  # fmt: skip
TOLERANCE = 1e-5
PREFILL = 16  # the study's kv decode: prefill ids[:, :16], then one token at a time
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_convert_nanochat.py"


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(fixture_path("study_checkpoints", name, "reference.safetensors"))


def _bench():
    """benchmarks/bench_convert_nanochat.py: the one implementation of the study comparisons."""
    spec = importlib.util.spec_from_file_location("bench_convert_nanochat", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()


# --------------------------------------------------------------------------------------------
# 1. Logits: the study's, at the trained r, at other r, and through the cached decode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_converted_logits_equal_the_studys_at_every_r_and_kv_budget_stored(name: str) -> None:
    model, _ = nanochat_to_looped(DATA / name)
    ref = reference(name)
    diffs = bench.reference_differences(model, ref)
    assert "logits" in diffs
    assert all(d <= TOLERANCE for d in diffs.values()), diffs


def test_the_fixtures_cover_other_r_and_kv_budgets_where_the_study_stored_them() -> None:
    keys = {name: set(reference(name)) for name in FIXTURES}
    assert {"logits_num_recur_8", "logits_num_recur_2", "logits_kv_budget_1", "logits_kv_budget_4"} <= keys[
        "loop4_linear"
    ]
    assert {"logits_num_recur_4", "logits_kv_budget_1"} <= keys["loop2_additive"]
    assert "logits_kv_budget_1" in keys["loop8_hyperconnect"]


def test_without_the_rope_reparametrisation_the_logits_are_far_off() -> None:
    """A name-for-name copy (the flip undone), the error the conversion removes: the logits are far off."""
    model, _ = nanochat_to_looped(DATA / "loop2_additive")
    ref = reference("loop2_additive")
    bench.undo_reparametrisation(model)
    with torch.no_grad():
        off = float((model(ref["input_ids"]).logits - ref["logits"]).abs().max())
    assert off > 1000 * TOLERANCE, off


def test_the_flip_negates_exactly_the_second_half_of_each_head_and_undoes_itself() -> None:
    w = torch.randn(2 * 6, 5)
    flipped = flip_second_rotary_half(w, num_heads=2, head_dim=6)
    rows = torch.tensor([1, 1, 1, -1, -1, -1] * 2, dtype=w.dtype)
    torch.testing.assert_close(flipped, w * rows[:, None], rtol=0, atol=0)
    torch.testing.assert_close(flip_second_rotary_half(flipped, 2, 6), w, rtol=0, atol=0)
    with pytest.raises(ConversionError, match="does not split into 3 heads"):
        flip_second_rotary_half(w, num_heads=3, head_dim=6)


@pytest.mark.parametrize("name", FIXTURES)
def test_every_weight_is_kept_so_the_accounting_counts_the_studys_parameters(name: str) -> None:
    model, ckpt = nanochat_to_looped(DATA / name)
    study_total = sum(t.numel() for t in ckpt.state_dict.values())
    assert model.num_scaling_params()["total"] == study_total
    config = model.config
    assert config.padded_vocab_size == math.ceil(config.vocab_size / 64) * 64
    assert model.lm_head.weight.shape[0] == config.padded_vocab_size  # padded rows kept
    torch.testing.assert_close(model.lm_head.weight, ckpt.state_dict["lm_head.weight"], rtol=0, atol=0)


def test_the_config_maps_every_study_key() -> None:
    meta = json.loads((DATA / "loop4_linear_trunc" / "meta_000020.json").read_text())
    config = nanochat_config(meta["model_config"], padded_rows=256)
    mc = meta["model_config"]
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        mc["vocab_size"], mc["n_embd"], mc["n_head"], mc["n_kv_head"])  # fmt: skip
    assert (config.num_prelude_layers, config.num_recurrent_layers, config.num_coda_layers) == (2, 4, 2)
    assert (config.num_recurrences, config.backprop_recurrences) == (4, 2)  # bptt_k 2 of r 4
    assert config.input_injection == "linear" and config.logit_softcap == 15.0
    assert config.max_position_embeddings == mc["sequence_len"] and config.head_dim == 16
    assert config.rope_table_dtype == "bfloat16" and config.init_scheme == "study"
    assert config.qk_norm == "after_rope" and config.intermediate_size == 4 * 32
    hc = json.loads((DATA / "loop8_hyperconnect" / "meta_000020.json").read_text())["model_config"]
    hc_config = nanochat_config(hc, padded_rows=256)
    assert hc_config.input_injection == "hyperconnection" and hc_config.num_hyperconnection_lanes == 2
    assert hc_config.backprop_recurrences is None  # bptt_k = r: full backprop
    additive = nanochat_config({**mc, "input_injection": "additive"}, padded_rows=256)
    assert additive.input_injection == "add" and additive.state_init == "zeros"
    assert (
        nanochat_config({**mc, "input_injection": "passthrough"}, padded_rows=256).input_injection == "none"
    )


# --------------------------------------------------------------------------------------------
# 2. What a checkpoint may hold: prefix, bf16, legacy keys; refused files named
# --------------------------------------------------------------------------------------------


def copy_fixture(name: str, dest: Path, state: dict | None = None, meta: dict | None = None) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    src = DATA / name
    if state is None:
        shutil.copyfile(src / "model_000020.pt", dest / "model_000020.pt")
    else:
        torch.save(state, dest / "model_000020.pt")
    meta = json.loads((src / "meta_000020.json").read_text()) if meta is None else meta
    (dest / "meta_000020.json").write_text(json.dumps(meta))
    return dest


def fixture_state(name: str) -> dict[str, torch.Tensor]:
    return torch.load(DATA / name / "model_000020.pt", weights_only=True)


def test_compiled_prefix_and_bf16_embedding_load_as_the_study_loads_them(tmp_path: Path) -> None:
    """A CUDA run saves wte in bf16 and a compiled model prefixes ``_orig_mod.``; the study's
    build_model strips the prefix and upcasts: the converted weights are exactly those."""
    state = fixture_state("loop2_additive")
    state = {
        f"_orig_mod.{k}": (v.bfloat16() if k == "transformer.wte.weight" else v) for k, v in state.items()
    }
    model, ckpt = nanochat_to_looped(copy_fixture("loop2_additive", tmp_path / "ck", state))
    plain, _ = nanochat_to_looped(DATA / "loop2_additive")
    wte = fixture_state("loop2_additive")["transformer.wte.weight"].bfloat16().float()
    torch.testing.assert_close(model.model.embed_tokens.weight, wte, rtol=0, atol=0)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        if name != "model.embed_tokens.weight":
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert any("_orig_mod." in note for note in ckpt.notes) and any("bfloat16" in note for note in ckpt.notes)


def test_a_file_that_needs_more_than_weights_only_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "ran"))

    ck = copy_fixture(
        "noloop", tmp_path / "ck", state={"transformer.wte.weight": torch.zeros(1), "x": Payload()}
    )
    with pytest.raises(ConversionError, match=r"model_000020\.pt: refused.*weights_only=True"):
        load_nanochat_checkpoint(ck)
    assert not marker.exists()


def test_unknown_config_keys_are_named_and_legacy_keys_migrate_as_the_study_does(tmp_path: Path) -> None:
    meta = json.loads((DATA / "loop4_linear" / "meta_000020.json").read_text())
    odd = {**meta, "model_config": {**meta["model_config"], "window_pattern": "SSSL", "mystery": 1}}
    with pytest.raises(ConversionError, match=r"\['mystery', 'window_pattern'\] are unknown"):
        nanochat_to_looped(copy_fixture("loop4_linear", tmp_path / "odd", meta=odd))
    legacy_config = {k: v for k, v in meta["model_config"].items() if k != "num_recur"}
    legacy_config.update(train_recur_mean=4.0, sandwich_norm=False)
    model, ckpt = nanochat_to_looped(
        copy_fixture("loop4_linear", tmp_path / "old", meta={**meta, "model_config": legacy_config})
    )
    assert model.config.num_recurrences == 4
    assert any("train_recur_mean" in n for n in ckpt.notes) and any("sandwich_norm" in n for n in ckpt.notes)


def test_weights_that_do_not_fit_the_meta_are_refused_by_key(tmp_path: Path) -> None:
    state = fixture_state("loop4_linear")
    extra = {**state, "transformer.recur.0.attn.rotary_scale": torch.ones(3)}
    with pytest.raises(ConversionError, match=r"does not know: \['transformer.recur.0.attn.rotary_scale'\]"):
        nanochat_to_looped(copy_fixture("loop4_linear", tmp_path / "extra", extra))
    short = {k: v for k, v in state.items() if k != "inject.weight"}
    with pytest.raises(ConversionError, match=r"missing \['model.injection.weight'\]"):
        nanochat_to_looped(copy_fixture("loop4_linear", tmp_path / "short", short))
    meta = json.loads((DATA / "loop4_linear" / "meta_000020.json").read_text())
    wide = {**meta, "model_config": {**meta["model_config"], "n_embd": 64, "n_head": 4, "n_kv_head": 4}}
    with pytest.raises(ConversionError, match=r"shape \(checkpoint, config\)"):
        nanochat_to_looped(copy_fixture("loop4_linear", tmp_path / "wide", meta=wide))


def test_the_latest_step_is_the_default_and_a_missing_step_is_named(tmp_path: Path) -> None:
    ck = copy_fixture("noloop", tmp_path / "ck")
    shutil.copyfile(ck / "model_000020.pt", ck / "model_000100.pt")
    (ck / "meta_000100.json").write_text((ck / "meta_000020.json").read_text())
    assert load_nanochat_checkpoint(ck).step == 100
    assert load_nanochat_checkpoint(ck, step=20).step == 20
    # The study's aliases are symlinks (create_checkpoint_alias): the step is the one they point to.
    (ck / "model_pre_warmdown.pt").symlink_to("model_000020.pt")
    (ck / "meta_pre_warmdown.json").symlink_to("meta_000020.json")
    assert load_nanochat_checkpoint(ck, step="pre_warmdown").step == 20
    assert main(["nanochat", str(ck), "--step", "pre_warmdown", "--out", str(tmp_path / "out")]) == 0
    with pytest.raises(ConversionError, match="expected a step number or an alias"):
        load_nanochat_checkpoint(ck, step="../x")
    with pytest.raises(ConversionError, match=r"meta_000007\.json|model_000007\.pt"):
        load_nanochat_checkpoint(ck, step=7)
    with pytest.raises(ConversionError, match="no model_<step>.pt"):
        load_nanochat_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------
# 3. The folder: CLI, card, tokenizer, refusals
# --------------------------------------------------------------------------------------------


def word_tokenizer(tmp_path: Path, size: int) -> Path:
    """A local word-level tokenizer with ``size`` tokens (no Hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = tmp_path / f"tok{size}"
    tok.save_pretrained(path)
    return path


def test_cli_writes_a_folder_with_a_card_that_says_where_the_weights_came_from(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    out = tmp_path / "hub"
    # 255 words: the study's tokenizer adds <|assistant_end|> to its base tokenizer to reach 256.
    tok = word_tokenizer(tmp_path, 255)
    assert main(["nanochat", str(DATA / "loop4_linear"), "--step", "20", "--out", str(out),
                 "--tokenizer", str(tok), "--repo-id", "me/loop4"]) == 0  # fmt: skip
    for name in ("config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py",
                 "generation_config.json", "tokenizer_config.json", "tokenizer.json", "README.md"):  # fmt: skip
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_looped.LoopedForCausalLM"
    assert config["pad_vocab_size_to_multiple_of"] == 64 and config["rope_table_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    meta = json.loads((DATA / "loop4_linear" / "meta_000020.json").read_text())
    ref = json.loads((DATA / "loop4_linear" / "reference.json").read_text())
    card = ModelCard.load(out / "README.md")
    source = card.data.converted_from
    assert (source["step"], source["tokens"], source["val_loss"]) == (20, meta["tokens"], meta["val_loss"])
    assert (
        source["sha256"] == ref["checkpoint"]["model_sha256"]
        and source["model_config"] == meta["model_config"]
    )
    assert card.data.looped["n_rec"] + card.data.looped["n_once"] > 0
    assert "model-index" not in card.content  # the study's val split is not claimed as a benchmark
    assert f"{meta['val_loss']:.6f}" in card.text and "5,120" in card.text and "me/loop4" in card.text
    assert "<|assistant_end|>" in card.text  # the note saying the special token was added
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(out)) == 256


def test_cli_refuses_bad_input_with_exit_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "hub"
    assert (
        main(
            [
                "nanochat",
                str(DATA / "noloop"),
                "--out",
                str(out),
                "--tokenizer",
                str(word_tokenizer(tmp_path, 300)),
            ]
        )
        == 2
    )
    assert "has 300 tokens but model_config.vocab_size=256" in capsys.readouterr().err
    assert not out.exists() and not any(p.name.startswith(".hub.tmp") for p in tmp_path.iterdir())
    out.mkdir()
    assert main(["nanochat", str(DATA / "noloop"), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["nanochat", str(DATA / "noloop"), "--out", str(tmp_path / "other"), "--step", "9"]) == 2
    assert "model_000009.pt: no such file" in capsys.readouterr().err and not (tmp_path / "other").exists()
    with pytest.raises(SystemExit):
        main(["safetensors", str(DATA / "noloop"), "--out", str(out)])  # an unknown source format
    with pytest.raises(PublishError, match="already exists"):
        convert_nanochat(DATA / "noloop", out)


def test_the_cli_is_routed_from_looped_hf() -> None:
    from looped_hf.cli import COMMANDS

    assert COMMANDS["convert"][0] == "looped_hf.convert"


@pytest.mark.slow
def test_converted_folders_load_without_looped_hf_with_the_studys_logits(tmp_path: Path) -> None:
    """All six folders through ``AutoModelForCausalLM`` in a process where looped_hf cannot be
    imported: every stored logits tensor (every r, every kv decode) within 1e-5 of the study's."""
    folders = {}
    for name in FIXTURES:
        folders[name] = str(convert_nanochat(DATA / name, tmp_path / "hub" / name))
    script = f"""
    import importlib.util, json, torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("bench", {str(BENCH)!r})
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # imports torch only: looped_hf stays blocked
    result = {{}}
    for name, folder in {json.dumps(folders)}.items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ref = load_file(f"{DATA}/{{name}}/reference.safetensors")
        result[name] = bench.reference_differences(model, ref)
        with torch.no_grad():
            gen = model.generate(ref["input_ids"][:1, :8], max_new_tokens=4, do_sample=False, kv_budget=1)
        assert gen.shape == (1, 12)
    print("DIFFS" + json.dumps(result))
    """
    stdout = run_without_looped_hf(script, tmp_path)
    diffs = json.loads(stdout.split("DIFFS", 1)[1])
    assert set(diffs) == set(FIXTURES)
    assert (
        sum(len(d) for d in diffs.values()) == 6 + 4 + 2 + 1
    )  # logits x6; loop4: 4 extras, additive: 2, hyperconnect: 1
    assert all(v <= TOLERANCE for d in diffs.values() for v in d.values()), diffs


# --------------------------------------------------------------------------------------------
# 4. generate(), the KV budget and adaptive exit on a converted model
# --------------------------------------------------------------------------------------------


def test_generate_with_a_kv_budget_follows_the_validated_cached_decode() -> None:
    """Greedy ``generate`` with kv_budget=1 picks, at every step, the arg-max of the cached decode
    that matches the study's (test 1) run over its own output."""
    model, _ = nanochat_to_looped(DATA / "loop2_additive")
    ids = reference("loop2_additive")["input_ids"][:, :PREFILL]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, kv_budget=1)
        replay = bench.cached_decode(model, out, kv_budget=1)
    assert torch.equal(out[:, PREFILL:], replay[:, PREFILL - 1 : -1].argmax(-1))
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == full.shape == (2, PREFILL + 6)


def test_adaptive_exit_runs_on_a_converted_model() -> None:
    model, _ = nanochat_to_looped(DATA / "loop4_linear")
    ids = reference("loop4_linear")["input_ids"][:, :PREFILL]
    r = model.config.num_recurrences
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=4, do_sample=False)
        never = model.generate(ids, max_new_tokens=4, do_sample=False, exit_criterion="kl", exit_threshold=0.0,
                               return_dict_in_generate=True)  # fmt: skip
        early = model.generate(ids, max_new_tokens=4, do_sample=False, exit_criterion="kl", exit_threshold=1e30,
                               return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(never.sequences, plain) and bool((never.recurrences_used == r).all())
    assert bool((early.recurrences_used == 1).all())  # every token stops after its first recurrence
