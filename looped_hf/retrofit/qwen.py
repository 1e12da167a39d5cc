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

from .family import Family, common_fields, refuse_sliding_window


def qwen2_fields(cfg: Any) -> dict[str, Any]:
    refuse_sliding_window(cfg)
    return {**common_fields(cfg), "attention_bias": True}


def qwen3_fields(cfg: Any) -> dict[str, Any]:
    refuse_sliding_window(cfg)
    return {**common_fields(cfg), "attention_bias": bool(getattr(cfg, "attention_bias", False)),
            "qk_norm": "learnable_before_rope"}  # fmt: skip


QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), qwen2_fields, zero_init=("self_attn.o_proj.bias",))
QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), qwen3_fields)

__all__ = ["QWEN2", "QWEN3", "qwen2_fields", "qwen3_fields"]
