"""IQuest's gated global + local loop attention (``LoopedConfig.loop_attention``) on vLLM's layers.

The KV cache is laid out as vLLM's own ``iquest_loopcoder.py`` lays it out: the block's first
recurrence writes full-attention slots; every later recurrence's slots are ``Attention`` layers
whose cache config has ``sliding_window = loop_window_size`` (vLLM's sliding-window KV: blocks past
the window are freed, its kernel attends to the last ``loop_window_size`` positions). At a later
recurrence, block layer j's query reads the first recurrence's slot without writing it
(``Attention(q, None, None)``, as vLLM's model does), attends through its own windowed slot, and the
two outputs are mixed per head by ``model.gate_projections.j``: g = sigmoid(q . W_h + b_h),
g * global + (1 - g) * local, q after RoPE, as ``loop_attention_looped.GatedLoopAttention`` (the
one statement of the design; this file runs it on the paged cache).

Per-request depth: the slots are the deepest request's (``depth.ServedDepth``); a request at r
writes the first r recurrences' slots. vLLM puts full-attention and sliding-window layers into
separate KV-cache groups, each with its own block table: ``batch_depth.BatchDepth.attend`` builds a
subset's metadata from each layer's own group.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..configuration_looped import LoopedConfig
from ..generation_looped import KVSlotPlan


def windowed_slots(config: LoopedConfig, plan: KVSlotPlan) -> frozenset[int]:
    """The KV slots of the block's recurrences after the first (the local reads' sliding windows);
    empty without the loop attention."""
    if config.loop_attention is None:
        return frozenset()
    return frozenset(
        plan.block(step, j) for step in range(1, plan.num_recurrences) for j in range(plan.num_recurrent)
    )


def slot_cache_config(vllm_config, config: LoopedConfig, plan: KVSlotPlan, slot: int):
    """The cache config of KV slot ``slot``: the engine's, with ``sliding_window = loop_window_size``
    for a later recurrence's slot (vLLM's ``iquest_loopcoder.py`` does the same per loop)."""
    if slot not in windowed_slots(config, plan):
        return vllm_config.cache_config
    return dataclasses.replace(vllm_config.cache_config, sliding_window=config.loop_window_size)


def build_loop_gates(config: LoopedConfig) -> nn.ModuleList | None:
    """``model.gate_projections``: one Linear(head_dim -> heads) per block layer (weight (heads,
    head_dim), the checkpoint's), or None without the loop attention."""
    if config.loop_attention is None:
        return None
    return nn.ModuleList(
        nn.Linear(config.head_dim, config.num_attention_heads) for _ in range(config.num_recurrent_layers)
    )


class GatedVllmAttention:
    """Stands in for a later recurrence's ``Attention`` in ``_LoopedAttention.forward``, which calls
    ``attn(q, k, v)`` with q, k, v of (tokens, heads * size) after RoPE (each head zero-padded to the
    attention head size where the CPU kernel needs it: the gate reads the true head_dim columns)."""

    def __init__(
        self, global_attn: nn.Module, local_attn: nn.Module, gate: nn.Linear, attention: nn.Module
    ) -> None:
        self.global_attn, self.local_attn, self.gate = global_attn, local_attn, gate
        self.num_heads, self.head_dim = attention.num_heads, attention.head_dim
        self.size = attention.attn_head_size

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tokens = q.shape[0]
        global_out = self.global_attn(q, None, None)  # reads recurrence 1's cache, writes nothing
        local_out = self.local_attn(q, k, v)
        heads = q.view(tokens, self.num_heads, self.size)[..., : self.head_dim]
        logits = torch.einsum("thd,hd->th", heads, self.gate.weight.to(q.dtype)) + self.gate.bias.to(q.dtype)
        g = torch.sigmoid(logits).unsqueeze(-1)
        shape = (tokens, self.num_heads, self.size)
        return (g * global_out.reshape(shape) + (1 - g) * local_out.reshape(shape)).reshape(tokens, -1)


__all__ = ["GatedVllmAttention", "build_loop_gates", "slot_cache_config", "windowed_slots"]  # fmt: skip
