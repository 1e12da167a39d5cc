"""The parent is read through the converters' one loader (``looped_hf.convert.loader.Checkpoint``:
config.json, single or sharded safetensors, pickle-only folders refused, the tokenizer checked),
one tensor at a time."""

from __future__ import annotations

import torch

from ..convert.loader import Checkpoint
from ..publish import PathLike


def open_parent(parent_dir: PathLike) -> Checkpoint:
    """The parent folder, opened and checked (one ``ConversionError`` line naming what is refused)."""
    return Checkpoint(parent_dir)


def read_tensor(parent: Checkpoint, name: str) -> torch.Tensor:
    """One parent tensor as memory of its own, the parent's files released after the read.

    The loader hands out views of memory-mapped files; their pages stay resident (and count in the
    process's RSS) while a file is open, so reading a whole parent through open files would hold it
    twice, and a view written to would change what the next read of the name returns."""
    tensor = parent.get_tensor(name).clone()
    parent.close()
    return tensor


__all__ = ["open_parent", "read_tensor"]
