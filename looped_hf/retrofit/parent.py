"""Reading a dense parent checkpoint tensor by tensor (never the whole state dict at once).

The converters' shared loader (branch ``loader``) replaces this module once it lands; until then
this is the same shape: a folder with ``config.json`` and safetensors weights (one file or a
sharded ``model.safetensors.index.json``), opened lazily, each tensor read when it is asked for.
A ``.bin``-only folder is refused: loading it would unpickle (run) code from the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..convert.common import ConversionError
from ..fileio import read_json, sha256_file
from ..publish import PathLike

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class ParentCheckpoint:
    """A parent folder: its ``config.json`` (as a dict), the safetensors files that hold its
    weights and which file holds each tensor. ``open()`` gives lazy per-tensor access."""

    path: Path
    config: dict[str, Any]
    weight_map: dict[str, Path]
    _stack: ExitStack | None = field(default=None, repr=False)
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.weight_map.values()))

    def keys(self) -> list[str]:
        return sorted(self.weight_map)

    def sha256(self) -> dict[str, str]:
        """Each weight file's name -> its sha256 (what the card and ``retrofit.json`` record)."""
        return {file.name: sha256_file(file) for file in self.files}

    def __enter__(self) -> ParentCheckpoint:
        from safetensors import safe_open

        self._stack = ExitStack()
        for file in self.files:
            try:
                self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
            except (OSError, ValueError, RuntimeError) as err:
                self._stack.close()
                raise ConversionError(f"{file}: not a readable safetensors file ({err})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
        self._handles.clear()

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its file now (inside ``with parent:``)."""
        if name not in self.weight_map:
            raise ConversionError(f"{self.path}: the weights have no tensor {name!r}")
        return self._handles[self.weight_map[name]].get_tensor(name)

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes of the stored tensors, read from the headers (no tensor data)."""
        found = set()
        for name, file in self.weight_map.items():
            found.add(self._handles[file].get_slice(name).get_dtype())
        mapping = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
        return {mapping.get(d, d) for d in found}

    def items(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names:
            yield name, self.tensor(name)


def open_parent(parent_dir: PathLike) -> ParentCheckpoint:
    """The parent folder's config and weight index, checked: a folder, a ``config.json`` object, and
    safetensors weights (a ``.bin``-only folder is refused). Raises ``ConversionError`` naming the file."""
    path = Path(parent_dir)
    if not path.is_dir():
        raise ConversionError(f"parent directory {path} does not exist")
    try:
        config = read_json(path / "config.json")
    except (OSError, ValueError) as err:
        raise ConversionError(f"{path / 'config.json'}: {err}") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path / 'config.json'}: not a JSON object")
    if (path / SINGLE_FILE).is_file():
        return ParentCheckpoint(path, config, _single_file_map(path / SINGLE_FILE))
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = read_json(path / INDEX_FILE).get("weight_map")
        except (OSError, ValueError, AttributeError) as err:
            raise ConversionError(f"{path / INDEX_FILE}: {err}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{path / INDEX_FILE}: no 'weight_map' object")
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise ConversionError(f"{path / INDEX_FILE}: names shard files that are not there: {missing[:4]}")
        return ParentCheckpoint(path, config, files)
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickles:
        raise ConversionError(f"{path}: weights={pickles[0]!r} is a pickle checkpoint (loading it would run code "
                              "from the file); convert it to safetensors first (save_pretrained does)")  # fmt: skip
    raise ConversionError(f"{path}: no {SINGLE_FILE} (or {INDEX_FILE})")


def _single_file_map(file: Path) -> dict[str, Path]:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return {name: file for name in handle.keys()}
    except (OSError, ValueError, RuntimeError) as err:
        raise ConversionError(f"{file}: not a readable safetensors file ({err})") from None


__all__ = ["ParentCheckpoint", "open_parent"]
