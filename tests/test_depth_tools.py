"""``looped-hf test-time`` on folders of looped classes that transformers ships (the zoo2 fixtures):
the curve's loss at each depth is the held-out loss of transformers' class built at that depth,
HRM-Text's H x L grid is written as a table and a heat map, and a folder without a tokenizer takes
``--tokenizer`` or is refused in one line. Needs transformers >= 5.25 (skips on 5.19)."""

from __future__ import annotations

import json
import shutil
import string
from pathlib import Path

import pytest
import torch
from conftest import fixture_path

from looped_hf.cli import main as looped_hf

WHY = "HRM-Text / Inkling2Loop need transformers >= 5.25 (the zoo2 references' version)"
pytest.importorskip("transformers", minversion="5.25", reason=WHY)
pytest.importorskip("transformers.models.inkling2_loop", reason=WHY)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def chars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A character tokenizer (96 ids, under both fixtures' 250 real ids), as a tokenizer.json."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    path = tmp_path_factory.mktemp("tok") / "chars.json"
    tok.save(str(path))
    return path


@pytest.fixture
def data_env(small_corpus: Path, data_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LOOPED_HF_CACHE", str(data_cache))
    return small_corpus


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fixture_path("zoo2", name), tmp_path / name))


def _heldout_loss_built_at(folder: Path, tokenizer: Path, blocks: list[list[int]], **depth: int) -> float:
    """Token-weighted next-token loss of transformers' class built with ``depth`` in its config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **depth).eval()
    ids = torch.tensor(blocks)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def _blocks(data: Path, tokenizer: Path) -> list[list[int]]:
    from looped_hf.data import heldout_from_recipe
    from looped_hf.data.tokenizer import load_tokenizer

    heldout = heldout_from_recipe(
        {"dataset": str(data), "seq_len": 32, "eval_blocks": 4}, load_tokenizer(str(tokenizer))
    )
    return [list(row) for row in heldout[:]["input_ids"]]


def test_hrm_curve_and_grid_are_the_class_built_at_each_depth(tmp_path, chars, data_env, capsys) -> None:
    folder = _copy("hrm-text-tiny", tmp_path)
    argv = ["test-time", str(folder), "--data", str(data_env), "--tokenizer", str(chars),
            "--seq-len", "32", "--eval-blocks", "4", "--max-factor", "1"]  # fmt: skip
    assert looped_hf(argv) == 0
    out = capsys.readouterr().out
    assert "| H_cycles \\ L_cycles | 1 | 2 | 3 |" in out and "| **2** (trained) |" in out
    curve = json.loads((folder / "test_time_scaling.json").read_text())
    grid = json.loads((folder / "depth_grid.json").read_text())
    assert [row["depth"] for row in curve["rows"]] == [
        {"H_cycles": 1, "L_cycles": 3},
        {"H_cycles": 2, "L_cycles": 3},
    ]
    assert [row["layer_applications"] for row in curve["rows"]] == [4, 8]
    assert (grid["row_values"], grid["col_values"]) == ([1, 2], [1, 2, 3])
    assert (folder / "depth_grid.png").stat().st_size > 0 and (
        folder / "test_time_scaling.png"
    ).stat().st_size > 0
    blocks = _blocks(data_env, chars)
    assert curve["rows"][0]["eval_tokens"] == 4 * 31
    # The curve's and the grid's cells are transformers' class built at that depth, on the same blocks.
    assert curve["rows"][0]["loss"] == pytest.approx(
        _heldout_loss_built_at(folder, chars, blocks, H_cycles=1), abs=1e-5
    )
    assert grid["loss"][1][0] == pytest.approx(
        _heldout_loss_built_at(folder, chars, blocks, H_cycles=2, L_cycles=1), abs=1e-5
    )
    assert grid["loss"][1][2] == pytest.approx(curve["rows"][1]["loss"], abs=1e-9)  # (2, 3) in both
    assert len({round(v, 6) for row in grid["loss"] for v in row}) == 6  # every cell a different depth
    assert "| 2 | " in (folder / "depth_grid.md").read_text()
    # publish: the files as they are, the tokenizer named, and a card with the curve and the grid.
    out = tmp_path / "pub"
    assert (
        looped_hf(
            ["publish", str(folder), "--repo-id", "me/hrm", "--tokenizer", str(chars), "--out", str(out)]
        )
        == 0
    )
    card = (out / "README.md").read_text()
    assert "with looped_hf.at_depth(model, (4, 3)):" in card and "| **2** (trained) |" in card
    assert "### H_cycles x L_cycles" in card and "| H_cycles \\ L_cycles | 1 | 2 | 3 |" in card
    assert (out / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    assert {"depth_grid.png", "test_time_scaling.png", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    from looped_hf import depth_tools, recurrence_curves

    assert depth_tools.CURVE_STEM == recurrence_curves.CURVE_STEM  # the card and load_curve read these


def test_inkling_curve_and_tokenizer_refusals(tmp_path, chars, data_env, capsys) -> None:
    folder = _copy("inkling2-loop-tiny", tmp_path)
    base = ["test-time", str(folder), "--data", str(data_env), "--seq-len", "32", "--eval-blocks", "4"]
    assert looped_hf(base) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"looped-hf test-time: checkpoint {str(folder)!r} has no tokenizer: name one with --tokenizer "
                   "(a Hub name, a folder or a tokenizer.json)")  # fmt: skip
    assert looped_hf([*base, "--tokenizer", "bytes"]) == 2  # 258 ids > the 256 of the model
    assert "--tokenizer 'bytes': 258 tokens, more than the model's vocab_size=256" in capsys.readouterr().err
    assert not (folder / "test_time_scaling.json").exists()
    assert looped_hf(["test-time", str(folder)]) == 2
    assert "has no run record: pass --data" in capsys.readouterr().err
    assert looped_hf(["publish", str(folder), "--out", str(tmp_path / "pub")]) == 2
    assert capsys.readouterr().err.strip().endswith("has no tokenizer: name one with --tokenizer (a Hub name, a "
                                                   "folder or a tokenizer.json)")  # fmt: skip
    assert not (tmp_path / "pub").exists()
    assert looped_hf([*base, "--tokenizer", str(chars), "--max-factor", "2"]) == 0
    curve = json.loads((folder / "test_time_scaling.json").read_text())
    assert [row["num_recurrences"] for row in curve["rows"]] == [1, 2, 3, 4, 5, 6]
    assert curve["grid"] is None and not (folder / "depth_grid.json").exists()
    assert [row["layer_applications"] for row in curve["rows"]] == [4, 6, 8, 10, 12, 14]
    blocks = _blocks(data_env, chars)
    assert curve["rows"][3]["loss"] == pytest.approx(
        _heldout_loss_built_at(folder, chars, blocks, loop_num_passes=4), abs=1e-5
    )


def _task_losses(out: Path) -> dict[int, float]:
    results = json.loads((out / "eval_results.json").read_text())
    return {row["num_recurrences"]: row["tasks"]["p_hop_2"]["loss"] for row in results["rows"]}


def test_eval_scores_each_depth_as_the_class_built_there(tmp_path, chars, capsys) -> None:
    folder = _copy("hrm-text-tiny", tmp_path)
    built_at_1 = Path(shutil.copytree(folder, tmp_path / "h1"))
    config = json.loads((built_at_1 / "config.json").read_text())
    (built_at_1 / "config.json").write_text(json.dumps({**config, "H_cycles": 1}))
    common = ["--bundle", "builtin", "--builtin-examples", "6", "--max-per-task", "4", "--tasks", "p_hop_2", "--tokenizer", str(chars),
              "--device", "cpu"]  # fmt: skip
    assert (
        looped_hf(["eval", str(folder), "--recurrences", "1", "3", "--out", str(tmp_path / "e"), *common])
        == 0
    )
    assert (
        looped_hf(["eval", str(built_at_1), "--recurrences", "1", "--out", str(tmp_path / "e1"), *common])
        == 0
    )
    losses, reference = _task_losses(tmp_path / "e"), _task_losses(tmp_path / "e1")
    assert losses[1] == pytest.approx(reference[1], abs=1e-5)
    assert abs(losses[3] - losses[1]) > 1e-3  # the depth reached the model
    results = json.loads((tmp_path / "e" / "eval_results.json").read_text())
    assert results["trained_num_recurrences"] == 2 and results["trained_depth"] == {
        "H_cycles": 2,
        "L_cycles": 3,
    }
    capsys.readouterr()
    for flags, message in (
        (["--kv-budget", "1"], "--kv-budget 1: HrmTextForCausalLM has no KV budget"),
        (["--exit-criterion", "kl"], "HrmTextForCausalLM has no adaptive exit"),
    ):
        assert looped_hf(["eval", str(folder), "--out", str(tmp_path / "x"), *common, *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_weights_that_are_not_the_model_are_refused_in_one_line(
    tmp_path, chars, data_env, capsys, change
) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy("hrm-text-tiny", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    if change == "drop":
        del tensors["lm_head.weight"]
    else:
        tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    argv = ["test-time", str(folder), "--data", str(data_env), "--tokenizer", str(chars), "--seq-len", "32"]
    assert looped_hf(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "the weights are not the model its config.json builds" in err and "\n" not in err
    assert (
        "missing keys lm_head.weight" if change == "drop" else "unexpected keys model.extra.weight"
    ) in err
    assert not (folder / "test_time_scaling.json").exists()
