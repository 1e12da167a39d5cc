"""The parent is read through the converters' one loader (``looped_hf.checkpoint_reader.Checkpoint``:
config.json, single or sharded safetensors, pickle-only folders refused, the tokenizer checked),
one tensor at a time (each read is a copy of its own, and no file stays open between reads), and
goes through the checks of every foreign folder (``Checkpoint.check_foreign``: the layer count
against the weight files before anything is built, RoPE scaling, the tie flag against the files,
``generation_config.json``) before a layer plan is made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint_reader import Checkpoint, ConversionError
from ..publish import PathLike
from .family import Family
from .llama import LLAMA, MISTRAL
from .olmo2 import OLMO2
from .qwen import QWEN2, QWEN3

#: ``architectures`` name -> the family that maps it (by name; nothing is guessed from the weights).
FAMILIES: dict[str, Family] = {
    arch: fam for fam in (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2) for arch in fam.architectures
}


def parent_family(config: dict[str, Any], where: Path) -> Family:
    """The family of the parent's ``architectures`` (by name), or a refusal naming the value."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"{where / 'config.json'} architectures={archs!r}: expected a list naming the model "
                              "class (save_pretrained writes it)")  # fmt: skip
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ConversionError(f"{where / 'config.json'} architectures={archs!r}: not a parent class retrofit maps "
                          f"(it maps {', '.join(sorted(FAMILIES))})")  # fmt: skip


def open_parent(parent_dir: PathLike) -> Checkpoint:
    """The parent folder, opened and checked (one ``ConversionError`` line naming what is refused)."""
    parent = Checkpoint(parent_dir)
    parent_family(parent.config, parent.folder)  # an unmapped class first: its keys are not read
    # The families' configs (Llama, Mistral, Qwen2/3, OLMo2) default to an untied head.
    parent.check_foreign(tie_default=False)
    return parent


def parent_name(parent: Checkpoint) -> str:
    """How a record or a card names the parent: its folder's name, never the path (a card is
    published; a path names the user's home). The weights' sha256 digests pin the parent."""
    return parent.folder.resolve().name


__all__ = ["FAMILIES", "open_parent", "parent_family", "parent_name"]
