"""``looped-hf convert iquest DIR``: IQuest-Coder-V1-Loop (model_type ``iquestloopcoder``).

    looped-hf convert iquest ./IQuest-Coder-V1-40B-Loop-Instruct --out ./IQuest-Loop-looped

Reads the folder the IQuest release ships (``config.json``, ``model.safetensors`` or its shards,
the tokenizer files if there are any, copied as they are) and writes a looped_hf folder that
``AutoModelForCausalLM`` loads with the same logits. IQuest LoopCoder is a Llama decoder whose
whole stack runs ``loop_num`` times, which ``LoopedConfig`` says as:

* no prelude, no coda, no re-injection: all ``num_hidden_layers`` layers are the recurrent block,
  ``input_injection="none"``, h_0 = the looked-up embedding (``state_init="prelude"`` with no
  prelude and no embedding norm), run ``loop_num`` times; no norm between loops, ``model.norm``
  once at the end;
* loop 1 is a plain causal pass; every later loop's attention is the gated global + local read,
  ``loop_attention="gated_global_local"`` with ``loop_window_size`` (``loop_attention_looped.py``):
  the gates ``model.gate_projections.N`` keep their names (some copies store them inside each
  layer, ``model.layers.N[.self_attn].gate_projection(s)``; both are read, one per layer);
* pre-norm layers, rotate-half RoPE with ``rope_theta`` (and ``rope_scaling`` if set), GQA, SwiGLU,
  ``head_dim`` from the config, untied head (tied if the config says so), no QK-norm, no soft-cap.

Every key of the config.json is either mapped, or known to have no effect on the forward
(``_NO_EFFECT``), or refused with one line naming it; nothing is written then. The weights are
renamed one for one and must fill the model exactly. Checked end to end in tests/test_zoo_iquest.py
against mlx-lm's IQuest model (loop 2) and a re-implementation of the Hub code's prefill (loops 1, 3).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..publish import PathLike
from .common import ConversionError, checked_model, convert_transformers_folder, whole_stack_key
from .loader import (
    Checkpoint,
    check_known_keys,
    check_recurrences,
    config_bool,
    config_int,
    config_rope_parameters,
    token_ids,
)

IQUEST_URL = "https://huggingface.co/IQuestLab/IQuest-Coder-V1-40B-Loop-Instruct"
#: Keys of the config.json that change nothing in the forward (bookkeeping; ``pretraining_tp`` is
#: checked to be 1 below).
_NO_EFFECT = frozenset({"pretraining_tp"})
#: IQuest key -> LoopedConfig field, copied as they are (LoopedConfig checks their values).
_COPIED = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "attention_dropout": "attention_dropout", "num_hidden_layers": "num_recurrent_layers",
}  # fmt: skip
#: Keys read by the mapping below (beside ``_COPIED``).
_READ = frozenset({"vocab_size", "tie_word_embeddings", "loop_num", "loop_window_size", "hidden_act", "rope_theta",
                   "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
                   "pad_token_id"})  # fmt: skip
#: The release's defaults where its config.json does not say (vLLM's and the Hub code's).
IQUEST_DEFAULT_LOOP_NUM = 2
IQUEST_DEFAULT_WINDOW = 64
#: The settings that make a LoopedConfig IQuest's loop (see the module docstring).
IQUEST_SETTINGS: dict[str, Any] = {
    "num_prelude_layers": 0, "num_coda_layers": 0, "input_injection": "none", "state_init": "prelude",
    "embedding_norm": False, "recurrence_norm": False, "norm_placement": "pre", "qk_norm": "none",
    "logit_softcap": None, "loop_attention": "gated_global_local",
}  # fmt: skip
_LAYER_PARTS = frozenset({
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
    "input_layernorm.weight", "post_attention_layernorm.weight",
})  # fmt: skip
_TOP_LEVEL = {"model.embed_tokens.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}  # fmt: skip
# The gate of layer N: at model level (the release, vLLM), or inside the layer (some copies).
_GATE_KEYS = (
    re.compile(r"^model\.gate_projections\.(\d+)\.(?:gate_proj\.)?(weight|bias)$"),
    re.compile(r"^model\.layers\.(\d+)\.(?:self_attn\.)?gate_projections?\.(?:gate_proj\.)?(weight|bias)$"),
)


def _bad(field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json {field}={value!r}: {why}")


def iquest_config(native: Mapping[str, Any]) -> Any:
    """The ``LoopedConfig`` of an IQuest LoopCoder ``config.json`` (as a dict). Raises
    ``ConversionError`` naming the first key it cannot map: an unknown key, or a value the looped
    model cannot run."""
    from looped_hf import LoopedConfig
    from looped_hf.configuration_looped import HIDDEN_ACTS

    if native.get("model_type") != "iquestloopcoder":
        raise _bad("model_type", native.get("model_type"), "not an IQuest LoopCoder config (model_type "
                                                           "'iquestloopcoder')")  # fmt: skip
    check_known_keys(native, _NO_EFFECT | set(_COPIED) | _READ, "IQuest LoopCoder")
    fields: dict[str, Any] = {looped: native[key] for key, looped in _COPIED.items() if key in native}
    vocab = config_int(native, "vocab_size", 1)
    fields["vocab_size"] = vocab
    fields["num_recurrences"] = check_recurrences(config_int(native, "loop_num", 1, default=IQUEST_DEFAULT_LOOP_NUM),
                                                  "loop_num")  # fmt: skip
    fields["loop_window_size"] = config_int(native, "loop_window_size", 1, default=IQUEST_DEFAULT_WINDOW)
    fields["tie_word_embeddings"] = config_bool(native, "tie_word_embeddings", False)
    fields["attention_bias"] = config_bool(native, "attention_bias", False)
    fields["mlp_bias"] = config_bool(native, "mlp_bias", False)
    fields.update(token_ids(native, vocab, "config.json"))
    act = native.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS or act == "relu2":  # the MLP is Llama's, always gated
        raise _bad("hidden_act", act, f"must be one of {tuple(a for a in HIDDEN_ACTS if a != 'relu2')}")
    fields["hidden_act"] = act
    tp = native.get("pretraining_tp", 1)
    if tp != 1:
        raise _bad("pretraining_tp", tp, "only 1 is converted (Llama's sliced-projection emulation)")
    fields["rope_parameters"] = config_rope_parameters(native)
    try:
        return LoopedConfig(**fields, **IQUEST_SETTINGS)
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def iquest_key(key: str) -> str | None:
    """The looped_hf parameter name of an IQuest one; ``None`` for a name it does not know."""
    for pattern in _GATE_KEYS:
        match = pattern.match(key)
        if match is not None:
            return f"model.gate_projections.{match.group(1)}.{match.group(2)}"
    return whole_stack_key(key, _TOP_LEVEL, _LAYER_PARTS)


def iquest_weights(ckpt: Checkpoint) -> dict[str, Any]:
    """The checkpoint's tensors under looped_hf names; an unknown name, or a gate stored both at
    model level and inside its layer, is refused naming the key."""
    unknown = sorted(k for k in ckpt.keys() if iquest_key(k) is None)
    if unknown:
        raise ConversionError(
            f"{ckpt.folder}: unknown IQuest LoopCoder weight {unknown[0]!r} (not converted)"
        )
    source: dict[str, str] = {}
    for key in ckpt.keys():
        name = iquest_key(key)
        if name in source:
            raise ConversionError(f"{ckpt.folder}: weight {key!r} and {source[name]!r} are both {name!r} (a gate "
                                  "stored twice: at model level and inside its layer)")  # fmt: skip
        source[name] = key
    return {name: ckpt.get_tensor(key) for name, key in source.items()}


def iquest_to_looped(folder: PathLike) -> Any:
    """An IQuest LoopCoder folder as a ``LoopedForCausalLM`` (eval mode, in the checkpoint's dtype)
    with the same logits; read through the loader (``Checkpoint``), so it refuses what it refuses."""
    ckpt = Checkpoint(folder)
    return _iquest_model(ckpt, iquest_config(ckpt.config))


def _iquest_model(ckpt: Checkpoint, config: Any) -> Any:
    dtype = ckpt.floating_dtype()  # built in the checkpoint's dtype: a bf16 release stays bf16
    return checked_model(ckpt, config, iquest_weights(ckpt), dtype)


def _card(model: Any, folder: Path, repo_id: str, license: str | None) -> Any:
    """A short model card: where the weights came from, the settings they map to, the r range."""
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf import __version__

    config = model.config
    data = ModelCardData(library_name="transformers", license=license, tags=["looped", "iquest", "converted"])
    data.converted_from = {"format": "iquest", "folder": folder.name, "looped_hf_version": __version__}
    body = (
        f"# {repo_id.split('/')[-1]}\n\n"
        f"An IQuest-Coder-V1-Loop checkpoint ({IQUEST_URL}) converted to looped_hf by `looped-hf convert "
        f"iquest`: the whole stack of {config.num_recurrent_layers} layers loops r = {config.num_recurrences} "
        "times; loop 1 is a plain causal pass, every later loop mixes a global read of loop 1's K/V with a "
        f"local read of its own K/V over the last {config.loop_window_size} positions, per head, by "
        "g = sigmoid(q . W_h + b_h) (`model.gate_projections`).\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({repo_id!r}, trust_remote_code=True)\n"
        "model.generate(input_ids, num_recurrences=3)  # any r up to the ceiling\n```\n\n"
        "Decoding with the cache gives the logits of a full forward (loop 1 keeps every position's K/V, "
        f"later loops the last {config.loop_window_size - 1}). `looped-hf test-time DIR --data TEXT --max-factor 2` "
        "measures the held-out loss at r = 1..4 and adds the curve to this card; `looped-hf eval DIR "
        "--recurrences 1 2 3 4` scores tasks at each r.\n"
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def convert_iquest(folder: PathLike, out: PathLike, *, repo_id: str | None = None, license: str | None = None,
                   overwrite: bool = False) -> Path:  # fmt: skip
    """Write a looped_hf folder for the IQuest LoopCoder folder ``folder`` and return its path.
    Raises ``ConversionError`` (a file, key or value it cannot convert; nothing written) or
    ``PublishError`` (``out`` exists without ``overwrite``, a bad ``repo_id``)."""
    return convert_transformers_folder(
        folder, out, config_of=iquest_config, model_of=_iquest_model,
        card_of=lambda model, src, ckpt, repo, lic: _card(model, src, repo, lic),
        repo_id=repo_id, license=license, overwrite=overwrite,
    )


CLI_OPTIONS: tuple[str, ...] = ()


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool) -> Path:  # fmt: skip
    """``looped-hf convert iquest``: :func:`convert_iquest`."""
    return convert_iquest(ckpt_dir, out, repo_id=repo_id, license=license, overwrite=overwrite)


__all__ = ["IQUEST_SETTINGS", "convert_cli", "convert_iquest", "iquest_config", "iquest_key", "iquest_to_looped",
           "iquest_weights"]  # fmt: skip
