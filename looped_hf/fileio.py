"""Atomic file output: a reader (or a kill) sees the old file or the new one, never half of one.

Imports only the standard library (and PyYAML on use), so torch-free modules such as
``looped_hf.scaling`` can share it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, fsync it, then ``os.replace`` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str, allow_nan=True))


def write_yaml_atomic(path: str | os.PathLike, obj: Any) -> None:
    import yaml

    write_text_atomic(path, yaml.safe_dump(obj, sort_keys=False))


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out``; an old ``out`` is removed only after the move."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


#: Files of a run directory that training writes and several modules read (this module imports
#: no torch, so the light commands can name them too).
RECORD_NAME = "run_record.json"
WEIGHTS_NAME = "model.safetensors"


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the file ``path``; one that is not UTF-8 JSON is a ValueError naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({getattr(err, 'msg', err)})") from None


def read_run_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run record of ``run_dir`` (None when it has none), the one reader of ``RECORD_NAME``:
    a record that is not a JSON object is a ValueError naming the file."""
    path = Path(run_dir) / RECORD_NAME
    if not path.is_file():
        return None
    record = read_json(path)
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(record).__name__}")
    return record


def sha256_file(path: str | os.PathLike) -> str:
    """The file's SHA-256, hex (cards, curves and conversions record which checkpoint they describe).
    Read in 1 MiB chunks: checkpoints can be many GB."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_sha256(directory: str | os.PathLike) -> str | None:
    """sha256 of a checkpoint folder's single-file weights, or None where it has none (sharded, or
    not local): what results saved beside a checkpoint are tied to, so stale ones are ignored."""
    path = Path(directory) / WEIGHTS_NAME
    return sha256_file(path) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# JSONL records (a sweep's results.jsonl, a run's own results_file): atomic appends, tolerant reads
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `<path>.lock` (a separate file, so the data file can be replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Records of complete, valid lines, and the byte length of the valid prefix."""
    records, valid = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a torn last line (killed mid-write): ignored, repaired on the next append
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        valid += len(line)
    return records, valid


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file; a truncated or corrupt tail is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    return _parse_lines(path.read_bytes())[0]


def append_jsonl(path: str | os.PathLike, record: dict[str, Any], unique_key: str | None = "run_id") -> bool:
    """Append `record` as one line: one `write` of the whole line, flush, fsync, under a file lock.

    A torn tail left by a killed writer is cut off first. With `unique_key`, a record whose key
    is already in the file is not appended again (returns False), so every run appears once even
    if two writers (a rerun and a stale job) finish the same run.
    """
    path = Path(path)
    line = (json.dumps(record, default=str, allow_nan=True) + "\n").encode("utf-8")
    with _locked(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with open(fd, "rb", closefd=False) as fh:
                data = fh.read()
            records, valid = _parse_lines(data)
            if unique_key is not None and any(r.get(unique_key) == record.get(unique_key) for r in records):
                return False
            if valid != len(data):
                os.ftruncate(fd, valid)
            os.lseek(fd, 0, os.SEEK_END)
            written = os.write(fd, line)
            if written != len(line):  # practically never for a local file; do not leave half a line
                os.ftruncate(fd, valid)
                raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
    return True
