"""``looped-hf retrofit`` refuses bad input with one line naming the field and the value (exit 2) and
writes nothing: an unmapped parent class, layer ranges that overlap, leave a gap or pass the last
layer, a LoRA rank above the width, a pickle-only parent, an existing ``--out``."""

from __future__ import annotations

import json

import pytest
import torch
from test_retrofit import tiny_parent

from looped_hf.cli import main as cli_main


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    return tiny_parent(tmp_path_factory.mktemp("refusals") / "parent", "llama")


def refused(capsys, *argv) -> str:
    """Run the command, assert exit 2 with one stderr line and nothing written beside the parent."""
    root = argv[0].parent
    before = sorted(p.name for p in root.iterdir())
    capsys.readouterr()  # what building the parent printed
    assert cli_main(["retrofit", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in root.iterdir()) == before
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prelude", "0-3", "--recurrent", "3-4", "--coda", "5"], "--prelude and --recurrent overlap at layer 3"),
        (["--prelude", "0-1", "--recurrent", "2-3", "--coda", "5"], "--recurrent=2-3: leaves a gap before the coda"),
        (["--prelude", "0-1", "--recurrent", "3-4"], "--recurrent=3-4: leaves a gap before the coda"),
        (["--prelude", "1-2", "--recurrent", "3-4", "--coda", "5"], "--prelude=1-2: leaves a gap"),
        (["--prelude", "0-1", "--recurrent", "2-3", "--coda", "4-6"], "--coda=4-6: passes the parent's last layer"),
        (["--prelude", "0-1", "--recurrent", "4-3"], "--recurrent='4-3': expected a layer range"),
        (["--layers", "2,4,2"], "--layers=2,4,2: needs P, C >= 0, R >= 1 and P + R + C <= num_hidden_layers=6"),
        (["--layers", "2,0,1"], "--layers=2,0,1"),
        (["--layers", "2,2"], "--layers='2,2': expected three counts"),
        (["--loop-in-place", "--layers", "1,2,1"], "--loop-in-place keeps every layer, but the layer choice drops"),
        (["--share", "average", "--blocks", "4"], "--blocks=4: must divide the parent's num_hidden_layers=6"),
        (["--share", "average", "--blocks", "2", "--lora-rank", "65"], "--lora-rank=65: must be in [1, the width hidden_size=64]"),
        (["--share", "average", "--blocks", "2", "--layers", "2,2,2"], "--layers: not an option of --share=average"),
        (["--share", "average"], "--share=average: needs --blocks K"),
        (["--layers", "2,2,2", "--lora-rank", "8"], "--lora-rank: only with --share"),
        (["--layers", "2,2,2", "--prelude", "0-1"], "give one layer choice, not both"),
        ([], "no layer choice"),
    ],
)  # fmt: skip
def test_bad_layer_choices_are_refused_by_name(capsys, parent, flags, message):
    assert message in refused(capsys, parent, *flags, "--out", parent.parent / "out")


def test_a_parent_class_it_cannot_map_is_refused(capsys, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    err = refused(capsys, tmp_path / "gpt2", "--layers", "1,1,0")
    assert "architectures=['GPT2LMHeadModel']: not a parent class retrofit maps" in err


def test_a_pickle_only_parent_is_refused(capsys, tmp_path, parent):
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_bytes((parent / "config.json").read_bytes())
    torch.save(load_file(parent / "model.safetensors"), folder / "pytorch_model.bin")
    err = refused(capsys, folder, "--loop-in-place")
    assert "only a pickled pytorch_model.bin checkpoint, refused" in err


def test_a_sliding_window_parent_is_refused(capsys, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=16)  # fmt: skip
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    err = refused(capsys, tmp_path / "mistral", "--loop-in-place")
    assert "sliding_window=16" in err


@pytest.mark.parametrize(
    ("family", "edits", "message"),
    [
        ("llama", {"hidden_act": "gelu"}, "config.json hidden_act='gelu': the families' MLP is gated silu"),
        ("llama", {"head_dim": 15}, "transformers cannot read it (RoPE requires an even rotary dimension, but got "
                                    "`head_dim`=15"),
        ("llama", {"rope_scaling": None, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                   "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
         "config.json rope_parameters.rope_type='longrope': retrofit carries the RoPE types"),
        ("mistral", {"mlp_bias": True}, "config.json mlp_bias=True: MistralMLP has no bias"),
        ("qwen2", {"attention_bias": True}, "config.json attention_bias=True: Qwen2Attention's biases are fixed"),
        ("qwen3", {"use_sliding_window": True}, "config.json use_sliding_window=True: Qwen's sliding attention"),
        ("olmo2", {"clip_qkv": 8.0}, "config.json clip_qkv=8.0: OLMo's q/k/v clipping"),
    ],
)  # fmt: skip
def test_parent_options_the_mapping_does_not_carry_are_refused_by_name(
    capsys, tmp_path, family, edits, message
):
    folder = tiny_parent(tmp_path / family, family, num_layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edits}))
    assert message in refused(capsys, folder, "--loop-in-place")
    assert message in refused(capsys, folder, "--share", "lower", "--blocks", "1", "--lora-rank", "4")


def test_an_existing_out_is_kept_unless_overwrite(capsys, parent, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = refused(capsys, parent, "--loop-in-place", "--out", out)
    assert f"--out {out} already exists; pass --overwrite" in err and (out / "keep.txt").read_text() == "mine"
    # --overwrite never replaces a user's other folder, only an earlier looped_hf output.
    err = refused(capsys, parent, "--loop-in-place", "--out", out, "--overwrite")
    assert "--overwrite replaces only an empty folder or an earlier looped_hf output" in err
    earlier = tmp_path / "earlier"
    assert cli_main(["retrofit", str(parent), "--layers", "2,2,2", "--out", str(earlier)]) == 0
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--out", str(earlier), "--overwrite"]) == 0
    assert '"method": "loop_in_place"' in (earlier / "retrofit.json").read_text()


def test_overwrite_replaces_an_earlier_loop_lora_retrofit(parent, tmp_path):
    from looped_hf.fileio import LOOPED_MODEL_TYPES
    from looped_hf.model_types import looped_classes

    assert tuple(looped_classes()) == LOOPED_MODEL_TYPES  # the one list of names, and a class for each
    earlier = tmp_path / "rrt"
    assert cli_main(["retrofit", str(parent), "--share", "lower", "--blocks", "3", "--lora-rank", "4",
                     "--out", str(earlier)]) == 0  # fmt: skip
    assert cli_main(["retrofit", str(parent), "--share", "lower", "--blocks", "2", "--lora-rank", "8",
                     "--out", str(earlier), "--overwrite"]) == 0  # fmt: skip
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--out", str(earlier), "--overwrite"]) == 0
    assert '"model_type": "looped"' in (earlier / "config.json").read_text()
    assert not (earlier / "loop_lora.py").exists()  # the folder is replaced, not merged


# --- a parent goes through the checks of every foreign folder (Checkpoint.check_foreign) -----------
def _edit_config(**changes):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def _write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def _generation(**changes):
    def edit(folder):
        path = folder / "generation_config.json"
        value = json.loads(path.read_text()) if path.is_file() else {}
        value.update(changes)
        path.write_text(json.dumps(value))

    return edit


def _own_head(folder):
    """config.json says tied, but the file holds an lm_head of its own that differs from the embedding."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _edit_config(tie_word_embeddings=True)(folder)


def _int8(folder):
    from safetensors.torch import load_file, save_file

    tensors = {name: t.to(torch.int8) for name, t in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


HOSTILE_PARENTS = {  # case: (family, layer flags, edit, what the one line says)
    "absurd layer count": ("llama", ["--loop-in-place"], _edit_config(num_hidden_layers=10**12),
                           "config.json num_hidden_layers=1000000000000: the weight files hold 2 layers"),
    "layer count a string": ("qwen2", ["--share", "lower", "--blocks", "1", "--lora-rank", "4"],
                             _edit_config(num_hidden_layers="2"), "config.json num_hidden_layers='2': expected an integer >= 1"),
    "vocabulary too large": ("qwen3", ["--layers", "1,1,0"], _edit_config(vocab_size=10**10),
                             "model.embed_tokens.weight has shape (61, 64), the config.json sizes make (10000000000, 64)"),
    "MLP too large": ("mistral", ["--loop-in-place"], _edit_config(intermediate_size=10**9),
                      "mlp.gate_proj.weight has shape (96, 64), the config.json sizes make (1000000000, 64)"),
    "tied, but a head of its own": ("llama", ["--loop-in-place"], _own_head,
                                    "config.json tie_word_embeddings=True, but lm_head.weight differs from "
                                    "model.embed_tokens.weight"),
    "tied, but a head of its own (share)": ("olmo2", ["--share", "average", "--blocks", "1", "--lora-rank", "2"],
                                            _own_head, "tie_word_embeddings=True, but lm_head.weight differs"),
    "generation config a list": ("qwen2", ["--loop-in-place"], _write("generation_config.json", "[]"),
                                 "generation_config.json: expected a JSON object, got list"),
    "generation config null": ("llama", ["--layers", "1,1,0"], _write("generation_config.json", "null"),
                               "generation_config.json: expected a JSON object, got NoneType"),
    "generation eos outside the vocabulary": ("olmo2", ["--loop-in-place"], _generation(eos_token_id=[2, 9999]),
                                              "generation_config.json eos_token_id=[2, 9999]: expected a token id in [0, 61)"),
    "generation pad a string": ("mistral", ["--loop-in-place"], _generation(pad_token_id="0"),
                                "generation_config.json pad_token_id='0': expected a token id"),
    "generation max_length -5": ("qwen3", ["--loop-in-place"], _generation(max_length=-5),
                                 "generation_config.json max_length=-5: expected an integer >= 1"),
    "generation temperature hot": ("llama", ["--share", "lower", "--blocks", "1", "--lora-rank", "4"],
                                   _generation(temperature="hot"), "generation_config.json temperature='hot': expected a "
                                   "finite number > 0"),
    "generation top_p 2": ("qwen2", ["--loop-in-place"], _generation(top_p=2.0), "generation_config.json top_p=2.0"),
    "yarn factor -2": ("llama", ["--loop-in-place"],
                       _edit_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0,
                                                     "original_max_position_embeddings": 64}),
                       "config.json rope_parameters.factor=-2.0: expected a number > 0"),
    "linear factor 0": ("qwen3", ["--loop-in-place"],
                        _edit_config(rope_scaling={"rope_type": "linear", "factor": 0}, rope_parameters=None),
                        "config.json rope_scaling.factor=0: expected a number > 0"),
    "dynamic factor 0.5": ("mistral", ["--layers", "1,1,0"],
                           _edit_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 0.5}),
                           "rope_parameters.factor=0.5: expected a number >= 1"),
    "int8 weights": ("olmo2", ["--loop-in-place"], _int8, "weights of dtypes ['torch.int8']: expected one floating dtype"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE_PARENTS))
def test_a_hostile_parent_is_refused_in_one_line_before_anything_is_built(capsys, tmp_path, case):
    family, flags, edit, message = HOSTILE_PARENTS[case]
    folder = tiny_parent(tmp_path / family, family, num_layers=2)
    edit(folder)
    assert message in refused(capsys, folder, *flags, "--out", tmp_path / "out")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--loop-in-place", "--seed", "9e22"], "--seed='9e22': must be an integer in [0, 2**32 - 1]"),
        (["--layers", "2,2,2", "--adapter-init", "study", "--seed", str(10**30)], "--seed='1000000000000000000000000000000'"),
        (["--layers", "2,2,2", "--seed", "-1"], "--seed='-1': must be an integer in [0, 2**32 - 1]"),
        (["--loop-in-place", "--seed", "3"], "--seed=3: seeds only --adapter-init study (the adapter is identity"),
        (["--layers", "2,2,2", "--adapter-init", "identity", "--seed", "0"], "--seed=0: seeds only --adapter-init study"),
        (["--share", "lower", "--blocks", "2", "--seed", "4"], "--seed: not an option of --share=lower"),
    ],
)  # fmt: skip
def test_a_seed_that_would_be_ignored_or_cannot_seed_is_refused(capsys, parent, flags, message):
    assert message in refused(capsys, parent, *flags, "--out", parent.parent / "out")


def test_loop_in_place_with_one_range_keeps_the_rest_as_prelude_and_coda(parent, tmp_path):
    out = tmp_path / "lip"
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--recurrent", "2-3", "--out", str(out)]) == 0
    layers = json.loads((out / "retrofit.json").read_text())["layer_map"]
    assert (layers["prelude"], layers["recurrent"], layers["coda"], layers["dropped"]) == ([0, 1], [2, 3], [4, 5], [])
    out2 = tmp_path / "lip2"  # a given range is kept as given
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--prelude", "0-2", "--recurrent", "3-4",
                     "--out", str(out2)]) == 0  # fmt: skip
    layers = json.loads((out2 / "retrofit.json").read_text())["layer_map"]
    assert (layers["prelude"], layers["recurrent"], layers["coda"]) == ([0, 1, 2], [3, 4], [5])


@pytest.mark.parametrize("marker", ["run_record.json", "checkpoints"])
def test_overwrite_never_replaces_a_training_run_or_another_commands_folder(capsys, parent, tmp_path, marker):
    run = tmp_path / "runs" / "x"
    assert cli_main(["retrofit", str(parent), "--layers", "2,2,2", "--out", str(run)]) == 0
    if marker == "checkpoints":
        (run / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    else:
        (run / marker).write_text('{"status": "ok"}')
    before = sorted(p.name for p in run.iterdir())
    err = refused(capsys, parent, "--loop-in-place", "--out", run, "--overwrite")
    assert f"--out {run}: a training run (run_record.json or checkpoints inside); --overwrite never replaces" in err
    assert sorted(p.name for p in run.iterdir()) == before
    # A convert output is not retrofit's to replace (no retrofit.json), nor a retrofit folder convert's.
    from test_convert_loader import copy_checkpoint

    converted = tmp_path / "converted"
    assert cli_main(["convert", "ouro", str(copy_checkpoint("ouro-tiny", tmp_path / "src")), "--out", str(converted)]) == 0
    err = refused(capsys, parent, "--loop-in-place", "--out", converted, "--overwrite")
    assert "--overwrite replaces only an empty folder or an earlier looped_hf output of this command" in err
    retrofitted = tmp_path / "retrofitted"
    assert cli_main(["retrofit", str(parent), "--layers", "2,2,2", "--out", str(retrofitted)]) == 0
    capsys.readouterr()
    assert cli_main(["convert", "ouro", str(tmp_path / "src"), "--out", str(retrofitted), "--overwrite"]) == 2
    assert "no retrofit.json); this folder is neither" in capsys.readouterr().err
