"""Atomic file output: a reader (or a kill) sees the old file or the new one, never half of one.

Imports only the standard library (and PyYAML on use), so torch-free modules such as
``looped_hf.scaling`` can share it.
"""

from __future__ import annotations

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
