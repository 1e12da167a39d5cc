"""``looped-hf retrofit`` refuses bad input with one line naming the field and the value (exit 2) and
writes nothing: an unmapped parent class, layer ranges that overlap, leave a gap or pass the last
layer, a LoRA rank above the width, a pickle-only parent, an existing ``--out``."""

from __future__ import annotations

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
    assert "weights='pytorch_model.bin' is a pickle checkpoint" in err


def test_a_sliding_window_parent_is_refused(capsys, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=16)  # fmt: skip
    MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    err = refused(capsys, tmp_path / "mistral", "--loop-in-place")
    assert "sliding_window=16" in err


def test_an_existing_out_is_kept_unless_overwrite(capsys, parent, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = refused(capsys, parent, "--loop-in-place", "--out", out)
    assert f"--out {out} already exists; pass --overwrite" in err and (out / "keep.txt").read_text() == "mine"
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--out", str(out), "--overwrite"]) == 0
    assert (out / "retrofit.json").is_file() and not (out / "keep.txt").exists()
