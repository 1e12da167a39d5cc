"""A parent family: the ``architectures`` names it maps, and its ``LoopedConfig`` fields.

What every family shares is here (``common_fields``: width, heads, GQA, MLP, RoPE incl. scaling,
vocabulary, tied head, special tokens); what differs (norm placement, QK-norm, biases, the
refusals of what looped_hf cannot reproduce) is one small module per family (``llama.py``,
``qwen.py``, ``olmo2.py``). Every family stores its layers under transformers' names
(``model.layers.<i>.self_attn.q_proj.weight``, ...) and the looped layers use the same suffixes,
so a layer maps name for name; ``zero_init`` names the looped tensors the parent has no source for
(they start at zero, which is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..convert.common import ConversionError


@dataclass(frozen=True)
class Family:
    """One parent family. ``fields(cfg)``: the family's own ``LoopedConfig`` fields (or a refusal,
    a ``ConversionError`` naming the config field and value) for the parent's transformers config."""

    name: str
    architectures: tuple[str, ...]
    fields: Callable[[Any], dict[str, Any]]
    zero_init: tuple[str, ...] = ()


def common_fields(cfg: Any) -> dict[str, Any]:
    """The ``LoopedConfig`` fields every family maps the same way, from the parent's transformers
    config (RoPE settings as transformers 5 normalised them into ``rope_parameters``)."""
    rope = dict(cfg.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if float(getattr(cfg, "partial_rotary_factor", None) or rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json partial_rotary_factor={rope.get('partial_rotary_factor')!r}: looped_hf "
                              "rotates every head dimension")  # fmt: skip
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    token_ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, key, None)
        ids = value if isinstance(value, list) else [value]
        if value is not None and all(isinstance(i, int) and 0 <= i < cfg.vocab_size for i in ids):
            token_ids[key] = value
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        # A dense transformers LM has none of the study's extra stabilisers.
        embedding_norm=False,
        logit_softcap=None,
        recurrence_norm=False,
        qk_norm="none",
        norm_placement="pre",
        **token_ids,
    )


def refuse_sliding_window(cfg: Any) -> None:
    """A sliding window that applies within the context changes attention, which looped_hf has not."""
    window = getattr(cfg, "sliding_window", None)
    used = getattr(cfg, "use_sliding_window", True)
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if "sliding_attention" in layer_types or (
        used and window is not None and window < cfg.max_position_embeddings
    ):
        raise ConversionError(f"config.json sliding_window={window!r}: a sliding attention window inside the context "
                              f"(max_position_embeddings={cfg.max_position_embeddings}) is not a looped_hf option")  # fmt: skip


__all__ = ["Family", "common_fields", "refuse_sliding_window"]
