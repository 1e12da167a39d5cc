"""What every source format's converter shares beside the loader (``loader.py``): the error type,
the output folder's checks, the model built from checked weights, and the atomic folder write
(built in a temporary sibling, moved into place at the end, so a failed conversion leaves nothing
half-written)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Set
from pathlib import Path
from typing import Any

import torch

from ..checkpoint_reader import ConversionError as ConversionError
from ..fileio import LOOPED_MODEL_TYPES, first_line
from ..publish import PathLike, PublishError

#: Files every converted folder has (the tokenizer's too when one was given).
REQUIRED_OUTPUT = ("config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py",
                   "generation_config.json", "README.md")  # fmt: skip
#: The default output folder is the checkpoint folder's sibling with this suffix.
DEFAULT_OUT_SUFFIX = "-looped"




def default_out(ckpt_dir: PathLike) -> Path:
    """Where ``looped-hf convert FORMAT CKPT_DIR`` writes without ``--out``: ``CKPT_DIR-looped``
    beside the checkpoint folder (``runs/x/checkpoints`` -> ``runs/x/checkpoints-looped``)."""
    path = Path(ckpt_dir).resolve()
    return path.with_name(path.name + DEFAULT_OUT_SUFFIX)


def is_looped_output(folder: Path, written_by: str | None = None) -> bool:
    """Whether ``folder`` holds an earlier output of the same command (a config.json whose
    ``model_type`` is in ``LOOPED_MODEL_TYPES``; with ``written_by``, a file of that name beside it,
    e.g. retrofit's ``retrofit.json``; without, none of the files another command leaves there):
    the only non-empty folder ``--overwrite`` may replace. A training run (``run_record.json``,
    ``checkpoints/``) is never one: its config.json is looped too, but it holds hours of work."""
    if any((folder / name).exists() for name in RUN_MARKERS):
        return False
    if written_by is not None and not (folder / written_by).is_file():
        return False
    if written_by is None and any((folder / name).exists() for name in OTHER_COMMANDS_RECORDS):
        return False
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in LOOPED_MODEL_TYPES


#: What a training run holds (``looped_hf.train``): a folder with either is never replaced.
RUN_MARKERS = ("run_record.json", "checkpoints")
#: The records other commands write into their output folder (``retrofit.json``): ``convert
#: --overwrite`` does not replace their folders.
OTHER_COMMANDS_RECORDS = ("retrofit.json",)


def check_target(ckpt_dir: PathLike, out: PathLike, *, overwrite: bool, repo_id: str | None,
                 written_by: str | None = None) -> Path:  # fmt: skip
    """``out`` as a path after the checks made before any work, each refused with one line:
    ``out`` can be made (not under a file, not in /proc or /sys: ``check_output_path``); it is not
    ``.``, ``..``, the working directory or a folder holding it, nor the checkpoint folder or one
    holding it; it does not exist, or ``overwrite`` is given and it is empty or an earlier
    output of the same command (`is_looped_output`: ``written_by`` names the record that command
    leaves; a user's other folder and a training run are never replaced); ``repo_id`` is a Hub id."""
    from looped_hf.fileio import OutputPathError, check_output_path
    from looped_hf.publish import check_repo_id

    dest = Path(out)
    real = dest.resolve()
    if dest.name in ("", ".", "..") or Path.cwd().resolve().is_relative_to(real):
        raise PublishError(f"--out {dest}: is the working directory or holds it; choose a new folder")
    if Path(ckpt_dir).resolve().is_relative_to(real):
        raise PublishError(
            f"--out {dest} is (or contains) the checkpoint directory {ckpt_dir}; choose another folder"
        )
    try:
        check_output_path(dest, "--out", directory=True)
    except OutputPathError as err:
        raise PublishError(str(err)) from None
    if dest.exists() and not overwrite:
        raise PublishError(f"--out {dest} already exists; pass --overwrite to replace it")
    if dest.exists() and any((dest / name).exists() for name in RUN_MARKERS):
        raise PublishError(f"--out {dest}: a training run ({' or '.join(RUN_MARKERS)} inside); --overwrite never "
                           "replaces one, choose another folder")  # fmt: skip
    if dest.exists() and any(dest.iterdir()) and not is_looped_output(dest, written_by):
        what = f"config.json with model_type in {LOOPED_MODEL_TYPES}" + (
            f" and {written_by}" if written_by else f", no {' or '.join(OTHER_COMMANDS_RECORDS)}"
        )
        raise PublishError(f"--out {dest}: --overwrite replaces only an empty folder or an earlier looped_hf "
                           f"output of this command ({what}); this folder is neither")  # fmt: skip
    if repo_id is not None:
        check_repo_id(repo_id)
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


def check_tied_head(weights: dict[str, torch.Tensor], config: Any, source: str) -> None:
    """A tied head is the embedding: a saved ``lm_head.weight`` must equal it (``source`` names the
    config's tie flag), and the state dict then names the embedding for both."""
    if not config.tie_word_embeddings or "model.embed_tokens.weight" not in weights:
        return
    embedding = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight", embedding)
    if head.shape != embedding.shape or not torch.equal(head, embedding):
        raise ConversionError(f"{source}=True, but the checkpoint's head differs from its embedding: a tied model "
                              "has one tensor for both (convert with the flag false, or fix the checkpoint)")  # fmt: skip
    weights["lm_head.weight"] = embedding


def build_model(config: Any, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, source: PathLike,
                transform: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None) -> Any:  # fmt: skip
    """A ``LoopedForCausalLM`` (eval mode, in ``dtype``) holding ``weights``, which must fill it exactly.

    The model is first built on the meta device (no memory) and the weights checked against it,
    so a config whose sizes the checkpoint does not hold (a vocab_size x hidden_size that would
    not fit in memory) is refused naming the fields, before anything is allocated. ``transform``
    (a reparametrisation that needs the checked shapes) is applied to the weights after the check."""
    from transformers.initialization import no_init_weights

    from looped_hf import LoopedForCausalLM

    sizes = (f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, intermediate_size="
             f"{config.intermediate_size}, layers {config.num_prelude_layers}/{config.num_recurrent_layers}/"
             f"{config.num_coda_layers}")  # fmt: skip
    for stage in ("prelude", "recurrent", "coda"):  # a layer count is a loop of module builds: checked first
        count = getattr(config, f"num_{stage}_layers")
        held = {name.split(".")[2] for name in weights if name.startswith(f"model.{stage}_layers.")}
        if count > len(held):
            raise ConversionError(f"{source}: the config describes num_{stage}_layers={count}, the checkpoint holds "
                                  f"{len(held)} such layers")  # fmt: skip
    try:
        with torch.device("meta"), no_init_weights():
            shell = LoopedForCausalLM._from_config(config, dtype=dtype)
    except (RuntimeError, ValueError, OverflowError) as err:
        raise ConversionError(f"{source}: a model of {sizes} cannot be built ({first_line(err)})") from None
    try:
        check_against_model(weights, shell, source)
    except ConversionError as err:
        needed, held = sum(p.numel() for p in shell.parameters()), sum(t.numel() for t in weights.values())
        if needed <= held:
            raise
        # Name the fields that size the model: a vocab_size or hidden_size typo is the usual cause.
        raise ConversionError(f"{err}; the config describes {needed:.3g} parameters ({sizes}), the checkpoint "
                              f"holds {held:.3g}: refused before allocating") from None  # fmt: skip
    with no_init_weights():  # every parameter comes from the checkpoint: skip the random init
        model = LoopedForCausalLM._from_config(config, dtype=dtype)
    if config.tie_word_embeddings:
        model.tie_weights()  # one tensor, as from_pretrained makes it; the state dict names it twice
    model.load_state_dict(weights if transform is None else transform(weights), strict=True)
    return model.eval()


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


def renamed_model(ckpt: Any, config: Any, key_of: Callable[[str], str | None], what: str) -> Any:
    """The model ``config`` describes, with ``ckpt``'s weights renamed by ``key_of`` (a name it maps to
    ``None`` is refused, naming the first): the body of every converter whose source is a plain rename."""
    unknown = sorted(k for k in ckpt.keys() if key_of(k) is None)
    if unknown:
        raise ConversionError(f"{ckpt.folder}: unknown {what} weight {unknown[0]!r} (not converted)")
    dtype = ckpt.floating_dtype()  # built in the checkpoint's dtype: a bf16 release stays bf16
    return checked_model(ckpt, config, {key_of(k): tensor for k, tensor in ckpt.items()}, dtype)


def checked_model(ckpt: Any, config: Any, weights: dict[str, Any], dtype: Any) -> Any:
    """``weights`` (looped_hf names) with the tie flag checked against them, built into the model."""
    check_tied_head(weights, config, "config.json tie_word_embeddings")
    return build_model(config, weights, dtype, ckpt.folder)


def convert_transformers_folder(folder: PathLike, out: PathLike, *, config_of: Callable[[dict[str, Any]], Any],
                                model_of: Callable[[Any, Any], Any], card_of: Callable[..., Any],
                                repo_id: str | None, license: str | None, overwrite: bool) -> Path:  # fmt: skip
    """The one driver of a converter whose source is a transformers-style folder (Ouro, Nanbeige, IQuest):
    ``out`` checked before any work, the folder read through the one reader (``Checkpoint``), its
    looped config (``config_of(config.json)``), the tokenizer and generation token ids checked before the
    model is built (a broken one fails in a second, not after), the model (``model_of(checkpoint,
    config)``), then the folder written whole with the tokenizer's files byte for byte and the card
    (``card_of(model, source, checkpoint, repo_id, license)``). Raises ``ConversionError`` (nothing
    written) or ``PublishError``."""
    from ..cards import CARD_NAME
    from ..checkpoint_reader import Checkpoint

    src = Path(folder)
    dest = check_target(src, out, overwrite=overwrite, repo_id=repo_id)
    ckpt = Checkpoint(src)
    config = config_of(ckpt.config)
    ckpt.check_tokenizer(config.vocab_size)
    generation_ids = ckpt.generation_token_ids(config.vocab_size)
    model = model_of(ckpt, config)
    for attr, value in generation_ids.items():
        setattr(model.generation_config, attr, value)

    def extras(tmp: Path) -> list[str]:
        names = ckpt.copy_tokenizer(tmp, config.vocab_size)
        card_of(model, src, ckpt, repo_id or f"path/to/{dest.name}", license).save(tmp / CARD_NAME)
        return names

    return write_folder(model, dest, extras)

#: Layer N's parameter in a transformers decoder: ``model.layers.N.<part>``.
_DECODER_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def whole_stack_key(key: str, top_level: Mapping[str, str], layer_parts: Mapping[str, str] | Set[str]) -> str | None:
    """The looped_hf name of a transformers decoder's parameter when its whole stack is the loop's
    block (Ouro, Nanbeige, IQuest): a model-level name through ``top_level``; layer N's part as
    ``model.recurrent_layers.N.<part>``, renamed through ``layer_parts`` when it is a mapping and
    kept when it is a set; ``None`` for a name neither knows (the caller refuses it)."""
    if key in top_level:
        return top_level[key]
    match = _DECODER_LAYER_KEY.match(key)
    if match is None or match.group(2) not in layer_parts:
        return None
    part = layer_parts[match.group(2)] if isinstance(layer_parts, Mapping) else match.group(2)
    return f"model.recurrent_layers.{match.group(1)}.{part}"


__all__ = ["checked_model", "convert_transformers_folder", "renamed_model", "whole_stack_key", "DEFAULT_OUT_SUFFIX", "REQUIRED_OUTPUT", "ConversionError", "build_model", "check_against_model",
           "check_target", "check_tied_head", "default_out", "is_looped_output", "write_folder"]  # fmt: skip
