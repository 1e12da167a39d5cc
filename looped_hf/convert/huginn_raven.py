"""Huginn-0125 and the retrofitted-recurrence models (``model_type: huginn_raven``) as looped_hf folders.

    looped-hf convert huginn DIR             # Huginn-0125 (seal-rg/recurrent-pretraining)
    looped-hf convert retrofit DIR           # McLeish et al. 2025, Llama or OLMo-2 variant, detected
    looped-hf convert huginn_raven DIR       # any of the three, detected

All three save a ``RavenForCausalLM`` (config.json + safetensors) with the same key names; what
differs is the modeling file shipped beside it, so the variant is read from the weights:

* ``huginn`` (recpre/raven_modeling_minimal.py): four norms per layer (``norm_1..4``), the
  sandwich ``x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))``; embeddings times
  ``init_values.embed_scale`` (sqrt(d)); ``qk_bias`` added to q and k before RoPE; RoPE on
  interleaved pairs (2i, 2i+1) with base ``rope_base``; ``ln_f`` after the loop, then the coda,
  then ``ln_f`` again (one weight).
* ``llama`` (convert_pretrained_model/raven_modeling_minimal_llama.py): two norms per layer,
  pre-norm; transformers' Llama RoPE (rotate-half, base ``rope_theta``, ``rope_scaling`` such as
  llama3); GQA; ``ln_f`` once, after the coda.
* ``olmo`` (raven_modeling_minimal_olmo.py): two norms per layer on the sublayer outputs,
  ``x = x + n1(attn x); x = x + n2(mlp x)``, and ``attn.q_norm`` / ``attn.k_norm`` over the
  whole q and k projections before the head split (OLMo-2); otherwise as ``llama``.

What the conversion does (every step exact):

* Splits the fused ``attn.Wqkv`` into q / k / v and the fused ``mlp.fc`` into gate / up (Huginn's
  ``GatedMLP``: ``silu(first half) * second half``).
* Huginn's interleaved-pair RoPE becomes transformers' rotate-half by permuting the rows of q and
  k (and of ``qk_bias``) within each head: dims (0, 2, 4, ...) first, then (1, 3, 5, ...). Pair
  (2i, 2i+1) rotates by the same angle as (i, i + head_dim/2) after the permutation, and q . k is
  unchanged when q and k are permuted alike; v and every output are untouched.
* The adapter reads ``[state; embeddings]``; looped_hf's linear injection reads ``[e; h]``, so
  its two column blocks swap.
* ``freqs_cis`` (Huginn's saved RoPE table) is dropped after checking it is the table
  ``rope_base`` gives (saved in bf16 / fp16, the converted model rounds its tables alike:
  ``rope_table_dtype``); the head is kept when untied and must equal the embedding when tied
  (``tie_embeddings``, written as ``tie_word_embeddings``).
* h_0: the references start from a zero state (Huginn's ``init_scale=0``), and so does the
  converted model by default (``state_init="zeros"``: deterministic, as generate() and vLLM
  parity need). ``--state-init truncated_normal`` writes Huginn's default random start instead
  (N(0, init_values.std) truncated at +-3 std, times the embedding scale); ``state_init_std``
  carries Huginn's std either way.
* Training-only fields (``mean_backprop_depth`` -> ``backprop_recurrences``; the sampling scheme,
  init strategy, activation checkpointing) are recorded in the card, not reproduced. A value the
  original code reads and looped_hf cannot reproduce (an adapter bias, test-time noise, qk_bias
  with GQA or after the OLMo QK-norm, an unknown RoPE type) is refused with one line naming the
  field, and nothing is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..publish import PathLike
from .common import ConversionError, build_model, check_target, check_tied_head, write_folder
from .loader import (
    Checkpoint,
    check_known_keys,
    check_recurrences,
    config_bool,
    config_int,
    config_number,
    config_rope_parameters,
    rope_parameters,
    token_ids,
)

#: The variants, by the name ``looped-hf convert`` gives each format.
VARIANTS = ("huginn", "llama", "olmo")
#: ``looped-hf convert`` format -> the variants it accepts (the one found in the weights must be one).
FORMAT_VARIANTS = {"huginn": ("huginn",), "retrofit": ("llama", "olmo"), "retrofit-llama": ("llama",),
                   "retrofit-olmo": ("olmo",), "huginn_raven": VARIANTS}  # fmt: skip
HUGINN_URL = "https://github.com/seal-rg/recurrent-pretraining"
RETROFIT_URL = "https://github.com/LoopedLMs/retrofitting-recurrence"
#: Each variant's norms: the native ``norm_i`` -> the looped_hf layer's norm (``norm_placement``).
NORMS = {
    "huginn": {"norm_1": "input_layernorm", "norm_2": "post_attention_residual_layernorm",
               "norm_3": "pre_feedforward_layernorm", "norm_4": "post_feedforward_residual_layernorm"},
    "llama": {"norm_1": "input_layernorm", "norm_2": "post_attention_layernorm"},
    "olmo": {"norm_1": "post_attention_layernorm", "norm_2": "post_feedforward_layernorm"},
}  # fmt: skip
NORM_PLACEMENT = {"huginn": "sandwich", "llama": "pre", "olmo": "sublayer_output"}
_STAGES = {"prelude": "prelude_layers", "core_block": "recurrent_layers", "coda": "coda_layers"}
#: The keys of a huginn_raven config.json that change nothing in the forward of the original
#: modeling files (training settings and class names the minimal modeling files fix).
_NO_EFFECT = frozenset({
    "activation_checkpoint_impl", "architecture_class_name", "block_class_name", "effective_expected_depth",
    "init_orthogonal", "init_strategy", "mlp_class_name", "n_layers", "nonlin_name", "norm_class_name",
    "padding_multiple", "sampling_scheme", "state_init", "test_time_noise_type",
})  # fmt: skip
#: The keys ``raven_config`` reads (every other key, beside ``_NO_EFFECT``, is refused).
_READ = frozenset({
    "n_embd", "n_heads", "num_key_value_heads", "head_dim", "bias", "test_time_noise", "qk_bias", "init_values",
    "vocab_size", "padded_vocab_size", "mean_recurrence", "mean_backprop_depth", "block_size",
    "max_position_embeddings", "intermediate_size", "norm_eps", "n_layers_in_prelude",
    "n_layers_in_recurrent_block", "n_layers_in_coda", "tie_embeddings", "tie_word_embeddings", "rope_base",
    "rope_theta", "rope_scaling", "injection_type", "bos_token_id", "eos_token_id", "pad_token_id",
})  # fmt: skip
#: The format-only ``looped-hf convert`` flags this format reads.
CLI_OPTIONS = ("state_init",)
STATE_INITS = ("zeros", "truncated_normal")


# --------------------------------------------------------------------------------------------
# Reading the checkpoint
# --------------------------------------------------------------------------------------------
def load_raven_checkpoint(ckpt_dir: PathLike) -> Checkpoint:
    """The huginn_raven folder ``ckpt_dir`` (config.json + safetensors, single or sharded) opened
    through the loader: checked, tensors read on demand."""
    return Checkpoint(ckpt_dir, model_types=("huginn_raven",))


def detect_variant(tensors: Checkpoint | Mapping[str, torch.Tensor]) -> str:
    """``huginn``, ``llama`` or ``olmo``, from the weights: four norms per layer are Huginn's
    sandwich, an ``attn.q_norm`` is the OLMo-2 retrofit, two norms and no QK-norm the Llama one."""
    if any(key.endswith(".norm_3.weight") for key in tensors):
        return "huginn"
    if any(key.endswith(".attn.q_norm.weight") for key in tensors):
        return "olmo"
    if any(key.endswith(".norm_2.weight") for key in tensors):
        return "llama"
    raise ConversionError("the weights have no transformer.<stage>.<i>.norm_2.weight: not a huginn_raven "
                          "RavenForCausalLM state dict")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
def _rope_parameters(cfg: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """Huginn: ``rope_base``, no scaling. The retrofits: ``rope_theta`` (their rotary embedding is
    transformers' Llama / OLMo-2 one, which never reads ``rope_base``) and ``rope_scaling``."""
    if variant == "huginn":
        if cfg.get("rope_scaling") not in (None, {}):
            raise ConversionError(f"config.json rope_scaling={cfg['rope_scaling']!r}: Huginn's RoPE table "
                                  "(precompute_freqs_cis) has no scaling, so this value has no meaning for it")  # fmt: skip
        return rope_parameters(None, config_number(cfg, "rope_base", 0))
    return config_rope_parameters(cfg, default_theta=...)  # rope_theta required


def raven_config(cfg: Mapping[str, Any], variant: str, state_init: str = "zeros") -> Any:
    """The ``LoopedConfig`` of a huginn_raven ``config.json`` of ``variant`` (see the module docstring).

    Key by key: ``n_embd`` -> ``hidden_size``, ``n_heads`` / ``num_key_value_heads`` -> the head
    counts, ``head_dim`` (Huginn: n_embd // n_heads, what its attention uses), ``intermediate_size``
    (gated SiLU MLP), ``n_layers_in_prelude`` / ``_recurrent_block`` / ``_in_coda`` -> the three
    layer counts, ``mean_recurrence`` -> ``num_recurrences``, ``mean_backprop_depth`` ->
    ``backprop_recurrences``, ``norm_eps`` -> ``rms_norm_eps``, ``vocab_size`` /
    ``padded_vocab_size`` -> the vocabulary and its padded rows, ``tie_embeddings`` ->
    ``tie_word_embeddings``, ``qk_bias``, ``init_values.embed_scale`` -> ``embedding_multiplier``,
    ``init_values.std`` -> ``state_init_std``, the RoPE fields (``_rope_parameters``), the context
    (Huginn: ``block_size``, its table's length; the retrofits: ``max_position_embeddings``).
    """
    from looped_hf import LoopedConfig

    if variant not in VARIANTS:
        raise ConversionError(f"variant={variant!r}: must be one of {VARIANTS}")
    if state_init not in STATE_INITS:
        raise ConversionError(f"--state-init={state_init!r}: must be one of {STATE_INITS}")
    check_known_keys(cfg, _NO_EFFECT | _READ, "huginn_raven")
    if cfg.get("injection_type", "linear") != "linear":
        raise ConversionError(f"config.json injection_type={cfg['injection_type']!r}: the original minimal modeling "
                              "files have only the linear adapter")  # fmt: skip
    d = config_int(cfg, "n_embd", 1)
    heads = config_int(cfg, "n_heads", 1)
    kv = cfg.get("num_key_value_heads", heads)
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        raise ConversionError(f"config.json num_key_value_heads={kv!r}: must be an integer dividing n_heads={heads}")
    head_dim = d // heads if variant == "huginn" else cfg.get("head_dim", d // heads)
    if variant == "huginn" and (d % heads or cfg.get("head_dim", head_dim) != head_dim):
        raise ConversionError(f"config.json head_dim={cfg.get('head_dim')!r}: Huginn's attention uses n_embd // n_heads "
                              f"= {d // heads} (n_embd={d}, n_heads={heads})")  # fmt: skip
    if cfg.get("bias", False) is not False:
        raise ConversionError(f"config.json bias={cfg['bias']!r}: the adapter would have a bias, which looped_hf's "
                              "linear injection has not")  # fmt: skip
    if cfg.get("test_time_noise", 0) != 0:
        raise ConversionError(f"config.json test_time_noise={cfg['test_time_noise']!r}: the original code adds fresh "
                              "noise to the state at every recurrence, which no converted model reproduces")  # fmt: skip
    qk_bias = cfg.get("qk_bias", False)
    if not isinstance(qk_bias, bool):
        raise ConversionError(f"config.json qk_bias={qk_bias!r}: expected true or false")
    if qk_bias and kv != heads:
        raise ConversionError(f"config.json qk_bias=True with num_key_value_heads={kv} < n_heads={heads}: the original "
                              "code adds an n_heads-wide bias to the keys, which only broadcasts without GQA")  # fmt: skip
    if qk_bias and variant == "olmo":
        raise ConversionError("config.json qk_bias=True in the OLMo variant: its bias is added after the QK-norm, "
                              "a placement looped_hf does not have")  # fmt: skip
    init_values = cfg.get("init_values") or {}
    if not isinstance(init_values, dict):
        raise ConversionError(f"config.json init_values={init_values!r}: expected an object")
    scale = init_values.get("embed_scale", math.sqrt(d) if variant == "huginn" else 1.0)
    std = init_values.get("std", math.sqrt(2 / (5 * d)))
    for key, value in (("embed_scale", scale), ("std", std)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConversionError(f"config.json init_values.{key}={value!r}: expected a finite number >= 0")
    vocab = config_int(cfg, "vocab_size", 1)
    padded = cfg.get("padded_vocab_size", vocab)
    if isinstance(padded, bool) or not isinstance(padded, int) or padded < vocab:
        raise ConversionError(f"config.json padded_vocab_size={padded!r}: must be an integer >= vocab_size={vocab}")
    r = check_recurrences(config_int(cfg, "mean_recurrence", 1), "mean_recurrence")
    backprop = cfg.get("mean_backprop_depth")
    backprop = backprop if isinstance(backprop, int) and not isinstance(backprop, bool) and 1 <= backprop < r else None
    context_key = "block_size" if variant == "huginn" or "max_position_embeddings" not in cfg else "max_position_embeddings"
    ids = token_ids(cfg, vocab, "config.json")
    tie_key = "tie_embeddings" if "tie_embeddings" in cfg else "tie_word_embeddings"
    tied = config_bool(cfg, tie_key, False)
    huginn = variant == "huginn"
    # Read before the try: their errors name config.json's field already.
    rope, intermediate, eps = _rope_parameters(cfg, variant), config_int(cfg, "intermediate_size", 1), config_number(
        cfg, "norm_eps", 0)
    layers = [config_int(cfg, key, low) for key, low in (("n_layers_in_prelude", 0), ("n_layers_in_recurrent_block", 1),
                                                          ("n_layers_in_coda", 0))]  # fmt: skip
    context = config_int(cfg, context_key, 1)
    try:
        return LoopedConfig(
            vocab_size=vocab,
            pad_vocab_size_to_multiple_of=padded if padded != vocab else 1,
            hidden_size=d,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=intermediate,
            hidden_act="silu",
            max_position_embeddings=context,
            rms_norm_eps=float(eps),
            rope_parameters=rope,
            norm_placement=NORM_PLACEMENT[variant],
            qk_norm="learnable_projection_before_rope" if variant == "olmo" else "none",
            qk_bias=qk_bias,
            embedding_multiplier=float(scale),
            embedding_norm=False,
            recurrence_norm=False,
            post_loop_norm="final" if huginn else None,
            logit_softcap=None,
            tie_word_embeddings=tied,
            num_prelude_layers=layers[0],
            num_recurrent_layers=layers[1],
            num_coda_layers=layers[2],
            num_recurrences=r,
            backprop_recurrences=backprop,
            input_injection="linear",
            state_init=state_init,
            state_init_std=float(std),
            **ids,
        )
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def interleaved_to_half_order(head_dim: int) -> torch.Tensor:
    """The row order within a head that turns interleaved-pair RoPE into rotate-half: new row j is
    old row ``order[j]``, the even dims (pair firsts) then the odd ones (pair seconds)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_heads(rows: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``rows`` (a q or k projection [num_heads * head_dim, ...] or its bias) with every head's rows in
    rotate-half order (:func:`interleaved_to_half_order`). Exact: rows move, no arithmetic."""
    if rows.shape[0] != num_heads * head_dim:
        raise ConversionError(f"a q/k tensor of shape {tuple(rows.shape)} does not split into {num_heads} heads "
                              f"of {head_dim}")  # fmt: skip
    order = interleaved_to_half_order(head_dim)
    return rows.reshape(num_heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


def check_freqs_cis(freqs_cis: torch.Tensor, config: Any) -> None:
    """Huginn saves its RoPE table as a buffer: it must be the table ``rope_base`` gives (cos, sin of
    position x inv_freq, [1, T, 1, head_dim/2, 2]), or the conversion would rotate by other angles."""
    dim, base = config.head_dim, config.rope_parameters["rope_theta"]
    if freqs_cis.dim() != 5 or freqs_cis.shape[-2:] != (dim // 2, 2):
        raise ConversionError(f"freqs_cis of shape {tuple(freqs_cis.shape)}: expected [1, T, 1, {dim // 2}, 2]")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(freqs_cis.shape[1], dtype=torch.float32), inv_freq)
    expected = torch.stack([angles.cos(), angles.sin()], dim=-1)
    error = (freqs_cis[0, :, 0].float() - expected).abs().max().item()
    # A table saved in bf16 / fp16 is the same table rounded: cos and sin are <= 1, so within eps.
    if error > max(1e-4, torch.finfo(freqs_cis.dtype).eps):
        raise ConversionError(f"freqs_cis differs from the RoPE table of rope_base={base} by {error:.3g}: "
                              "the checkpoint rotates by other angles than its config says")  # fmt: skip


def raven_state_dict(tensors: Checkpoint | Mapping[str, torch.Tensor], config: Any, variant: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under looped_hf names (see the module docstring); unknown keys are
    refused by name, ``freqs_cis`` is checked and dropped, a tied head must equal the embedding."""
    d, heads, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter = config.intermediate_size
    permute = variant == "huginn"  # the retrofits already rotate halves (transformers' RoPE)
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    norms = NORMS[variant]
    for key, tensor in tensors.items():
        parts = key.split(".")
        if key == "freqs_cis":
            check_freqs_cis(tensor, config)
        elif key == "transformer.wte.weight":
            out["model.embed_tokens.weight"] = tensor
        elif key == "transformer.ln_f.weight":
            out["model.norm.weight"] = tensor
        elif key == "transformer.adapter.weight":
            if tensor.shape != (d, 2 * d):
                raise ConversionError(f"{key} of shape {tuple(tensor.shape)}: expected ({d}, {2 * d})")
            out["model.injection.weight"] = torch.cat([tensor[:, d:], tensor[:, :d]], dim=1)  # [h; e] -> [e; h]
        elif key == "lm_head.weight":
            out["lm_head.weight"] = tensor  # a tied one must equal the embedding: check_tied_head
        elif len(parts) >= 5 and parts[0] == "transformer" and parts[1] in _STAGES and parts[2].isdigit():
            prefix = f"model.{_STAGES[parts[1]]}.{int(parts[2])}."
            name = ".".join(parts[3:])
            if name == "attn.Wqkv.weight":
                if tensor.shape[0] != (heads + 2 * kv) * hd:
                    raise ConversionError(f"{key} of shape {tuple(tensor.shape)}: expected {(heads + 2 * kv) * hd} rows")
                q, k, v = tensor.split([heads * hd, kv * hd, kv * hd])
                if permute:
                    q, k = permute_heads(q, heads, hd), permute_heads(k, kv, hd)
                out[prefix + "self_attn.q_proj.weight"] = q
                out[prefix + "self_attn.k_proj.weight"] = k
                out[prefix + "self_attn.v_proj.weight"] = v
            elif name == "attn.qk_bias":
                if not config.qk_bias or tuple(tensor.shape) != (2, 1, heads, hd):
                    raise ConversionError(f"{key} of shape {tuple(tensor.shape)} with config.json "
                                          f"qk_bias={config.qk_bias}: expected (2, 1, {heads}, {hd}) and qk_bias=true")  # fmt: skip
                q, k = tensor[0].reshape(heads * hd), tensor[1].reshape(heads * hd)
                if permute:
                    q, k = permute_heads(q, heads, hd), permute_heads(k, kv, hd)
                out[prefix + "self_attn.q_proj.bias"] = q
                out[prefix + "self_attn.k_proj.bias"] = k
            elif name in ("attn.q_norm.weight", "attn.k_norm.weight"):
                n = heads if name.startswith("attn.q") else kv
                out[prefix + f"self_attn.{name[5:]}"] = permute_heads(tensor, n, hd) if permute else tensor
            elif name == "attn.proj.weight":
                out[prefix + "self_attn.o_proj.weight"] = tensor
            elif name == "mlp.fc.weight":
                if tensor.shape[0] != 2 * inter:
                    raise ConversionError(f"{key} of shape {tuple(tensor.shape)}: expected 2 x intermediate_size="
                                          f"{inter} rows (config.json intermediate_size)")  # fmt: skip
                gate, up = tensor.chunk(2, dim=0)  # silu(first half) * second half
                out[prefix + "mlp.gate_proj.weight"] = gate
                out[prefix + "mlp.up_proj.weight"] = up
            elif name == "mlp.proj.weight":
                out[prefix + "mlp.down_proj.weight"] = tensor
            elif name.endswith(".weight") and name[: -len(".weight")] in norms:
                out[prefix + norms[name[: -len(".weight")]] + ".weight"] = tensor
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    if unknown:
        raise ConversionError(f"state-dict keys the {variant} variant does not have: {sorted(unknown)[:8]}"
                              f"{' ...' if len(unknown) > 8 else ''}")  # fmt: skip
    return {name: tensor.contiguous() for name, tensor in out.items()}


def raven_to_looped(ckpt_dir: PathLike, source_format: str = "huginn_raven", state_init: str = "zeros") -> tuple[Any, dict[str, Any]]:
    """Load a huginn_raven checkpoint as a ``LoopedForCausalLM`` (eval mode, in the checkpoint's dtype)
    with the original's logits. ``source_format`` (a ``FORMAT_VARIANTS`` key) names the variants
    accepted; the one in the weights must be among them. Returns the model and what the card
    records (variant, native config, files and their sha256)."""
    ckpt, variant, config = _open(ckpt_dir, source_format, state_init)
    return _raven_model(ckpt, variant, config)


def _open(ckpt_dir: PathLike, source_format: str, state_init: str) -> tuple[Checkpoint, str, Any]:
    """The checkpoint, its variant (which must fit ``source_format``) and its ``LoopedConfig``."""
    if source_format not in FORMAT_VARIANTS:
        raise ConversionError(f"source format {source_format!r}: must be one of {sorted(FORMAT_VARIANTS)}")
    ckpt = load_raven_checkpoint(ckpt_dir)
    variant = detect_variant(ckpt)
    if variant not in FORMAT_VARIANTS[source_format]:
        raise ConversionError(f"{ckpt_dir}: the weights are the {variant} variant, not {source_format} "
                              f"(expected {' or '.join(FORMAT_VARIANTS[source_format])}); "
                              "`looped-hf convert huginn_raven` detects it")  # fmt: skip
    config = raven_config(ckpt.config, variant, state_init)
    if "freqs_cis" in ckpt and ckpt.dtype("freqs_cis") in (torch.bfloat16, torch.float16):
        # Huginn rotates with the table as saved: rounded to bf16 / fp16, the same rounding here.
        config.rope_table_dtype = str(ckpt.dtype("freqs_cis")).removeprefix("torch.")
    return ckpt, variant, config


def _raven_model(ckpt: Checkpoint, variant: str, config: Any) -> tuple[Any, dict[str, Any]]:
    """The model of an opened checkpoint (``_open``) and what its card records."""
    # Built in the checkpoint's dtype (a bf16 Huginn-0125 never exists in fp32 here).
    dtype = ckpt.floating_dtype(exclude=("freqs_cis",))
    weights = raven_state_dict(ckpt, config, variant)
    check_tied_head(weights, config, "config.json tie_embeddings")
    model = build_model(config, weights, dtype, ckpt.folder)
    source = {
        "format": "huginn_raven", "variant": variant, "code": HUGINN_URL if variant == "huginn" else RETROFIT_URL,
        "files": ckpt.sha256(), "config": ckpt.config,
    }  # fmt: skip
    return model, source


# --------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------
_CARD_BODY = """
# {{ model_name }}

{{ title }}, converted to [looped_hf]({{ looped_hf }}) with `looped-hf convert {{ source_format }}`: it loads
with `AutoModelForCausalLM` (looped_hf installed, or `trust_remote_code=True`) on today's transformers.
Original code: {{ code }}.

| | value |
|---|---|
| variant | `{{ variant }}` |
| layers (prelude / block / coda), trained r | {{ config.num_prelude_layers }} / {{ config.num_recurrent_layers }} / {{ config.num_coda_layers }}, r = {{ config.num_recurrences }} |
| norm placement, post-loop norm | `{{ config.norm_placement }}`, `{{ config.post_loop_norm }}` |
| initial state | `{{ config.state_init }}` (std {{ config.state_init_std }}) |
| N_once / N_rec | {{ params.once }} / {{ params.recurrent }} |

Source files (sha256):

{% for name, digest in files.items() %}- `{{ name }}`: `{{ digest }}`
{% endfor %}
"""


def _card(model: Any, source: dict[str, Any], source_format: str, repo_id: str, license: str | None) -> Any:
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf import __version__
    from looped_hf.cards.common import _count, _project_link

    variant = source["variant"]
    data = ModelCardData(library_name="transformers", license=license,
                         tags=["looped_hf", "looped", "converted", "huginn_raven", variant])  # fmt: skip
    data.converted_from = {**{k: v for k, v in source.items() if k != "config"},
                           "native_config": source["config"], "looped_hf_version": __version__}  # fmt: skip
    title = "Huginn-0125 (Geiping et al. 2025)" if variant == "huginn" else (
        f"A retrofitted-recurrence model, {variant} variant (McLeish et al. 2025)")
    params = {key: _count(value) for key, value in model.num_scaling_params().items()}
    return ModelCard.from_template(
        data, template_str="---\n{{ card_data }}\n---\n" + _CARD_BODY, model_name=repo_id.split("/")[-1],
        title=title, looped_hf=_project_link(), source_format=source_format, code=source["code"], variant=variant,
        config=model.config, params=params, files=source["files"],
    )  # fmt: skip


def convert_raven(
    ckpt_dir: PathLike,
    out: PathLike,
    *,
    source_format: str = "huginn_raven",
    state_init: str = "zeros",
    repo_id: str | None = None,
    license: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hub-ready looped_hf folder for one huginn_raven checkpoint and return its path.

    Args:
        ckpt_dir: the folder holding ``config.json`` and ``model.safetensors`` (or a sharded index).
        out: the folder to write (built in a temporary sibling, moved into place at the end).
        source_format: ``huginn``, ``retrofit``, ``retrofit-llama``, ``retrofit-olmo`` or
            ``huginn_raven`` (any variant); the variant found in the weights must fit it.
        state_init: h_0 of the converted model, ``zeros`` (default, deterministic) or
            ``truncated_normal`` (Huginn's random start).
        repo_id: ``ORG/NAME`` for the card (default: the folder's name).
        license: license id for the card metadata (default: none stated).
        overwrite: replace an existing ``out`` (otherwise refused).

    The source folder's tokenizer files (``TOKENIZER_FILES``) are copied when it has them.

    Raises:
        ConversionError: a file missing or refused, an unknown key or value, weights that do not fit.
        PublishError: ``out`` exists without ``overwrite``, or a bad ``repo_id``.
    """
    from looped_hf.cards import CARD_NAME

    dest = check_target(ckpt_dir, out, overwrite=overwrite, repo_id=repo_id)
    ckpt, variant, config = _open(ckpt_dir, source_format, state_init)
    # Checked before the model is built: a broken tokenizer or token id fails at once.
    ckpt.check_tokenizer(config.vocab_size)
    generation_ids = ckpt.generation_token_ids(config.vocab_size)
    model, source = _raven_model(ckpt, variant, config)
    for key, value in generation_ids.items():
        setattr(model.generation_config, key, value)

    def extras(tmp: Path) -> list[str]:
        names = ckpt.copy_tokenizer(tmp, config.vocab_size)
        _card(model, source, source_format, repo_id or f"path/to/{dest.name}", license).save(tmp / CARD_NAME)
        return names

    return write_folder(model, dest, extras)


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool, state_init: str = "zeros") -> Path:  # fmt: skip
    """``looped-hf convert huginn | retrofit | retrofit-llama | retrofit-olmo | huginn_raven``."""
    return convert_raven(ckpt_dir, out, source_format=source_format, state_init=state_init, repo_id=repo_id,
                         license=license, overwrite=overwrite)  # fmt: skip


__all__ = [
    "FORMAT_VARIANTS",
    "VARIANTS",
    "convert_raven",
    "detect_variant",
    "interleaved_to_half_order",
    "load_raven_checkpoint",
    "permute_heads",
    "raven_config",
    "raven_state_dict",
    "raven_to_looped",
]
