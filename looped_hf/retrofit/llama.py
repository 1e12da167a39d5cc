"""Llama-shaped parents: ``LlamaForCausalLM`` (Llama 2 / 3 incl. llama3 RoPE scaling, TinyLlama,
SmolLM) and ``MistralForCausalLM`` (the same layer; its sliding window only where it never
applies). Pre-norm layers, no QK-norm; Llama's ``attention_bias`` / ``mlp_bias`` carry over as
they are; Mistral's classes have no bias, so a config that sets either flag is refused."""

from __future__ import annotations

from typing import Any

from .family import Family, common_fields, no_flag, refuse_sliding_window


def llama_fields(cfg: Any) -> dict[str, Any]:
    refuse_sliding_window(cfg)
    return {**common_fields(cfg), "attention_bias": bool(getattr(cfg, "attention_bias", False)),
            "mlp_bias": bool(getattr(cfg, "mlp_bias", False))}  # fmt: skip


LLAMA = Family("llama", ("LlamaForCausalLM",), llama_fields)
MISTRAL = Family("mistral", ("MistralForCausalLM",), llama_fields,
                 options=(no_flag("attention_bias", "MistralAttention has no projection bias"),
                          no_flag("mlp_bias", "MistralMLP has no bias")))  # fmt: skip

__all__ = ["LLAMA", "MISTRAL", "llama_fields"]
