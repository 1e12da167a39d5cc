"""A parent family: the ``architectures`` names it maps, and its ``LoopedConfig`` fields.

What every family shares is here (``common_fields``: width, heads, GQA, MLP, RoPE incl. scaling,
vocabulary, tied head, special tokens); what differs (norm placement, QK-norm, biases, the
refusals of what looped_hf cannot reproduce) is one small module per family (``llama.py``,
``qwen.py``, ``olmo2.py``). Every family stores its layers under transformers' names
(``model.layers.<i>.self_attn.q_proj.weight``, ...) and the looped layers use the same suffixes,
so a layer maps name for name; ``zero_init`` names the looped tensors the parent has no source for
(they start at zero, which is exact).

A parent config option that changes the function and that the mapping does not carry is refused
by name and value before any tensor is read: ``COMMON_OPTIONS`` for every family (activation, RoPE
type) and each family's ``options`` table (bias flags its transformers class ignores,
Qwen's ``use_sliding_window``, OLMo's ``clip_qkv``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..convert.common import ConversionError


@dataclass(frozen=True)
class Option:
    """A parent config field the mapping carries only at the values ``ok`` accepts (``why`` says
    what the other values would change). ``read`` gets the value (default: the attribute; a
    config.json key the class does not declare is kept as one)."""

    field: str
    ok: Callable[[Any], bool]
    why: str
    read: Callable[[Any], Any] | None = None

    def check(self, cfg: Any) -> None:
        value = self.read(cfg) if self.read is not None else getattr(cfg, self.field, None)
        if not self.ok(value):
            raise ConversionError(f"config.json {self.field}={value!r}: {self.why}")


def _absent_or_false(value: Any) -> bool:
    return value is None or value is False


def no_flag(field: str, what: str) -> Option:
    """``field`` must be unset or false: the family's transformers class has no such switch (``what``
    it has instead), so a true value says the weights are not what the class runs."""
    return Option(field, _absent_or_false, f"{what}; retrofit maps the class as transformers runs it")


#: RoPE types whose looped tables are pinned against the parent's (tests/test_retrofit.py).
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")

#: What every family refuses.
COMMON_OPTIONS = (
    Option("hidden_act", lambda v: v == "silu",
           "the families' MLP is gated silu (SwiGLU); another activation is not a mapping retrofit carries"),
    Option("rope_parameters.rope_type", lambda v: v in ROPE_TYPES, f"retrofit carries the RoPE types {ROPE_TYPES}",
           read=lambda cfg: (cfg.rope_parameters or {}).get("rope_type", "default")),
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One parent family. ``fields(cfg)``: the family's own ``LoopedConfig`` fields (or a refusal,
    a ``ConversionError`` naming the config field and value) for the parent's transformers config;
    ``options``: the family's refused option values, checked with ``COMMON_OPTIONS`` first."""

    name: str
    architectures: tuple[str, ...]
    fields: Callable[[Any], dict[str, Any]]
    zero_init: tuple[str, ...] = ()
    options: tuple[Option, ...] = ()

    def looped_fields(self, cfg: Any) -> dict[str, Any]:
        """``fields(cfg)`` after every option check, each refusal naming the field and value."""
        for option in (*COMMON_OPTIONS, *self.options):
            option.check(cfg)
        return self.fields(cfg)


def head_dim(cfg: Any) -> Any:
    """The head size the families' attention uses: ``head_dim`` when the config sets it, else
    ``hidden_size // num_attention_heads`` (transformers' ``getattr(config, "head_dim", ...)``)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def common_fields(cfg: Any) -> dict[str, Any]:
    """The ``LoopedConfig`` fields every family maps the same way, from the parent's transformers
    config (RoPE settings as transformers 5 normalised them into ``rope_parameters``)."""
    rope = dict(cfg.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if float(getattr(cfg, "partial_rotary_factor", None) or rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json partial_rotary_factor={rope.get('partial_rotary_factor')!r}: looped_hf "
                              "rotates every head dimension")  # fmt: skip
    heads = cfg.num_attention_heads
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
        head_dim=head_dim(cfg),
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


__all__ = [
    "COMMON_OPTIONS",
    "ROPE_TYPES",
    "Family",
    "Option",
    "common_fields",
    "no_flag",
    "refuse_sliding_window",
]
