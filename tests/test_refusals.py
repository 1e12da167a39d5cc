"""Hostile and careless recipes and flags: refused with one line naming the field, never a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from looped_hf.arguments import RecipeError, load_yaml, parse_recipe
from looped_hf.fileio import YAML_MAX_NODES, yaml_load
from looped_hf.sweep import cli as sweep_cli
from looped_hf.sweep import make_plan, run_sweep
from looped_hf.train import check_recipe
from looped_hf.train import main as train_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _tiny_text() -> str:
    return (RECIPES / "tiny.yaml").read_text()


def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_recipe_is_refused_before_it_is_expanded(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    nested = "".join(f"  {line}\n" for line in _bomb().splitlines())
    path.write_text(_tiny_text() + "lr_scheduler_kwargs:\n" + nested)
    started = time.monotonic()
    assert train_main([str(path), "--check"]) == 2
    assert time.monotonic() - started < 30  # refused from the node graph, not after 9^9 values
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"expands past {YAML_MAX_NODES} values" in err and "bomb.yaml" in err


def test_aliases_below_the_bound_and_merge_keys_still_load():
    assert yaml_load("base: &b {x: 1}\nuse: *b\nover: {<<: *b, x: 2}\n") == {
        "base": {"x": 1}, "use": {"x": 1}, "over": {"x": 2}
    }  # fmt: skip
    with pytest.raises(yaml.YAMLError, match="recursive alias"):
        yaml_load("a: &a [1, *a]\n")


def test_duplicate_keys_are_refused_naming_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(_tiny_text() + "seq_len: 128\n")
    with pytest.raises(RecipeError, match=r"duplicate key 'seq_len' \(first given on line \d+\)"):
        load_yaml(path)
    nested = tmp_path / "nested.yaml"
    nested.write_text("lr_scheduler_kwargs:\n  a: 1\n  a: 2\n")
    with pytest.raises(RecipeError, match=r"line 3.*duplicate key 'a'"):
        parse_recipe(nested)


@pytest.mark.parametrize("kind", ["binary", "directory", "missing", "invalid"])
def test_a_recipe_that_is_not_a_yaml_file_is_one_line_exit_2(tmp_path, capsys, kind):
    path = tmp_path / "recipe.yaml"
    if kind == "binary":
        path.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00")
    elif kind == "directory":
        path.mkdir()
    elif kind == "invalid":
        path.write_text("sweep: [1\n")
    for main in (train_main, sweep_cli.main):
        assert main([str(path)] + (["--check"] if main is train_main else [])) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(path) in err
        expected = {"binary": "binary file", "directory": "is a directory", "missing": "no such file",
                    "invalid": "not valid YAML"}  # fmt: skip
        assert expected[kind] in err


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("x")
    recipe = yaml.safe_load(_tiny_text()) | {"output_dir": str(taken)}
    with pytest.raises(RecipeError, match=r"output_dir='.*taken': is an existing file"):
        check_recipe(recipe)


def test_eval_blocks_the_corpus_cannot_supply_are_refused_at_check(tmp_path):
    recipe = yaml.safe_load(_tiny_text()) | {"output_dir": str(tmp_path / "run"), "eval_blocks": 100_000_000}
    with pytest.raises(RecipeError, match=r"DataArguments.eval_blocks=100000000: .* holds fewer than"):
        check_recipe(recipe)


def _sweep(tiny_recipe: dict, tmp_path: Path, **sweep: object) -> dict:
    drop = ("max_steps", "output_dir", "hidden_size", "head_dim", "num_prelude_layers", "num_recurrent_layers",
            "num_coda_layers", "num_recurrences", "save_strategy")  # fmt: skip
    section = {"effective_depth": 4, "prelude": 1, "coda": 1, "recurrences": [1, 2], "head_dim": 16,
               "budgets": [6e8], "widths": [32], "output_dir": str(tmp_path / "sweep"), **sweep}  # fmt: skip
    return {"sweep": section, **{k: v for k, v in tiny_recipe.items() if k not in drop}}


@pytest.mark.parametrize(("field", "value"), [("recurrences", [2, 2]), ("seeds", [0, 0]), ("widths", [32, 32])])
def test_a_repeated_sweep_value_names_its_own_field(tiny_recipe, tmp_path, field, value):
    with pytest.raises(RecipeError, match=rf"sweep\.{field}=.*repeats"):
        make_plan(_sweep(tiny_recipe, tmp_path, **{field: value}))


@pytest.mark.parametrize("bad", [-1, 0, 2.5, True])
def test_max_runs_below_one_is_refused_before_anything_runs(tiny_recipe, tmp_path, bad):
    with pytest.raises(RecipeError, match=r"--max-runs=.*must be an integer >= 1"):
        run_sweep(_sweep(tiny_recipe, tmp_path), max_runs=bad)
    assert not (tmp_path / "sweep").exists()


def test_max_runs_flag_below_one_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sweep_cli.main([str(tmp_path / "any.yaml"), "--max-runs", "-1"])
    assert exit_info.value.code == 2 and "--max-runs='-1': must be an integer >= 1" in capsys.readouterr().err


def test_data_modules_import_one_way():
    import looped_hf.data.corpus as corpus
    import looped_hf.data.data_arguments as data_arguments
    from looped_hf.data import DataArguments

    assert DataArguments is data_arguments.DataArguments
    assert "DataArguments" not in corpus.__dict__ and "data_arguments" not in Path(corpus.__file__).read_text()


@pytest.mark.parametrize(
    ("written", "expected"),
    [({}, (0.8, 0.95, 1e-10)), ({"adam_beta1": 0.9}, (0.9, 0.95, 1e-10)),
     ({"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}, (0.9, 0.999, 1e-8))],
)  # fmt: skip
def test_a_value_the_recipe_writes_is_never_replaced_by_the_studys(tmp_path, written, expected):
    recipe = yaml.safe_load(_tiny_text()) | {"output_dir": str(tmp_path / "run"), "optimizer": "muonh", **written}
    recipe.pop("learning_rate", None)
    _, _, training = parse_recipe(recipe)
    assert (training.adam_beta1, training.adam_beta2, training.adam_epsilon) == expected


def test_adam_fields_left_unset_take_the_optimizers_defaults(tmp_path):
    _, _, adamw = parse_recipe(yaml.safe_load(_tiny_text()) | {"output_dir": str(tmp_path / "run")})
    assert (adamw.adam_beta1, adamw.adam_beta2, adamw.adam_epsilon) == (0.9, 0.999, 1e-8)


# --------------------------------------------------------------------------------------------
# Model inputs: refuse only what cannot work
# --------------------------------------------------------------------------------------------


def test_the_model_refuses_token_ids_outside_the_vocabulary_but_runs_packed_and_long_rows():
    """A token id past the vocabulary cannot be embedded: one line naming input_ids and the id.
    Packed rows (position_ids restarting per sequence, longer than max_position_embeddings in
    tokens) and inputs past max_position_embeddings can work, as on Llama, so they run."""
    import torch
    from conftest import TINY_VOCAB, tiny_looped_model

    model = tiny_looped_model(max_position_embeddings=8)
    with pytest.raises(ValueError, match=rf"^input_ids: token id {TINY_VOCAB} is outside the vocabulary"):
        model(torch.tensor([[3, TINY_VOCAB]]))
    packed = torch.full((1, 12), 5)
    positions = torch.cat([torch.arange(6), torch.arange(6)])[None]
    logits = model(packed, position_ids=positions).logits
    torch.testing.assert_close(logits[:, 6:], logits[:, :6])  # two equal documents, attended apart
    assert model(torch.full((1, 12), 5)).logits.shape == (1, 12, TINY_VOCAB)
