"""``looped-hf convert parcae DIR``: Sandy Research's Parcae (arXiv 2604.12946; code sandyresearch/parcae).

    looped-hf convert parcae ./parcae-small-140m --out ./parcae-small-140m-looped
    looped-hf convert parcae ./parcae-small-140m --state-init like_init   # Parcae's random h_0

Reads the folder ``parcae_lm``'s ``save_pretrained`` writes (``config.json``: the ``ParcaeConfig``
dataclass fields plus ``"_class_name": "ParcaeConfig"``; ``model.safetensors`` and / or
``pytorch_model.bin``, the ``torch.save`` state dict) and writes a looped_hf folder that
``AutoModelForCausalLM`` loads with the same logits. ``model.safetensors`` is read when present;
a folder with only ``pytorch_model.bin`` is read with ``torch.load(..., weights_only=True)``, never
a full unpickle (``loader.read_torch_bin``: anything else is refused in one line).

What maps to what (every step exact; ``LoopedConfig``'s Parcae options are ``parcae_looped.py``):

* prelude (``transformer.prelude``) -> ``ln_prelude`` = e (``prelude_norm``); h_0 zeros, or with
  ``--state-init like_init`` Parcae's truncated normal (std sqrt(2 / (5 n_embd)), +-3 std, drawn with
  Parcae's RNG calls: a seed gives its state bit for bit); r steps of the diagonal injection
  (``transformer.adapter`` -> ``input_injection="diagonal"``) then the core blocks, no norm between
  steps (``recurrence_norm=False``); ``transformer.C`` (``post_loop_projection``); coda; ``ln_f``;
  the head (tied to ``wte`` when ``tie_embeddings``; both keys are in the files).
* Blocks are pre-norm (``norm_1`` / ``norm_2``), attention ``c_q/c_k/c_v/c_proj`` without bias,
  MLP ``proj(0.5 relu(fc x)^2)`` (``mlp_activation_scale=0.5``); the parameter-free QK RMSNorm after
  RoPE with torch's default eps (``qk_norm_eps="torch_default"``); the core is MHA whatever the
  prelude and coda use (``recurrent_num_key_value_heads``).
* RoPE on interleaved pairs (base ``rope_settings.rope_base``) becomes rotate-half by permuting each
  head's q and k rows (Huginn's mapping, ``huginn_raven.permute_heads``): exact, since the QK norm
  over head_dim and q . k do not see a permutation applied to both. ``freqs_cis`` is checked
  against the base and dropped.
* Value embeddings: ``value_embeds.<i>`` exists for unique layer i when i % 2 == (P+C+D-1) % 2, a
  layer's ``attn.ve_gate`` when layer_id % 2 == (n_layer-1) % 2 (n_layer = core layers x
  ``mean_backprop_depth``; layer_id = i in the prelude and core, P + C x ``mean_recurrence`` + j for
  coda block j); only where both exist does the layer add 2 sigmoid(gate(x[..., :32])) * ve[ids].
  The rule is derived from the config (``value_embedding_layers``); tables and gates a file carries
  elsewhere are unused by Parcae's forward and dropped.
* r = ``mean_recurrence``. Parcae samples a Poisson depth when called without ``num_steps_pair``;
  the converted model runs the configured r unless told otherwise (``num_recurrences=``).
* The logits keep Parcae's ``padded_vocab_size`` columns (``vocab_size`` = the padded size).

Every key of the config is mapped, known to change nothing in the forward (``_NO_EFFECT``), or
refused by name; so is a value the mapping cannot express (another block, norm, MLP or injection
type, a wider or narrower recurrent state, an init strategy whose embedding or logit scale is not
1, ...). Nothing is written then.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..publish import PathLike
from .common import ConversionError, build_model, check_target, check_tied_head, write_folder
from .huginn_raven import check_freqs_cis, permute_heads
from .loader import Checkpoint, check_known_keys, check_recurrences, config_bool, config_int, config_number

PARCAE_URL = "https://github.com/sandyresearch/parcae"
#: Keys of Parcae's config.json that change nothing in an inference forward at a given r: names,
#: training-time settings (the depth sampler, truncated backprop, checkpointing, initialisation
#: other than the scales checked below), kernels, and monitoring-only switches.
_NO_EFFECT = frozenset({
    "name", "hf_config", "_class_name", "model_class_name", "_is_recurrent_block_config", "attn_impl",
    "init_orthogonal", "skip_initialization", "use_fused_head", "debias_attention", "center_attention",
    "activation_checkpoint_impl", "simple_ops", "strategy", "sampling_scheme", "lockstep_n", "lockstep_k",
    "curriculum_target", "recurrent_iteration_method", "randomize_positions_from", "architecture_class_name",
    "padding_multiple",
})  # fmt: skip
#: Keys read by ``parcae_config``.
_READ = frozenset({
    "block_size", "n_embd", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "padded_vocab_size", "rope_settings", "use_abacus", "block_class_name", "norm_class_name", "norm_eps",
    "mlp_class_name", "nonlin_name", "bias", "qk_bias", "init_strategy", "mup_model_scaling_factor", "clip_qkv",
    "qk_norm", "logit_softcap", "injection_type", "n_layers_in_recurrent_block", "n_layers_in_prelude",
    "n_layers_in_coda", "state_init", "recurrent_embedding_dimension",
    "recurrent_intermediation_embedding_dimension", "recurrent_num_attention_heads", "prelude_norm",
    "mean_recurrence", "mean_backprop_depth", "tie_embeddings",
})  # fmt: skip
#: Each value a key must have, where looped_hf reproduces only that one (the released models' values).
_REQUIRED = {"block_class_name": "TransformerPreNormBlock", "norm_class_name": "RMSNorm",
             "mlp_class_name": "BaseMLP", "nonlin_name": "ReLU2", "injection_type": "diagonal", "bias": False,
             "qk_bias": False, "use_abacus": False, "clip_qkv": None, "mup_model_scaling_factor": 1}  # fmt: skip
#: Init strategies whose embedding scale and logit scale are 1 and whose "embedding" std (the like-init
#: state's) is sqrt(2 / (5 n_embd)) (parcae_lm/utils/init.py get_factor_table).
_INIT_STRATEGIES = ("scaled", "scaled-geiping", "scaled-zero", "scaled-stuck")
#: ``--state-init`` choices: the converted model's h_0.
STATE_INITS = ("zeros", "like_init")
CLI_OPTIONS = ("state_init",)
#: Parcae's ``attn.ve_gate`` reads this many channels of the normed block input (mixer.py).
VE_GATE_CHANNELS = 32
_STAGES = {"prelude": "prelude_layers", "core_block": "recurrent_layers", "coda": "coda_layers"}
_LAYER_PARTS = {
    "norm_1.weight": "input_layernorm.weight", "norm_2.weight": "post_attention_layernorm.weight",
    "attn.c_q.weight": "self_attn.q_proj.weight", "attn.c_k.weight": "self_attn.k_proj.weight",
    "attn.c_v.weight": "self_attn.v_proj.weight", "attn.c_proj.weight": "self_attn.o_proj.weight",
    "attn.ve_gate.weight": "self_attn.ve_gate.weight",
    "mlp.fc.weight": "mlp.up_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight",
}  # fmt: skip
_TOP_LEVEL = {
    "transformer.wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
    "transformer.ln_f.weight": "model.norm.weight", "transformer.ln_prelude.weight": "model.prelude_norm.weight",
    "transformer.C.weight": "model.post_loop_projection.weight",
    "transformer.adapter.A_log": "model.injection.A_log", "transformer.adapter.dt_bias": "model.injection.dt_bias",
    "transformer.adapter.B": "model.injection.B",
}  # fmt: skip
_LAYER_KEY = re.compile(r"^transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$")
_VALUE_KEY = re.compile(r"^value_embeds\.(\d+)\.weight$")


def _bad(field: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"config.json {field}={value!r}: {why}")


def has_ve(index: int, n_layer: int) -> bool:
    """Parcae's ``mixer.has_ve``: whether layer ``index`` of ``n_layer`` has a value embedding (or,
    with the gate's numbering, a gate): alternate layers, the last always included."""
    return index % 2 == (n_layer - 1) % 2


def value_embedding_layers(prelude: int, core: int, coda: int, mean_recurrence: int,
                           mean_backprop_depth: int) -> list[int]:  # fmt: skip
    """The unique layers (prelude, core, coda, 0-based) whose values Parcae's forward really mixes a
    value embedding into: those with both a table (``value_embeds``, numbered over the unique
    layers) and a gate (``attn.ve_gate``, numbered by ``layer_id`` against n_layer = core x
    mean_backprop_depth, the coda's ids counted after mean_recurrence unrolled cores)."""
    n_unique, n_layer = prelude + core + coda, core * mean_backprop_depth
    layer_ids = list(range(prelude + core)) + [prelude + core * mean_recurrence + j for j in range(coda)]
    return [i for i in range(n_unique) if has_ve(i, n_unique) and has_ve(layer_ids[i], n_layer)]


def parcae_config(native: Mapping[str, Any], state_init: str = "zeros") -> Any:
    """The ``LoopedConfig`` of a Parcae ``config.json`` (a dict). Raises ``ConversionError`` naming
    the first key it cannot map (an unknown key, or a value the looped model cannot reproduce)."""
    from looped_hf import LoopedConfig

    if native.get("_class_name") != "ParcaeConfig":
        raise _bad(
            "_class_name", native.get("_class_name"), "not a Parcae config (_class_name 'ParcaeConfig')"
        )
    if state_init not in STATE_INITS:
        raise ConversionError(f"--state-init={state_init!r}: must be one of {STATE_INITS}")
    check_known_keys(native, _NO_EFFECT | _READ, "Parcae")
    for key, value in _REQUIRED.items():
        if key in native and native[key] != value:
            raise _bad(key, native[key], f"looped_hf converts only {value!r} (the released Parcae models')")
    if native.get("model_class_name", "Parcae") != "Parcae":
        raise _bad("model_class_name", native["model_class_name"], "not a Parcae model")
    init_strategy = native.get("init_strategy", "scaled")
    if init_strategy not in _INIT_STRATEGIES:
        raise _bad("init_strategy", init_strategy, f"its embedding / logit scales and state std are not converted "
                                                   f"(one of {_INIT_STRATEGIES})")  # fmt: skip
    d = config_int(native, "n_embd", 1)
    heads = config_int(native, "num_attention_heads", 1)
    kv = native.get("num_key_value_heads")
    kv = heads if kv is None else config_int(native, "num_key_value_heads", 1)
    if d % heads or heads % kv:
        raise _bad(
            "num_attention_heads",
            heads,
            f"must divide n_embd={d} and be divisible by num_key_value_heads={kv}",
        )
    intermediate = native.get("intermediate_size")
    intermediate = 4 * d if intermediate is None else config_int(native, "intermediate_size", 1)
    for key, expected in (("recurrent_embedding_dimension", d), ("recurrent_intermediation_embedding_dimension",
                                                                  intermediate)):  # fmt: skip
        if native.get(key, expected) != expected:
            raise _bad(key, native[key], f"a core of another width than the prelude and coda ({expected}) is not "
                                         "converted (every released Parcae model has the same)")  # fmt: skip
    rec_heads = native.get("recurrent_num_attention_heads")
    if rec_heads is not None and rec_heads != heads:
        # Parcae's RoPE table has the prelude's head size: another head count could not even run there.
        raise _bad("recurrent_num_attention_heads", rec_heads, f"must be null or num_attention_heads={heads}")
    rope = native.get("rope_settings") or {}
    if not isinstance(rope, dict):
        raise _bad("rope_settings", rope, "expected an object")
    check_known_keys(
        rope, {"use_rope", "rope_condense_ratio", "rope_base"}, "Parcae", "config.json rope_settings"
    )
    if rope.get("use_rope", True) is not True:
        raise _bad("rope_settings.use_rope", rope["use_rope"], "a Parcae model without RoPE is not converted")
    if rope.get("rope_condense_ratio", 1) != 1:
        raise _bad("rope_settings.rope_condense_ratio", rope["rope_condense_ratio"], "only 1 is converted")
    base = config_number(rope, "rope_base", 0, "config.json rope_settings", default=50000.0)
    vocab = config_int(native, "vocab_size", 1)
    padded = native.get("padded_vocab_size")
    padded = vocab if padded is None else config_int(native, "padded_vocab_size", vocab)
    prelude = config_int(native, "n_layers_in_prelude", 0, default=1)
    core = config_int(native, "n_layers_in_recurrent_block", 1, default=4)
    coda = config_int(native, "n_layers_in_coda", 0, default=1)
    r = check_recurrences(config_int(native, "mean_recurrence", 1, default=32), "mean_recurrence")
    backprop = config_int(native, "mean_backprop_depth", 1, default=8)
    ve_layers = value_embedding_layers(prelude, core, coda, r, backprop)
    if kv != heads and any(prelude <= i < prelude + core for i in ve_layers):
        raise _bad("num_key_value_heads", kv, f"a core layer with a value embedding needs the core's {heads} KV "
                                              "heads (Parcae's own forward fails to reshape it)")  # fmt: skip
    qk_norm = config_bool(native, "qk_norm", False)
    softcap = native.get("logit_softcap")
    if softcap is not None:
        softcap = config_number(native, "logit_softcap", 0)
    state = native.get("state_init", "like-init")
    if state not in ("like-init", "zero"):
        raise _bad("state_init", state, "only 'like-init' and 'zero' are converted")
    fields = dict(
        vocab_size=padded, hidden_size=d, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=d // heads, recurrent_num_key_value_heads=heads if kv != heads else None,
        hidden_act="relu2", mlp_activation_scale=0.5, max_position_embeddings=config_int(native, "block_size", 1),
        rms_norm_eps=config_number(native, "norm_eps", 0, default=1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": base},
        qk_norm="after_rope" if qk_norm else "none", qk_norm_eps="torch_default" if qk_norm else None,
        logit_softcap=softcap, embedding_norm=False, tie_word_embeddings=config_bool(native, "tie_embeddings", False),
        num_prelude_layers=prelude, num_recurrent_layers=core, num_coda_layers=coda, num_recurrences=r,
        input_injection="diagonal", recurrence_norm=False, prelude_norm=config_bool(native, "prelude_norm", False),
        post_loop_projection=True, norm_placement="pre",
        state_init="zeros" if state_init == "zeros" or state == "zero" else "like_init",
        state_init_std=math.sqrt(2 / (5 * d)), backprop_recurrences=backprop if backprop <= r else None,
        value_embedding_layers=ve_layers or None, value_embedding_gate_channels=VE_GATE_CHANNELS,
    )  # fmt: skip
    try:
        return LoopedConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def parcae_state_dict(ckpt: Checkpoint, config: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under looped_hf names (see the module docstring): unknown names
    refused, ``freqs_cis`` checked and dropped, unused value embeddings and gates dropped, q / k
    rows permuted to rotate-half order, a tied head checked against the embedding."""
    used = set(config.value_embedding_layers or ())
    counts = {"prelude": config.num_prelude_layers, "core_block": config.num_recurrent_layers,
              "coda": config.num_coda_layers}  # fmt: skip
    offsets = {"prelude": 0, "core_block": config.num_prelude_layers,
               "coda": config.num_prelude_layers + config.num_recurrent_layers}  # fmt: skip
    heads, hd = config.num_attention_heads, config.head_dim
    out: dict[str, torch.Tensor] = {}
    for key in ckpt.keys():
        if key == "freqs_cis":
            check_freqs_cis(ckpt.get_tensor(key), config)
            continue
        if key in _TOP_LEVEL:
            out[_TOP_LEVEL[key]] = ckpt.get_tensor(key)
            continue
        value = _VALUE_KEY.match(key)
        if value is not None:
            if int(value.group(1)) in used:
                out[f"model.value_embeddings.{int(value.group(1))}.weight"] = ckpt.get_tensor(key)
            continue  # a table Parcae's forward never reads (no gate on that layer, or no such layer)
        layer = _LAYER_KEY.match(key)
        if layer is None or layer.group(3) not in _LAYER_PARTS:
            raise ConversionError(f"{ckpt.folder}: unknown Parcae weight {key!r} (not converted)")
        stage, j, part = layer.group(1), int(layer.group(2)), layer.group(3)
        if j >= counts[stage]:
            raise ConversionError(f"{ckpt.folder}: weight {key!r} names {stage} block {j}, but the config has "
                                  f"{counts[stage]}")  # fmt: skip
        if part == "attn.ve_gate.weight" and offsets[stage] + j not in used:
            continue  # a gate without a table: unused by Parcae's forward
        tensor = ckpt.get_tensor(key)
        if part in ("attn.c_q.weight", "attn.c_k.weight"):
            n = heads if part == "attn.c_q.weight" else tensor.shape[0] // hd
            tensor = permute_heads(tensor, n, hd)  # interleaved pairs -> rotate-half (exact)
        out[f"model.{_STAGES[stage]}.{j}.{_LAYER_PARTS[part]}"] = tensor
    check_tied_head(out, config, "config.json tie_embeddings")
    return out


def _open(folder: PathLike, state_init: str) -> tuple[Checkpoint, Any]:
    ckpt = Checkpoint(folder, torch_bin=True)
    return ckpt, parcae_config(ckpt.config, state_init)


def _parcae_model(ckpt: Checkpoint, config: Any) -> Any:
    weights = parcae_state_dict(ckpt, config)
    dtype = ckpt.floating_dtype(exclude=("freqs_cis",))
    return build_model(config, weights, dtype, ckpt.folder)


def parcae_to_looped(folder: PathLike, state_init: str = "zeros") -> Any:
    """A Parcae folder as a ``LoopedForCausalLM`` (eval mode, in the checkpoint's dtype) with the
    same logits; read through the loader, so it refuses what the loader refuses."""
    ckpt, config = _open(folder, state_init)
    return _parcae_model(ckpt, config)


def _card(model: Any, native: Mapping[str, Any], folder: Path, repo_id: str, license: str | None) -> Any:
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf import __version__

    config = model.config
    data = ModelCardData(library_name="transformers", license=license, tags=["looped", "parcae", "converted"])
    data.converted_from = {"format": "parcae", "folder": folder.name, "looped_hf_version": __version__,
                           "state_init": config.state_init}  # fmt: skip
    body = (
        f"# {repo_id.split('/')[-1]}\n\n"
        f"A Parcae checkpoint ({PARCAE_URL}) converted to looped_hf by `looped-hf convert parcae`: prelude of "
        f"{config.num_prelude_layers} blocks, a core of {config.num_recurrent_layers} blocks run r = "
        f"{config.num_recurrences} times (Parcae's mean_recurrence) through the stable diagonal injection, "
        f"the projection C, a coda of {config.num_coda_layers} blocks. h_0: {config.state_init}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({repo_id!r}, trust_remote_code=True)\n"
        "model.generate(input_ids, num_recurrences=8)  # any r up to the config's ceiling\n```\n\n"
        "Parcae's own code samples a Poisson depth when called without a depth; this model runs "
        f"r = {config.num_recurrences} unless `num_recurrences=` says otherwise. Training-time settings "
        f"(sampling scheme {native.get('sampling_scheme')!r}, mean_backprop_depth "
        f"{native.get('mean_backprop_depth')}) are recorded here, not reproduced. `looped-hf test-time` "
        "on this folder adds the loss curve over r to this card.\n"
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def convert_parcae(folder: PathLike, out: PathLike, *, state_init: str = "zeros", repo_id: str | None = None,
                   license: str | None = None, overwrite: bool = False) -> Path:  # fmt: skip
    """Write a looped_hf folder for the Parcae folder ``folder`` and return its path. Raises
    ``ConversionError`` (a file, key or value it cannot convert; nothing written) or
    ``PublishError`` (``out`` exists without ``overwrite``, a bad ``repo_id``)."""
    from looped_hf.cards import CARD_NAME

    src = Path(folder)
    dest = check_target(src, out, overwrite=overwrite, repo_id=repo_id)
    ckpt, config = _open(src, state_init)
    ckpt.check_tokenizer(config.vocab_size)
    model = _parcae_model(ckpt, config)

    def extras(tmp: Path) -> list[str]:
        names = ckpt.copy_tokenizer(tmp, config.vocab_size)
        _card(model, ckpt.config, src, repo_id or f"path/to/{dest.name}", license).save(tmp / CARD_NAME)
        return names

    return write_folder(model, dest, extras)


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool, state_init: str = "zeros") -> Path:  # fmt: skip
    """``looped-hf convert parcae``: :func:`convert_parcae`."""
    return convert_parcae(ckpt_dir, out, state_init=state_init, repo_id=repo_id, license=license,
                          overwrite=overwrite)  # fmt: skip


__all__ = ["STATE_INITS", "convert_cli", "convert_parcae", "parcae_config", "parcae_state_dict",
           "parcae_to_looped", "value_embedding_layers"]  # fmt: skip
