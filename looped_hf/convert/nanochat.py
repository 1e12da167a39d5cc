"""The iso-depth study's (nanochat) checkpoints as Hub-ready looped_hf folders.

    looped-hf convert nanochat CKPT_DIR                                 # the latest model_<step>.pt
    looped-hf convert nanochat CKPT_DIR --step 2000 --out DIR --tokenizer NousResearch/Llama-2-7b-hf

``nanochat`` is the iso-depth study's code
(kschwethelm/looped-lm-scaling, a nanochat fork): ``base_train`` writes ``model_<step:06d>.pt``
(a ``torch.save`` of the state dict) and ``meta_<step:06d>.json`` (``model_config`` = its
``GPTConfig``, plus ``step``, ``tokens``, ``val_loss``, ...) into one directory.

What the conversion does, and why:

* Loads the weights with ``torch.load(weights_only=True)`` only: a file that needs more (arbitrary
  pickled objects) is refused, so converting a downloaded checkpoint never executes its code.
* Strips the ``_orig_mod.`` prefix ``torch.compile`` adds, and upcasts bf16/fp16 tensors to fp32
  (a CUDA run stores the embedding in bf16), as the study's ``build_model`` does on CPU.
* Maps every ``GPTConfig`` key to a ``LoopedConfig`` field (an unknown key is refused by name;
  the study's own legacy renames are applied), with the study's fixed conventions: squared-ReLU
  MLP, parameter-free QK-norm after RoPE (eps 1e-6), norms after the embedding and every
  recurrence, untied head, ``init_scheme="study"``, the vocabulary padded to a multiple of 64
  (the padded rows are kept: they are the checkpoint's weights, and the FLOP and parameter
  accounting then match the study's), and bf16 rotary tables (``rope_table_dtype``).
* Reparametrises RoPE. The study rotates pairs by -theta (``y1 = x1 cos + x2 sin``,
  ``y2 = -x1 sin + x2 cos``), transformers' ``rotate_half`` by +theta. Negating the second half
  of every head's rows of ``c_q`` and ``c_k`` maps one onto the other exactly: transformers'
  rotation of the flipped q equals the study's rotated q with its second half negated; the
  parameter-free RMS-norm after RoPE is blind to per-element signs, and q . k is unchanged when
  both carry the same flipped halves. v, and so every output, is untouched. (A name-for-name
  copy without it gives logits off by about half their size.)

The folder is written in a temporary sibling and moved into place at the end (nothing
half-written): ``model.safetensors``, ``config.json`` with ``auto_map`` and the self-contained
model code (via ``save_pretrained``), ``generation_config.json``, the tokenizer when given, and a
model card whose metadata says where the weights came from (file, sha256, step, tokens,
val_loss, the study's config).
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..fileio import first_line, read_json, sha256_file
from ..publish import PathLike
from .common import ConversionError, build_model, check_target, write_folder
from .loader import check_known_keys, check_recurrences, config_int

STUDY_URL = "https://github.com/kschwethelm/looped-lm-scaling"
#: The study's GPT pads the vocabulary to a multiple of this (nanochat/gpt.py ``pad_vocab_size_to``).
NANOCHAT_VOCAB_MULTIPLE = 64
#: The study's tokenizer adds these to its base tokenizer (nanochat/tokenizer.py ``SPECIAL_TOKENS``).
NANOCHAT_SPECIAL_TOKENS = ("<|assistant_end|>",)
#: ``GPTConfig`` defaults (nanochat/gpt.py at ad7d8f3): what the study's ``build_model`` uses for a
#: key an older meta file lacks (``GPTConfig(**model_config)``).
NANOCHAT_CONFIG_DEFAULTS: dict[str, Any] = {
    "sequence_len": 2048, "vocab_size": 32001, "size": 20, "n_head": 10, "n_kv_head": 10, "n_embd": 1280,
    "n_prelude": 2, "n_recur_block": 4, "n_coda": 2, "num_recur": 4, "bptt_k": 4,
    "input_injection": "inject_init_prelude", "num_lanes": 2, "logit_softcap": 15.0,
}  # fmt: skip
#: Keys the study's ``build_model`` drops from old meta files (checkpoint_manager.py).
NANOCHAT_DEPRECATED_KEYS = ("recur_warm_start", "sandwich_norm", "train_recur_mean", "train_recur_max")
NANOCHAT_INJECTIONS = {"inject_init_prelude": "linear", "additive": "add", "passthrough": "none",
                       "hyperconnect": "hyperconnection"}  # fmt: skip
_STAGES = {"prelude": "prelude_layers", "recur": "recurrent_layers", "coda": "coda_layers"}
_LAYER_PARTS = {
    "attn.c_q.weight": "self_attn.q_proj.weight",
    "attn.c_k.weight": "self_attn.k_proj.weight",
    "attn.c_v.weight": "self_attn.v_proj.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_fc.weight": "mlp.up_proj.weight",
    "mlp.c_proj.weight": "mlp.down_proj.weight",
    "n1.weight": "input_layernorm.weight",
    "n3.weight": "post_attention_layernorm.weight",
}
_TOP_LEVEL = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "inject.weight": "model.injection.weight",
    "lane_alpha": "model.hyperconnection.alpha",
    "lane_mixing": "model.hyperconnection.mixing",
    "lane_beta": "model.hyperconnection.beta",
    "norm_emb.weight": "model.embedding_norm.weight",
    "norm_recur.weight": "model.recurrence_norm.weight",
    "norm_final.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER_KEY = re.compile(r"^transformer\.(prelude|recur|coda)\.(\d+)\.(.+)$")
_STEP_FILE = re.compile(r"^model_(\d+)\.pt$")


@dataclass
class NanochatCheckpoint:
    """One loaded nanochat checkpoint: the state dict as saved (prefix stripped, fp32) and its meta."""

    model_path: Path
    meta_path: Path
    step: int | str
    state_dict: dict[str, torch.Tensor]
    meta: dict[str, Any]
    sha256: str
    notes: list[str] = field(default_factory=list)  # what loading changed, for the card


# --------------------------------------------------------------------------------------------
# Reading the checkpoint
# --------------------------------------------------------------------------------------------
def _step_infix(step: int | str) -> str:
    """The file infix of ``step``: a zero-padded number or an alias (``pre_warmdown``), as the study's
    ``resolve_step``."""
    if isinstance(step, bool):
        raise ConversionError(f"step={step!r}: expected a step number or an alias name")
    if isinstance(step, int):
        if step < 0:
            raise ConversionError(f"step={step}: must be >= 0")
        return f"{step:06d}"
    text = str(step)
    if text.isdigit():
        return f"{int(text):06d}"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise ConversionError(f"step={step!r}: expected a step number or an alias such as 'pre_warmdown'")
    return text


def latest_nanochat_step(ckpt_dir: PathLike) -> int:
    """The largest ``N`` with a ``model_N.pt`` in ``ckpt_dir`` (the study's ``find_last_step``)."""
    steps = [int(m.group(1)) for p in Path(ckpt_dir).iterdir() if (m := _STEP_FILE.match(p.name))]
    if not steps:
        raise ConversionError(
            f"{ckpt_dir}: no model_<step>.pt file (is this a nanochat checkpoint directory?)"
        )
    return max(steps)


def _load_weights_only(path: Path) -> dict[str, torch.Tensor]:
    """``torch.load(weights_only=True)``: tensors and plain containers only, nothing executed."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ConversionError(
            f"{path}: refused, the file holds more than tensors (torch.load(weights_only=True) failed: "
            f"{first_line(err)}). "
            "Loading it fully would run code stored in the file; a nanochat base_train checkpoint never needs that."
        ) from None
    except (RuntimeError, OSError, EOFError) as err:
        raise ConversionError(
            f"{path}: not a readable torch.save file ({type(err).__name__}: {err})"
        ) from None
    if not isinstance(obj, Mapping) or not obj:
        raise ConversionError(f"{path}: expected a state dict (str -> Tensor), got {type(obj).__name__}")
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise ConversionError(f"{path}: entries that are not str -> Tensor: {bad[:5]}")
    return dict(obj)


def load_nanochat_checkpoint(ckpt_dir: PathLike, step: int | str | None = None) -> NanochatCheckpoint:
    """Read ``model_<step>.pt`` and ``meta_<step>.json`` from ``ckpt_dir`` (default: the latest step).

    The weights load with ``weights_only=True`` only; the ``_orig_mod.`` prefix is stripped and
    bf16/fp16 tensors are upcast to fp32 (the study's ``build_model`` on CPU). Raises
    ``ConversionError`` naming the file for anything missing or refused.
    """
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ConversionError(f"checkpoint directory {path} does not exist")
    if step is None:
        step = latest_nanochat_step(path)
    infix = _step_infix(step)
    model_path, meta_path = path / f"model_{infix}.pt", path / f"meta_{infix}.json"
    for file in (model_path, meta_path):
        if not file.is_file():
            raise ConversionError(f"{file}: no such file (step {step!r} of {path})")
    try:
        meta = read_json(meta_path)
    except ValueError as err:
        raise ConversionError(str(err)) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model_config"), dict):
        raise ConversionError(f"{meta_path}: no 'model_config' object (not a nanochat base_train meta file)")
    raw = _load_weights_only(model_path)
    notes: list[str] = []
    state: dict[str, torch.Tensor] = {}
    prefixed = 0
    for key, tensor in raw.items():
        name = key.removeprefix("_orig_mod.")
        prefixed += name != key
        if name in state:
            raise ConversionError(
                f"{model_path}: key {name!r} appears with and without the '_orig_mod.' prefix"
            )
        state[name] = tensor
    if prefixed:
        notes.append(f"stripped the torch.compile prefix '_orig_mod.' from {prefixed} keys")
    low = sorted(
        {
            str(t.dtype).removeprefix("torch.")
            for t in state.values()
            if t.dtype in (torch.bfloat16, torch.float16)
        }
    )
    bad = {k: str(t.dtype) for k, t in state.items() if not t.is_floating_point()}
    if bad:
        raise ConversionError(f"{model_path}: non-floating-point weights {bad}")
    if low:
        notes.append(f"upcast {', '.join(low)} tensors to float32 (lossless)")
    state = {k: t.float() for k, t in state.items()}
    # An alias (model_pre_warmdown.pt) is a symlink to a numbered step: report that step.
    target = _STEP_FILE.match(model_path.resolve().name)
    resolved: int | str = int(target.group(1)) if target else infix
    return NanochatCheckpoint(model_path=model_path, meta_path=meta_path, step=resolved, state_dict=state,
                              meta=meta, sha256=sha256_file(model_path), notes=notes)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
def _study_model_config(model_config: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """The 14 ``GPTConfig`` keys of a meta file's ``model_config``: the study's legacy rename and
    drops applied, missing keys at ``GPTConfig``'s defaults, unknown keys refused by name."""
    cfg = dict(model_config)
    if "train_recur_mean" in cfg and "num_recur" not in cfg:
        cfg["num_recur"] = int(cfg.pop("train_recur_mean"))
        notes.append(
            "renamed the legacy config key train_recur_mean to num_recur (as the study's build_model)"
        )
    dropped = [key for key in NANOCHAT_DEPRECATED_KEYS if key in cfg]
    for key in dropped:
        cfg.pop(key)
    if dropped:
        notes.append(f"dropped the deprecated config keys {dropped} (as the study's build_model)")
    check_known_keys(cfg, NANOCHAT_CONFIG_DEFAULTS, "nanochat", where="model_config")
    missing = [key for key in NANOCHAT_CONFIG_DEFAULTS if key not in cfg]
    if missing:
        notes.append(
            f"model_config lacks {missing}: GPTConfig's defaults used, as the study's build_model does"
        )
    return {**NANOCHAT_CONFIG_DEFAULTS, **cfg}


def nanochat_config(model_config: Mapping[str, Any], padded_rows: int | None = None,
                    notes: list[str] | None = None) -> Any:  # fmt: skip
    """The ``LoopedConfig`` of a study ``GPTConfig`` (a meta file's ``model_config``).

    Key by key: ``vocab_size``, ``n_head`` -> ``num_attention_heads``, ``n_kv_head`` ->
    ``num_key_value_heads``, ``n_embd`` -> ``hidden_size`` (head_dim = n_embd // n_head, MLP 4d),
    ``n_prelude`` / ``n_recur_block`` / ``n_coda`` -> the three layer counts, ``num_recur`` ->
    ``num_recurrences``, ``bptt_k`` -> ``backprop_recurrences`` (None when it covers every
    recurrence), ``input_injection`` (``inject_init_prelude`` / ``additive`` / ``passthrough`` /
    ``hyperconnect`` -> ``linear`` / ``add`` / ``none`` / ``hyperconnection``), ``num_lanes`` ->
    ``num_hyperconnection_lanes``, ``logit_softcap``, ``sequence_len`` (the training context) ->
    ``max_position_embeddings``; ``size`` is a label with no effect. ``padded_rows``: the
    embedding's row count in the checkpoint (default: the study's multiple of 64).
    """
    from looped_hf import LoopedConfig

    notes = [] if notes is None else notes
    cfg = _study_model_config(model_config, notes)
    vocab = config_int(cfg, "vocab_size", 1, "model_config")
    n_head, n_kv, d = (config_int(cfg, key, 1, "model_config") for key in ("n_head", "n_kv_head", "n_embd"))
    if d % n_head:
        raise ConversionError(f"model_config.n_embd={d} is not a multiple of n_head={n_head}")
    r = check_recurrences(config_int(cfg, "num_recur", 1, "model_config"), "num_recur", where="model_config")
    bptt = cfg["bptt_k"]
    if bptt is not None and (isinstance(bptt, bool) or not isinstance(bptt, int) or bptt < 1):
        raise ConversionError(f"model_config.bptt_k={bptt!r}: must be None or an integer >= 1")
    injection = cfg["input_injection"]
    if injection not in NANOCHAT_INJECTIONS:
        raise ConversionError(
            f"model_config.input_injection={injection!r}: must be one of {sorted(NANOCHAT_INJECTIONS)}"
        )
    cap = cfg["logit_softcap"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ConversionError(f"model_config.logit_softcap={cap!r}: must be a number > 0")
    multiple = NANOCHAT_VOCAB_MULTIPLE
    if padded_rows is not None and padded_rows != -(-vocab // multiple) * multiple:
        if padded_rows < vocab:
            raise ConversionError(
                f"transformer.wte.weight has {padded_rows} rows, fewer than model_config.vocab_size={vocab}"
            )
        multiple = padded_rows  # any other padding: keep the checkpoint's rows exactly
        notes.append(
            f"the embedding has {padded_rows} rows (not vocab_size rounded up to 64): kept as they are"
        )
    try:
        return LoopedConfig(
            vocab_size=vocab,
            pad_vocab_size_to_multiple_of=multiple,
            hidden_size=d,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv,
            head_dim=d // n_head,
            intermediate_size=4 * d,
            hidden_act="relu2",
            max_position_embeddings=config_int(cfg, "sequence_len", 1, "model_config"),
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_table_dtype="bfloat16",
            qk_norm="after_rope",
            embedding_norm=True,
            recurrence_norm=True,
            tie_word_embeddings=False,
            logit_softcap=None if cap is None else float(cap),
            init_scheme="study",
            num_prelude_layers=config_int(cfg, "n_prelude", 0, "model_config"),
            num_recurrent_layers=config_int(cfg, "n_recur_block", 0, "model_config"),
            num_coda_layers=config_int(cfg, "n_coda", 0, "model_config"),
            num_recurrences=r,
            backprop_recurrences=None if bptt is None or bptt >= r else bptt,
            input_injection=NANOCHAT_INJECTIONS[injection],
            num_hyperconnection_lanes=config_int(cfg, "num_lanes", 1, "model_config"),
        )
    except ValueError as err:
        raise ConversionError(f"model_config {dict(model_config)}: {err}") from None


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------
def flip_second_rotary_half(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``weight`` (a q or k projection, [num_heads * head_dim, d]) with the second half of every
    head's rows negated: the study's RoPE (rotation by -theta) in transformers' (+theta) form.
    Applying it twice gives ``weight`` back."""
    if weight.shape[0] != num_heads * head_dim or head_dim % 2:
        raise ConversionError(f"a q/k weight of shape {tuple(weight.shape)} does not split into {num_heads} heads "
                              f"of {head_dim} (even) dims")  # fmt: skip
    sign = torch.ones(head_dim, dtype=weight.dtype)
    sign[head_dim // 2 :] = -1
    return (weight.view(num_heads, head_dim, -1) * sign[None, :, None]).reshape(weight.shape)


def nanochat_key(key: str) -> str | None:
    """The looped_hf name of a nanochat state-dict key, or ``None`` for a key it does not know."""
    if key in _TOP_LEVEL:
        return _TOP_LEVEL[key]
    match = _LAYER_KEY.match(key)
    if match and match.group(3) in _LAYER_PARTS:
        stage, index, part = match.groups()
        return f"model.{_STAGES[stage]}.{int(index)}.{_LAYER_PARTS[part]}"
    return None


def _renamed(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors under looped_hf names; unknown keys are refused by name."""
    unknown = sorted(key for key in state_dict if nanochat_key(key) is None)
    if unknown:
        raise ConversionError(f"state-dict keys this converter does not know: {unknown[:8]}"
                              f"{' ...' if len(unknown) > 8 else ''}")  # fmt: skip
    return {nanochat_key(key): tensor for key, tensor in state_dict.items()}


def _reparametrised(weights: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """q and k rows flipped for transformers' RoPE (:func:`flip_second_rotary_half`), the rest as is."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            tensor = flip_second_rotary_half(tensor, config.num_attention_heads, config.head_dim)
        elif name.endswith("self_attn.k_proj.weight"):
            tensor = flip_second_rotary_half(tensor, config.num_key_value_heads, config.head_dim)
        out[name] = tensor.contiguous()
    return out


def nanochat_state_dict(state_dict: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under looped_hf names, q and k reparametrised for transformers' RoPE
    (:func:`flip_second_rotary_half`). Unknown keys are refused by name."""
    return _reparametrised(_renamed(state_dict), config)


def nanochat_to_looped(ckpt_dir: PathLike, step: int | str | None = None) -> tuple[Any, NanochatCheckpoint]:
    """Load a nanochat checkpoint as a ``LoopedForCausalLM`` (eval mode, fp32) with the same logits.

    Returns the model and the loaded checkpoint (its meta and the notes of what loading changed).
    """


    ckpt = load_nanochat_checkpoint(ckpt_dir, step)
    wte = ckpt.state_dict.get("transformer.wte.weight")
    if wte is None or wte.dim() != 2:
        raise ConversionError(
            f"{ckpt.model_path}: no 2-d 'transformer.wte.weight' (not a nanochat GPT state dict)"
        )
    config = nanochat_config(ckpt.meta["model_config"], padded_rows=wte.shape[0], notes=ckpt.notes)
    model = build_model(config, _renamed(ckpt.state_dict), torch.float32, ckpt.model_path,
                        transform=lambda weights: _reparametrised(weights, config))  # fmt: skip
    ckpt.notes.append("negated the second half of every head's c_q / c_k rows (the study's RoPE rotates by -theta, "
                      "transformers' by +theta; exact)")  # fmt: skip
    if config.padded_vocab_size != config.vocab_size:
        ckpt.notes.append(f"kept the {config.padded_vocab_size - config.vocab_size} padded vocabulary rows "
                          f"({config.padded_vocab_size} rows, logits cropped to {config.vocab_size})")  # fmt: skip
    return model.eval(), ckpt


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------
#: Where a checkpoint folder keeps its own tokenizer, looked for in this order when --tokenizer is not
#: given: a ``save_pretrained`` folder, or the ``tokenizer.json`` nanochat's ``Tokenizer.save`` writes.
OWN_TOKENIZER = ("tokenizer_config.json", "tokenizer/tokenizer_config.json", "tokenizer.json",
                 "tokenizer/tokenizer.json")  # fmt: skip


def find_tokenizer(ckpt_dir: PathLike, vocab_size: int, notes: list[str]) -> str | None:
    """The tokenizer a checkpoint brings with it, when ``--tokenizer`` is not given: the folder's
    own (``OWN_TOKENIZER``), else looped_hf's embedded tokenizer when the vocabulary has exactly its
    size, else ``None`` (a note says the folder ships without one)."""
    from looped_hf.data.tokenizer import embedded_tokenizer_path

    for relative in OWN_TOKENIZER:
        path = Path(ckpt_dir) / relative
        if path.is_file():
            return str(path.parent if path.name == "tokenizer_config.json" else path)
    embedded = embedded_tokenizer_path()
    from tokenizers import Tokenizer

    if Tokenizer.from_file(str(embedded)).get_vocab_size() == vocab_size:
        notes.append(f"no tokenizer in the checkpoint folder: shipped looped_hf's embedded tokenizer, whose "
                     f"{vocab_size} tokens match vocab_size")  # fmt: skip
        return str(embedded)
    notes.append(f"no tokenizer in the checkpoint folder, and vocab_size={vocab_size} is not the embedded "
                 "tokenizer's: the folder has none (pass --tokenizer, the study's is NousResearch/Llama-2-7b-hf)")  # fmt: skip
    return None


def load_study_tokenizer(name: str, vocab_size: int, notes: list[str] | None = None) -> Any:
    """``AutoTokenizer.from_pretrained(name)`` (a built-in name, ``bytes`` or ``embedded``, through
    ``looped_hf.data.load_tokenizer``), with the study's special tokens added when the
    tokenizer is short of exactly them (its ``get_tokenizer`` adds ``<|assistant_end|>`` to the
    Llama-2 tokenizer); then it must have ``vocab_size`` tokens, as the study's ``build_model`` checks."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from looped_hf.data.tokenizer import BYTES, EMBEDDED, load_tokenizer, split_tokenizer_spec

    notes = [] if notes is None else notes
    try:
        if split_tokenizer_spec(name)[0] in (EMBEDDED, BYTES):  # a built-in name, never a Hub lookup
            tokenizer = load_tokenizer(name)
        elif Path(name).is_file():  # a tokenizers file, as nanochat's Tokenizer.save writes it
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(name))
        else:
            tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a plain Exception for a broken file
        raise ConversionError(
            f"--tokenizer {name!r}: could not be loaded ({type(err).__name__}: {err})"
        ) from None
    vocab = tokenizer.get_vocab()
    absent = [tok for tok in NANOCHAT_SPECIAL_TOKENS if tok not in vocab]
    if absent and len(tokenizer) + len(absent) == vocab_size:
        tokenizer.add_special_tokens({"additional_special_tokens": absent})
        notes.append(
            f"added the study's special tokens {absent} to the tokenizer {name} (nanochat/tokenizer.py)"
        )
    if len(tokenizer) != vocab_size:
        raise ConversionError(
            f"--tokenizer {name!r} has {len(tokenizer)} tokens but model_config.vocab_size={vocab_size}: "
            "not the tokenizer this model was trained with"
        )
    return tokenizer


# --------------------------------------------------------------------------------------------
# The card
# --------------------------------------------------------------------------------------------
_CARD_BODY = """
# {{ model_name }}

A **looped (depth-recurrent) language model** converted from a checkpoint of the iso-depth study's code ([kschwethelm/looped-lm-scaling]({{ study_url }}), a nanochat fork) into transformers with {{ looped_hf }}: a block of {{ config.num_recurrent_layers }} shared layers is applied **r = {{ config.num_recurrences }}** times between a prelude of {{ config.num_prelude_layers }} and a coda of {{ config.num_coda_layers }} layers.

## Where the weights came from

| | value |
|---|---|
| source file | `{{ source.file }}` (sha256 `{{ source.sha256 }}`) |
| training step | {{ source.step }} |
| training tokens | {{ source.tokens }} |
| validation loss (the study's `evaluate_loss`, nats/token) | {{ source.val_loss }} |
| training FLOPs (looped-aware count, computed from the config and tokens) | {{ source.train_flops }} |

The study's `model_config`:

```json
{{ source.model_config }}
```

What the conversion changed (none of it changes the logits):

{% for note in notes %}- {{ note }}
{% endfor %}
## Architecture

```
{{ diagram }}
```

| | value |
|---|---|
| width / heads x head dim / MLP | {{ config.hidden_size }} / {{ config.num_attention_heads }} x {{ config.head_dim }} / {{ config.intermediate_size }} (squared ReLU) |
| vocabulary (embedding rows) / training context | {{ config.vocab_size }} ({{ config.padded_vocab_size }}) / {{ config.max_position_embeddings }} |
| input injection | `{{ config.input_injection }}` |
| N_once (prelude + coda + norms) / N_rec (block + injection) | {{ params.once }} / {{ params.recurrent }} |
| embedding / lm_head / total parameters | {{ params.embedding }} / {{ params.lm_head }} / {{ params.total }} |

## How to use

```python
from transformers import AutoModelForCausalLM{% if tokenizer %}, AutoTokenizer{% endif %}

model = AutoModelForCausalLM.from_pretrained("{{ repo_id }}", trust_remote_code=True)
{% if tokenizer %}tokenizer = AutoTokenizer.from_pretrained("{{ repo_id }}")
inputs = tokenizer("The capital of France is", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
{% endif %}```

{% if config.input_injection == "hyperconnection" %}This model uses hyperconnections: its lane parameters are indexed by recurrence step, so it runs only at r = {{ config.num_recurrences }}.{% else %}`forward` and `generate` take `num_recurrences=` (test-time compute), `kv_budget=` (the study's KV-cache budget) and `exit_criterion=` (per-token adaptive exit).{% endif %}
"""


def _card(model: Any, ckpt: NanochatCheckpoint, repo_id: str, license: str | None, tokenizer: bool) -> Any:
    """The converted checkpoint's model card: the ``looped:`` metadata block of a published looped_hf
    checkpoint, plus a ``converted_from:`` block, and a body saying where the weights came from."""
    from huggingface_hub import ModelCard

    from looped_hf import __version__
    from looped_hf.cards import architecture_diagram, checkpoint_card_data, si
    from looped_hf.cards.common import _count, _project_link

    config, meta = model.config, ckpt.meta
    params = model.num_scaling_params()
    tokens = meta.get("tokens")
    flops = None
    if isinstance(tokens, (int, float)) and tokens > 0:
        flops = float(model.training_flops_per_token(config.max_position_embeddings) * tokens)
    val_loss = meta.get("val_loss")
    if not isinstance(val_loss, (int, float)) or not math.isfinite(val_loss):
        raise ConversionError(
            f"{ckpt.meta_path}: val_loss={val_loss!r}, the card needs a finite validation loss"
        )
    record = {"loss": float(val_loss), "tokens": tokens, "train_flops": flops}
    data = checkpoint_card_data(record, config, params, model_name=repo_id.split("/")[-1],
                                license=license or "other")  # fmt: skip
    # The study's validation split is not a looped_hf held-out split: no model-index claim about it.
    data.eval_results = None
    data.license = license
    data.tags = [*data.tags, "nanochat", "converted"]
    data.converted_from = {
        "format": "nanochat", "code": STUDY_URL, "file": ckpt.model_path.name, "sha256": ckpt.sha256,
        "step": ckpt.step, "tokens": tokens, "val_loss": float(val_loss),
        "model_config": dict(meta["model_config"]), "looped_hf_version": __version__,
    }  # fmt: skip
    source = {
        "file": ckpt.model_path.name, "sha256": ckpt.sha256, "step": ckpt.step, "tokens": _count(tokens),
        "val_loss": f"{float(val_loss):.6f}", "train_flops": si(flops),
        "model_config": json.dumps(meta["model_config"], indent=2),
    }  # fmt: skip
    return ModelCard.from_template(
        data, template_str="---\n{{ card_data }}\n---\n" + _CARD_BODY, model_name=repo_id.split("/")[-1],
        repo_id=repo_id, study_url=STUDY_URL, looped_hf=_project_link(), config=config, source=source,
        notes=ckpt.notes, diagram=architecture_diagram(config), tokenizer=tokenizer,
        params={key: _count(value) for key, value in params.items()},
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------
def convert_nanochat(
    ckpt_dir: PathLike,
    out: PathLike,
    *,
    step: int | str | None = None,
    tokenizer: str | None = None,
    repo_id: str | None = None,
    license: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hub-ready looped_hf folder for one nanochat checkpoint and return its path.

    Args:
        ckpt_dir: the directory holding ``model_<step>.pt`` and ``meta_<step>.json``.
        out: the folder to write (built in a temporary sibling, moved into place at the end).
        step: a step number or alias (default: the largest numbered step).
        tokenizer: a tokenizer name or path for ``AutoTokenizer`` (or a ``tokenizer.json`` file);
            saved into the folder after the vocabulary check (:func:`load_study_tokenizer`).
            Default: the checkpoint folder's own, else the embedded one when the vocabulary
            sizes match, else none (:func:`find_tokenizer`; the card's notes say which).
        repo_id: ``ORG/NAME`` for the card's loading code (default: the folder's name).
        license: license id for the card metadata (default: none stated).
        overwrite: replace an existing ``out`` (otherwise refused).

    Raises:
        ConversionError: a file missing or refused, an unknown key, weights that do not fit.
        PublishError: ``out`` exists without ``overwrite``, or a bad ``repo_id``.
    """
    from looped_hf.cards import CARD_NAME

    dest = check_target(ckpt_dir, out, overwrite=overwrite, repo_id=repo_id)
    model, ckpt = nanochat_to_looped(ckpt_dir, step)
    tok = None
    if tokenizer is None:
        tokenizer = find_tokenizer(ckpt_dir, model.config.vocab_size, ckpt.notes)
    if tokenizer is not None:
        tok = load_study_tokenizer(tokenizer, model.config.vocab_size, ckpt.notes)
        for attr in ("bos_token_id", "eos_token_id"):
            value = getattr(tok, attr, None)
            if value is not None:
                setattr(model.config, attr, value)
                setattr(model.generation_config, attr, value)

    def extras(tmp: Path) -> list[str]:
        if tok is not None:
            tok.save_pretrained(tmp)
        card = _card(model, ckpt, repo_id or f"path/to/{dest.name}", license, tok is not None)
        card.save(tmp / CARD_NAME)
        return ["tokenizer_config.json"] if tok is not None else []

    return write_folder(model, dest, extras)


__all__ = [
    "ConversionError",
    "NanochatCheckpoint",
    "convert_nanochat",
    "flip_second_rotary_half",
    "latest_nanochat_step",
    "load_nanochat_checkpoint",
    "find_tokenizer",
    "load_study_tokenizer",
    "nanochat_config",
    "nanochat_key",
    "nanochat_state_dict",
    "nanochat_to_looped",
]



#: The format-only ``looped-hf convert`` flags this format reads.
CLI_OPTIONS = ("step", "tokenizer")


def convert_cli(source_format: str, ckpt_dir: PathLike, out: PathLike, *, repo_id: str | None,
                license: str | None, overwrite: bool, step: int | str | None = None,
                tokenizer: str | None = None) -> Path:  # fmt: skip
    """``looped-hf convert nanochat``: :func:`convert_nanochat`; says so when the folder has no tokenizer."""
    folder = convert_nanochat(ckpt_dir, out, step=step, tokenizer=tokenizer, repo_id=repo_id, license=license,
                              overwrite=overwrite)  # fmt: skip
    if not (folder / "tokenizer_config.json").is_file():
        print(f"[convert] no tokenizer: {ckpt_dir} has none and its vocabulary is not the embedded tokenizer's; "
              "pass --tokenizer NAME (the study's: NousResearch/Llama-2-7b-hf) to serve or evaluate the folder")  # fmt: skip
    return folder
