"""eval, publish and test-time on broken or foreign checkpoints and bad flags: one line, exit 2,
checked before the work (and the output path before the scoring)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_publish import make_run_dir

from looped_hf.cli import main as looped_hf
from looped_hf.evaluation import load_bundle
from looped_hf.evaluation.bundle import BundleError
from looped_hf.fileio import CheckpointError, check_checkpoint_dir, check_safetensors

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "eval_bundle"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runs") / "loop2-w32-b0")


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    dest = tmp_path / run_dir.name
    shutil.copytree(run_dir, dest)
    return dest


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "warning" not in line.lower()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _eval(*argv: str) -> int:
    return looped_hf(["eval", *argv])


def test_truncated_weights_are_named_by_eval_publish_and_test_time(run_dir, tmp_path, capsys):
    broken = _copy(run_dir, tmp_path)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        check_safetensors(weights)
    for argv in (["eval", str(broken), "--bundle", str(FIXTURE), "--device", "cpu"],
                 ["publish", str(broken), "--repo-id", "me/x", "--out", str(tmp_path / "pub")],
                 ["test-time", str(broken)]):  # fmt: skip
        assert looped_hf(argv) == 2
        line = _one_line(capsys)
        assert "model.safetensors" in line and "truncated" in line
    assert not (tmp_path / "pub").exists()


def test_garbage_weights_header_is_named(run_dir, tmp_path):
    broken = _copy(run_dir, tmp_path)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        check_checkpoint_dir(broken)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", None])
def test_a_folder_that_is_not_looped_is_refused(run_dir, tmp_path, capsys, model_type):
    foreign = _copy(run_dir, tmp_path)
    config = json.loads((foreign / "config.json").read_text())
    config["model_type"] = model_type
    (foreign / "config.json").write_text(json.dumps(config))
    for argv in (["eval", str(foreign), "--bundle", str(FIXTURE), "--device", "cpu"],
                 ["publish", str(foreign), "--repo-id", "me/x", "--out", str(tmp_path / "pub")],
                 ["test-time", str(foreign)]):  # fmt: skip
        assert looped_hf(argv) == 2
        assert f"model_type={model_type!r}" in _one_line(capsys)


def test_publish_of_a_config_with_zero_recurrences_is_one_line(run_dir, tmp_path, capsys):
    bad = _copy(run_dir, tmp_path)
    config = json.loads((bad / "config.json").read_text())
    config["num_recurrences"] = 0
    (bad / "config.json").write_text(json.dumps(config))
    assert looped_hf(["publish", str(bad), "--repo-id", "me/x", "--out", str(tmp_path / "pub")]) == 2
    assert "num_recurrences" in _one_line(capsys)
    assert not (tmp_path / "pub").exists() and not list(tmp_path.glob(".pub.tmp-*"))


def test_publish_onto_a_file_is_refused_and_overwrite_leaves_no_old_copy(run_dir, tmp_path, capsys):
    target = tmp_path / "pub"
    target.write_text("a file")
    assert looped_hf(["publish", str(run_dir), "--repo-id", "me/x", "--out", str(target), "--overwrite"]) == 2
    assert "is a file" in _one_line(capsys) and target.read_text() == "a file"
    assert looped_hf(["publish", str(run_dir), "--repo-id", "me/x", "--out", str(target / "sub")]) == 2
    assert f"cannot be written ({target} is a file, not a folder)" in _one_line(capsys)
    folder = tmp_path / "folder"
    for _ in range(2):
        assert looped_hf(["publish", str(run_dir), "--repo-id", "me/x", "--out", str(folder), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pub"]  # no .folder.old-PID


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_publish_to_a_read_only_folder_is_one_line(run_dir, tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert looped_hf(["publish", str(run_dir), "--repo-id", "me/x", "--out", str(locked / "pub")]) == 2
        assert "cannot be written" in _one_line(capsys)
    finally:
        locked.chmod(0o700)


def test_read_only_filesystem_error_is_one_line(run_dir, tmp_path, capsys, monkeypatch):
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert looped_hf(["publish", str(run_dir), "--repo-id", "me/x", "--out", str(tmp_path / "pub")]) == 2
    assert "Read-only file system" in _one_line(capsys)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--batch-tokens", "0"], "--batch-tokens='0'"),
        (["--batch-tokens", "-5"], "--batch-tokens='-5'"),
        (["--recurrences", "0"], "--recurrences='0'"),
        (["--max-per-task", "0"], "--max-per-task='0'"),
    ],
)
def test_bad_eval_counts_exit_2_naming_the_flag(run_dir, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        _eval(str(run_dir), "--bundle", str(FIXTURE), *flags)
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_eval_device_and_out_are_checked_before_loading(run_dir, tmp_path, capsys, monkeypatch):
    import looped_hf.evaluation.runner as runner

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint must not be loaded")

    monkeypatch.setattr(runner, "load_checkpoint", never)
    assert _eval(str(run_dir), "--bundle", str(FIXTURE), "--device", "tpu9") == 2
    assert "--device 'tpu9'" in _one_line(capsys)
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    assert _eval(str(run_dir), "--bundle", str(FIXTURE), "--device", "cpu", "--out", str(taken)) == 2
    assert f"--out {taken}: is a file, not a folder" in _one_line(capsys) and taken.read_text() == "{}"


def test_unknown_lm_eval_task_is_refused_before_loading(run_dir, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    import looped_hf.evaluation.runner as runner

    monkeypatch.setattr(runner, "load_checkpoint", lambda *a, **k: pytest.fail("loaded before the task check"))
    include = tmp_path / "tasks"
    include.mkdir()
    (include / "mine.yaml").write_text("task: mine\n")
    monkeypatch.setattr(
        "lm_eval.tasks.TaskManager.__init__", lambda self, *a, **k: setattr(self, "_all", ["mine", "arc_easy"])
    )
    monkeypatch.setattr("lm_eval.tasks.TaskManager.all_tasks", property(lambda self: self._all), raising=False)
    assert _eval(str(run_dir), "--lm-eval", "no_such_task", "--device", "cpu", "--out", str(tmp_path / "o")) == 2
    assert "--lm-eval no_such_task: not lm-eval task(s)" in _one_line(capsys)


def _bundle(tmp_path: Path, rows: list[dict], uri: str = "t.jsonl") -> Path:
    folder = tmp_path / "bundle"
    folder.mkdir(exist_ok=True)
    (folder / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bundle.yaml").write_text(
        f"tasks:\n  - label: t\n    task_type: multiple_choice\n    dataset_uri: {uri}\n"
    )
    return folder


@pytest.mark.parametrize("choices", [["a", None, "c"], [1, "b"], ["a", ""], ["  ", "b"]])
def test_bundle_choices_must_be_non_empty_strings(tmp_path, choices):
    rows = [{"query": "q", "choices": choices, "gold": 0}] * 3
    with pytest.raises(BundleError, match=r"line 1: field 'choices'\[\d\] = .*: expected a non-empty string"):
        load_bundle(_bundle(tmp_path, rows))


@pytest.mark.parametrize("uri", ["../../../etc/hostname", "/etc/hostname", "../outside.jsonl"])
def test_a_bundle_reads_only_files_inside_it(tmp_path, uri):
    (tmp_path / "outside.jsonl").write_text(json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n")
    with pytest.raises(BundleError, match=r"dataset_uri' = .*outside the bundle folder"):
        load_bundle(_bundle(tmp_path, [{"query": "q", "choices": ["a", "b"], "gold": 0}] * 3, uri))


def test_a_bundle_link_out_of_the_folder_is_refused(tmp_path):
    folder = _bundle(tmp_path, [{"query": "q", "choices": ["a", "b"], "gold": 0}] * 3, "link.jsonl")
    (folder / "link.jsonl").symlink_to(folder / "t.jsonl")
    assert load_bundle(folder).tasks[0].label == "t"  # a link inside the folder is fine
    (folder / "link.jsonl").unlink()
    (tmp_path / "secret.jsonl").write_text((folder / "t.jsonl").read_text())
    (folder / "link.jsonl").symlink_to(tmp_path / "secret.jsonl")
    with pytest.raises(BundleError, match="outside the bundle folder"):
        load_bundle(folder)


def test_the_dispatcher_turns_expected_errors_into_one_line_and_keeps_bug_tracebacks(monkeypatch, capsys):
    import looped_hf.recurrence_curves as curves

    def expected(argv):
        raise curves.TestTimeError("field x=1: bad\nsecond line")

    monkeypatch.setattr(curves, "main", expected)
    assert looped_hf(["test-time", "x"]) == 2
    assert capsys.readouterr().err == "looped-hf test-time: field x=1: bad\n"

    def bug(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(curves, "main", bug)
    with pytest.raises(KeyError):
        looped_hf(["test-time", "x"])


def test_recurrences_far_past_the_trained_r_warn_with_their_cost(capsys):
    from looped_hf.evaluation.cli import WARN_RECURRENCE_FACTOR, _warn_cost

    _warn_cost([1, 2, 4], trained=2)
    assert capsys.readouterr().err == ""
    _warn_cost([2, 64, 128], trained=2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[64, 128]" in err and f"over {WARN_RECURRENCE_FACTOR}x" in err and "~64x" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--max-factor", "0"], "--max-factor='0'"), (["--batch-size", "-5"], "--batch-size='-5'")],
)  # fmt: skip
def test_test_time_counts_exit_2(run_dir, capsys, flags, named):
    with pytest.raises(SystemExit) as exit_info:
        looped_hf(["test-time", str(run_dir), *flags])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def _last_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    """The one line of ``prefix`` on stderr (transformers' weight-loading bar shares it)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_test_time_max_factor_past_the_models_ceiling_is_refused_before_measuring(run_dir, capsys):
    """The one r ceiling is the config's (64 x the trained r = 2 here): a --max-factor past it is
    refused before its grid is built or any r measured."""
    assert looped_hf(["test-time", str(run_dir), "--max-factor", "10000"]) == 2
    line = _last_line(capsys, "looped-hf test-time:")
    assert "max_factor=10000" in line and "num_recurrences=20000" in line and "ceiling of 128" in line
    assert not (run_dir / "test_time_scaling.json").exists()


def test_test_time_compare_path_is_checked_before_measuring(run_dir, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert looped_hf(["test-time", str(run_dir), "--compare", str(taken / "c.png")]) == 2
    line = _one_line(capsys)
    assert f"--compare {taken / 'c.png'}: cannot be written ({taken} is a file" in line
    assert not (run_dir / "test_time_scaling.json").exists()


def test_eval_refuses_an_r_above_the_models_ceiling_before_scoring_any(run_dir, tmp_path, capsys, monkeypatch):
    """The model's own ceiling (config.max_recurrences) is checked for every r before the first is scored,
    so a typo in the largest r costs no scoring of the smaller ones."""
    import looped_hf.evaluation.runner as runner

    capped = _copy(run_dir, tmp_path)
    config = json.loads((capped / "config.json").read_text())
    config["max_recurrences"] = 4
    (capped / "config.json").write_text(json.dumps(config))
    scored = []
    monkeypatch.setattr(runner, "evaluate_model", lambda *a, **k: scored.append(a))
    assert _eval(str(capped), "--bundle", str(FIXTURE), "--device", "cpu", "--recurrences", "1", "8",
                 "--out", str(tmp_path / "ev")) == 2  # fmt: skip
    err = capsys.readouterr().err  # transformers' weight-loading bar shares stderr
    lines = [line for line in err.splitlines() if line.startswith("looped-hf eval:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "num_recurrences=8" in lines[0] and "ceiling of 4" in lines[0]
    assert not scored


def test_test_time_checks_every_run_before_measuring_the_first(run_dir, tmp_path, capsys):
    failed = make_run_dir(tmp_path / "failed-run", status="failed", loss=float("nan"))
    good = _copy(run_dir, tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    assert looped_hf(["test-time", str(good), str(failed)]) == 2
    line = _one_line(capsys)
    assert "failed-run/run_record.json: status='failed'" in line and "only finished runs" in line
    assert not (good / "test_time_scaling.json").exists()


# --- one owner for config overrides, one tokenizer-file list -----------------------------------------
def test_config_overrides_have_one_owner_that_checks_and_copies() -> None:
    """``model_types.with_overrides`` is how serve, ``engine_args`` and train's ``init_from`` change a
    loaded config: a copy built by the config's class (its rules run, derived fields follow), the
    original unchanged; a key that is no field is one line naming it (unless the caller reads it)."""
    from looped_hf.configuration_looped import LoopedConfig
    from looped_hf.model_types import with_overrides

    config = LoopedConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_prelude_layers=1,
                          num_recurrent_layers=2, num_coda_layers=1, num_recurrences=2)  # fmt: skip
    deeper = with_overrides(config, {"num_recurrences": 4})
    assert type(deeper) is LoopedConfig and config.num_recurrences == 2 and deeper.num_recurrences == 4
    assert deeper.num_hidden_layers == 1 + 2 * 4 + 1 != config.num_hidden_layers  # derived: follows
    with pytest.raises(ValueError, match=r"^kv_budgte=2: not a LoopedConfig field$"):
        with_overrides(config, {"kv_budgte": 2})
    with pytest.raises(ValueError, match=r"^max_recurences=8: not a LoopedConfig field \(nor max_num_recurrences\)$"):
        with_overrides(config, {"max_recurences": 8}, extra=("max_num_recurrences",))
    assert with_overrides(config, {"max_num_recurrences": 8}, extra=("max_num_recurrences",)).max_num_recurrences == 8
    with pytest.raises(ValueError, match="num_recurrences"):  # the class's own rule refuses the value
        with_overrides(config, {"num_recurrences": 0})
    assert config.num_recurrences == 2


def test_every_reader_of_a_folders_tokenizer_uses_the_one_list(tmp_path: Path) -> None:
    """publish, serve, eval and the converters read ``fileio.TOKENIZER_FILES``; a folder has a
    tokenizer when it holds one file that defines one (a BPE's merges.txt alone does not)."""
    from looped_hf import fileio
    from looped_hf.convert import loader

    assert loader.TOKENIZER_FILES is fileio.TOKENIZER_FILES
    assert set(fileio.TOKENIZER_DEFINING_FILES) < set(fileio.TOKENIZER_FILES)
    assert not fileio.has_tokenizer(tmp_path)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "special_tokens_map.json").write_text("{}")
    assert not fileio.has_tokenizer(tmp_path)
    for name in fileio.TOKENIZER_DEFINING_FILES:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("{}")
        assert fileio.has_tokenizer(folder), name
    for module in ("publish", "serving/cli", "evaluation/runner", "convert/loader"):
        source = (REPO / "looped_hf" / f"{module}.py").read_text()
        assert "tokenizer.json\"" not in source, f"{module} names tokenizer files itself"
