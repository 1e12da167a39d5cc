"""Qwen parents.

* ``Qwen2ForCausalLM``: q, k and v have a bias, o has none (transformers' ``Qwen2Attention``).
  ``qk_bias`` would drop v's, so the folder uses ``attention_bias=True`` (all four) with o's bias
  zero: the same function, exactly.
* ``Qwen3ForCausalLM``: a per-head RMSNorm with a learnable scale on q and k, after the
  projection and the head split, before RoPE (``Qwen3Attention``: ``q_norm(q_proj(x).view(...,
  head_dim))``, eps ``rms_norm_eps``): looped_hf's ``qk_norm="learnable_before_rope"``, the same
  placement (``LoopedAttention``). ``attention_bias`` (all four projections) carries over.
"""

from __future__ import annotations

from typing import Any

from .family import Family, Option, common_fields, no_flag, refuse_sliding_window


def qwen2_fields(cfg: Any) -> dict[str, Any]:
    refuse_sliding_window(cfg)
    return {**common_fields(cfg), "attention_bias": True}


def qwen3_fields(cfg: Any) -> dict[str, Any]:
    refuse_sliding_window(cfg)
    return {**common_fields(cfg), "attention_bias": bool(getattr(cfg, "attention_bias", False)),
            "qk_norm": "learnable_before_rope"}  # fmt: skip


#: Qwen's sliding window, switched on, applies to the layers past ``max_window_layers``: refused by
#: name whatever the window (looped_hf attends to the whole context).
SLIDING = Option("use_sliding_window", lambda v: v is not True,
                 "Qwen's sliding attention window is not a looped_hf option")  # fmt: skip
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), qwen2_fields, zero_init=("self_attn.o_proj.bias",),
               options=(SLIDING, no_flag("attention_bias", "Qwen2Attention's biases are fixed: q, k, v, not o"),
                        no_flag("mlp_bias", "Qwen2MLP has no bias")))  # fmt: skip
QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    qwen3_fields,
    options=(SLIDING, no_flag("mlp_bias", "Qwen3MLP has no bias")),
)

__all__ = ["QWEN2", "QWEN3", "qwen2_fields", "qwen3_fields"]
