"""Gated global + local loop attention (``LoopedConfig.loop_attention="gated_global_local"``).

IQuest-Coder-V1-Loop's design: the first recurrence is a plain causal pass that keeps each block
layer's K/V; at every later recurrence, block layer j's query q (after RoPE) attends to

* the first recurrence's K/V of layer j over the whole prefix (global), and
* its own recurrence's K/V within the last ``loop_window_size`` positions, itself included (local),

and the two outputs are mixed per head and position, g * global + (1 - g) * local, with
g = sigmoid(q . W_h + b_h) from ``model.gate_projections.j`` (the released checkpoints' own name).

Built when the model is built (``build_loop_attention``): the block layers' attention becomes
``GatedLoopAttention`` (the same parameters under the same names) and the gates a module list, or
nothing at all without the option. Each forward, ``LoopedRecurrentBlock`` hands every block layer
application a ``LoopAttentionCall`` (``LoopAttentionKV.at``): at the first recurrence the layer
runs its plain attention and leaves its K/V there; later recurrences read them.

The KV cache: recurrence 1's slots keep every position; a later recurrence's slot is a
``LoopWindowLayer`` that keeps only the last ``loop_window_size`` - 1 positions (all that a later
query's window reaches), so decoding one token at a time gives the prefill's logits exactly.

Shipped beside ``modeling_looped.py`` in every checkpoint (remote code follows the relative
import), so it imports only torch, transformers and the looped modules it names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .configuration_looped import LoopedConfig
from .decoder_layers_looped import LoopedAttention, repeat_kv


class LoopGate(nn.Linear):
    """One block layer's gate, g_h = sigmoid(q_h . W[h] + b[h]) per head h: an ``nn.Linear``
    (head_dim -> heads) so that its weight is (heads, head_dim) as in the released checkpoints and
    transformers' init applies (W ~ N(0, initializer_range), b = 0: g = 1/2 at init). Only the
    diagonal of the linear map is read: head h's query with head h's row."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config.head_dim, config.num_attention_heads, bias=True)

    def gate(self, query: torch.Tensor) -> torch.Tensor:
        """(batch, heads, tokens, 1) gates from the (batch, heads, tokens, head_dim) query."""
        logits = torch.einsum("bhtd,hd->bht", query, self.weight.to(query.dtype))
        return torch.sigmoid(logits + self.bias.to(query.dtype)[None, :, None]).unsqueeze(-1)


class LoopWindowLayer(DynamicLayer):
    """A later recurrence's cache slot: ``update`` returns the kept positions and the new ones, and
    keeps only the last ``window - 1`` (the most any later query's window reaches).
    ``get_seq_length`` counts every position written, as a full slot would."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.seen = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        keep = self.window - 1
        self.keys = keys[:, :, keys.shape[-2] - min(keep, keys.shape[-2]) :]
        self.values = values[:, :, values.shape[-2] - min(keep, values.shape[-2]) :]
        return keys, values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def crop(self, max_length: int) -> None:
        # Dropped positions outside the window cannot come back: refused, never silently wrong.
        raise ValueError(f"loop_window_size={self.window}: a windowed loop-attention cache slot cannot be cropped "
                         "(assisted / speculative decoding is not supported with loop_attention)")  # fmt: skip

    def reset(self) -> None:
        super().reset()
        self.seen = 0


class LoopAttentionKV:
    """One forward's view of the loop attention: the gates, the window, and the first recurrence's
    K/V of each block layer (all positions the call's queries see, cached ones included)."""

    def __init__(self, gates: nn.ModuleList, window: int, kv_budget: int | None = None) -> None:
        """``kv_budget``: the call's effective budget when it shares slots (below r), refused."""
        if kv_budget is not None:
            raise ValueError(f"kv_budget={kv_budget}: refused with loop_attention (recurrence 1's KV is read by "
                             "every later recurrence, so each recurrence keeps its own cache slots)")  # fmt: skip
        self.gates, self.window = gates, window
        self.first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, step: int, j: int) -> LoopAttentionCall:
        return LoopAttentionCall(self, step, j)


class LoopAttentionCall:
    """What block layer ``j``'s attention at recurrence ``step`` (0-based) needs from the forward."""

    def __init__(self, kv: LoopAttentionKV, step: int, j: int) -> None:
        self.kv, self.step, self.j = kv, step, j

    def update(self, cache: Cache | None, cache_index: int, key: torch.Tensor, value: torch.Tensor):
        """The first recurrence's cache write (``LoopedAttention`` calls ``cache.update``): written
        as usual, and the K/V it returns kept for the later recurrences."""
        if cache is not None:
            key, value = cache.update(key, value, cache_index)
        self.kv.first[self.j] = (key, value)
        return key, value


class _RecordingCache:
    """Stands in for the cache in the first recurrence's plain attention, which calls only
    ``update``: it writes through and records the K/V (``LoopAttentionCall.update``)."""

    def __init__(self, call: LoopAttentionCall, cache: Cache | None) -> None:
        self.call, self.cache = call, cache

    def update(self, key: torch.Tensor, value: torch.Tensor, cache_index: int, *args, **kwargs):
        return self.call.update(self.cache, cache_index, key, value)


def _allowed(mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The (batch or 1, 1, q_len, kv_len) boolean mask of the global read: the call's own mask
    (padding, packed documents) where it gives one, else plain causal over the cached prefix."""
    if mask is None:
        past = kv_len - q_len
        rows = torch.arange(q_len, device=device)[:, None] + past
        return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"loop_attention: an attention mask of type {type(mask).__name__} is not supported; "
                         "use attn_implementation='sdpa' or 'eager'")  # fmt: skip
    if mask.dim() == 2:  # flash attention's (batch, kv_len) padding mask
        return _allowed(None, q_len, kv_len, device) & mask.bool()[:, None, None, -kv_len:]
    if mask.shape[-1] != kv_len or mask.shape[-2] != q_len:
        raise ValueError(f"loop_attention: the attention mask has shape {tuple(mask.shape)}, expected "
                         f"(..., {q_len}, {kv_len})")  # fmt: skip
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive: 0 where allowed, the dtype's min elsewhere


def _attend(module: LoopedAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            allowed: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Softmax attention (batch, heads, tokens, head_dim) in float32, as the eager path; a row with
    no allowed key (a padding position) gets the dtype's minimum everywhere, never NaN."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * module.scaling
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


class GatedLoopAttention(LoopedAttention):
    """A block layer's attention under ``loop_attention="gated_global_local"``: the plain attention
    at the first recurrence (its K/V kept), the gated global + local read at later ones (see the
    module docstring). The parameters are ``LoopedAttention``'s, under the same names."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache, cache_index,
                loop_attention: LoopAttentionCall | None = None, **kwargs):  # fmt: skip
        if loop_attention is None:
            raise ValueError(
                "GatedLoopAttention runs inside the loop only (LoopedRecurrentBlock gives it its call)"
            )
        if loop_attention.step == 0:
            recording = _RecordingCache(loop_attention, cache)
            return super().forward(
                hidden_states, position_embeddings, attention_mask, recording, cache_index, **kwargs
            )
        if kwargs.get("loop_deltas") is not None:  # its gated read below has no per-loop delta path
            raise ValueError("loop_attention: per-loop LoRA deltas (loop_lora_looped.py) are not supported with "
                             "the gated global + local read")  # fmt: skip
        if cache is not None and not isinstance(cache, Cache):
            raise ValueError("loop_attention: adaptive exit (exit_criterion) is not supported (recurrences >= 2 "
                             "read recurrence 1's KV of every token)")  # fmt: skip
        input_shape = hidden_states.shape[:-1]
        # The layer's own q, k, v (its QK-norm and value embedding included): the gate reads q
        # after RoPE and after any QK-norm, as the global and local reads do.
        query, key, value = self.project(hidden_states, position_embeddings, None,
                                         kwargs.pop("value_embeddings", None))  # fmt: skip
        call = loop_attention
        first_key, first_value = call.kv.first[call.j]
        q_len, kv_len = query.shape[-2], first_key.shape[-2]
        allowed = _allowed(attention_mask, q_len, kv_len, query.device)
        if cache is not None:
            slot = cache.layers[cache_index]
            if not isinstance(slot, DynamicLayer):
                # A static or quantised layer keeps positions at fixed places, not the last window.
                raise ValueError(f"loop_attention: a {type(slot).__name__} cache slot cannot hold a windowed "
                                 "loop's KV; use the default DynamicCache")  # fmt: skip
            if not isinstance(slot, LoopWindowLayer):
                if slot.is_initialized:
                    raise ValueError(f"loop_attention: cache slot {cache_index} was filled by another model's "
                                     "forward (a full slot where a windowed one belongs)")  # fmt: skip
                cache.layers[cache_index] = LoopWindowLayer(call.kv.window)
            key, value = cache.update(key, value, cache_index)
        # The local keys are the last ones of the global read's positions: the same mask's last
        # columns, of which each query keeps its last ``window`` allowed keys (itself included).
        # Counted over allowed keys, not cache indices, so a left-padded row's window holds as
        # many real tokens as the unpadded row's, and a packed document's stays inside it.
        local_allowed = allowed[..., kv_len - key.shape[-2] :]
        from_the_end = local_allowed.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)
        local_allowed = local_allowed & (from_the_end <= call.kv.window)
        global_out = _attend(self, query, first_key, first_value, allowed)
        local_out = _attend(self, query, key, value, local_allowed)
        g = call.kv.gates[call.j].gate(query)
        out = (g * global_out + (1 - g) * local_out).transpose(1, 2).reshape(*input_shape, -1)
        return self.o_proj(out), None


def build_loop_attention(model: nn.Module, config: LoopedConfig) -> None:
    """Give ``model`` (``LoopedModel``) the loop attention its config names: the block layers'
    attention becomes ``GatedLoopAttention`` and ``model.gate_projections`` holds one ``LoopGate``
    per block layer; ``None`` without the option (nothing else changes)."""
    model.gate_projections = None
    if config.loop_attention is None:
        return
    for layer in model.recurrent_layers:
        layer.self_attn = GatedLoopAttention(config)
    model.gate_projections = nn.ModuleList(LoopGate(config) for _ in model.recurrent_layers)


def loop_attention_kv(model: nn.Module, plan: object) -> LoopAttentionKV | None:
    """The forward's ``LoopAttentionKV`` for ``model`` at ``plan`` (a ``KVSlotPlan``), or ``None``."""
    gates = getattr(model, "gate_projections", None)
    if gates is None:
        return None
    return LoopAttentionKV(
        gates, model.config.loop_window_size, plan.kv_budget if plan.shares_slots else None
    )


__all__ = ["GatedLoopAttention", "LoopAttentionKV", "LoopGate", "LoopWindowLayer", "build_loop_attention",
           "loop_attention_kv"]  # fmt: skip
