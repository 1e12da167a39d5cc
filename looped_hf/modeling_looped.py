"""A looped (depth-recurrent) decoder for transformers 5.x.

    tokens -> embed [-> norm] -> prelude (P layers) = e -> h_0 = init(e)
           -> r times: h = block(inject(h, e)) [-> norm]     block: K shared layers
           -> coda (C layers) -> norm -> lm_head [-> soft-cap]

The layer is Llama's (pre-norm, RoPE, GQA) with the study's switches: squared-ReLU MLP, QK-norm,
logit soft-cap. Where the study's code (kschwethelm/looped-lm-scaling, nanochat/gpt.py) fixes a
convention, this file follows it and says so: injection order and init, hyperconnection update,
QK-norm placement, initialisation, parameter groups. ``config.looped_format == 1`` keeps the forward
of looped_hf 0.1.0 for checkpoints saved by it. Every *application* of a layer (P + r*K + C per
token) owns one KV-cache slot, so the cache is the flat stack a looped model unrolls into;
``config.num_hidden_layers`` is that depth at the default r and a dynamic cache grows when a call
asks for more recurrences.

It behaves like transformers 5.24's Llama wherever a looped model can: ``cache=`` (the old
``past_key_values=`` is mapped with Llama's deprecation warning), ``return_dict=False`` gives a
tuple, a keyword the model does not know raises ``TypeError`` instead of vanishing into
``**kwargs``, hidden states and attentions are collected per layer application by transformers'
output-capturing hooks (``interface_looped.py`` says which index is which), the forward compiles
with ``torch.compile(fullgraph=True)`` at a fixed r, and the standard heads (sequence / token
classification, question answering) are transformers' generic ones. What a call may add at test
time (a KV budget, per-token adaptive exit, self-speculative drafting) lives in
``generation_looped.py``.

This module is the one owner of parameter and FLOP accounting (``num_scaling_params``,
``training_flops_per_token``, ``inference_flops_per_token``); training, planning and model cards
call it. It is shipped with checkpoints as remote code, so it imports only torch, transformers
and ``.configuration_looped``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    create_causal_mask,
    flash_attention_mask,
    sdpa_mask,
)
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import TransformersKwargs, can_return_tuple, merge_with_config_defaults
from transformers.utils.import_utils import is_tracing
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_looped import LoopedConfig
from .generation_looped import (
    LoopedGenerateOutput,
    LoopedGenerationMixin,
    RecurrenceDraftCandidateGenerator,
    _AdaptiveExit,
    _ExitKV,
    coda_predictor,
    prepare_cache,
    resolve_exit_rule,
    resolve_kv_budget,
)
from .interface_looped import (
    _LOSS_KWARGS,
    LoopedCausalLMOutputWithPast,
    LoopedModelOutputWithPast,
    _checked_kwargs,
    _select_hidden_states_at_r,
)

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.20 (vLLM's pinned range) slices inline, as its Llama does

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]

# ---------------------------------------------------------------------------------------------
# Building blocks (Llama's, with the study's switches)
# ---------------------------------------------------------------------------------------------


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


class LoopedRotaryEmbedding(nn.Module):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: LoopedConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        if self.config.rope_table_dtype is not None:
            # The study keeps its tables in bf16 (nanochat/gpt.py): its weights expect those values.
            table = getattr(torch, self.config.rope_table_dtype)
            cos, sin = cos.to(table), sin.to(table)
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _SoftCap(torch.autograd.Function):
    """cap * tanh(x / cap) in fp32 (the study's soft-cap), with a one-kernel backward.

    The forward is the study's three ops, so logits are bit-identical. Autograd's own backward
    of them is three passes over the (batch, seq, vocab) logits (x cap, tanh', / cap), the
    largest tensors of a training step (16 GB of traffic at batch 8 x 2048 x 32k); the derivative
    is 1 - tanh^2(x / cap), one ``tanh_backward`` from the saved tanh. The gradient equals
    autograd's up to the rounding of the x cap / cap pair it skips (1 ulp).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, cap: float) -> torch.Tensor:
        t = torch.tanh(logits.float() / cap)
        ctx.save_for_backward(t)
        ctx.input_dtype = logits.dtype
        return cap * t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (t,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, t).to(ctx.input_dtype), None


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.relu(self.up_proj(x)).square())


class LoopedAttention(nn.Module):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        d, h, kv, bias = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=bias)
        # QK-norm bounds the attention logits, which matters more when the same weights are applied
        # r times. The study (nanochat/gpt.py) normalises q and k after RoPE with no learnable scale;
        # "learnable_before_rope" is the OLMo-2 / Qwen3 placement (and looped_hf 0.1.0's).
        self.qk_norm = config.qk_norm
        self.qk_norm_eps = config.rms_norm_eps
        if self.qk_norm == "learnable_before_rope":
            self.q_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.looped_study_init = ("uniform", d**-0.5)  # std 1/sqrt(d): read by _init_weights

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        cache_index: int,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if self.qk_norm == "learnable_before_rope":
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        # RoPE and the QK-norm run on the projections' own (batch, seq, heads, head_dim) layout and
        # only then turn into attention's (batch, heads, seq, head_dim) view: the same values bit for
        # bit (elementwise ops and a norm over head_dim), without norming a strided view (~10% of
        # their time on a CPU).
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, unsqueeze_dim=2)
        if self.qk_norm == "after_rope":
            # RMS over head_dim with no weights, as the study (its fused kernel accumulates in fp32).
            query_states = F.rms_norm(query_states, (self.head_dim,), eps=self.qk_norm_eps)
            key_states = F.rms_norm(key_states, (self.head_dim,), eps=self.qk_norm_eps)
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
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
        attn_output = self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())
        return attn_output, attn_weights


class LoopedDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm attention + MLP. Each call of a shared layer is checkpointed on its own."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.self_attn = LoopedAttention(config)
        self.mlp = LoopedMLP(config)
        self.input_layernorm = LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        cache_index: int = 0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = hidden_states
        attn, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, cache_index, **kwargs
        )
        hidden_states = residual + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


class LoopedHyperConnection(nn.Module):
    """Hyperconnections at loop boundaries (the study's probe; Zhu et al. 2024 applied per layer).

    ``N`` lanes H, all starting as the prelude output e. At step i the block reads
    x = sum_j alpha[i, j] H_j and the lanes update as H <- M[i] H + beta[i] norm(block(x)), norm
    being the recurrence norm applied to the block's output, none on the lanes (the study's
    nanochat/gpt.py ``_hyperconnect_step``). Cyclic init (alpha_i = e_(i mod N), M = I, beta = 1)
    breaks the lane symmetry. The lanes are summed before the coda. Parameters are per step, so
    the model runs only at its trained r. (looped_format 1 wrote the residual delta block(x) - x
    and normed the lanes.)
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        r, n = config.num_recurrences, config.num_hyperconnection_lanes
        self.num_lanes = n
        self.alpha = nn.Parameter(torch.empty(r, n))
        self.mixing = nn.Parameter(torch.empty(r, n, n))
        self.beta = nn.Parameter(torch.empty(r, n))

    def reset_parameters(self) -> None:
        r, n = self.alpha.shape
        alpha = torch.zeros(r, n)
        alpha[torch.arange(r), torch.arange(r) % n] = 1.0
        init.copy_(self.alpha, alpha)
        init.copy_(self.mixing, torch.eye(n).expand(r, n, n))
        init.ones_(self.beta)

    def read(self, lanes: torch.Tensor, step: int) -> torch.Tensor:
        return torch.einsum("n,n...->...", self.alpha[step].to(lanes.dtype), lanes)

    def write(self, lanes: torch.Tensor, step: int, update: torch.Tensor) -> torch.Tensor:
        """H <- M[step] H + beta[step] * update (one gain per lane)."""
        mixed = torch.einsum("mn,n...->m...", self.mixing[step].to(lanes.dtype), lanes)
        gain = self.beta[step].to(lanes.dtype).view(-1, *([1] * update.dim()))
        return mixed + gain * update.unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# The attention mask
# ---------------------------------------------------------------------------------------------

# Mask builders whose attention function applies a plain causal mask itself when it gets none
# (SDPA's ``is_causal``, flash-attention's ``causal``). Keyed by the builder, not by the name, so a
# hub kernel or a registered alias that reuses one of them is covered too.
_CAUSAL_BY_ITSELF = (sdpa_mask, flash_attention_mask)


def _plain_causal(attention_mask: torch.Tensor | None, cache: Cache | None, q_length: int) -> bool:
    """Whether attention over these inputs is exactly the causal triangle over the new tokens:
    no padding (no mask, or a 2-D mask that is all ones, read only outside tracing), and no
    earlier tokens in the cache (the keys are the queries' own tokens, so the square is causal)."""
    # The cache first: it is host-side bookkeeping, while reading the mask's values waits for the device.
    if cache is not None:
        if getattr(cache, "is_compileable", False):
            return False  # a static cache attends over all max_cache_len slots: it needs its mask
        if cache.get_seq_length() != 0 or cache.get_mask_sizes(q_length, 0)[0] != q_length:
            return False
    if attention_mask is None:
        return True
    return attention_mask.ndim == 2 and not is_tracing(attention_mask) and bool(attention_mask.all())


def causal_attention_mask(
    config: LoopedConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask every layer application gets, or ``None`` where the attention function's own causal
    mode is the same thing.

    Why not always ``create_causal_mask``: under ``torch.compile`` it cannot read tensors, so it
    assumes the worst (position ids might be packed documents, a mask might have padding) and
    materialises a (batch, 1, T, T) mask even for unpadded training rows. SDPA then cannot take
    its causal fast path (the flash kernel skips the upper triangle only with ``is_causal``) and
    reads the mask in backward too: about 3x the attention time on an H200. So when the call is
    plain causal (``_plain_causal``), ``position_ids`` were not given (this forward's own
    positions are one sequence per row, never packed) and the backend masks causally by itself,
    the answer is ``None`` — in eager mode and compiled alike. Everything else (padding, decode
    steps and chunked prefill over a cache, static caches, packed ``position_ids``, eager / flex
    attention, which need their mask) goes to ``create_causal_mask`` unchanged.
    """
    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(config._attn_implementation)
    if (
        position_ids is None
        and builder in _CAUSAL_BY_ITSELF
        and _plain_causal(attention_mask, cache, inputs_embeds.shape[1])
    ):
        return None
    return create_causal_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
        position_ids=position_ids,
    )


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _all_in_mode(module: nn.Module, mode: bool) -> bool:
    """Whether `module` and all its submodules have `training == mode` (a plain walk: `modules()`
    builds every module's dotted name on the way, three times slower)."""
    if module.training is not mode:
        return False
    return all(child is None or _all_in_mode(child, mode) for child in module._modules.values())


class LoopedPreTrainedModel(PreTrainedModel):
    config: LoopedConfig
    config_class = LoopedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LoopedDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # r is a Python int: each r is its own graph (recompiled once), the forward has no data-dependent
    # branch at a fixed r.
    _can_compile_fullgraph = True
    # One record per *application* of a layer: a shared layer's hook fires every time it runs, so
    # the hidden states and attentions are in execution order (see the module docstring).
    _can_record_outputs = {
        "hidden_states": OutputRecorder(LoopedDecoderLayer, index=0),
        "attentions": OutputRecorder(LoopedAttention, index=1),
    }

    def train(self, mode: bool = True):
        # The Trainer calls `model.train()` before every micro-batch and torch's walks every module
        # (~3 us each on a CPU: 0.3 ms a step for the loop4 model, on the training loop's host
        # path). When every module is already in `mode` there is nothing to set.
        if isinstance(mode, bool) and _all_in_mode(self, mode):
            return self
        return super().train(mode)

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init (``init_scheme="hf"``) or the study's (``"study"``, nanochat/gpt.py
        ``init_weights``). Roles are tagged on the leaf modules when they are built
        (``looped_study_init``), so this works leaf by leaf, as transformers applies it, and under
        remote code. Both schemes start the injection at [I | 0] and hyperconnections cyclic."""
        study = self.config.init_scheme == "study"
        role = getattr(module, "looped_study_init", None)
        if role == "injection":
            # u = W [e; h] with W = [I | 0]: every recurrence reads e at init (the study). 0.1.0
            # checkpoints concatenated [h; e]; they are loaded, never initialised, so one form.
            d = module.weight.shape[0]
            init.copy_(module.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
        elif study and role is not None:
            kind, std = role
            if kind == "uniform":
                # Uniform with bound sqrt(3) std has that std and no outliers (the study's choice).
                bound = 3**0.5 * std
                init.uniform_(module.weight, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif study and isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=1.0)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, LoopedHyperConnection):
            module.reset_parameters()
        else:
            super()._init_weights(module)


class LoopedModel(LoopedPreTrainedModel):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size, self.padding_idx)
        self.embedding_norm = LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if config.embedding_norm else None
        self.prelude_layers = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.num_prelude_layers))
        self.recurrent_layers = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.num_recurrent_layers))
        self.coda_layers = nn.ModuleList(LoopedDecoderLayer(config) for _ in range(config.num_coda_layers))
        # The linear injection adapter is a plain nn.Linear(2d -> d) so LoRA and tensor parallelism
        # see it like any projection; its weight keeps 0.1.0's key (``model.injection.weight``).
        self.injection = None
        if config.input_injection == "linear":
            self.injection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.injection.looped_study_init = "injection"
        self.hyperconnection = LoopedHyperConnection(config) if config.input_injection == "hyperconnection" else None
        self.recurrence_norm = (
            LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if config.recurrence_norm else None
        )
        self.norm = LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LoopedRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    # The parameter groups of the study's accounting (nanochat/gpt.py num_scaling_params and
    # effective_params): "recurrent" (N_rec) is the block and the injection adapter or
    # hyperconnection gains; "once" (N_once) is prelude + coda + the model-level norm scales, the
    # recurrence norm INCLUDED although it runs r times (the study counts all three norm_* scales
    # as "scalars", run once). The token embedding is apart (a lookup: no FLOPs).
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        once = [*self.prelude_layers.parameters(), *self.coda_layers.parameters(), *self.norm.parameters()]
        for module in (self.embedding_norm, self.recurrence_norm):
            if module is not None:
                once += list(module.parameters())
        recurrent = list(self.recurrent_layers.parameters())
        for module in (self.injection, self.hyperconnection):
            if module is not None:
                recurrent += list(module.parameters())
        return {"once": once, "recurrent": recurrent, "embedding": list(self.embed_tokens.parameters())}

    def _injection_split(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W_e e, W_h) for the linear injection u = W [e; h] = W_e e + W_h h, or ``None``.

        e is the same at every recurrence, so W_e e is computed once per forward instead of a
        concat and a d x 2d matmul per recurrence (r + 1 d x d matmuls instead of 2r, forward and
        backward). Only for a plain ``nn.Linear``: a wrapped adapter (LoRA, quantisation, FSDP)
        must see its own forward called, and gets ``self.injection(cat)`` instead. Not for
        looped_format 1 (0.1.0) checkpoints either: their logits are pinned to 1e-6, and the split's
        two matmuls round differently from the one concatenated matmul they were saved with.
        """
        injection = self.injection
        if self.config.looped_format == 1 or type(injection) is not nn.Linear or injection.bias is not None:
            return None
        d = self.config.hidden_size
        # The study's order is [e; h]: W = [I | 0] reads e.
        return F.linear(e, injection.weight[:, :d]), injection.weight[:, d:]

    def _inject(
        self, h: torch.Tensor, e: torch.Tensor, legacy: bool, split: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """The block's input u from the state h and the prelude output e (see LoopedConfig)."""
        mode = self.config.input_injection
        if mode == "linear":
            if split is not None:
                e_part, w_h = split
                return e_part + F.linear(h, w_h)
            return self.injection(torch.cat([h, e] if legacy else [e, h], dim=-1))
        if mode == "add":
            return h + e
        return h

    def _resolve_num_recurrences(self, num_recurrences: int | None) -> int:
        config = self.config
        r = config.num_recurrences if num_recurrences is None else num_recurrences
        try:
            # r must be a Python int (a graph per r under torch.compile); numpy / 0-d tensor ints convert.
            r = operator.index(r) if not isinstance(r, bool) else None
        except TypeError:
            r = None
        if r is None:
            raise ValueError(f"num_recurrences={num_recurrences!r}: must be an integer >= 1")
        if r < 1:
            raise ValueError(f"num_recurrences={r}: must be >= 1")
        if config.is_recurrence_locked and r != config.num_recurrences:
            raise ValueError(
                f"num_recurrences={r}: this model uses input_injection='hyperconnection', whose parameters are "
                f"indexed by recurrence step, so it can only run at its trained num_recurrences={config.num_recurrences}"
            )
        return r

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @_select_hidden_states_at_r
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        num_recurrences: int | None = None,
        output_recurrent_states: bool = False,
        kv_budget: int | None = None,
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_recurrences: int | None = None,
        exit_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LoopedModelOutputWithPast:
        r"""The decoder. ``num_recurrences`` overrides r for this call; ``output_recurrent_states``
        returns the state after every recurrence; ``kv_budget`` overrides ``config.kv_budget`` (the
        KV-cache slots kept per block layer, see ``LoopedConfig.kv_budget``). ``exit_criterion``,
        ``exit_threshold`` and ``min_recurrences`` override the config's adaptive exit (see
        ``LoopedConfig``); ``exit_head`` maps a final-normed state to logits for the criteria that
        read the next-token distribution (``LoopedForCausalLM`` passes its head).
        ``output_hidden_states`` / ``output_attentions`` are collected per layer application (see
        the module docstring); ``return_dict=False`` returns a tuple. Unknown keywords raise
        ``TypeError``."""
        config = self.config
        kwargs = _checked_kwargs(self, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        r = self._resolve_num_recurrences(num_recurrences)
        budget = resolve_kv_budget(config, kv_budget, r)
        exit_rule = resolve_exit_rule(self, exit_criterion, exit_threshold, min_recurrences, r, exit_head, cache, kwargs)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            prepare_cache(cache, config.num_kv_slots(r, budget), r, budget)

        positions_given = position_ids is not None
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = causal_attention_mask(
            config, inputs_embeds, attention_mask, cache, position_ids if positions_given else None
        )
        # What every layer application gets, as Llama's layers do. position_ids only when the caller
        # gave them: the varlen / packed-sequence attention backends read them, and positions this
        # forward made itself are one plain sequence per row (nothing for a backend to look for).
        layer_kwargs = dict(
            attention_mask=causal_mask, position_embeddings=self.rotary_emb(inputs_embeds, position_ids),
            cache=cache, **kwargs,
        )
        if positions_given:
            layer_kwargs["position_ids"] = position_ids

        app = 0  # index of the current layer application == its cache slot
        h = inputs_embeds
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        for layer in self.prelude_layers:
            h = layer(h, cache_index=app, **layer_kwargs)[0]
            app += 1
        e = h
        if config.state_init == "zeros":
            h = torch.zeros_like(e)
        elif config.state_init == "noise":
            # Huginn's random state: draws from the global RNG, which Trainer/set_seed seed.
            h = torch.randn_like(e) * config.state_init_std

        hc = self.hyperconnection
        legacy = config.looped_format == 1
        lanes = h.unsqueeze(0).expand(hc.num_lanes, *h.shape) if hc is not None else None
        split = self._injection_split(e) if config.input_injection == "linear" else None
        K = len(self.recurrent_layers)
        num_new_tokens = inputs_embeds.shape[1]

        def block_layer(layer: nn.Module, x: torch.Tensor, step: int, j: int) -> torch.Tensor:
            """Block layer j at recurrence ``step``, in cache slot P + (step mod k)*K + j (the
            study's nanochat/gpt.py ``_get_kv_layer_idx``). The study writes a slot at every
            recurrence, so the slot ends up holding its last writer's KV, while each writer's own
            tokens attend to their fresh KV. Same here: an earlier writer (step < r - k, a later
            recurrence reuses its slot) writes, attends, then crops its tokens back out."""
            slot = len(self.prelude_layers) + (step % budget) * K + j
            x = layer(x, cache_index=slot, **block_kwargs)[0]
            if cache is not None and step < r - budget:
                cache.layers[slot].crop(-num_new_tokens)
            return x

        def recurrence(step: int, h: torch.Tensor, lanes: torch.Tensor | None) -> tuple:
            """One pass through the block; returns (h, lanes, the state after it)."""
            if hc is not None:
                x = hc.read(lanes, step)
                y = x
                for j, layer in enumerate(self.recurrent_layers):
                    y = block_layer(layer, y, step, j)
                if legacy:
                    lanes = hc.write(lanes, step, y - x)
                    if self.recurrence_norm is not None:
                        lanes = self.recurrence_norm(lanes)
                else:
                    lanes = hc.write(lanes, step, self.recurrence_norm(y) if self.recurrence_norm is not None else y)
                return h, lanes, lanes.sum(0)
            h = self._inject(h, e, legacy, split)
            for j, layer in enumerate(self.recurrent_layers):
                h = block_layer(layer, h, step, j)
            if self.recurrence_norm is not None:
                h = self.recurrence_norm(h)
            return h, lanes, h

        # Truncated backprop: the first r - k recurrences run under no_grad (the study's detach of
        # the state). Without truncation no grad-mode switch is entered at all.
        k = config.backprop_recurrences
        no_grad_steps = r - k if k is not None and k < r and torch.is_grad_enabled() else 0
        recurrent_states: list[torch.Tensor] = []
        state = None  # the state after the last recurrence run; exit's criterion starts from h_0
        coda_start = len(self.prelude_layers) + budget * K  # the coda's slots follow the k recurrence slots
        exit_, block_kwargs = None, layer_kwargs  # adaptive exit gives the block its own cache view
        if exit_rule is not None:
            exit_kv = _ExitKV(cache, len(self.prelude_layers), K)
            block_kwargs = {**layer_kwargs, "cache": exit_kv}
            predict = None
            if exit_head is not None:
                predict = coda_predictor(self.coda_layers, self.norm, exit_head, coda_start, layer_kwargs, num_new_tokens)
            state = lanes.sum(0) if hc is not None else h
            exit_ = _AdaptiveExit(exit_rule, r, state, exit_kv, predict)
        for step in range(r):
            if exit_ is not None and exit_.all_exited:
                # Every token has stopped: nothing runs; later tokens will read the latest KV.
                if cache is not None and step >= r - budget:
                    exit_kv.refill_recurrence(step, budget)
            else:
                old = (h, lanes, state)
                if step < no_grad_steps:
                    with torch.no_grad():
                        h, lanes, state = recurrence(step, h, lanes)
                else:
                    h, lanes, state = recurrence(step, h, lanes)
                if exit_ is not None:
                    h, lanes, state = exit_.step(step + 1, old, (h, lanes, state))
            if output_recurrent_states:
                recurrent_states.append(state)
        if hc is not None:
            h = lanes.sum(0)  # lanes are summed before the coda
        app = coda_start
        for layer in self.coda_layers:
            h = layer(h, cache_index=app, **layer_kwargs)[0]
            app += 1
        h = self.norm(h)

        return LoopedModelOutputWithPast(
            last_hidden_state=h,
            cache=cache if use_cache else None,
            recurrent_states=tuple(recurrent_states) if output_recurrent_states else None,
            recurrences_used=exit_.used if exit_ is not None else None,
        )

class LoopedForCausalLM(LoopedPreTrainedModel, LoopedGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor parallelism as Llama: the head's output columns are sharded then gathered (the
    # soft-cap is elementwise, so it runs on the gathered logits). No pipeline plan: transformers'
    # pipeline parallelism splits ``base_model.layers`` into stages, and a looped model's shared
    # block runs r times in one place, so there is no flat stack to cut.
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config)
        self.model = LoopedModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        if not config.tie_word_embeddings:
            self.lm_head.looped_study_init = ("normal", 0.001)  # the study: small logits at init
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def logits_from_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """lm_head, cropped to ``vocab_size`` (padded rows never get probability), then the study's
        soft-cap (tanh, in fp32), cap * tanh(logits / cap)."""
        logits = self.lm_head(hidden_states)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        cap = self.config.logit_softcap
        if cap is not None:
            logits = _SoftCap.apply(logits, cap)
        return logits

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_recurrences: int | None = None,
        output_recurrent_states: bool = False,
        kv_budget: int | None = None,
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_recurrences: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LoopedCausalLMOutputWithPast:
        r"""Causal-LM forward. ``num_recurrences`` overrides r for this call (``generate`` passes it
        through, as it does ``kv_budget``, the KV-cache budget of ``LoopedConfig.kv_budget``);
        ``output_recurrent_states`` returns the state after every recurrence; ``exit_criterion``,
        ``exit_threshold`` and ``min_recurrences`` set per-token adaptive exit (``LoopedConfig``;
        ``recurrences_used`` in the output says how many recurrences each token ran); ``labels`` are NOT
        shifted by the caller (the loss shifts them; -100 is ignored). ``ignore_index`` and
        ``shift_labels`` go to the loss (a loss is computed when either labels or shift_labels is
        given), ``return_dict=False`` returns a tuple, and an unknown keyword raises ``TypeError``."""
        loss_kwargs = {key: kwargs.pop(key) for key in _LOSS_KWARGS if key in kwargs}
        kwargs = _checked_kwargs(self, kwargs)  # so an error names the class the caller called
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            num_recurrences=num_recurrences,
            output_recurrent_states=output_recurrent_states,
            kv_budget=kv_budget,
            exit_criterion=exit_criterion,
            exit_threshold=exit_threshold,
            min_recurrences=min_recurrences,
            exit_head=self.logits_from_hidden,
            return_dict=True,  # the tuple, if asked for, is made here (config.return_dict=False too)
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.logits_from_hidden(hidden_states)
        loss = None
        if labels is not None or loss_kwargs.get("shift_labels") is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                num_items_in_batch=kwargs.get("num_items_in_batch"), **loss_kwargs,
            )
        return LoopedCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            recurrent_states=outputs.recurrent_states,
            recurrences_used=outputs.recurrences_used,
        )

    # -----------------------------------------------------------------------------------------
    # Accounting: the one place that counts parameters and FLOPs.
    # -----------------------------------------------------------------------------------------
    def num_scaling_params(self) -> dict[str, int]:
        """Parameters in the study's groups; the parts sum to the real parameter count.

        ``once``: prelude + coda + the model-level norm scales (after the embedding, after every
        recurrence, before the head: the study counts all three as run-once "scalars").
        ``recurrent``: the block + the injection adapter or hyperconnection gains. ``embedding``
        and ``lm_head`` apart (a tied head counts 0 here: its weights are the embedding's). The
        scaling law's N_once and N_rec are ``once`` and ``recurrent`` (the study's
        ``effective_params``: once = prelude + coda + scalars, reused = recur_block + inject).
        """
        groups = {name: sum(p.numel() for p in params) for name, params in self.model.parameter_groups().items()}
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        groups["lm_head"] = 0 if tied else self.lm_head.weight.numel()
        groups["total"] = groups["once"] + groups["recurrent"] + groups["embedding"] + groups["lm_head"]
        # Unique tensors only, so a shared or tied weight is never counted twice.
        real = sum(p.numel() for p in self.parameters())
        if groups["total"] != real:
            raise RuntimeError(f"parameter groups sum to {groups['total']} but the model has {real}")
        return groups

    def _flops_terms(self, seq_len: int, num_recurrences: int | None) -> tuple[int, int, int, int, int]:
        config = self.config
        r = config.num_recurrences if num_recurrences is None else int(num_recurrences)
        if r < 1 or seq_len < 1:
            raise ValueError(f"num_recurrences={r}, seq_len={seq_len}: both must be >= 1")
        k = config.backprop_recurrences
        r_grad = r if k is None else min(k, r)
        params = self.num_scaling_params()
        # The head's matmul costs V*d per token whether or not its weights are tied; V counts the
        # padded rows (they are computed, then cropped), as the study's estimate_flops does.
        n_head = config.padded_vocab_size * config.hidden_size
        n_rec = params["recurrent"]
        hc = self.model.hyperconnection
        if hc is not None:
            # Lane mixing is no weight matmul: per step and token it reads N lanes, mixes N x N and
            # writes N gains, all of width d. The study (gpt.py estimate_flops) counts it as
            # (N^2 + 2N) d "equivalent params" per recurrence in place of the r (N^2 + 2N) scalars.
            n = hc.num_lanes
            n_rec += (n * n + 2 * n) * config.hidden_size - sum(p.numel() for p in hc.parameters())
        # The model-level norm scales (after the embedding, after each recurrence, before the head)
        # are elementwise, not matmuls: the study's estimate_flops leaves them out; so do we.
        base = self.model
        scalars = sum(
            p.numel() for m in (base.embedding_norm, base.recurrence_norm, base.norm) if m is not None for p in m.parameters()
        )
        return r, r_grad, params["once"] - scalars + n_head, n_rec, config.num_attention_heads * config.head_dim

    def training_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Training FLOPs per token (the study's count; PaLM's MFU formula for a looped model).

        A matmul with N weights costs 2N FLOPs per token forward and 4N backward (grads of the
        input and of the weights): 6N per token for a parameter used once with gradient. So:

            6 * (N_once + N_head)                          prelude, coda (their layer norms too, as
                                                           the study), lm_head; not the model-level
                                                           norm scales (elementwise)
          + (6 * r_grad + 2 * r_nograd) * N_rec            the block + injection (hyperconnections:
                                                           (N^2 + 2N) d per step, as the study);
                                                           with truncated backprop only
                                                           the last k = r_grad steps train; the
                                                           first r - k run forward only (2x)
          + 12 * h * q * T * (P + C + r_grad * K)          attention scores + weighted sum: 2*2*h*q*T
          +  4 * h * q * T * (r_nograd * K)                forward per application, x3 with grad

        with T the full sequence length (no causal halving, as in PaLM and the study), h heads of
        size q. The embedding lookup is free. Norm and elementwise FLOPs are ignored (O(d)).
        """
        config = self.config
        r, r_grad, n_once_head, n_rec, hq = self._flops_terms(seq_len, num_recurrences)
        r_nograd = r - r_grad
        K = config.num_recurrent_layers
        apps_grad = config.num_prelude_layers + config.num_coda_layers + r_grad * K
        apps_nograd = r_nograd * K
        dense = 6 * n_once_head + (6 * r_grad + 2 * r_nograd) * n_rec
        attention = 12 * hq * seq_len * apps_grad + 4 * hq * seq_len * apps_nograd
        return float(dense + attention)

    def inference_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Forward-only FLOPs per token at context ``seq_len``: 2 * (N_once + N_head + r * N_rec)
        + 4 * h * q * T per layer application (P + r*K + C applications)."""
        config = self.config
        r, _, n_once_head, n_rec, hq = self._flops_terms(seq_len, num_recurrences)
        return float(2 * n_once_head + 2 * r * n_rec + 4 * hq * seq_len * config.num_layer_applications(r))


# ---------------------------------------------------------------------------------------------
# The standard heads: transformers' generic ones on the looped trunk (as Llama's in 5.24)
# ---------------------------------------------------------------------------------------------


# The generic heads build their trunk with ``AutoModel.from_config(config)``, which cannot resolve
# the looped trunk in a process that loads it as remote code without looped_hf installed (the
# config class is not registered there). So each head builds ``LoopedModel`` itself, exactly as
# the generic ``__init__`` would, and keeps the generic forward and loss unchanged.


class LoopedForSequenceClassification(GenericForSequenceClassification, LoopedPreTrainedModel):
    """A linear ``score`` head on the last non-pad token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LoopedModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class LoopedForTokenClassification(GenericForTokenClassification, LoopedPreTrainedModel):
    """A linear ``score`` head on every token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = LoopedModel(config)
        # The generic head's dropout: classifier_dropout, else hidden_dropout, else 0.1.
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=getattr(config, "token_classification_bias", True))
        self.post_init()


class LoopedForQuestionAnswering(GenericForQuestionAnswering, LoopedPreTrainedModel):
    """Start / end span logits from every token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.model = LoopedModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "LoopedPreTrainedModel",
    "LoopedModel",
    "LoopedForCausalLM",
    "LoopedGenerateOutput",
    "RecurrenceDraftCandidateGenerator",
    "LoopedForSequenceClassification",
    "LoopedForTokenClassification",
    "LoopedForQuestionAnswering",
]
