"""``looped-hf convert nanbeige DIR``: Nanbeige4.2 (Nanbeige4.2-3B, model_type ``nanbeige``).

    looped-hf convert nanbeige ./Nanbeige4.2-3B --out ./Nanbeige4.2-3B-looped

Reads the folder the model is published as (``config.json``, ``model.safetensors`` or its shards
with Llama's names, the tokenizer files if there are any, copied as they are) and writes a
looped_hf folder that ``AutoModelForCausalLM`` loads with the same logits. Nanbeige4.2 is a Llama
decoder whose whole stack runs ``num_loops`` times with shared weights; ``LoopedConfig`` says it
with options that already exist (Ouro's whole-stack loop, with Llama's two norms per layer):

* no prelude, no coda, no re-injection: all ``num_hidden_layers`` layers are the recurrent block,
  ``input_injection="none"``, h_0 = the looked-up embedding (``state_init="prelude"`` with no
  prelude and no embedding norm), run ``num_loops`` times;
* ``model.norm`` replaces the state after every loop and that state feeds the next loop, the last
  one the head: ``recurrence_norm=True, recurrence_norm_weight="final"`` (one tensor, and no second
  norm before the head, ``loop_norms``); with ``skip_loop_final_norm`` nothing runs between loops
  and ``model.norm`` once before the head: ``recurrence_norm=False`` (the final norm);
* Llama's layer: ``norm_placement="pre"``, rotate-half RoPE with ``rope_theta`` (and
  ``rope_scaling``), GQA, SwiGLU, ``head_dim`` from the config (not hidden / heads in the 3B model),
  Llama's ``attention_bias`` (q, k, v, o) and ``mlp_bias``, tied head when the config says so;
* each (loop, layer) application owns its KV-cache slot: looped_hf's layout for every model
  (``KVSlotPlan``), which is also mlx-lm's (``num_loops * num_hidden_layers`` caches).

mlx-lm, the reference implementation here (no copy of the Hub remote code was reachable), takes the
loop count from ``loop_loss_weights`` (its length + 1) when that key is present, whatever
``num_loops`` says; so does this converter, and a ``num_loops`` that disagrees is named in the card.

Every key of the ``config.json`` is mapped, known to change nothing in the forward
(``_NO_EFFECT``) or refused with one line naming it, as is a value the mapping cannot express; then
nothing is written. The weights are renamed one for one (``model.layers.N`` ->
``model.recurrent_layers.N``) and must fill the model exactly. The conversion is checked end to end in
tests/test_zoo_nanbeige.py against mlx-lm's outputs and a plain-torch recomputation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..publish import PathLike
from .common import ConversionError, convert_transformers_folder, renamed_model, whole_stack_key
from .loader import (
    Checkpoint,
    check_known_keys,
    check_recurrences,
    config_bool,
    config_int,
    config_rope_parameters,
    token_ids,
)

#: Keys of a Nanbeige config.json that change nothing in its forward (bookkeeping; a dropout is off
#: in eval; ``pretraining_tp`` is checked to be 1 below).
_NO_EFFECT = frozenset({"attention_dropout", "pretraining_tp"})
#: Nanbeige key -> LoopedConfig field, copied as they are (LoopedConfig checks their values).
_COPIED = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads", "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps", "num_hidden_layers": "num_recurrent_layers",
}  # fmt: skip
#: Nanbeige keys read by the mapping below (beside ``_COPIED``).
_READ = frozenset({"vocab_size", "tie_word_embeddings", "num_loops", "loop_loss_weights", "skip_loop_final_norm",
                   "hidden_act", "rope_theta", "rope_scaling", "rope_parameters", "head_dim",
                   "num_key_value_heads", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
                   "pad_token_id"})  # fmt: skip
#: The settings that make a LoopedConfig Nanbeige's whole-stack loop (see the module docstring).
NANBEIGE_SETTINGS: dict[str, Any] = {
    "num_prelude_layers": 0, "num_coda_layers": 0, "input_injection": "none", "state_init": "prelude",
    "embedding_norm": False, "norm_placement": "pre", "qk_norm": "none", "qk_bias": False, "logit_softcap": None,
    "post_loop_norm": None, "exit_gate": False,
}  # fmt: skip
#: The two ways the final norm runs around the loop (``skip_loop_final_norm`` false / true).
_SHARED_NORM = {"recurrence_norm": True, "recurrence_norm_weight": "final"}
_NORM_ONCE = {"recurrence_norm": False}
_LAYER_PARTS = frozenset({
    f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")
} | {f"mlp.{p}_proj.{kind}" for p in ("gate", "up", "down") for kind in ("weight", "bias")}
  | {"input_layernorm.weight", "post_attention_layernorm.weight"})  # fmt: skip
_TOP_LEVEL = {name: name for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}


def _bad(field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json {field}={value!r}: {why}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def nanbeige_num_loops(native: Mapping[str, Any]) -> int:
    """The loop count of a Nanbeige ``config.json``: ``len(loop_loss_weights) + 1`` when that key
    is present (mlx-lm's rule: one weight per loop before the last), else ``num_loops``; checked
    against the ceiling of recurrences."""
    weights = native.get("loop_loss_weights")
    if weights is not None:
        if not isinstance(weights, list) or not all(_is_number(w) for w in weights):
            raise _bad(
                "loop_loss_weights", weights, "expected a list of numbers (one per loop before the last)"
            )
        return check_recurrences(len(weights) + 1, "loop_loss_weights")
    return check_recurrences(config_int(native, "num_loops", 1), "num_loops")


def nanbeige_config(native: Mapping[str, Any]) -> Any:
    """The ``LoopedConfig`` of a Nanbeige4.2 ``config.json`` (as a dict). Raises ``ConversionError``
    naming the first key it cannot map: an unknown key, or a value the looped model cannot run."""
    from looped_hf import LoopedConfig
    from looped_hf.configuration_looped import HIDDEN_ACTS

    if native.get("model_type") != "nanbeige":
        raise _bad("model_type", native.get("model_type"), "not a Nanbeige config (model_type 'nanbeige')")
    check_known_keys(native, _NO_EFFECT | set(_COPIED) | _READ, "Nanbeige")
    fields: dict[str, Any] = {looped: native[key] for key, looped in _COPIED.items() if key in native}
    heads = config_int(native, "num_attention_heads", 1)
    hidden = config_int(native, "hidden_size", 1)
    vocab = config_int(native, "vocab_size", 1)
    # Sizes without a default here: transformers' Llama defaults (32 layers, 11008) are not this model's.
    for key in ("num_hidden_layers", "intermediate_size"):
        config_int(native, key, 1)
    fields["vocab_size"] = vocab
    fields["num_key_value_heads"] = config_int(native, "num_key_value_heads", 1, default=heads)
    # Llama's rule: head_dim absent (or null) is hidden / heads; Nanbeige4.2-3B sets it to another value.
    fields["head_dim"] = (
        hidden // heads if native.get("head_dim") is None else config_int(native, "head_dim", 1)
    )
    fields["num_recurrences"] = nanbeige_num_loops(native)
    fields["tie_word_embeddings"] = config_bool(native, "tie_word_embeddings", False)
    fields["attention_bias"] = config_bool(native, "attention_bias", False)
    fields["mlp_bias"] = config_bool(native, "mlp_bias", False)
    fields.update(token_ids(native, vocab, "config.json"))
    act = native.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS or act == "relu2":  # Llama's MLP is always gated
        raise _bad("hidden_act", act, f"must be one of {tuple(a for a in HIDDEN_ACTS if a != 'relu2')}")
    fields["hidden_act"] = act
    if native.get("pretraining_tp", 1) != 1:
        raise _bad(
            "pretraining_tp", native["pretraining_tp"], "only 1 is converted (Llama's sliced projections)"
        )
    fields["rope_parameters"] = config_rope_parameters(native)
    skip = config_bool(native, "skip_loop_final_norm", False)
    try:
        return LoopedConfig(**fields, **NANBEIGE_SETTINGS, **(_NORM_ONCE if skip else _SHARED_NORM))
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def nanbeige_key(key: str) -> str | None:
    """The looped_hf parameter name of a Nanbeige one; ``None`` for a name it does not know."""
    return whole_stack_key(key, _TOP_LEVEL, _LAYER_PARTS)


def nanbeige_to_looped(folder: PathLike) -> Any:
    """A Nanbeige folder as a ``LoopedForCausalLM`` (eval mode, in the checkpoint's dtype) with the
    same logits; read through the loader (``Checkpoint``), so it refuses what the loader refuses."""
    ckpt = Checkpoint(folder)
    return _nanbeige_model(ckpt, nanbeige_config(ckpt.config))


def _nanbeige_model(ckpt: Checkpoint, config: Any) -> Any:
    """The weights of ``ckpt`` renamed (unknown names refused) into the model ``config`` describes."""
    return renamed_model(ckpt, config, nanbeige_key, "Nanbeige")


def _card(model: Any, folder: Path, native: Mapping[str, Any], repo_id: str, license: str | None) -> Any:
    """A short model card: where the weights came from and the settings they map to."""
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf import __version__

    config = model.config
    data = ModelCardData(
        library_name="transformers", license=license, tags=["looped", "nanbeige", "converted"]
    )
    data.converted_from = {"format": "nanbeige", "folder": folder.name, "looped_hf_version": __version__}
    norm = ("`model.norm` once, after the last loop (`skip_loop_final_norm`)" if not config.recurrence_norm
            else "`model.norm` after every loop, its output the next loop's input")  # fmt: skip
    loops = ""
    if native.get("loop_loss_weights") is not None and native.get("num_loops") not in (
        None,
        config.num_recurrences,
    ):
        loops = (f" The loop count is `len(loop_loss_weights) + 1` = {config.num_recurrences}, as mlx-lm reads it; "
                 f"the config's `num_loops` says {native['num_loops']}: pass `num_recurrences=` to run that.")  # fmt: skip
    body = (
        f"# {repo_id.split('/')[-1]}\n\n"
        f"A Nanbeige4.2 checkpoint (model_type `nanbeige`) converted to looped_hf by `looped-hf convert nanbeige`: the "
        f"whole stack of {config.num_recurrent_layers} Llama layers loops r = {config.num_recurrences} times with "
        f"shared weights, {norm}.{loops}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({repo_id!r}, trust_remote_code=True)\n```\n\n"
        "`num_recurrences=` runs it at another loop count (`generate()`, `looped-hf test-time`, `looped-hf eval`, "
        "and per request in `looped-hf serve`), up to the config's ceiling "
        f"({config.recurrence_ceiling}).\n"
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def convert_nanbeige(folder: PathLike, out: PathLike, *, repo_id: str | None = None, license: str | None = None,
                     overwrite: bool = False) -> Path:  # fmt: skip
    """Write a looped_hf folder for the Nanbeige folder ``folder`` and return its path. Raises
    ``ConversionError`` (a file, key or value it cannot convert; nothing written) or
    ``PublishError`` (``out`` exists without ``overwrite``, a bad ``repo_id``)."""
    return convert_transformers_folder(
        folder, out, config_of=nanbeige_config, model_of=_nanbeige_model,
        card_of=lambda model, src, ckpt, repo, lic: _card(model, src, ckpt.config, repo, lic),
        repo_id=repo_id, license=license, overwrite=overwrite,
    )


CLI_OPTIONS: tuple[str, ...] = ()


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool) -> Path:  # fmt: skip
    """``looped-hf convert nanbeige``: :func:`convert_nanbeige`."""
    return convert_nanbeige(ckpt_dir, out, repo_id=repo_id, license=license, overwrite=overwrite)


__all__ = ["NANBEIGE_SETTINGS", "convert_cli", "convert_nanbeige", "nanbeige_config", "nanbeige_key",
           "nanbeige_num_loops", "nanbeige_to_looped"]  # fmt: skip
