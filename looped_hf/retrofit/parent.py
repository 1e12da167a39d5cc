"""The parent is read through the converters' one loader (``looped_hf.convert.loader.Checkpoint``:
config.json, single or sharded safetensors, pickle-only folders refused, the tokenizer checked),
one tensor at a time (each read is a copy of its own, and no file stays open between reads), and
goes through the checks of every foreign folder (``Checkpoint.check_foreign``: the layer count
against the weight files before anything is built, RoPE scaling, the tie flag against the files,
``generation_config.json``) before a layer plan is made."""

from __future__ import annotations

from ..convert.loader import Checkpoint
from ..publish import PathLike


def open_parent(parent_dir: PathLike) -> Checkpoint:
    """The parent folder, opened and checked (one ``ConversionError`` line naming what is refused)."""
    from .core import parent_family  # core imports this module

    parent = Checkpoint(parent_dir)
    parent_family(parent.config, parent.folder)  # an unmapped class first: its keys are not read
    # The families' configs (Llama, Mistral, Qwen2/3, OLMo2) default to an untied head.
    parent.check_foreign(tie_default=False)
    return parent


def parent_name(parent: Checkpoint) -> str:
    """How a record or a card names the parent: its folder's name, never the path (a card is
    published; a path names the user's home). The weights' sha256 digests pin the parent."""
    return parent.folder.resolve().name


__all__ = ["open_parent", "parent_name"]
