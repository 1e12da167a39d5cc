"""`looped-hf fit` and `looped-hf plan` refuse bad input with one line naming the file, the field
and the value, and exit status 2: never a traceback, and never after the work is done."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from looped_hf.planner.cli import main as plan_main
from looped_hf.scaling import ScalingLawFit, fit_scaling_law
from looped_hf.scaling.cli import main as fit_main
from looped_hf.scaling.synthetic import study_runs

REPO = Path(__file__).resolve().parents[1]
DEMO_FIT = REPO / "model_cards" / "iso_depth_tiny" / "fit.json"
TINY = REPO / "recipes" / "iso_depth_tiny.yaml"
BUDGETS = (4.64e17, 1.0e18)


def _rows() -> list[dict]:
    return study_runs(seed=0, budgets=BUDGETS)


def _write(path: Path, rows: list) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _fit_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert fit_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _plan_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    return _write(tmp_path / "results.jsonl", _rows())


def test_fit_out_is_checked_before_the_fit(results: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    import looped_hf.scaling.cli as cli

    def no_fit(*args, **kwargs):  # the check must come first: reaching the fit is a failure
        raise AssertionError("the fit started before --out was checked")

    monkeypatch.setattr(cli, "fit_scaling_law", no_fit)
    err = _fit_fails([str(results), "--out", str(tmp_path)], capsys)
    assert f"--out {tmp_path}: is a directory" in err
    err = _fit_fails([str(results), "--out", str(results / "fit.json")], capsys)
    assert f"{results} is a file, not a folder" in err
    err = _fit_fails([str(results), "--plots", str(results)], capsys)
    assert f"--plots {results}: is a file" in err
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert "is not writable" in _fit_fails([str(results), "--out", str(ro / "fit.json")], capsys)


def test_fit_of_runs_that_all_have_one_loss(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path / "r.jsonl", [{**r, "loss": 3.0} for r in _rows()])
    err = _fit_fails([str(path)], capsys)
    assert f"{path}: column 'loss': all" in err and "same loss (3)" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "7"])
def test_fix_phi_must_be_finite_and_in_the_box(results: Path, capsys, value: str) -> None:
    err = _fit_fails([str(results), f"--fix-phi={value}"], capsys)
    assert f"fix_phi={float(value)!r}: must be a finite number in the search box [-3, 3]" in err


def test_a_json_results_file_of_non_objects(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path / "r.json", [1, 2, 3])
    assert f"{path}: item 0: expected a JSON object, got int" in _fit_fails([str(path)], capsys)
    path = _write(tmp_path / "d.json", {"loss": 1})
    assert "expected a JSON list of run records, got dict" in _fit_fails([str(path)], capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    assert f"{bad}: not valid JSON" in _fit_fails([str(bad)], capsys)


def test_only_failed_runs_says_no_successful_runs(tmp_path: Path, capsys) -> None:
    rows = [{k: v for k, v in r.items() if k != "loss"} | {"status": "failed"} for r in _rows()]
    path = _write(tmp_path / "r.jsonl", rows)
    err = _fit_fails([str(path)], capsys)
    assert f"{path}: no successful runs: all {len(rows)} record(s) have a status other than 'ok'" in err


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("num_recurrences", 2.5, "column 'num_recurrences' must be an integer >= 1, got 2.5"),
        ("num_recurrences", 0, "column 'num_recurrences' must be an integer >= 1, got 0"),
        ("tokens", 1e308, "column 'tokens' is 1e+308; counts above 1e+18"),
        ("n_rec", 1e30, "column 'n_rec' is 1e+30; counts above 1e+18"),
    ],
)
def test_run_counts_are_integers_and_sane(tmp_path: Path, capsys, column: str, value: float, message: str) -> None:
    rows = _rows()
    looped = next(i for i, r in enumerate(rows) if r["num_recurrences"] > 1)
    rows[looped][column] = value
    path = _write(tmp_path / "r.jsonl", rows)
    assert f"{path}: line {looped + 1}: {message}" in _fit_fails([str(path)], capsys)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"format": "looped_hf.scaling/1"}], "not a looped_hf scaling fit: expected a JSON object, got list"),
        ({"format": "looped_hf.scaling/1"}, "not a looped_hf scaling fit: field 'params' is missing"),
        ({"format": "other"}, "not a looped_hf scaling fit (format 'other')"),
        ("{", "not valid JSON"),
    ],
)
def test_plan_of_a_broken_fit_file(tmp_path: Path, capsys, content, message: str) -> None:
    path = tmp_path / "fit.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    err = _plan_fails([str(path), "--budget", "1e12", "--recipe", str(TINY)], capsys)
    assert f"{path}: {message}" in err


def test_plan_resamples_must_be_non_negative(capsys) -> None:
    err = _plan_fails([str(DEMO_FIT), "--budget", "1.2e11", "--recipe", str(TINY), "--resamples", "-3"], capsys)
    assert "resamples=-3: must be an integer >= 0" in err


def test_publish_fit_of_a_json_list_is_refused(tmp_path: Path) -> None:
    from looped_hf.publish import PublishError, _load_fit

    path = tmp_path / "fit.json"
    path.write_text("[1, 2]")
    with pytest.raises(PublishError, match="expected a JSON object, got list"):
        _load_fit(path)


def test_a_good_fit_still_round_trips(tmp_path: Path) -> None:
    fit = fit_scaling_law(_rows(), checks=False)
    assert ScalingLawFit.from_json(fit.to_json()).params == fit.params
    assert ScalingLawFit.from_json(DEMO_FIT).params["phi"] == pytest.approx(1.022, abs=1e-3)


def test_one_reader_of_run_records(tmp_path: Path) -> None:
    # eval, publish, test-time and the sweep read run_record.json through fileio.read_run_record.
    import ast

    from looped_hf.fileio import RECORD_NAME, read_run_record

    assert read_run_record(tmp_path) is None
    (tmp_path / RECORD_NAME).write_text('{"status": "ok", "loss": 3.1}')
    assert read_run_record(tmp_path) == {"status": "ok", "loss": 3.1}
    (tmp_path / RECORD_NAME).write_text("[1]")
    with pytest.raises(ValueError, match=rf"{RECORD_NAME}: expected a JSON object, got list"):
        read_run_record(tmp_path)
    (tmp_path / RECORD_NAME).write_bytes(b'{"status": "o')
    with pytest.raises(ValueError, match=rf"{RECORD_NAME}: not valid JSON"):
        read_run_record(tmp_path)
    # No other function reads the record and parses it itself (json.loads of a read_text beside RECORD_NAME).
    for path in (REPO / "looped_hf").rglob("*.py"):
        if path.name == "fileio.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                body = ast.unparse(node)
                reads = "RECORD_NAME" in body and "json.loads" in body and "read_text" in body
                assert not reads, f"{path}: {node.name} parses {RECORD_NAME} itself"
