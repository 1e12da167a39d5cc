"""No record is ever lost by appending to a JSONL file: bad lines are moved aside, never truncated."""

from __future__ import annotations

import json

import pytest

from looped_hf.fileio import append_jsonl, corrupt_path, read_jsonl


def _write(path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def _records(n: int) -> list[bytes]:
    return [(json.dumps({"run_id": f"r{i}", "loss": float(i)}) + "\n").encode() for i in range(1, n + 1)]


BAD_LINES = {
    "garbage": b"this is not json\n",
    "invalid_utf8": b'{"run_id": "\xff\xfe"}\n',
    "not_an_object": b"[1, 2, 3]\n",
    "a_number": b"42\n",
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_bad_line_mid_file_keeps_every_other_record(tmp_path, kind):
    path = tmp_path / "results.jsonl"
    good = _records(4)
    _write(path, [good[0], BAD_LINES[kind], *good[1:]])
    with pytest.warns(UserWarning, match=r"results\.jsonl line 2"):
        assert [r["run_id"] for r in read_jsonl(path)] == ["r1", "r2", "r3", "r4"]
    with pytest.warns(UserWarning, match=r"line 2: not a JSON object .*moved to .*results\.jsonl\.corrupt"):
        assert append_jsonl(path, {"run_id": "new"})
    assert [r["run_id"] for r in read_jsonl(path)] == ["r1", "r2", "r3", "r4", "new"]
    assert corrupt_path(path).read_bytes() == BAD_LINES[kind]  # the bad line itself is kept too


def test_a_torn_last_line_is_repaired_and_kept_aside(tmp_path):
    path = tmp_path / "results.jsonl"
    good = _records(3)
    _write(path, [*good, b'{"run_id": "r4", "lo'])  # a writer killed mid-line
    assert [r["run_id"] for r in read_jsonl(path)] == ["r1", "r2", "r3"]
    assert append_jsonl(path, {"run_id": "r4", "loss": 4.0})
    assert path.read_bytes() == b"".join(good) + b'{"run_id": "r4", "loss": 4.0}\n'
    assert corrupt_path(path).read_bytes() == b'{"run_id": "r4", "lo\n'


def test_a_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"run_id": "a"}')  # hand-edited: a record, only its newline missing
    assert append_jsonl(path, {"run_id": "b"})
    assert [r["run_id"] for r in read_jsonl(path)] == ["a", "b"]
    assert not corrupt_path(path).exists()


def test_a_duplicate_after_a_bad_line_is_still_seen(tmp_path):
    path = tmp_path / "results.jsonl"
    good = _records(3)
    _write(path, [good[0], BAD_LINES["garbage"], *good[1:]])
    assert not append_jsonl(path, {"run_id": "r3"})  # r3 is after the bad line, and still counts
    assert path.read_bytes() == b"".join([good[0], BAD_LINES["garbage"], *good[1:]])  # untouched


def test_the_issue_repro_keeps_records_one_to_four(tmp_path):
    path = tmp_path / "results.jsonl"
    good = _records(4)
    _write(path, [good[0], b"garbage\n", *good[1:]])
    with pytest.warns(UserWarning):
        append_jsonl(path, {"run_id": "new"})
    assert [r["run_id"] for r in read_jsonl(path)] == ["r1", "r2", "r3", "r4", "new"]


def test_blank_lines_are_not_corrupt(tmp_path):
    path = tmp_path / "results.jsonl"
    _write(path, [_records(1)[0], b"\n", _records(2)[1]])
    assert append_jsonl(path, {"run_id": "x"})
    assert [r["run_id"] for r in read_jsonl(path)] == ["r1", "r2", "x"]
    assert not corrupt_path(path).exists()


# ---------------------------------------------------------------------------------------------
# The one finished-run check and the umask of folders built aside
# ---------------------------------------------------------------------------------------------
def test_check_finished_run_names_the_file_and_the_status(tmp_path):
    from looped_hf.fileio import RunDirError, check_finished_run, is_finished

    assert check_finished_run(tmp_path, required=False) is None  # a published folder: no record
    with pytest.raises(RunDirError, match=r": not a finished run directory \(no run_record.json\)$"):
        check_finished_run(tmp_path)
    (tmp_path / "run_record.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    with pytest.raises(RunDirError, match=r"run_record.json: status='failed' \(error: 'boom'\); only finished runs"):
        check_finished_run(tmp_path, required=False)
    (tmp_path / "run_record.json").write_text("[1]")
    with pytest.raises(RunDirError, match="expected a JSON object, got list"):
        check_finished_run(tmp_path)
    (tmp_path / "run_record.json").write_text(json.dumps({"status": "ok", "loss": 3.0}))
    assert check_finished_run(tmp_path) == {"status": "ok", "loss": 3.0}
    assert is_finished({"status": "ok"}) and not is_finished({"status": "diverged"}) and not is_finished(None)


def test_a_folder_built_aside_gets_the_umask_not_mkdtemps_0700(tmp_path):
    import os
    import stat

    from looped_hf.fileio import follow_umask, make_temp_dir

    old = os.umask(0o027)
    try:
        tmp = make_temp_dir(tmp_path / "card")
        assert tmp.parent == tmp_path and tmp.name.startswith(".card.tmp-")
        assert stat.S_IMODE(tmp.stat().st_mode) == 0o750
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "w.safetensors").write_bytes(b"x")
        (tmp / "sub" / "w.safetensors").chmod(0o600)
        follow_umask(tmp)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp / "sub").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp / "sub" / "w.safetensors").stat().st_mode) == 0o640
