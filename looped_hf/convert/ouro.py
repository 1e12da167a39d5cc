"""``looped-hf convert ouro DIR``: ByteDance's Ouro (Ouro-1.4B / 2.6B, model_type ``ouro``).

    looped-hf convert ouro ./Ouro-1.4B --out ./Ouro-1.4B-looped

Reads the folder Ouro's own code saved (``config.json``, ``model.safetensors`` or its shards, the
tokenizer files if there are any, copied as they are) and writes a looped_hf folder that ``AutoModelForCausalLM`` loads with
the same logits. Ouro is a whole-stack loop, which ``LoopedConfig`` says as:

* no prelude, no coda, no re-injection: all ``num_hidden_layers`` layers are the recurrent block,
  ``input_injection="none"``, h_0 = the looked-up embedding (``state_init="prelude"`` with no
  prelude and no embedding norm), run ``total_ut_steps`` times;
* ``model.norm`` closes every loop, its output is the next loop's input and that loop's logits
  come from ``lm_head`` directly: ``recurrence_norm_weight="final"`` (one tensor);
* four norms per layer, on each sublayer's input and on its output before the residual add:
  ``norm_placement="pre_and_output"``;
* the exit gate ``model.early_exit_gate`` (Linear(hidden -> 1) with bias, on each loop's normed
  state): ``exit_gate=True``; Ouro's ``early_exit_threshold`` becomes ``exit_gate_output=
  "threshold"`` at that threshold (its default 1.0 is every token's last loop, except where the
  exit CDF rounds to 1 earlier, as in Ouro's own code), ``None`` the last loop's logits;
* rotate-half RoPE with ``rope_theta`` (and ``rope_scaling`` if set), GQA when
  ``num_key_value_heads`` < ``num_attention_heads``, SwiGLU, no biases, untied head (tied if the
  config says so), no QK-norm, no soft-cap.

Every key of Ouro's ``config.json`` is either mapped, or known to have no effect on the forward
(``_NO_EFFECT``), or refused with one line naming it; so is a value the mapping cannot express
(sliding-window layers, ``early_exit_step``): nothing is written then. The weights are renamed
one for one (no reparametrisation: Ouro's RoPE is already rotate-half) and must fill the model
exactly. The conversion is checked end to end in tests/test_zoo_ouro.py against the outputs of
Ouro's own code.
"""

from __future__ import annotations

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

OURO_URL = "https://huggingface.co/ByteDance/Ouro-1.4B"
#: Keys of Ouro's config.json that change nothing in its forward (bookkeeping, or a switch whose
#: other value is refused below).
_NO_EFFECT = frozenset({"max_window_layers", "sliding_window", "chunk_size", "attention_bias"})
#: Ouro key -> LoopedConfig field, copied as they are (LoopedConfig checks their values).
_COPIED = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "attention_dropout": "attention_dropout", "num_hidden_layers": "num_recurrent_layers",
}  # fmt: skip
#: Ouro keys read by the mapping below (beside ``_COPIED``).
_READ = frozenset({"vocab_size", "tie_word_embeddings", "total_ut_steps", "hidden_act", "rope_theta",
                   "rope_scaling", "layer_types", "use_sliding_window", "early_exit_threshold", "early_exit_step",
                   "bos_token_id", "eos_token_id", "pad_token_id"})  # fmt: skip
#: Ouro's ``total_ut_steps`` when its config.json does not say (``OuroModel`` reads it with this default).
OURO_DEFAULT_UT_STEPS = 4
#: The settings that make a LoopedConfig Ouro's whole-stack loop (see the module docstring).
OURO_SETTINGS: dict[str, Any] = {
    "num_prelude_layers": 0, "num_coda_layers": 0, "input_injection": "none", "state_init": "prelude",
    "embedding_norm": False, "recurrence_norm": True, "recurrence_norm_weight": "final",
    "norm_placement": "pre_and_output", "qk_norm": "none", "logit_softcap": None, "attention_bias": False,
    "mlp_bias": False, "exit_gate": True,
}  # fmt: skip
# Ouro layer parameter -> looped layer parameter (the four norms in the order they run).
_LAYER_PARTS = {
    "self_attn.q_proj.weight": "self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    # Ouro names its four norms after where they sit in Llama's layer; looped_hf after Gemma-2's
    # (LoopedPreAndOutputNormDecoderLayer), so Ouro's post_attention_layernorm is the MLP's input norm.
    "input_layernorm.weight": "input_layernorm.weight",  # the attention's input
    "input_layernorm_2.weight": "post_attention_layernorm.weight",  # its output, before the add
    "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",  # the MLP's input
    "post_attention_layernorm_2.weight": "post_feedforward_layernorm.weight",  # its output, before the add
}
_TOP_LEVEL = {
    "model.embed_tokens.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.norm.weight",
    "model.early_exit_gate.weight": "model.exit_gate.weight",
    "model.early_exit_gate.bias": "model.exit_gate.bias",
    "lm_head.weight": "lm_head.weight",
}


def _bad(field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json {field}={value!r}: {why}")


def ouro_config(native: Mapping[str, Any]) -> Any:
    """The ``LoopedConfig`` of an Ouro ``config.json`` (as a dict). Raises ``ConversionError``
    naming the first key it cannot map: an unknown key, or a value the looped model cannot run."""
    from looped_hf import LoopedConfig
    from looped_hf.configuration_looped import HIDDEN_ACTS

    if native.get("model_type") != "ouro":
        raise _bad("model_type", native.get("model_type"), "not an Ouro config (model_type 'ouro')")
    check_known_keys(native, _NO_EFFECT | set(_COPIED) | _READ, "Ouro")
    fields: dict[str, Any] = {looped: native[key] for key, looped in _COPIED.items() if key in native}
    vocab = config_int(native, "vocab_size", 1)
    fields["vocab_size"] = vocab
    fields["num_recurrences"] = check_recurrences(config_int(native, "total_ut_steps", 1, default=OURO_DEFAULT_UT_STEPS),
                                                  "total_ut_steps")  # fmt: skip
    fields["tie_word_embeddings"] = config_bool(native, "tie_word_embeddings", False)
    fields.update(token_ids(native, vocab, "config.json"))
    act = native.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS or act == "relu2":  # Ouro's MLP is always gated
        raise _bad("hidden_act", act, f"must be one of {tuple(a for a in HIDDEN_ACTS if a != 'relu2')}")
    fields["hidden_act"] = act
    if native.get("use_sliding_window"):
        raise _bad("use_sliding_window", True, "sliding-window attention is not supported by looped_hf")
    layer_types = native.get("layer_types") or []
    other = [t for t in layer_types if t != "full_attention"]
    if other:
        raise _bad("layer_types", other[0], "only 'full_attention' layers are supported by looped_hf")
    if native.get("early_exit_step") is not None:
        raise _bad("early_exit_step", native["early_exit_step"], "a fixed exit step is not converted: convert "
                                                                 "without it and run at num_recurrences=step+1")  # fmt: skip
    fields["rope_parameters"] = config_rope_parameters(native)
    threshold = native.get("early_exit_threshold")
    if threshold is not None:
        fields["exit_gate_output"] = "threshold"
        fields["exit_gate_threshold"] = threshold
    try:
        return LoopedConfig(**fields, **OURO_SETTINGS)
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def ouro_key(key: str) -> str | None:
    """The looped_hf parameter name of an Ouro one; ``None`` for a name it does not know."""
    return whole_stack_key(key, _TOP_LEVEL, _LAYER_PARTS)


def ouro_to_looped(folder: PathLike) -> Any:
    """An Ouro folder as a ``LoopedForCausalLM`` (eval mode, in the checkpoint's dtype) with the
    same logits; read through the loader (``Checkpoint``), so it refuses what the loader refuses."""
    ckpt = Checkpoint(folder)
    return _ouro_model(ckpt, ouro_config(ckpt.config))


def _ouro_model(ckpt: Checkpoint, config: Any) -> Any:
    """The weights of ``ckpt`` renamed (unknown names refused) into the model ``config`` describes."""
    return renamed_model(ckpt, config, ouro_key, "Ouro")


def _card(model: Any, folder: Path, repo_id: str, license: str | None) -> Any:
    """A short model card: where the weights came from and the settings they map to."""
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf import __version__

    config = model.config
    data = ModelCardData(library_name="transformers", license=license, tags=["looped", "ouro", "converted"])
    data.converted_from = {"format": "ouro", "folder": folder.name, "looped_hf_version": __version__}
    exit_rule = (f"threshold {config.exit_gate_threshold}" if config.exit_gate_output == "threshold"
                 else config.exit_gate_output)  # fmt: skip
    body = (
        f"# {repo_id.split('/')[-1]}\n\n"
        f"An Ouro checkpoint ({OURO_URL}) converted to looped_hf by `looped-hf convert ouro`: the whole "
        f"stack of {config.num_recurrent_layers} layers loops r = {config.num_recurrences} times, `model.norm` "
        "closes every loop, four norms per layer, exit gate on each loop's state "
        f"(readout: {exit_rule}).\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({repo_id!r}, trust_remote_code=True)\n```\n\n"
        "`exit_probabilities` on the outputs is the gate's distribution over the loops; "
        "`exit_gate_output=` / `exit_gate_threshold=` change the readout per call.\n"
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def convert_ouro(folder: PathLike, out: PathLike, *, repo_id: str | None = None, license: str | None = None,
                 overwrite: bool = False) -> Path:  # fmt: skip
    """Write a looped_hf folder for the Ouro folder ``folder`` and return its path. Raises
    ``ConversionError`` (a file, key or value it cannot convert; nothing written) or
    ``PublishError`` (``out`` exists without ``overwrite``, a bad ``repo_id``)."""
    return convert_transformers_folder(
        folder, out, config_of=ouro_config, model_of=_ouro_model,
        card_of=lambda model, src, ckpt, repo, lic: _card(model, src, repo, lic),
        repo_id=repo_id, license=license, overwrite=overwrite,
    )


CLI_OPTIONS: tuple[str, ...] = ()


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool) -> Path:  # fmt: skip
    """``looped-hf convert ouro``: :func:`convert_ouro`."""
    return convert_ouro(ckpt_dir, out, repo_id=repo_id, license=license, overwrite=overwrite)


__all__ = ["OURO_SETTINGS", "convert_cli", "convert_ouro", "ouro_config", "ouro_key", "ouro_to_looped"]
