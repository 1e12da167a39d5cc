"""The per-loop LoRA model's old import path: the model type lives beside the other models, as
shipped remote code (``looped_hf/loop_lora_looped.py``); this module re-exports its names."""

from __future__ import annotations

from ..loop_lora_looped import (
    LOOP_LORA_TARGETS,
    LoopLoRA,
    LoopLoRAConfig,
    LoopLoRAForCausalLM,
    LoRAPair,
    NormDelta,
    delta_key,
    norm_keys,
)

__all__ = [
    "LOOP_LORA_TARGETS",
    "LoRAPair",
    "LoopLoRA",
    "LoopLoRAConfig",
    "LoopLoRAForCausalLM",
    "NormDelta",
    "delta_key",
    "norm_keys",
]
