"""``looped-hf convert`` as a package: one command over every source format, a default output folder
(``looped-hf convert nanochat CKPT_DIR`` as the README shows it), and the tokenizer that travels with
a study checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import fixture_path

from looped_hf.cli import main as looped_hf_main
from looped_hf.convert import FORMATS, default_out, main

STUDY = fixture_path("study_checkpoints", "noloop")


def _study_copy(tmp_path: Path) -> Path:
    src = tmp_path / "checkpoints"
    shutil.copytree(STUDY, src)
    return src


def _nanochat_tokenizer(path: Path, size: int) -> None:
    """A word-level ``tokenizer.json`` with ``size`` tokens, as nanochat's ``Tokenizer.save`` writes one
    (a bare tokenizers file, no tokenizer_config.json), the study's special token among them."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size - 1)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken("<|assistant_end|>", special=True)])
    path.parent.mkdir(parents=True, exist_ok=True)
    core.save(str(path))


def test_nanochat_without_out_writes_beside_the_checkpoint_and_says_where(tmp_path: Path, capsys) -> None:
    src = _study_copy(tmp_path)
    assert looped_hf_main(["convert", "nanochat", str(src)]) == 0
    out = tmp_path / "checkpoints-looped"
    assert out == default_out(src) and (out / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    # The fixture's 256 tokens are neither its own tokenizer's nor the embedded one's: said, not guessed.
    assert "[convert] no tokenizer" in printed and not (out / "tokenizer_config.json").exists()
    assert looped_hf_main(["convert", "nanochat", str(src)]) == 2  # a second run does not overwrite
    assert "already exists; pass --overwrite" in capsys.readouterr().err


def test_nanochat_ships_the_checkpoint_folders_own_tokenizer(tmp_path: Path, capsys) -> None:
    src = _study_copy(tmp_path)
    _nanochat_tokenizer(src / "tokenizer" / "tokenizer.json", 256)
    out = tmp_path / "hub"
    assert main(["nanochat", str(src), "--out", str(out)]) == 0
    assert "no tokenizer" not in capsys.readouterr().out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 256 and tokenizer.convert_tokens_to_ids("<|assistant_end|>") == 255
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 256


def test_a_tokenizer_of_another_size_in_the_folder_is_refused(tmp_path: Path, capsys) -> None:
    src = _study_copy(tmp_path)
    _nanochat_tokenizer(src / "tokenizer.json", 300)
    assert main(["nanochat", str(src), "--out", str(tmp_path / "hub")]) == 2
    assert "has 300 tokens but model_config.vocab_size=256" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists()


def test_every_format_names_a_module_with_a_converter() -> None:
    import importlib

    for name, (module, help_) in FORMATS.items():
        assert callable(importlib.import_module(module).convert_cli) and help_, name


def test_tokenizer_bytes_is_the_built_in_one_with_its_vocabulary_check(tmp_path: Path, capsys) -> None:
    """``--tokenizer bytes`` names looped_hf's byte tokenizer (wherever a tokenizer is asked
    for), not a Hub repo called "bytes"; its 258 tokens still have to be the model's vocabulary."""
    from looped_hf.convert.nanochat import load_study_tokenizer
    from looped_hf.data import load_tokenizer

    src = _study_copy(tmp_path)
    assert main(["nanochat", str(src), "--out", str(tmp_path / "hub"), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer 'bytes' has 258 tokens but model_config.vocab_size=256" in err, err
    assert not (tmp_path / "hub").exists()
    # Where the sizes fit it is the built-in tokenizer itself, token for token.
    notes: list[str] = []
    tokenizer = load_study_tokenizer("bytes", 258, notes)
    assert tokenizer.get_vocab() == load_tokenizer("bytes").get_vocab() and notes == []
    assert tokenizer("hi")["input_ids"] == load_tokenizer("bytes")("hi")["input_ids"]
    # One short of the study's vocabulary: the study's special token is added, as for any tokenizer.
    study = load_study_tokenizer("bytes", 259, notes)
    assert study.convert_tokens_to_ids("<|assistant_end|>") == 258 and "added the study's" in notes[0]
