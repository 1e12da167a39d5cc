"""The decoder layers of a looped model: Llama's layer (RoPE, GQA, its attention interfaces) with
the study's switches (squared-ReLU MLP, QK-norm variants, QK bias), one class per norm placement.

``LoopedConfig.norm_placement`` picks the class (``DECODER_LAYERS``): pre-norm (Llama, the study),
sandwich (Huginn), sublayer-output (OLMo-2), pre-and-output (Ouro, Gemma-2). ``modeling_looped.py``
stacks them into the prelude, the shared block and the coda; the vLLM model runs their forwards on
vLLM's projections. Shipped beside ``modeling_looped.py`` in every checkpoint (remote code follows
the relative import), so it imports only torch, transformers and the looped modules it names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_looped import LoopedConfig
from .interface_looped import CheckpointingLayer
from .parcae_looped import add_value_embedding


class LoopedRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of eight: decoding at batch 1 is bound by per-op overhead, and
            # a looped model applies its norms r times. Bit-identical to the path below in fp32.
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
        # Normalise in fp32 (bf16 variance underflows), cast back, then scale: Llama's order, with
        # the fp32 part fused (one kernel instead of five).
        input_dtype = hidden_states.dtype
        normed = F.rms_norm(hidden_states.to(torch.float32), self.weight.shape, None, self.variance_epsilon)
        return self.weight * normed.to(input_dtype)


def with_delta(module: nn.Module, x: torch.Tensor, deltas: nn.ModuleDict | None, key: str) -> torch.Tensor:
    """``module(x)``, plus ``deltas[key](x)`` where the call carries a per-loop delta for it: a shared
    block layer of a per-loop LoRA model (``loop_lora_looped.py``) is handed loop t's deltas as an
    argument of each application (``loop_deltas``), so the loop step is part of the computation
    that activation checkpointing replays, not state beside it. The projection keys are
    ``{name}_delta`` (so peft's usual ``q_proj`` ... targets match the shared projections only),
    the norm keys the norm's own name (the delta of an RMSNorm scale: the norm is linear in it)."""
    out = module(x)
    if deltas is None or key not in deltas:
        return out
    return out + deltas[key](x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class LoopedMLP(nn.Module):
    """Squared-ReLU (the study, non-gated: 2 matrices) or gated (SwiGLU/GeGLU: 3 matrices)."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.hidden_act != "relu2"
        if self.gated:
            self.gate_proj = nn.Linear(d, f, bias=bias)
            self.act_fn = ACT2FN[config.hidden_act]
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        # The study's init: MLP-in std 1/sqrt(d), MLP-out Kaiming fan-in std 1/sqrt(f) (f = 4d).
        for proj in (self.up_proj, getattr(self, "gate_proj", None)):
            if proj is not None:
                proj.looped_study_init = ("uniform", d**-0.5)
        self.down_proj.looped_study_init = ("uniform", f**-0.5)
        # Parcae's squared ReLU is 0.5 relu(x)^2 (config.mlp_activation_scale; None: no scaling op).
        self.activation_scale = config.mlp_activation_scale if config.mlp_activation_scale != 1.0 else None

    def forward(self, x: torch.Tensor, loop_deltas: nn.ModuleDict | None = None) -> torch.Tensor:
        d = loop_deltas
        up = with_delta(self.up_proj, x, d, "up_proj_delta")
        if self.gated:
            return with_delta(self.down_proj, self.act_fn(with_delta(self.gate_proj, x, d, "gate_proj_delta")) * up,
                              d, "down_proj_delta")  # fmt: skip
        if self.activation_scale is not None:
            return with_delta(self.down_proj, F.relu(up).square().mul(self.activation_scale), d, "down_proj_delta")
        return with_delta(self.down_proj, F.relu(up).square(), d, "down_proj_delta")


class LoopedAttention(nn.Module):
    def __init__(self, config: LoopedConfig, num_key_value_heads: int | None = None) -> None:
        """``num_key_value_heads``: this layer's own KV heads (the block's may differ: Parcae's core
        is MHA), default ``config.num_key_value_heads``."""
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        kv_heads = config.num_key_value_heads if num_key_value_heads is None else num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, h, kv, bias = (
            config.hidden_size,
            config.num_attention_heads,
            kv_heads,
            config.attention_bias,
        )
        # qk_bias (Huginn): q and k get a bias, v and o do not. The projection's own bias adds the same
        # vector right after the matmul, before any QK-norm and RoPE, where Huginn adds it.
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=bias or config.qk_bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=bias or config.qk_bias)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=bias)
        # QK-norm bounds the attention logits, which matters more when the same weights are applied
        # r times. The study (nanochat/gpt.py) normalises q and k after RoPE with no learnable scale;
        # "learnable_before_rope" is the Qwen3 placement (and looped_hf 0.1.0's), per head;
        # "learnable_projection_before_rope" is OLMo-2's, one norm over all heads of q (and of k).
        # None: F.rms_norm's own eps, finfo(dtype).eps (qk_norm_eps="torch_default", Parcae's).
        eps = config.qk_norm_eps
        self.qk_norm_eps = config.rms_norm_eps if eps is None else (None if eps == "torch_default" else eps)
        # Chosen here, not branched in forward: ``heads`` splits q and k into heads with any QK-norm
        # that runs before RoPE, ``norm_after_rope`` is the one after it (or None).
        self.heads = self._split_heads
        self.norm_after_rope = None
        if config.qk_norm == "learnable_before_rope":
            self.q_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.heads = self._split_then_norm_heads
        elif config.qk_norm == "learnable_projection_before_rope":
            self.q_norm = LoopedRMSNorm(h * self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LoopedRMSNorm(kv * self.head_dim, eps=config.rms_norm_eps)
            self.heads = self._norm_projections_then_split
        elif config.qk_norm == "after_rope":
            self.norm_after_rope = self._weightless_head_norm
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.looped_study_init = ("uniform", d**-0.5)  # std 1/sqrt(d): read by _init_weights
        # A gated value embedding (config.value_embedding_layers): parcae_looped.build_parcae_modules
        # puts the gate here, and the index of the table the layer reads.
        self.ve_gate: nn.Module | None = None
        self.value_embedding_index: int | None = None

    # ``d``: the loop's per-loop deltas (``loop_lora_looped.py``), whose ``q_norm``/``k_norm`` entries
    # add to the learnable QK-norms; None outside a loop-LoRA block.
    def _split_heads(self, q: torch.Tensor, k: torch.Tensor, shape: tuple[int, ...], d: nn.ModuleDict | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """q and k as (batch, seq, heads, head_dim), no QK-norm before RoPE."""
        return q.view(shape), k.view(shape)

    def _split_then_norm_heads(self, q: torch.Tensor, k: torch.Tensor, shape: tuple[int, ...],
                               d: nn.ModuleDict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``qk_norm="learnable_before_rope"`` (Qwen3's, 0.1.0's): a learnable norm per head."""
        return (with_delta(self.q_norm, q.view(shape), d, "q_norm"),
                with_delta(self.k_norm, k.view(shape), d, "k_norm"))  # fmt: skip

    def _norm_projections_then_split(self, q: torch.Tensor, k: torch.Tensor, shape: tuple[int, ...],
                                     d: nn.ModuleDict | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``qk_norm="learnable_projection_before_rope"`` (OLMo-2's): one norm over all heads."""
        return (with_delta(self.q_norm, q, d, "q_norm").view(shape),
                with_delta(self.k_norm, k, d, "k_norm").view(shape))  # fmt: skip

    def _weightless_head_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk_norm="after_rope"``: RMS over head_dim with no weights, as the study (its fused kernel
        accumulates in fp32)."""
        return (F.rms_norm(q, (self.head_dim,), eps=self.qk_norm_eps),
                F.rms_norm(k, (self.head_dim,), eps=self.qk_norm_eps))  # fmt: skip

    def project(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        d: nn.ModuleDict | None = None,
        value_embeddings: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (after RoPE and this layer's QK-norm) and v as (batch, heads, seq, head_dim): the one
        place a layer makes them, which the gated loop attention's later recurrences also call.
        ``d``: the loop's deltas; ``value_embeddings``: ``parcae_looped.value_embedding_lookup``'s."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, key_states = self.heads(
            with_delta(self.q_proj, hidden_states, d, "q_proj_delta"),
            with_delta(self.k_proj, hidden_states, d, "k_proj_delta"),
            hidden_shape,
            d,
        )
        # RoPE and the QK-norm run on the projections' own (batch, seq, heads, head_dim) layout and
        # only then turn into attention's (batch, heads, seq, head_dim) view: the same values bit for
        # bit (elementwise ops and a norm over head_dim), without norming a strided view.
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, unsqueeze_dim=2)
        if self.norm_after_rope is not None:
            query_states, key_states = self.norm_after_rope(query_states, key_states)
        value_states = with_delta(self.v_proj, hidden_states, d, "v_proj_delta").view(hidden_shape)
        if self.ve_gate is not None:
            value_states = add_value_embedding(self.ve_gate, hidden_states, value_states,
                                               value_embeddings[self.value_embedding_index])  # fmt: skip
        return query_states.transpose(1, 2), key_states.transpose(1, 2), value_states.transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        cache_index: int,
        loop_deltas: nn.ModuleDict | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        d = loop_deltas
        query_states, key_states, value_states = self.project(
            hidden_states, position_embeddings, d, kwargs.pop("value_embeddings", None)
        )
        if cache is not None:
            # A shared layer has one cache slot per application, not per module.
            key_states, value_states = cache.update(key_states, value_states, cache_index)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = with_delta(
            self.o_proj, attn_output.reshape(*input_shape, -1).contiguous(), d, "o_proj_delta"
        )
        return attn_output, attn_weights


class LoopedDecoderLayer(CheckpointingLayer):
    """A decoder layer, attention then MLP, each call of a shared layer checkpointed on its own.

    This class is ``norm_placement="pre"`` (Llama, the study): x = x + attn(n1 x); x = x + mlp(n2 x).
    The other placements are the subclasses below: each names its norms (``norm_names``, in the
    order they run) and writes its two residual steps; ``DECODER_LAYERS`` maps the config's
    ``norm_placement`` to its class. Norm names follow the transformers model with that placement
    (Llama, Gemma-2, OLMo-2): ``post_attention_layernorm`` is the MLP's input norm in Llama's
    pre-norm and the attention output's norm in Gemma-2's and OLMo-2's.
    """

    norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: LoopedConfig, num_key_value_heads: int | None = None) -> None:
        super().__init__()
        self.self_attn = LoopedAttention(config, num_key_value_heads)
        self.mlp = LoopedMLP(config)
        for name in self.norm_names:
            setattr(self, name, LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        cache_index: int = 0,
        loop_deltas: nn.ModuleDict | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``loop_deltas``: loop t's per-loop deltas of this shared block layer (a per-loop LoRA
        model's, ``with_delta``), handed in by the loop for each application; ``None`` elsewhere."""
        d = loop_deltas
        residual = hidden_states
        attn, attn_weights = self.self_attn(
            with_delta(self.input_layernorm, hidden_states, d, "input_layernorm"),
            position_embeddings,
            attention_mask,
            cache,
            cache_index,
            loop_deltas=d,
            **kwargs,
        )
        hidden_states = residual + attn
        hidden_states = hidden_states + self.mlp(
            with_delta(self.post_attention_layernorm, hidden_states, d, "post_attention_layernorm"), d
        )
        return hidden_states, attn_weights


class LoopedSandwichDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="sandwich"`` (Huginn's SandwichBlock): a norm before each sublayer and one
    after each residual add, x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))."""

    norm_names = ("input_layernorm", "post_attention_residual_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_residual_layernorm")  # fmt: skip

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                loop_deltas=None, **kwargs):  # fmt: skip
        d = loop_deltas
        attn, attn_weights = self.self_attn(
            with_delta(self.input_layernorm, hidden_states, d, "input_layernorm"),
            position_embeddings,
            attention_mask,
            cache,
            cache_index,
            loop_deltas=d,
            **kwargs,
        )
        hidden_states = with_delta(self.post_attention_residual_layernorm, attn + hidden_states, d,
                                   "post_attention_residual_layernorm")  # fmt: skip
        out = self.mlp(
            with_delta(self.pre_feedforward_layernorm, hidden_states, d, "pre_feedforward_layernorm"), d
        )
        hidden_states = with_delta(self.post_feedforward_residual_layernorm, out + hidden_states, d,
                                   "post_feedforward_residual_layernorm")  # fmt: skip
        return hidden_states, attn_weights


class LoopedSublayerOutputNormDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="sublayer_output"`` (OLMo-2): no input norms, each sublayer's output normed
    before the residual add, x = x + n1(attn x); x = x + n2(mlp x)."""

    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                loop_deltas=None, **kwargs):  # fmt: skip
        d = loop_deltas
        attn, attn_weights = self.self_attn(
            hidden_states, position_embeddings, attention_mask, cache, cache_index, loop_deltas=d, **kwargs
        )
        hidden_states = hidden_states + with_delta(
            self.post_attention_layernorm, attn, d, "post_attention_layernorm"
        )
        hidden_states = hidden_states + with_delta(self.post_feedforward_layernorm, self.mlp(hidden_states, d), d,
                                                   "post_feedforward_layernorm")  # fmt: skip
        return hidden_states, attn_weights


class LoopedPreAndOutputNormDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="pre_and_output"`` (Ouro, Gemma-2): four norms, on each sublayer's input and
    on its output before the residual add, x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x))."""

    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")  # fmt: skip

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                loop_deltas=None, **kwargs):  # fmt: skip
        d = loop_deltas
        attn, attn_weights = self.self_attn(
            with_delta(self.input_layernorm, hidden_states, d, "input_layernorm"),
            position_embeddings,
            attention_mask,
            cache,
            cache_index,
            loop_deltas=d,
            **kwargs,
        )
        hidden_states = hidden_states + with_delta(
            self.post_attention_layernorm, attn, d, "post_attention_layernorm"
        )
        out = self.mlp(
            with_delta(self.pre_feedforward_layernorm, hidden_states, d, "pre_feedforward_layernorm"), d
        )
        hidden_states = hidden_states + with_delta(
            self.post_feedforward_layernorm, out, d, "post_feedforward_layernorm"
        )
        return hidden_states, attn_weights


#: ``LoopedConfig.norm_placement`` -> the decoder layer class that places its norms so.
DECODER_LAYERS: dict[str, type[LoopedDecoderLayer]] = {
    "pre": LoopedDecoderLayer,
    "sandwich": LoopedSandwichDecoderLayer,
    "sublayer_output": LoopedSublayerOutputNormDecoderLayer,
    "pre_and_output": LoopedPreAndOutputNormDecoderLayer,
}


__all__ = [
    "DECODER_LAYERS",
    "LoopedAttention",
    "LoopedDecoderLayer",
    "LoopedMLP",
    "LoopedPreAndOutputNormDecoderLayer",
    "LoopedRMSNorm",
    "LoopedSandwichDecoderLayer",
    "LoopedSublayerOutputNormDecoderLayer",
    "apply_rotary_pos_emb",
    "with_delta",
]
