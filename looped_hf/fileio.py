"""Atomic file output: a reader (or a kill) sees the old file or the new one, never half of one.

Imports only the standard library (PyYAML and filelock on use), so torch-free modules such as
``looped_hf.scaling`` can share it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, NamedTuple

#: The files a transformers tokenizer is saved as: the one list every reader of a folder uses (publish,
#: serve and eval need a tokenizer, ``has_tokenizer``; a converter checks and copies each the source has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")  # fmt: skip
#: Those that describe a tokenizer only beside one of the others (a BPE's merges need its vocabulary).
_TOKENIZER_COMPANIONS = frozenset(
    {"merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja"}
)
#: The ones a folder needs one of to have a tokenizer, in ``TOKENIZER_FILES``' order (for messages).
TOKENIZER_DEFINING_FILES = tuple(name for name in TOKENIZER_FILES if name not in _TOKENIZER_COMPANIONS)


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a tokenizer: one of ``TOKENIZER_DEFINING_FILES``."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_DEFINING_FILES)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, fsync it, then ``os.replace`` it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) atomically: a reader sees the old file or the new one."""
    write_bytes_atomic(path, text.encode("utf-8"))


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
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file or a link where the folder goes: rmtree would leave it behind as .old-PID
            old.unlink(missing_ok=True)


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
    """An exclusive lock on `<path>.lock` (a separate file, so the data file can be replaced),
    waiting for it: `filelock` (flock on POSIX, msvcrt on Windows; the OS drops it if the holder
    dies)."""
    from filelock import FileLock  # on use: the light commands that never append skip its import

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path.with_name(path.name + ".lock")):
        yield


class _Parsed(NamedTuple):
    """A JSONL file split into its records and the lines that are not records."""

    records: list[dict[str, Any]]
    #: (1-based line number, raw bytes) of each complete line that is not a JSON object.
    bad: list[tuple[int, bytes]]
    #: A last line without its newline that is not a JSON object: a writer killed mid-line.
    torn: bytes


def _parse_one(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)  # bytes: invalid UTF-8 raises UnicodeDecodeError, a ValueError
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _parse_lines(data: bytes) -> _Parsed:
    """Every record of the file, wherever a bad line sits: a bad line costs itself, never the
    records after it (stopping there once made an append truncate every later record)."""
    records: list[dict[str, Any]] = []
    bad: list[tuple[int, bytes]] = []
    torn = b""
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.strip():
            continue  # a blank line holds nothing
        record = _parse_one(line)
        if record is not None:
            records.append(record)
        elif not line.endswith(b"\n"):
            torn = line  # only the last line can lack its newline
        else:
            bad.append((number, line))
    return _Parsed(records, bad, torn)


def corrupt_path(path: str | os.PathLike) -> Path:
    """Where `append_jsonl` moves the lines of `path` that are not records (`results.jsonl.corrupt`)."""
    path = Path(path)
    return path.with_name(path.name + ".corrupt")


def _describe(line: bytes) -> str:
    shown = line.rstrip(b"\r\n")[:40].decode("utf-8", errors="replace")
    return repr(shown) + ("..." if len(line.rstrip(b"\r\n")) > 40 else "")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records (JSON objects, one a line) of a JSONL file. A line that is not one (garbage,
    invalid UTF-8, a list) is skipped with a warning naming the file and the line; a torn last line
    (a writer killed mid-line) is skipped silently, as the next append repairs it."""
    path = Path(path)
    if not path.exists():
        return []
    parsed = _parse_lines(path.read_bytes())
    for number, line in parsed.bad:
        warnings.warn(f"{path} line {number}: not a JSON object ({_describe(line)}); skipped", stacklevel=2)
    return parsed.records


def append_jsonl(path: str | os.PathLike, record: dict[str, Any], unique_key: str | None = "run_id") -> bool:
    """Append `record` as one line: one `write` of the whole line, flush, fsync, under a file lock.

    Nothing that was in the file is lost. A line that is not a record (garbage, invalid UTF-8, a
    JSON list) and a torn last line left by a killed writer are moved, byte for byte, to
    `corrupt_path(path)` with a warning naming the line, and the file is rewritten atomically
    without them; every record stays. With `unique_key`, a record whose key is already in the file
    is not appended again (returns False), so every run appears once even if two writers (a rerun
    and a stale job) finish the same run.
    """
    path = Path(path)
    line = (json.dumps(record, default=str, allow_nan=True) + "\n").encode("utf-8")
    with _locked(path):
        data = path.read_bytes() if path.exists() else b""
        parsed = _parse_lines(data)
        if unique_key is not None and any(
            r.get(unique_key) == record.get(unique_key) for r in parsed.records
        ):
            return False
        if parsed.bad or parsed.torn:
            data = _move_aside(path, data, parsed)
        elif data and not data.endswith(b"\n"):
            data += b"\n"  # a complete record without its newline (an edited file): keep it, end it
            write_bytes_atomic(path, data)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            written = os.write(fd, line)
            if written != len(line):  # practically never for a local file; do not leave half a line
                os.ftruncate(fd, len(data))
                raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


def _move_aside(path: Path, data: bytes, parsed: _Parsed) -> bytes:
    """Append the bad lines (and a torn tail) to the corrupt file, then rewrite `path` atomically
    without them: the side file is written first, so a kill between the two loses nothing."""
    aside = corrupt_path(path)
    moved = [line for _, line in parsed.bad] + ([parsed.torn + b"\n"] if parsed.torn else [])
    with open(aside, "ab") as fh:
        fh.write(b"".join(moved))
        fh.flush()
        os.fsync(fh.fileno())
    for number, line in parsed.bad:
        warnings.warn(f"{path} line {number}: not a JSON object ({_describe(line)}); moved to {aside}",
                      stacklevel=3)  # fmt: skip
    bad = {number for number, _ in parsed.bad}
    kept = [
        line
        for number, line in enumerate(data.splitlines(keepends=True), start=1)
        if number not in bad and line.endswith(b"\n")
    ]
    new = b"".join(kept)
    write_bytes_atomic(path, new)
    return new


# ---------------------------------------------------------------------------------------------
# YAML: the safe loader, with duplicate keys refused and aliases bounded
# ---------------------------------------------------------------------------------------------
#: The most nodes a YAML document may hold once its aliases are expanded. A recipe has a few
#: hundred; a "billion laughs" document (aliases of aliases) has 10^9 and would hang any walk of
#: the loaded value, so it is refused from its node graph, before anything is expanded.
YAML_MAX_NODES = 100_000


def _expanded_size(root: Any, limit: int) -> int:
    """Nodes of the document with every alias expanded, counted over the (shared) node graph with
    memoisation, so a bomb costs its own size to measure; raises on a recursive alias or past `limit`."""
    import yaml

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise yaml.constructor.ConstructorError(
                None, None, "a recursive alias (an anchor used inside itself) is not allowed", node.start_mark
            )
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        active.discard(key)
        if total > limit:
            raise yaml.constructor.ConstructorError(
                None, None, f"the document expands past {limit} values (aliases of aliases?); refused",
                node.start_mark,
            )  # fmt: skip
        sizes[key] = total
        return total

    return size(root)


@functools.cache
def _bounded_loader() -> type:
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        """`yaml.SafeLoader` that refuses a duplicate key (the last would silently win) and a
        document whose aliases expand past `YAML_MAX_NODES`."""

        def get_single_node(self):  # type: ignore[no-untyped-def]
            node = super().get_single_node()
            if node is not None:
                _expanded_size(node, YAML_MAX_NODES)
            return node

        def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *base` then a key of base: an override, as YAML means it
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node.start_mark.line + 1)
                    except TypeError:
                        continue  # an unhashable key: the base class names that error
                    if first != key_node.start_mark.line + 1:
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping", node.start_mark,
                            f"duplicate key {key!r} (first given on line {first})", key_node.start_mark,
                        )  # fmt: skip
            return super().construct_mapping(node, deep=deep)

    return BoundedSafeLoader


def yaml_load(text: str | bytes) -> Any:
    """`yaml.safe_load` with duplicate keys refused and aliases bounded (raises `yaml.YAMLError`)."""
    import yaml

    return yaml.load(text, Loader=_bounded_loader())  # noqa: S506 - a SafeLoader subclass


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (stripped), or its class name when the message is
    empty: how an error from a library is quoted in a one-line refusal."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


# ---------------------------------------------------------------------------------------------
# A checkpoint folder, checked before torch reads it
# ---------------------------------------------------------------------------------------------
class CheckpointError(ValueError):
    """A checkpoint folder that cannot be a looped model: the message names the file and what is wrong."""


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``: anything else (unreadable, not UTF-8 JSON, a list) is a
    `CheckpointError` naming the file (checkpoint folders and the converters' sources read so)."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as err:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{path}: not a readable JSON file ({first_line(err)})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


#: safetensors' own bound on a header (MAX_HEADER_SIZE in the safetensors crate).
SAFETENSORS_MAX_HEADER = 100_000_000


def check_safetensors(path: str | os.PathLike) -> None:
    """A safetensors file whose header parses and whose tensors all lie inside the file.

    The format is an 8-byte little-endian header length, a JSON header mapping each tensor to its
    `data_offsets` in the byte buffer after the header, then that buffer: a file cut short (a copy
    or download stopped midway) is found from the header and the file's size, without reading the
    tensors."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{path}: truncated ({size} bytes; a safetensors file starts with an 8-byte header length)"
            )
        length = int.from_bytes(head, "little")
        if length > SAFETENSORS_MAX_HEADER:  # read before the size check: a huge file must not be read whole
            raise CheckpointError(f"{path}: not safetensors (a header of {length} bytes, above the format's "
                                  f"{SAFETENSORS_MAX_HEADER})")  # fmt: skip
        if length > size - 8:
            raise CheckpointError(
                f"{path}: truncated or not safetensors (header of {length} bytes in a file of {size})"
            )
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    need = 8 + length + max(ends, default=0)
    if need > size:
        raise CheckpointError(f"{path}: truncated: its header needs {need} bytes, the file has {size}")


#: The ``model_type`` of every checkpoint looped_hf writes and reads: ``LoopedConfig``'s and the per-loop
#: LoRA retrofit's (``retrofit/loop_lora.py``). The classes of each are ``looped_hf.model_types``'s.
LOOPED_MODEL_TYPES = ("looped", "looped_loop_lora")


def check_model_type(config: dict[str, Any], where: str | os.PathLike) -> str:
    """The ``model_type`` of a checkpoint's config.json, one of ``LOOPED_MODEL_TYPES``; any other is
    a `CheckpointError` naming ``where`` and the value (a gpt2 or llama folder would otherwise load
    with the Auto classes, or be read as looped), and a config.json without one."""
    model_type = config.get("model_type")
    if model_type not in LOOPED_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type={model_type!r}; only "
                              f"{' or '.join(map(repr, LOOPED_MODEL_TYPES))} checkpoints are read here")  # fmt: skip
    return model_type


def check_checkpoint_dir(folder: str | os.PathLike) -> dict[str, Any]:
    """Check a local checkpoint folder before loading it; returns its config.json.

    Refuses, naming the file: a missing or unreadable config.json, one whose `model_type` is not a
    looped one (`check_model_type`), and a single-file `model.safetensors` that is truncated or
    corrupt."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (not a checkpoint folder)")
    config = read_json_object(config_path)
    check_model_type(config, config_path)
    weights = folder / WEIGHTS_NAME
    if weights.is_file():
        check_safetensors(weights)
    return config


# ---------------------------------------------------------------------------------------------
# A finished run: the one reading of a run record's status
# ---------------------------------------------------------------------------------------------
class RunDirError(ValueError):
    """A folder that is not a finished run: the message names the file and the value."""


def is_finished(record: dict[str, Any] | None) -> bool:
    """Whether a run record is a finished, successful run (``status: ok``): only those have weights
    and a held-out loss. A sweep's failed, diverged or stopped runs have another status."""
    return isinstance(record, dict) and record.get("status") == "ok"


def check_finished_run(run_dir: str | os.PathLike, *, required: bool = True) -> dict[str, Any] | None:
    """The run record of a finished run directory, the one check of "only finished runs".

    A record that is not a JSON object, or whose ``status`` is not ``ok``, is a `RunDirError`
    naming the file and the status. A folder without a record is refused when ``required``, else
    None (a published folder or a converted checkpoint has weights but no record)."""
    path = Path(run_dir) / RECORD_NAME
    try:
        record = read_run_record(run_dir)
    except ValueError as err:
        raise RunDirError(str(err)) from None
    if record is None:
        if required:
            raise RunDirError(f"{run_dir}: not a finished run directory (no {RECORD_NAME})")
        return None
    if not is_finished(record):
        error = f" (error: {record.get('error')!r})" if record.get("error") else ""
        raise RunDirError(
            f"{path}: status={record.get('status')!r}{error}; only finished runs (status 'ok') have a checkpoint"
        )
    return record


# ---------------------------------------------------------------------------------------------
# An output path, checked before the work whose results it receives
# ---------------------------------------------------------------------------------------------
class OutputPathError(ValueError):
    """An output path that cannot be written: the message names the option and the path."""


def _named(flag: str, path: Path) -> str:
    """``--out PATH`` for a command-line flag, ``field='PATH'`` for a recipe field."""
    return f"{flag} {path}" if flag.startswith("-") else f"{flag}={str(path)!r}"


def _probe(target: Path, name: str) -> None:
    """Make the missing folders up to ``target`` and a file in it, then remove all of them again."""
    made: list[Path] = []
    try:
        for folder in reversed([target, *target.parents]):
            if not folder.exists():
                try:
                    folder.mkdir()
                except FileExistsError:  # made meanwhile by another process: not ours to remove
                    continue
                made.append(folder)
        fd, probe = tempfile.mkstemp(prefix=f".{name}.probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    finally:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()


def check_output_path(path: str | os.PathLike, flag: str, *, directory: bool = False) -> Path:
    """Refuse an output path that cannot be written, before any work is done; returns it as a Path.

    ``directory``: the path is a folder the command writes into (else a file it writes). Refused,
    as an `OutputPathError` naming ``flag`` and the path: a file where a folder is meant or the
    reverse, a parent that is a file, and a place where nothing can be made. The last is found by
    trying: the missing folders are made and a probe file written in the folder that will receive
    the output, then both are removed again, so the check writes nothing and believes neither
    ``os.access`` (root passes it everywhere) nor the permission bits (``/proc``, a read-only mount,
    a full disk refuse anyway)."""
    path = Path(path)
    name = _named(flag, path)
    try:
        kind = "directory" if path.is_dir() else "file" if path.exists() else None
    except (OSError, ValueError) as err:  # a name too long for the file system, a NUL byte
        raise OutputPathError(f"{name}: cannot be written ({getattr(err, 'strerror', None) or first_line(err)})") from None
    if kind == "file" and directory:
        raise OutputPathError(f"{name}: is a file, not a folder")
    if kind == "directory" and not directory:
        raise OutputPathError(f"{name}: is a directory; give a file path")
    target = path if directory else path.parent  # the folder the output lands in
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise OutputPathError(f"{name}: cannot be written ({existing} is a file, not a folder)")
    for attempt in range(3):
        try:
            _probe(target, path.name)
            break
        except FileNotFoundError as err:
            # Another process probing the same new folder (each rank of a distributed run checks
            # its recipe) may remove it between our mkdir and our probe file: try again, and
            # only a place where the folder cannot be made at all (/proc) fails every time.
            if attempt == 2:
                raise OutputPathError(f"{name}: cannot be written ({err.strerror or first_line(err)})") from None
        except ValueError as err:  # a NUL byte in the name
            raise OutputPathError(f"{name}: cannot be written ({first_line(err)})") from None
        except OSError as err:
            why = f"{existing} is not writable" if isinstance(err, PermissionError) else err.strerror or first_line(err)
            raise OutputPathError(f"{name}: cannot be written ({why})") from None
    return path


# ---------------------------------------------------------------------------------------------
# Folders built aside and moved into place, with the user's umask
# ---------------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process's umask (read by setting it and putting it back: the only portable way)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_temp_dir(out: str | os.PathLike) -> Path:
    """A temporary folder beside ``out`` (same file system, so `replace_dir` is a rename), with
    the mode an ordinary ``mkdir`` gives under the user's umask: ``tempfile.mkdtemp`` makes it
    0700, which the folder would keep once renamed into place (a shared card folder nobody else
    can read)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~current_umask())
    return tmp


def follow_umask(folder: str | os.PathLike) -> None:
    """Give ``folder`` and everything under it the modes of an ordinary folder and file under the
    user's umask: safetensors writes its files 0600 and ``mkdtemp`` its folders 0700, and a run,
    a card or a published model is meant to be read by whoever may read the user's files."""
    mask = current_umask()
    root = Path(folder)
    root.chmod(0o777 & ~mask)
    for item in root.rglob("*"):
        if item.is_symlink():
            continue
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)
