"""What every source format's converter shares: the error type, the weight check, the default
output folder and the atomic folder write (built in a temporary sibling, moved into place at the
end, so a failed conversion leaves nothing half-written)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..publish import PathLike, PublishError

#: Files every converted folder has (the tokenizer's too when one was given).
REQUIRED_OUTPUT = ("config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py",
                   "generation_config.json", "README.md")  # fmt: skip
#: The default output folder is the checkpoint folder's sibling with this suffix.
DEFAULT_OUT_SUFFIX = "-looped"


class ConversionError(ValueError):
    """A checkpoint that cannot be converted; the message names the file, key or field."""


def default_out(ckpt_dir: PathLike) -> Path:
    """Where ``looped-hf convert FORMAT CKPT_DIR`` writes without ``--out``: ``CKPT_DIR-looped``
    beside the checkpoint folder (``runs/x/checkpoints`` -> ``runs/x/checkpoints-looped``)."""
    path = Path(ckpt_dir).resolve()
    return path.with_name(path.name + DEFAULT_OUT_SUFFIX)


def check_target(ckpt_dir: PathLike, out: PathLike, *, overwrite: bool, repo_id: str | None) -> Path:
    """``out`` as a path after the checks made before any work: it does not exist (unless
    ``overwrite``), it does not hold the checkpoint, ``repo_id`` is a Hub id."""
    from looped_hf.publish import check_repo_id

    dest = Path(out)
    if dest.exists() and not overwrite:
        raise PublishError(f"--out {dest} already exists; pass --overwrite to replace it")
    if repo_id is not None:
        check_repo_id(repo_id)
    if Path(ckpt_dir).resolve().is_relative_to(dest.resolve()):
        raise PublishError(
            f"--out {dest} is (or contains) the checkpoint directory {ckpt_dir}; choose another folder"
        )
    return dest


def check_against_model(weights: Mapping[str, torch.Tensor], model: torch.nn.Module, source: PathLike) -> None:
    """Every parameter present with its shape, nothing left over; the error lists what differs."""
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    shapes = {k: (tuple(weights[k].shape), expected[k]) for k in set(expected) & set(weights)
              if tuple(weights[k].shape) != expected[k]}  # fmt: skip
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}")
        if extra:
            parts.append(f"not in this config {extra[:8]}")
        if shapes:
            parts.append(
                "shape (checkpoint, config) "
                + ", ".join(f"{k}: {a} vs {b}" for k, (a, b) in sorted(shapes.items())[:8])
            )
        raise ConversionError(
            f"{source}: the weights do not fit the model its config describes: {'; '.join(parts)}"
        )


def write_folder(model: Any, dest: Path, extras: Callable[[Path], list[str]] | None = None) -> Path:
    """``model.save_pretrained`` (weights, config with ``auto_map``, the self-contained model code,
    generation config) into a temporary sibling of ``dest``, then ``extras(tmp)`` (the card, the
    tokenizer; it returns further file names that must exist), a check that every required file is
    there, and the move into place. Returns ``dest``."""
    from looped_hf.fileio import replace_dir
    from looped_hf.publish import _make_readable

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        required = list(REQUIRED_OUTPUT) + (extras(tmp) if extras is not None else [])
        missing = [name for name in required if not (tmp / name).is_file()]
        auto_map = json.loads((tmp / "config.json").read_text(encoding="utf-8")).get("auto_map") or {}
        if missing or "AutoModelForCausalLM" not in auto_map:
            raise ConversionError(f"the converted folder lacks {missing or 'auto_map.AutoModelForCausalLM'}: "
                                  "transformers' save_pretrained changed?")  # fmt: skip
        _make_readable(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


__all__ = ["DEFAULT_OUT_SUFFIX", "REQUIRED_OUTPUT", "ConversionError", "check_against_model", "check_target",
           "default_out", "write_folder"]  # fmt: skip
