"""``Olmo2ForCausalLM``: the norms on the sublayer outputs (x = x + n1(attn x); x = x + n2(mlp x),
``norm_placement="sublayer_output"``, the same names: ``post_attention_layernorm`` /
``post_feedforward_layernorm``) and one RMSNorm over the whole q (and k) projection before the
head split and RoPE (``qk_norm="learnable_projection_before_rope"``), as ``looped-hf convert
retrofit-olmo`` maps the paper's OLMo retrofits. OLMo's ``clip_qkv`` (not in ``Olmo2Attention``)
and ``mlp_bias`` (``Olmo2MLP`` has none) are refused when set."""

from __future__ import annotations

from typing import Any

from .family import Family, Option, common_fields, no_flag


def olmo2_fields(cfg: Any) -> dict[str, Any]:
    return {**common_fields(cfg), "attention_bias": bool(getattr(cfg, "attention_bias", False)),
            "norm_placement": "sublayer_output", "qk_norm": "learnable_projection_before_rope"}  # fmt: skip


OLMO2 = Family("olmo2", ("Olmo2ForCausalLM",), olmo2_fields,
               options=(Option("clip_qkv", lambda v: v is None, "OLMo's q/k/v clipping is not in Olmo2Attention nor "
                                                              "looped_hf (OLMo-2 trains without it)"),
                        no_flag("mlp_bias", "Olmo2MLP has no bias")))  # fmt: skip

__all__ = ["OLMO2", "olmo2_fields"]
