"""The parent is read through the converters' one loader (``looped_hf.convert.loader.Checkpoint``:
config.json, single or sharded safetensors, pickle-only folders refused, the tokenizer checked),
one tensor at a time (each read is a copy of its own, and no file stays open between reads)."""

from __future__ import annotations

from ..convert.loader import Checkpoint
from ..publish import PathLike


def open_parent(parent_dir: PathLike) -> Checkpoint:
    """The parent folder, opened and checked (one ``ConversionError`` line naming what is refused)."""
    return Checkpoint(parent_dir)


__all__ = ["open_parent"]
