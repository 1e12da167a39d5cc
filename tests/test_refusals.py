"""Hostile and careless recipes and flags: refused with one line naming the field, never a hang."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
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
    with pytest.raises(RecipeError, match=r"output_dir='.*taken': is a file, not a folder"):
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
# ---------------------------------------------------------------------------------------------
# Output paths: one check (looped_hf.fileio.check_output_path) for every command
# ---------------------------------------------------------------------------------------------
def _one_error_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    """The one line of ``prefix`` on stderr, and no traceback (transformers' loading bar may share it)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_fit_out_under_proc_is_one_line_exit_2(tmp_path, capsys):
    """The user's report: a FileNotFoundError traceback, where every other command refused in one line
    (root passes os.access everywhere, so the check tries to make the folder and a file in it)."""
    from looped_hf.cli import main as looped_hf

    assert looped_hf(["fit", str(tmp_path / "results.jsonl"), "--out", "/proc/nope/f.json"]) == 2
    line = _one_error_line(capsys, "looped-hf fit:")
    assert "--out /proc/nope/f.json: cannot be written" in line
    assert not Path("/proc/nope").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_publish import make_run_dir

    return make_run_dir(tmp_path_factory.mktemp("runs") / "loop2-w32-b0")


def _commands(run: Path, tmp: Path, bad: Path) -> dict[str, list[str]]:
    """Each command with one output path under ``bad`` (a file, so nothing can be made there)."""
    return {
        "fit --out": ["fit", str(tmp / "results.jsonl"), "--out", str(bad / "fit.json")],
        "fit --plots": ["fit", str(tmp / "results.jsonl"), "--plots", str(bad / "plots")],
        "eval --out": ["eval", str(run), "--bundle", "builtin", "--device", "cpu", "--out", str(bad / "ev")],
        "test-time --compare": ["test-time", str(run), "--compare", str(bad / "c.png")],
        "publish --out": ["publish", str(run), "--out", str(bad / "pub")],
        "card --out": ["card", str(tmp), "--out", str(bad / "card")],
        "sweep --output": ["sweep", str(RECIPES / "iso_depth_tiny.yaml"), "--output", str(bad / "sweep")],
        "prepare-data --output-dir": ["prepare-data", "embedded", "--val-docs", "2", "--output-dir", str(bad / "p")],
        "demo --card-dir": ["demo", "--card-dir", str(bad / "card"), "--out", str(tmp / "demo")],
    }


@pytest.mark.parametrize("command", list(_commands(Path("r"), Path("t"), Path("b"))))
def test_every_commands_output_path_goes_through_the_one_check(finished_run, tmp_path, capsys, command):
    from looped_hf.cli import main as looped_hf

    bad = tmp_path / "a-file"
    bad.write_text("x")
    argv = _commands(finished_run, tmp_path, bad)[command]
    assert looped_hf(argv) == 2
    line = _one_error_line(capsys, f"looped-hf {argv[0]}")
    assert f"{command.split()[1]} {bad}/" in line and f"cannot be written ({bad} is a file, not a folder)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written, not even a folder


def test_the_output_check_makes_and_removes_what_it_probes(tmp_path):
    from looped_hf.fileio import OutputPathError, check_output_path

    assert check_output_path(tmp_path / "a" / "b" / "fit.json", "--out") == tmp_path / "a" / "b" / "fit.json"
    assert list(tmp_path.iterdir()) == []  # the folders it made to try are gone again
    with pytest.raises(OutputPathError, match=r"^--out .*: is a directory; give a file path$"):
        check_output_path(tmp_path, "--out")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=r"^output_dir='.*/f': is a file, not a folder$"):
        check_output_path(tmp_path / "f", "output_dir", directory=True)


# ---------------------------------------------------------------------------------------------
# publish without --repo-id, --tokenizer bytes, truncated weights
# ---------------------------------------------------------------------------------------------
def test_publish_without_repo_id_writes_the_folder_and_says_where(finished_run, tmp_path, capsys):
    import shutil

    from looped_hf.cli import main as looped_hf

    run = tmp_path / finished_run.name
    shutil.copytree(finished_run, run)
    assert looped_hf(["publish", str(run)]) == 0
    out = capsys.readouterr().out
    folder = run / "publish"  # the default, as --help says
    assert f"[publish] wrote {folder}:" in out and "--repo-id ORG/NAME" in out
    assert (folder / "model.safetensors").is_file()
    assert f'from_pretrained("your-name/{run.name}"' in (folder / "README.md").read_text()
    # Uploading still needs the repository: one line, nothing uploaded.
    assert looped_hf(["publish", str(run), "--push"]) == 2
    assert "--push needs --repo-id" in _one_error_line(capsys, "looped-hf publish:")


def test_publish_help_names_the_default_folder(capsys):
    from looped_hf.publish import main as publish_main

    with pytest.raises(SystemExit):
        publish_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: RUN_DIR/publish" in text and "needed with --push" in text


def test_tokenizer_bytes_is_the_builtin_one_wherever_a_tokenizer_is_asked_for(monkeypatch):
    """`bytes` (and `embedded`) name the built-in tokenizers, never a Hub id: the packer and the
    recipes both resolve through looped_hf.data.load_tokenizer and never ask the Hub for them."""
    import huggingface_hub

    from looped_hf.data import load_tokenizer
    from looped_hf.data.tokenizer import is_builtin_tokenizer
    from looped_hf.prepack import packing_tokenizer

    def no_hub(*args, **kwargs):
        raise AssertionError("a built-in tokenizer was looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", no_hub)
    assert is_builtin_tokenizer("bytes") and is_builtin_tokenizer("embedded") and not is_builtin_tokenizer("gpt2")
    assert len(load_tokenizer("bytes")) == 258
    raw, bos, vocab = packing_tokenizer("bytes")
    assert vocab == 258 and raw.encode("A").ids == [65]


def test_prepare_data_accepts_tokenizer_bytes(tmp_path, capsys):
    from looped_hf.cli import main as looped_hf

    out = tmp_path / "packed"
    argv = ["prepare-data", "embedded", "--output-dir", str(out), "--tokenizer", "bytes", "--seq-len", "32",
            "--val-docs", "2", "--max-rows", "4", "--rows-per-shard", "4"]  # fmt: skip
    assert looped_hf(argv) == 0, capsys.readouterr().err
    meta = json.loads((out / "meta_train.json").read_text())
    assert meta["vocab_size"] == 258 and meta["bos_token_id"] == 256  # the byte tokenizer's EOS-as-BOS


@pytest.mark.parametrize("command", ["eval", "test-time", "publish"])
def test_truncated_safetensors_is_refused_in_one_line(finished_run, tmp_path, capsys, command):
    import shutil

    from looped_hf.cli import main as looped_hf

    run = tmp_path / finished_run.name
    shutil.copytree(finished_run, run)
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 100])
    argv = {"eval": ["eval", str(run), "--bundle", "builtin", "--device", "cpu", "--out", str(tmp_path / "ev")],
            "test-time": ["test-time", str(run)], "publish": ["publish", str(run)]}[command]  # fmt: skip
    assert looped_hf(argv) == 2
    line = _one_error_line(capsys, f"looped-hf {command}:")
    assert f"{weights}: truncated" in line
    assert not (run / "publish").exists() and not (tmp_path / "ev").exists()


# --------------------------------------------------------------------------------------------
# Hostile checkpoints: one line, exit 2, nothing written, nothing lost (every converter, through
# looped_hf.convert.loader), in both safetensors layouts
# --------------------------------------------------------------------------------------------
def _set_json(name: str, drop: tuple[str, ...] = (), **changes: object):
    """An edit: the JSON object in ``name`` with ``changes`` set and ``drop`` removed."""

    def edit(folder: Path) -> None:
        value = json.loads((folder / name).read_text())
        value.update(changes)
        (folder / name).write_text(json.dumps({k: v for k, v in value.items() if k not in drop}))

    return edit


def _write(name: str, data: bytes | str):
    def edit(folder: Path) -> None:
        (folder / name).write_bytes(data.encode() if isinstance(data, str) else data)

    return edit


def _index_edit(change):
    """An edit of the index's weight_map: ``change(weight_map)`` in place."""

    def edit(folder: Path) -> None:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        change(index["weight_map"])
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    return edit


def _shard_edit(number: int, change):
    """An edit of the tensors in shard ``number`` of 2: ``change(tensors)`` in place, saved again."""
    from safetensors.torch import load_file, save_file

    def edit(folder: Path) -> None:
        path = folder / f"model-{number:05d}-of-00002.safetensors"
        tensors = load_file(path)
        change(tensors)
        save_file(tensors, path)

    return edit


def _key_in_both_shards(key: str):
    """``key`` (named by the index in shard 1) also saved, as zeros, in shard 2: merged in file
    order, the old readers took the zeros without a word."""
    import torch
    from safetensors.torch import load_file

    def edit(folder: Path) -> None:
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert weight_map[key] == "model-00001-of-00002.safetensors", "pick a key of shard 1"
        first = folder / weight_map[key]
        _shard_edit(2, lambda t: t.update({key: torch.zeros_like(load_file(first)[key])}))(folder)

    return edit


def _link_shard_out(folder: Path) -> None:
    outside = folder.parent / "elsewhere.safetensors"
    shard_path = folder / "model-00001-of-00002.safetensors"
    shard_path.rename(outside)
    shard_path.symlink_to(outside)


def _pickle_only(folder: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def _truncate(name: str, keep: float):
    def edit(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])

    return edit


def _tokenizer(size: int, name: str = "tokenizer.json"):
    """A word-level tokenizer of ``size`` tokens saved as ``name`` (loads with transformers)."""

    def edit(folder: Path) -> None:
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0")).save(str(folder / name))

    return edit


def _both(*edits):
    def edit(folder: Path) -> None:
        for one in edits:
            one(folder)

    return edit


# (fixture, convert format, layout, edit of the copy, what the one line must say)
HOSTILE_CHECKPOINTS = {
    "key stored in two shards": ("ouro-tiny", "ouro", "sharded", _key_in_both_shards("lm_head.weight"),
                                 "tensor 'lm_head.weight' is stored twice (also in model-00001-of-00002"),
    "shard holds a key the index does not name": (
        "huginn-tiny", "huginn", "sharded", _shard_edit(1, lambda t: t.update(stray=next(iter(t.values())).clone())),
        "holds tensor 'stray', which the index's weight_map does not name"),
    "index without weight_map": ("huginn-tiny", "huginn", "sharded",
                                 _set_json("model.safetensors.index.json", drop=("weight_map",)),
                                 "model.safetensors.index.json: no 'weight_map' object"),
    "index weight_map of a number": ("retrofit-olmo-tiny", "retrofit", "sharded",
                                     _index_edit(lambda m: m.update({"transformer.wte.weight": 3})),
                                     "weight_map['transformer.wte.weight']=3: expected a shard file name"),
    "index is a list": ("ouro-tiny", "ouro", "sharded", _write("model.safetensors.index.json", "[]"),
                        "model.safetensors.index.json: expected a JSON object, got list"),
    "index is not JSON": ("retrofit-llama-tiny", "retrofit-llama", "sharded",
                          _write("model.safetensors.index.json", "{weight_map"),
                          "model.safetensors.index.json: not a readable JSON file"),
    "shard missing": ("retrofit-llama-tiny", "retrofit", "sharded",
                      lambda f: (f / "model-00002-of-00002.safetensors").unlink(),
                      "model-00002-of-00002.safetensors: missing (the checkpoint names it)"),
    "index names a key its shard lacks": (
        "retrofit-olmo-tiny", "huginn_raven", "sharded",
        _index_edit(lambda m: m.update({"transformer.extra.weight": "model-00001-of-00002.safetensors"})),
        "model-00001-of-00002.safetensors: lacks 'transformer.extra.weight', which the index's weight_map names"),
    "shard name with ..": ("ouro-tiny", "ouro", "sharded",
                           _index_edit(lambda m: m.update({"lm_head.weight": "../outside.safetensors"})),
                           "shard '../outside.safetensors': not a file name inside the checkpoint folder"),
    "absolute shard name": ("huginn-tiny", "huginn", "sharded",
                            _index_edit(lambda m: m.update({"freqs_cis": "/etc/hostname"})),
                            "shard '/etc/hostname': not a file name inside the checkpoint folder"),
    "shard linked out of the folder": ("huginn-tiny", "huginn_raven", "sharded", _link_shard_out,
                                       "model-00001-of-00002.safetensors' leads out of the checkpoint folder"),
    "truncated shard": ("ouro-tiny", "ouro", "sharded", _truncate("model-00002-of-00002.safetensors", 0.5),
                        "model-00002-of-00002.safetensors: truncated"),
    "truncated weights": ("huginn-tiny", "huginn", "single", _truncate("model.safetensors", 0.9),
                          "model.safetensors: truncated"),
    "empty weights": ("ouro-tiny", "ouro", "single", _write("model.safetensors", b""),
                      "model.safetensors: truncated (0 bytes"),
    "weights that are text": ("retrofit-olmo-tiny", "retrofit", "single",
                              _write("model.safetensors", "these are not tensors, just words"),
                              "model.safetensors: not safetensors (a header of 8241904413164529780 bytes"),
    "weights announcing a huge header": ("huginn-tiny", "huginn", "sharded",
                                         _write("model-00002-of-00002.safetensors", (2**40).to_bytes(8, "little")),
                                         "model-00002-of-00002.safetensors: not safetensors (a header of 1099511627776"),
    "a pickle-only folder": ("huginn-tiny", "huginn", "single", _pickle_only,
                             "only a pickled pytorch_model.bin checkpoint, refused (unpickling runs code"),
    "config.json not JSON": ("ouro-tiny", "ouro", "single", _write("config.json", "{\"model_type\": "),
                             "config.json: not a readable JSON file"),
    "config.json a list": ("huginn-tiny", "huginn", "sharded", _write("config.json", "[1, 2]"),
                           "config.json: expected a JSON object, got list"),
    "generation_config.json not JSON": ("ouro-tiny", "ouro", "single", _write("generation_config.json", "nope"),
                                        "generation_config.json: not a readable JSON file"),
    "generation_config.json a list": ("retrofit-llama-tiny", "retrofit", "sharded",
                                      _write("generation_config.json", "[]"),
                                      "generation_config.json: expected a JSON object, got list"),
    "generation eos outside the vocabulary": (
        "huginn-tiny", "huginn", "single", _set_json("generation_config.json", eos_token_id=1000),
        "generation_config.json eos_token_id=1000: expected a token id in [0, 256)"),
    "config bos outside the vocabulary": ("ouro-tiny", "ouro", "sharded", _set_json("config.json", bos_token_id=-1),
                                          "config.json bos_token_id=-1: expected a token id in [0, 256)"),
    "llama3 rope scaling without low_freq_factor": (
        "retrofit-llama-tiny", "retrofit", "single",
        _set_json("config.json", rope_scaling={"rope_type": "llama3", "factor": 4.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}),
        "config.json rope_scaling has no 'low_freq_factor': rope_type 'llama3' needs"),
    "yarn rope scaling without its context": (
        "ouro-tiny", "ouro", "single", _set_json("config.json", rope_scaling={"type": "yarn", "factor": 4.0}),
        "config.json rope_scaling has no 'original_max_position_embeddings': rope_type 'yarn' needs"),
    "tie flag a string": ("ouro-tiny", "ouro", "single", _set_json("config.json", tie_word_embeddings="yes"),
                          "config.json tie_word_embeddings='yes': expected true or false"),
    "tie flag a number": ("huginn-tiny", "huginn", "sharded", _set_json("config.json", tie_embeddings=1),
                          "config.json tie_embeddings=1: expected true or false"),
    "tied head that differs from the embedding": (
        "ouro-tiny", "ouro", "single", _set_json("config.json", tie_word_embeddings=True),
        "config.json tie_word_embeddings=True, but the checkpoint's head differs from its embedding"),
    "vocabulary too large to allocate": ("ouro-tiny", "ouro", "sharded", _set_json("config.json", vocab_size=10**9),
                                         "vocab_size=1000000000, hidden_size=64"),
    "MLP too large to allocate": ("ouro-tiny", "ouro", "single", _set_json("config.json", intermediate_size=10**8),
                                  "intermediate_size=100000000, layers 0/2/0), the checkpoint holds"),
    "fused MLP too large (retrofit)": ("retrofit-olmo-tiny", "retrofit", "single",
                                       _set_json("config.json", intermediate_size=10**8),
                                       "mlp.fc.weight of shape (256, 64): expected 2 x intermediate_size=100000000"),
    "absurd layer count (Ouro)": ("ouro-tiny", "ouro", "sharded", _set_json("config.json", num_hidden_layers=10**9),
                                  "LoopedConfig.num_recurrent_layers=1000000000: the model would have 1000000000 unique layers"),
    "absurd layer count (Huginn)": ("huginn-tiny", "huginn", "single",
                                    _set_json("config.json", n_layers_in_coda=10**8),
                                    "LoopedConfig.num_coda_layers=100000000: the model would have 100000003 unique layers"),
    "absurd trained r (Ouro)": ("ouro-tiny", "ouro", "single", _set_json("config.json", total_ut_steps=10**12),
                                "config.json total_ut_steps=1000000000000: above the ceiling of"),
    "absurd trained r (Huginn)": ("huginn-tiny", "huginn", "sharded", _set_json("config.json", mean_recurrence=10**9),
                                  "config.json mean_recurrence=1000000000: above the ceiling of"),
    "unknown config key (retrofit)": ("retrofit-llama-tiny", "retrofit", "single",
                                      _set_json("config.json", flux_capacitor=3),
                                      "config.json flux_capacitor=3: unknown huginn_raven config key"),
    "tokenizer.json not JSON": ("huginn-tiny", "huginn", "single", _write("tokenizer.json", "{"),
                                "tokenizer.json: not a readable JSON file"),
    "tokenizer_config.json a list": ("ouro-tiny", "ouro", "sharded",
                                     _both(_tokenizer(10), _write("tokenizer_config.json", "[]")),
                                     "tokenizer_config.json: expected a JSON object, got list"),
    "tokenizer that does not load": ("retrofit-olmo-tiny", "retrofit", "single",
                                     _write("tokenizer.json", '{"version": "1.0"}'),
                                     "the tokenizer (tokenizer.json) does not load"),
    "tokenizer larger than the vocabulary": ("ouro-tiny", "ouro", "single", _tokenizer(300),
                                             "the tokenizer has 300 tokens, more than the model's vocab_size=256"),
}  # fmt: skip


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    from looped_hf.cli import main as looped_hf

    assert looped_hf(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("looped-hf ")]  # transformers' bar may share it
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


@pytest.mark.parametrize("case", list(HOSTILE_CHECKPOINTS))
def test_a_hostile_checkpoint_is_refused_in_one_line_writing_nothing(case, tmp_path, capsys):
    from test_convert_loader import copy_checkpoint, shard

    fixture, fmt, layout, edit, message = HOSTILE_CHECKPOINTS[case]
    src = copy_checkpoint(fixture, tmp_path / "src")
    if layout == "sharded":
        shard(src)
    edit(src)
    before, out = _snapshot(src), tmp_path / "out"
    _refused_in_one_line(["convert", fmt, str(src), "--out", str(out)], capsys, "looped-hf convert: error: ", message)
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing written, not even a temp folder
    assert _snapshot(src) == before  # nothing lost


@pytest.mark.parametrize(("model_config", "message"), [
    ({"num_recur": 10**12}, "model_config.num_recur=1000000000000: above the ceiling of"),
    ({"n_embd": "wide"}, "model_config.n_embd='wide': expected an integer >= 1"),
    ({"flux": 1}, "model_config.flux=1: unknown nanochat config key"),
])  # fmt: skip
def test_a_hostile_nanochat_meta_is_refused_in_one_line_writing_nothing(model_config, message, tmp_path, capsys):
    src = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "study_checkpoints" / "noloop", src)
    meta = json.loads((src / "meta_000020.json").read_text())
    meta["model_config"].update(model_config)
    (src / "meta_000020.json").write_text(json.dumps(meta))
    before, out = _snapshot(src), tmp_path / "out"
    _refused_in_one_line(["convert", "nanochat", str(src), "--out", str(out)], capsys, message)
    assert not out.exists() and _snapshot(src) == before


# --------------------------------------------------------------------------------------------
# --out of a conversion: checked before converting; --overwrite replaces only looped_hf output
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["under a file", "proc", "sys", "dot", "dotdot", "the source", "above the source"])
def test_a_conversion_out_that_cannot_be_used_is_refused_before_converting(where, tmp_path, capsys, monkeypatch):
    from test_convert_loader import copy_checkpoint

    if where in ("proc", "sys") and not Path(f"/{where}/self" if where == "proc" else "/sys/kernel").exists():
        pytest.skip(f"needs Linux's /{where}")
    src = copy_checkpoint("ouro-tiny", tmp_path / "work" / "src")
    (tmp_path / "a-file").write_text("x")
    monkeypatch.chdir(tmp_path / "work")
    out, message = {
        "under a file": (str(tmp_path / "a-file" / "out"), "is a file, not a folder"),
        "proc": ("/proc/looped-out", "--out /proc/looped-out: cannot be written"),
        "sys": ("/sys/looped-out", "--out /sys/looped-out: cannot be written"),
        "dot": (".", "is the working directory or holds it"),
        "dotdot": ("..", "is the working directory or holds it"),
        "the source": (str(src), "is (or contains) the checkpoint directory"),
        "above the source": (str(tmp_path / "work" / "src" / ".."), "is the working directory or holds it"),
    }[where]
    before = _snapshot(tmp_path)
    _refused_in_one_line(["convert", "ouro", str(src), "--out", out, "--overwrite"], capsys, message)
    assert _snapshot(tmp_path) == before and not Path("/proc/looped-out").exists()


def test_overwrite_replaces_only_an_empty_folder_or_an_earlier_looped_output(tmp_path, capsys):
    from test_convert_loader import copy_checkpoint

    from looped_hf.cli import main as looped_hf

    src = copy_checkpoint("ouro-tiny", tmp_path / "src")
    mine = tmp_path / "my-notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    message = "--overwrite replaces only an empty folder or an earlier looped_hf output"
    _refused_in_one_line(["convert", "ouro", str(src), "--out", str(mine), "--overwrite"], capsys, message)
    assert (mine / "thesis.tex").read_text() == "years of work"  # nothing lost
    empty = tmp_path / "empty"
    empty.mkdir()
    assert looped_hf(["convert", "ouro", str(src), "--out", str(empty), "--overwrite"]) == 0
    assert json.loads((empty / "config.json").read_text())["model_type"] == "looped"
    (empty / "stale.txt").write_text("from the earlier output")
    assert looped_hf(["convert", "huginn", str(ZOO_HUGINN), "--out", str(empty), "--overwrite"]) == 0
    assert not (empty / "stale.txt").exists() and json.loads((empty / "config.json").read_text())["qk_bias"]


ZOO_HUGINN = Path(__file__).parent / "fixtures" / "zoo" / "huginn-tiny"


# --------------------------------------------------------------------------------------------
# test-time and eval: a foreign tokenizer, unreadable --data, exit thresholds that cannot work
# --------------------------------------------------------------------------------------------
def _run_copy(finished_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / finished_run.name
    shutil.copytree(finished_run, run)
    return run


@pytest.mark.parametrize("command", ["test-time", "eval"])
def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(finished_run, tmp_path, capsys, command):
    run = _run_copy(finished_run, tmp_path)
    (run / "tokenizer_config.json").unlink()
    _tokenizer(300)(run)  # 300 tokens, the model has 258
    argv = {"test-time": ["test-time", str(run)],
            "eval": ["eval", str(run), "--bundle", "builtin", "--device", "cpu", "--out", str(tmp_path / "ev")]}  # fmt: skip
    _refused_in_one_line(argv[command], capsys, "the tokenizer has 300 tokens, more than the model's vocab_size=258")
    assert not list(run.glob("test_time_scaling*"))


@pytest.mark.parametrize(("name", "data", "message"), [
    ("empty.txt", b"", "empty file, no held-out text"),
    ("held.txt", bytes(range(256)) * 8, "not UTF-8 text (byte 0); is it a binary file?"),
    ("held.jsonl", b'{"text": "caf\xc3\xa9"}\n' + b"\xff\xfe" * 20, "not UTF-8 text (byte 18)"),
])  # fmt: skip
def test_test_time_data_that_is_empty_or_binary_is_one_line(finished_run, tmp_path, capsys, name, data, message):
    run = _run_copy(finished_run, tmp_path)
    (tmp_path / name).write_bytes(data)
    _refused_in_one_line(["test-time", str(run), "--data", str(tmp_path / name)], capsys,
                         f"--data {str(tmp_path / name)!r}: {message}")  # fmt: skip
    assert not list(run.glob("test_time_scaling*"))


@pytest.mark.parametrize(("flags", "message"), [
    (["--exit-criterion", "kl", "--exit-threshold", "nan"], "exit_threshold=nan: must be a finite number"),
    (["--exit-criterion", "kl", "--exit-threshold", "-1"], "exit_threshold=-1.0: exit_criterion='kl' compares"),
    (["--exit-threshold", "nan"], "--exit-threshold nan: no exit criterion reads it"),
])  # fmt: skip
def test_eval_exit_thresholds_that_cannot_work_are_refused_before_any_forward(
    finished_run, tmp_path, capsys, monkeypatch, flags, message
):
    import looped_hf.evaluation.runner as runner

    def no_forward(*args, **kwargs):
        raise AssertionError("the model was run")

    monkeypatch.setattr(runner, "evaluate_model", no_forward)
    out = tmp_path / "ev"
    _refused_in_one_line(["eval", str(finished_run), "--bundle", "builtin", "--device", "cpu", "--out", str(out),
                          *flags], capsys, message)  # fmt: skip
    assert not out.exists()  # not even the builtin bundle


# --------------------------------------------------------------------------------------------
# Weights that are not the model their config.json builds (eval, test-time, publish): refused
# from the headers before loading, where transformers would load with a report and go on
# --------------------------------------------------------------------------------------------
def _edit_weights(change):
    """An edit of model.safetensors: ``change(state_dict)`` in place, then written back."""

    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    return edit


LAYER = "model.recurrent_layers.0"
MISMATCHED_WEIGHTS = {  # case: (command, edit, message)
    "a shape the config changed": ("eval", _set_json("config.json", intermediate_size=192),
                                   "has shape [128, 32] in model.safetensors, the config makes [192, 32]"),
    "a weight no file holds": ("test-time", _edit_weights(lambda t: t.pop(f"{LAYER}.mlp.down_proj.weight")),
                               f"'{LAYER}.mlp.down_proj.weight' is in no weight file"),
    "a weight the model lacks": ("publish", _edit_weights(lambda t: t.update(extra=t[f"{LAYER}.input_layernorm.weight"].clone())),
                                 "'extra' is not a weight of that model"),
    "layers the config dropped": ("eval", _set_json("config.json", num_coda_layers=0),
                                  "'model.coda_layers.0.input_layernorm.weight' (and 7 more) is not a weight of that model"),
    # A run folder re-saved as int8: from_pretrained casts it and eval used to score it.
    "all int8 (eval)": ("eval", _edit_weights(lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})),
                        "'model.embed_tokens.weight' has dtype I8 in model.safetensors: weights must be floating point"),
    "all int8 (test-time)": ("test-time", _edit_weights(lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})),
                             "has dtype I8 in model.safetensors: weights must be floating point"),
    "one uint8 tensor (publish)": ("publish", _edit_weights(lambda t: t.update({f"{LAYER}.mlp.up_proj.weight":
                                                                                 t[f"{LAYER}.mlp.up_proj.weight"].to(torch.uint8)})),
                                   f"'{LAYER}.mlp.up_proj.weight' has dtype U8 in model.safetensors"),
    "int32 (serve)": ("serve", _edit_weights(lambda t: t.update({k: v.to(torch.int32) for k, v in t.items()})),
                      "has dtype I32 in model.safetensors: weights must be floating point"),
    "a weight no file holds (serve)": ("serve", _edit_weights(lambda t: t.pop(f"{LAYER}.mlp.up_proj.weight")),
                                       f"'{LAYER}.mlp.up_proj.weight' is in no weight file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MISMATCHED_WEIGHTS))
def test_weights_that_are_not_the_configs_model_are_refused_before_loading(finished_run, tmp_path, capsys, case):
    command, edit, message = MISMATCHED_WEIGHTS[case]
    run = _run_copy(finished_run, tmp_path)
    edit(run)
    before = _snapshot(run)
    argv = {"eval": ["eval", str(run), "--bundle", "builtin", "--device", "cpu", "--out", str(tmp_path / "ev")],
            "test-time": ["test-time", str(run)], "publish": ["publish", str(run)],
            "serve": ["serve", str(run), "--dry-run"]}[command]  # fmt: skip
    line = _refused_in_one_line(argv, capsys, f"looped-hf {command}: ", "the weights are not the model its "
                                "config.json builds: ", message)  # fmt: skip
    assert "LOAD REPORT" not in capsys.readouterr().err and str(run) in line
    assert _snapshot(run) == before and not (tmp_path / "ev").exists()


@pytest.fixture(scope="module")
def loop_lora_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-loop LoRA retrofit (model_type looped_loop_lora): 2 shared layers, 3 loops, rank 4."""
    from test_retrofit import retrofit, tiny_parent

    base = tmp_path_factory.mktemp("loop_lora")
    retrofit(tiny_parent(base / "parent", "llama"), "--share", "lower", "--blocks", "2", "--lora-rank", "4",
             "--out", base / "rrt")  # fmt: skip
    return base / "rrt"


HOSTILE_LOOP_LORA = {  # config.json change: what the one line says
    "heads": ({"num_attention_heads": 3}, "LoopLoRAConfig.num_attention_heads=3: does not divide hidden_size=64"),
    "rank text": ({"loop_lora_rank": "four"}, "LoopLoRAConfig.loop_lora_rank='four': must be an integer >= 1"),
    "rank 0": ({"loop_lora_rank": 0}, "LoopLoRAConfig.loop_lora_rank=0: must be an integer >= 1"),
    "rank bool": ({"loop_lora_rank": True}, "LoopLoRAConfig.loop_lora_rank=True: must be an integer >= 1"),
    "rank not saved": ({"loop_lora_rank": 8}, "'model.loop_lora.steps.0.0.q_proj_delta.A' has shape [4, 64] in "
                                              "model.safetensors, "
                                              "the config makes [8, 64]"),
    "targets text": ({"loop_lora_targets": "self_attn.q_proj"},
                     "LoopLoRAConfig.loop_lora_targets='self_attn.q_proj': must be a list of distinct names from"),
    "targets unknown": ({"loop_lora_targets": ["self_attn.q_proj", "mlp.zz_proj"]},
                        "loop_lora_targets=['self_attn.q_proj', 'mlp.zz_proj']: must be a list of distinct names"),
    "targets twice": ({"loop_lora_targets": ["mlp.up_proj", "mlp.up_proj"]}, "must be a list of distinct names"),
    "ceiling above the ceiling": ({"max_recurrences": 10**6},
                                  "LoopLoRAConfig.max_recurrences=1000000: exceeds MAX_NUM_RECURRENCES=4096"),
    "ceiling above the loops": ({"max_recurrences": 4}, "LoopLoRAConfig.max_recurrences=4: must be <= loop_lora_loops=3"),
    "loops above the ceiling": ({"loop_lora_loops": 10**6},  # built 10^6 loops of deltas: a hang
                                "LoopLoRAConfig.loop_lora_loops=1000000: must be an integer in [num_recurrences=3, 4096]"),
    "loops below r": ({"loop_lora_loops": 1}, "LoopLoRAConfig.loop_lora_loops=1: must be an integer in"),
    "loops text": ({"loop_lora_loops": "3"}, "LoopLoRAConfig.loop_lora_loops='3': must be an integer in"),
    "loops not saved": ({"loop_lora_loops": 4, "max_recurrences": 4, "num_recurrences": 4},
                        "'model.loop_lora.steps.3.0.q_proj_delta.A' (and 31 more) is in no weight file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE_LOOP_LORA))
def test_a_hostile_per_loop_lora_config_is_refused_in_one_line(loop_lora_folder, tmp_path, capsys, case):
    change, message = HOSTILE_LOOP_LORA[case]
    folder = tmp_path / "rrt"
    shutil.copytree(loop_lora_folder, folder)
    _set_json("config.json", **change)(folder)
    out = tmp_path / "ev"
    _refused_in_one_line(["eval", str(folder), "--bundle", "builtin", "--device", "cpu", "--out", str(out)], capsys,
                         "looped-hf eval: ", message)  # fmt: skip
    assert not out.exists()


def test_a_per_loop_lora_config_is_checked_when_built_as_a_looped_one_is():
    from looped_hf import LoopedConfig
    from looped_hf.configuration_looped import LoopedConfigError
    from looped_hf.loop_lora_looped import LoopLoRAConfig

    for cls in (LoopedConfig, LoopLoRAConfig):  # the subclass used to skip every validate_* rule at construction
        with pytest.raises(LoopedConfigError, match=rf"^{cls.__name__}.num_attention_heads=3: does not divide"):
            cls(hidden_size=64, num_attention_heads=3)
        with pytest.raises(LoopedConfigError, match=rf"^{cls.__name__}.num_recurrences=0: must be an integer >= 1$"):
            cls(num_recurrences=0)
    config = LoopLoRAConfig(loop_lora_rank=4, loop_lora_targets=["mlp.up_proj"])
    config.loop_lora_rank = -1  # not a field: checked by validate(), which save_pretrained runs
    with pytest.raises(LoopedConfigError, match=r"^LoopLoRAConfig.loop_lora_rank=-1: must be an integer >= 1$"):
        config.validate()


# --------------------------------------------------------------------------------------------
# Foreign folders a run reads: the distill_from teacher and init_from. Refused before output_dir
# is written (no recipe.yaml left behind), one line, exit 2.
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def student_and_teacher(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny looped student and a 2-layer Llama teacher, both on the bytes tokenizer's 258 ids."""
    from test_retrofit_train import _llama_parent

    from looped_hf import LoopedConfig, LoopedForCausalLM
    from looped_hf.data import load_tokenizer

    base = tmp_path_factory.mktemp("distill")
    torch.manual_seed(0)
    LoopedForCausalLM(LoopedConfig(vocab_size=258, hidden_size=32, num_attention_heads=2, head_dim=16,
                                   intermediate_size=64, num_prelude_layers=1, num_recurrent_layers=1,
                                   num_coda_layers=1, num_recurrences=2)).save_pretrained(base / "student")  # fmt: skip
    load_tokenizer("bytes").save_pretrained(base / "student")
    return base / "student", _llama_parent(base / "teacher", num_layers=2, seed=1)


def _encoder(kind: str):
    """Replace the folder by a BERT of the same vocabulary, saved as ``kind``."""

    def edit(folder: Path) -> None:
        import transformers
        from transformers import BertConfig

        shutil.rmtree(folder)
        config = BertConfig(vocab_size=258, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64)  # fmt: skip
        getattr(transformers, kind)(config).save_pretrained(folder)

    return edit


def _bare_llama(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaModel

    config = json.loads((folder / "config.json").read_text())
    shutil.rmtree(folder)
    LlamaModel(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})).save_pretrained(folder)


def _sharded_with_a_key_twice(folder: Path) -> None:
    from test_convert_loader import shard

    shard(folder)
    _key_in_both_shards("lm_head.weight")(folder)


HOSTILE_TEACHERS = {  # case: (edit of the teacher copy, what the one line says)
    "a BERT folder": (_encoder("BertForMaskedLM"), "architectures=['BertForMaskedLM']: not a causal LM"),
    "a BERT saved as its LM head, not a decoder": (_encoder("BertLMHeadModel"),
                                                   "model_type='bert' with is_decoder=False: a bidirectional encoder"),
    "a bare LlamaModel": (_bare_llama, "architectures=['LlamaModel']: not a causal LM (the folder must hold a "
                                       "LlamaForCausalLM"),
    "a tensor missing": (_edit_weights(lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
                         "'model.layers.1.mlp.down_proj.weight' is in no weight file"),
    "a config that drops a layer": (_set_json("config.json", num_hidden_layers=1),
                                    "config.json num_hidden_layers=1: the weight files hold 2 layers"),
    "an absurd layer count": (_set_json("config.json", num_hidden_layers=10**12),
                              "num_hidden_layers=1000000000000: the weight files hold 2 layers"),
    "a key in two shards": (_sharded_with_a_key_twice, "tensor 'lm_head.weight' is stored twice"),
    "int8 weights": (_edit_weights(lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})),
                     "has dtype I8 in model.safetensors: weights must be floating point"),
    "a shape the config changed": (_set_json("config.json", intermediate_size=96),
                                   "'model.layers.0.mlp.gate_proj.weight' has shape [64, 32] in model.safetensors, "
                                   "the config makes [96, 32]"),
    "another vocabulary": (_set_json("config.json", vocab_size=300), "'model.embed_tokens.weight' has shape"),
    "tied, with a head of its own": (_set_json("config.json", tie_word_embeddings=True),
                                     "tie_word_embeddings=True, but lm_head.weight differs from model.embed_tokens.weight"),
    "generation temperature hot": (_write("generation_config.json", '{"temperature": "hot"}'),
                                   "generation_config.json temperature='hot': expected a finite number > 0"),
    "rope linear factor 0": (_set_json("config.json", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 0}),
                             "rope_parameters.factor=0: expected a number > 0"),
}  # fmt: skip


def _train_refused(recipe: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    from looped_hf.train import main as train_main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert train_main([str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("looped-hf train: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(text in lines[0] for text in expected), lines[0]
    assert not Path(recipe["output_dir"]).exists()  # refused before anything is written: no recipe.yaml
    return lines[0]


def _student_recipe(small_corpus: Path, data_cache: Path, tmp_path: Path, student: Path, **changes) -> dict:
    from conftest import tiny_recipe_in

    recipe = tiny_recipe_in(small_corpus, data_cache, tmp_path / "run")
    for key in ("hidden_size", "head_dim", "num_prelude_layers", "num_recurrent_layers", "num_coda_layers"):
        recipe.pop(key)
    return {**recipe, "init_from": str(student), "max_steps": 1, **changes}


@pytest.mark.parametrize("case", list(HOSTILE_TEACHERS))
def test_a_hostile_distillation_teacher_is_refused_before_the_run_writes_anything(
    case, student_and_teacher, small_corpus, data_cache, tmp_path, capsys
):
    student, teacher = student_and_teacher
    edit, message = HOSTILE_TEACHERS[case]
    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    edit(copy)
    recipe = _student_recipe(small_corpus, data_cache, tmp_path, student, distill_from=str(copy))
    _train_refused(recipe, tmp_path, capsys, f"distill_from={str(copy)!r}", message)


def test_a_looped_teachers_flops_are_counted_at_the_r_it_runs(student_and_teacher):
    from looped_hf.model_types import load_causal_lm
    from looped_hf.train import teacher_flops

    student, _ = student_and_teacher
    config = load_causal_lm(student).config
    at_r = teacher_flops(str(student), config, 32)  # the teacher runs at its own num_recurrences = 2
    with torch.device("meta"):
        from looped_hf import LoopedForCausalLM

        model = LoopedForCausalLM(config)
    assert at_r == model.inference_flops_per_token(32, 2) > model.inference_flops_per_token(32, 1)


@pytest.mark.parametrize(("edit", "message"), [
    (_edit_weights(lambda t: t.update({k: v.to(torch.int8) for k, v in t.items()})), "has dtype I8 in model.safetensors"),
    (_edit_weights(lambda t: t.pop("model.norm.weight")), "'model.norm.weight' is in no weight file"),
    (_set_json("config.json", num_coda_layers=0), "'model.coda_layers.0.input_layernorm.weight' (and 7 more) is not a weight"),
])  # fmt: skip
def test_an_init_from_folder_whose_weights_are_not_its_model_leaves_nothing_behind(
    edit, message, student_and_teacher, small_corpus, data_cache, tmp_path, capsys
):
    student, _ = student_and_teacher
    copy = tmp_path / "student"
    shutil.copytree(student, copy)
    edit(copy)
    recipe = _student_recipe(small_corpus, data_cache, tmp_path, copy)
    _train_refused(recipe, tmp_path, capsys, f"init_from={str(copy)!r}: its weights do not load", message)


def test_a_frozen_backbone_without_an_adapter_from_init_from_leaves_nothing_behind(
    student_and_teacher, small_corpus, data_cache, tmp_path, capsys
):
    """freeze_backbone on an init_from model whose injection has no weights: refused on the meta
    device, before output_dir is written (train() also removes a run folder it made, should a recipe
    error come only after it)."""
    student, _ = student_and_teacher
    copy = tmp_path / "student"
    shutil.copytree(student, copy)
    _set_json("config.json", input_injection="add", state_init="zeros")(copy)
    _edit_weights(lambda t: t.pop("model.injection.weight"))(copy)
    recipe = _student_recipe(small_corpus, data_cache, tmp_path, copy, freeze_backbone=True)
    _train_refused(recipe, tmp_path, capsys, "freeze_backbone=True: input_injection='add' has no adapter weights")


@pytest.mark.parametrize("drop", ["loop_lora_rank", "loop_lora_targets"])
def test_serve_dry_run_on_a_loop_lora_config_missing_a_field_is_one_line(loop_lora_folder, tmp_path, capsys, drop):
    folder = tmp_path / "rrt"
    shutil.copytree(loop_lora_folder, folder)
    _set_json("config.json", drop=(drop,))(folder)
    _refused_in_one_line(["serve", str(folder), "--dry-run"], capsys, "looped-hf serve: ", f"LoopLoRAConfig.{drop}")


@pytest.mark.parametrize("state_init", ["zeros", "noise", "truncated_normal", "like_init"])
def test_a_loop_that_would_never_read_its_input_is_refused_in_one_line(state_init: str) -> None:
    # With no injection, h_0 must be the prelude's output: a zero or random h_0 leaves the tokens
    # unread, and such a model trains to the uniform distribution (a whole probe sweep once did).
    from looped_hf import LoopedConfig

    with pytest.raises(ValueError) as err:
        LoopedConfig(input_injection="none", state_init=state_init)
    message = str(err.value)
    assert message.startswith(f"LoopedConfig.state_init={state_init!r}: with input_injection='none'") and "\n" not in message
    LoopedConfig(input_injection="none", state_init="prelude")  # the plain decoder / whole-stack loop
