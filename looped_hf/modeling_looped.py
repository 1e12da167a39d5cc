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
asks for more recurrences. A KV budget k (``config.kv_budget`` or ``kv_budget=`` per call, the
study's engine) keeps only k recurrence slots: recurrence i's block layer j uses slot
P + (i mod k)*K + j and the coda's slots follow at P + k*K, so the cache has P + k*K + C slots; a
slot keeps the KV of the last recurrence that wrote it (see ``LoopedConfig.kv_budget``).

Test-time compute per token: with an exit criterion (``config.exit_criterion`` or
``exit_criterion=`` per call) each token stops recurring once its criterion fires; its state
freezes and, at later recurrences, it offers the KV of its last computed one (``_ExitKV``,
Huginn's "latest"). ``generate(..., draft_num_recurrences=k)`` decodes self-speculatively: the
same weights at k recurrences draft, r verifies, through transformers' assisted decoding (two
``generate`` hooks at the end of ``LoopedForCausalLM``, no decoding loop of our own).

It behaves like transformers 5.24's Llama wherever a looped model can: ``cache=`` (the old
``past_key_values=`` is mapped with Llama's deprecation warning), ``return_dict=False`` gives a
tuple, a keyword the model does not know raises ``TypeError`` instead of vanishing into
``**kwargs``, hidden states and attentions are collected by transformers' output-capturing hooks,
the forward compiles with ``torch.compile(fullgraph=True)`` at a fixed r, and the standard heads
(sequence / token classification, question answering) are transformers' generic ones.

Hidden states, ``output_hidden_states=True``: P + r*K + C + 1 tensors, one per layer
*application* in execution order. Index 0 is the input of the first application (with P > 0 the
embedding, after the embedding norm when there is one; with P = 0 the first block input, the
injected state); index i >= 1 is the output of application i - 1: prelude layer p (0-based) is
p + 1, recurrence s and block layer j (0-based) are P + s*K + j + 1, coda layer c is
P + r*K + c + 1, and the last entry is the final normed state (``last_hidden_state``), as for
Llama. A block layer's output is recorded before the recurrence norm and the next injection (the
normed state after every recurrence is ``recurrent_states``). ``output_hidden_states=[i, ...]``
selects by these indices, negative ones counted from the end at the call's r. Attentions (eager
attention only) have the same order without the leading input: ``attentions[a]`` is application
a, the one that also owns cache slot a (without a KV budget).

This module is the one owner of parameter and FLOP accounting (``num_scaling_params``,
``training_flops_per_token``, ``inference_flops_per_token``); training, planning and model cards
call it. It is shipped with checkpoints as remote code, so it imports only torch, transformers
and ``.configuration_looped``.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import wraps

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, GenerationMixin
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import TransformersKwargs, can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_looped import LoopedConfig

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
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if self.qk_norm == "after_rope":
            # RMS over head_dim with no weights, as the study (its fused kernel accumulates in fp32).
            query_states = F.rms_norm(query_states, (self.head_dim,), eps=self.qk_norm_eps)
            key_states = F.rms_norm(key_states, (self.head_dim,), eps=self.qk_norm_eps)
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
# Adaptive exit (test-time compute): which tokens stop, and the KV they offer once stopped
# ---------------------------------------------------------------------------------------------

# Criteria that read the next-token distribution, so need the coda, final norm and LM head.
_HEAD_CRITERIA = ("kl", "entropy_diff", "argmax_stability")


class _ExitKV:
    """The block layers' view of the cache under adaptive exit.

    A token that exited at recurrence s offers, at every later recurrence, the KV its block
    layers computed at s (Huginn's "latest" cache lookup), both to the other tokens of the same
    call and, through the cache, to later tokens. ``update`` is the cache's: the block's
    attention calls it with its fresh KV, and the exited positions are swapped for their latest.
    """

    def __init__(self, cache: Cache | None, first_slot: int, num_layers: int) -> None:
        self.cache = cache
        self.first_slot = first_slot
        self.num_layers = num_layers
        self.exited: torch.Tensor | None = None  # (batch, tokens) bool, None while no token exited
        self.latest: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def update(self, key: torch.Tensor, value: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = (slot - self.first_slot) % self.num_layers
        if self.exited is not None:
            stopped = self.exited[:, None, :, None]  # key/value: (batch, kv heads, tokens, head_dim)
            key = torch.where(stopped, self.latest[j][0], key)
            value = torch.where(stopped, self.latest[j][1], value)
        self.latest[j] = (key, value)
        return (key, value) if self.cache is None else self.cache.update(key, value, slot)

    def refill(self, slot: int) -> None:
        """Write the latest KV into ``slot`` for a recurrence that no token of the call runs."""
        if self.cache is not None:
            self.cache.update(*self.latest[(slot - self.first_slot) % self.num_layers], slot)


class _AdaptiveExit:
    """Per-token exit decisions for one forward: the criterion's memory, who stopped, and when.

    After recurrence c (1-based), ``step`` freezes the tokens that stopped earlier (their state
    keeps its value, their KV its latest, see ``_ExitKV``) and stops the running tokens whose
    criterion fires, from c = ``min_recurrences`` on. Distribution criteria decode the state
    (``predict``: coda, norm, head) from c = min_recurrences - 1 on, so their memory is ready.
    """

    def __init__(
        self, rule: tuple[str, float, int], num_recurrences: int, state0: torch.Tensor,
        kv: _ExitKV, predict: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.criterion, self.threshold, self.minimum = rule
        self.kv = kv
        self.predict = predict
        batch_shape, device = state0.shape[:-1], state0.device
        self.exited = torch.zeros(batch_shape, dtype=torch.bool, device=device)
        self.used = torch.full(batch_shape, num_recurrences, dtype=torch.long, device=device)
        self.prev_state = state0
        self.prev_logp: torch.Tensor | None = None  # None: the uniform distribution (Huginn's start)
        self.prev_entropy: torch.Tensor | None = None
        self.prev_argmax: torch.Tensor | None = None
        self.stable = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.any_exited = self.all_exited = False  # Python bools, refreshed only when a token stops

    def _record(self, c: int, fires: torch.Tensor) -> None:
        """Stop the running tokens in ``fires`` at recurrence c. One host sync (``any``) per
        recurrence, as Huginn's loop; under torch.compile there is none (every recurrence runs,
        stopped tokens stay frozen), so the graph has no data-dependent branch."""
        stops = fires & ~self.exited if self.any_exited else fires
        compiling = torch.compiler.is_compiling()
        if not compiling and not bool(stops.any()):
            return
        self.used = self.used.masked_fill(stops, c)
        self.exited = self.exited | stops
        self.kv.exited = self.exited
        self.any_exited = True
        self.all_exited = not compiling and bool(self.exited.all())

    def _fires(self, c: int, state: torch.Tensor) -> torch.Tensor | None:
        """Update the criterion's memory with recurrence c's state; which tokens may stop now."""
        if self.criterion in ("cosine", "latent_diff"):
            prev, self.prev_state = self.prev_state.float(), state
            cur = state.float()
            if self.criterion == "cosine":
                value = (1 - F.cosine_similarity(cur, prev, dim=-1, eps=1e-12)).clamp_min(0)
            else:
                value = (cur - prev).norm(dim=-1) / cur.norm(dim=-1).clamp_min(torch.finfo(cur.dtype).tiny)
            return value < self.threshold if c >= self.minimum else None
        if c < self.minimum - 1:
            return None
        logp = F.log_softmax(self.predict(state).float(), dim=-1)
        vocab = logp.shape[-1]
        if self.criterion == "kl":
            # KL(p_(c-1) || p_c), Huginn's F.kl_div(log p_c, log p_(c-1), log_target=True).
            prev = torch.full_like(logp, -math.log(vocab)) if self.prev_logp is None else self.prev_logp
            value = (prev.exp() * (prev - logp)).sum(-1).clamp_min(0)
            self.prev_logp = logp
        elif self.criterion == "entropy_diff":
            entropy = -(logp.exp() * logp).sum(-1)
            prev = torch.full_like(entropy, math.log(vocab)) if self.prev_entropy is None else self.prev_entropy
            value = (entropy - prev).abs()
            self.prev_entropy = entropy
        else:  # argmax_stability: recurrences in a row with the same arg-max token
            argmax = logp.argmax(-1)
            same = argmax == self.prev_argmax if self.prev_argmax is not None else torch.zeros_like(self.exited)
            self.stable = torch.where(same, self.stable + 1, torch.zeros_like(self.stable))
            self.prev_argmax = argmax
            return self.stable >= self.threshold if c >= self.minimum else None
        return value < self.threshold if c >= self.minimum else None

    def step(self, c: int, old: tuple, new: tuple) -> tuple:
        """(h, lanes, state) after recurrence c: frozen where a token had stopped before it."""
        if self.any_exited:
            keep = self.exited[..., None]
            new = tuple(None if n is None else torch.where(keep, o, n) for o, n in zip(old, new))
        with torch.no_grad():  # exit decisions are not differentiable; no graph for them
            fires = self._fires(c, new[2])
        if fires is not None:
            self._record(c, fires)
        return new


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopedModelOutputWithPast(BaseModelOutputWithPast):
    """``recurrent_states[i]``: the state after recurrence i+1 (before the coda), for logit lens.
    ``recurrences_used``: (batch, tokens) recurrences each token ran, with adaptive exit only."""

    recurrent_states: tuple[torch.Tensor, ...] | None = None
    recurrences_used: torch.LongTensor | None = None


@dataclass
class LoopedCausalLMOutputWithPast(CausalLMOutputWithPast):
    recurrent_states: tuple[torch.Tensor, ...] | None = None
    recurrences_used: torch.LongTensor | None = None


# ---------------------------------------------------------------------------------------------
# Keyword arguments: what ``**kwargs`` may carry, and what it must not swallow
# ---------------------------------------------------------------------------------------------

# The keywords transformers 5.24 threads through a decoder's ``**kwargs`` (``TransformersKwargs``):
# the output flags (read by ``capture_outputs``), ``num_items_in_batch`` (the loss, from Trainer)
# and the packed-sequence / attention-backend ones the attention functions read. Anything else
# would vanish into ``**kwargs`` with no effect, so it is refused (a ``None`` value asks for
# nothing and is dropped). ``output_router_logits`` is left out: there is no router here.
_FORWARD_KWARGS = frozenset(TransformersKwargs.__annotations__) - {"output_router_logits", "position_ids"}
# Loss keywords ``ForCausalLMLoss`` reads besides logits / labels / vocab_size / num_items_in_batch.
_LOSS_KWARGS = ("ignore_index", "shift_labels")
# Why a keyword that v4-era code (or another architecture) passes is refused.
_REFUSED_KWARG_HINTS = {
    "cache_position": "transformers 5 removed it; positions come from position_ids, or from the cache's length "
    "when position_ids is None",
    "num_logits_to_keep": "it is called logits_to_keep",
    "head_mask": "transformers 5 removed head masking",
    "token_type_ids": "a decoder-only model has no token types (looped_hf's tokenizers do not return them); "
    "drop the key",
    "output_router_logits": "this model has no router (it is not a mixture of experts)",
    "labels": "LoopedModel computes no loss; use LoopedForCausalLM (or a head class) for a loss",
    "layer_past": "the cache keyword is cache",
    "encoder_hidden_states": "this is a decoder-only model: there is no cross-attention",
}


def _checked_kwargs(owner: nn.Module, kwargs: dict, accepted: frozenset[str] = _FORWARD_KWARGS) -> dict:
    """``kwargs`` without ``None`` values of unknown keys; ``TypeError`` naming any other unknown key.

    A keyword that ``**kwargs`` swallows silently is a wrong result with no error (the v4
    ``past_key_values=`` restarted positions at 0); this makes every such keyword loud.
    """
    out = {}
    for key, value in kwargs.items():
        if key in accepted:
            out[key] = value
        elif value is not None:
            hint = _REFUSED_KWARG_HINTS.get(key, f"{type(owner).__name__} does not use it")
            shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)[:80]
            raise TypeError(f"{type(owner).__name__}.forward() got an unexpected keyword argument {key}={shown}: {hint}")
    return out


def _select_hidden_states_at_r(forward: Callable) -> Callable:
    """Make ``output_hidden_states=[i, ...]`` select by the indices of the call's r.

    transformers' ``capture_outputs`` resolves (and bounds) the indices with
    ``config.num_hidden_layers``, the applications at the *default* r; a call at another r has
    P + r*K + C + 1 hidden states. For such a call (``num_recurrences=`` given as a keyword and
    different from the default) every state is collected and the unselected ones are replaced by
    ``None`` afterwards, as ``capture_outputs`` would. Applied outside ``capture_outputs``.
    """

    @wraps(forward)
    def wrapper(self, *args, **kwargs):
        selection = kwargs.get("output_hidden_states")
        r = kwargs.get("num_recurrences")
        if selection is None or isinstance(selection, bool) or r is None or r == self.config.num_recurrences:
            return forward(self, *args, **kwargs)
        n = self.config.num_layer_applications(int(r)) + 1
        indices = [selection] if isinstance(selection, int) else list(selection)
        keep = {i % n for i in indices if -n <= i < n}
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        out = forward(self, *args, **{**kwargs, "output_hidden_states": True, "return_dict": True})
        out.hidden_states = tuple(h if i in keep else None for i, h in enumerate(out.hidden_states))
        return out if return_dict else out.to_tuple()

    return wrapper


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


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


def _grow_cache(cache: Cache, num_slots: int, shrink: bool = False) -> None:
    """``generate()`` sizes its cache from ``num_hidden_layers`` (the default r); more recurrences
    per call need more slots. Dynamic caches grow; fixed-size ones must be built big enough.

    ``shrink`` (a KV budget is in force): trailing slots that were never written are dropped, so
    the cache has exactly the P + k*K + C slots the budget allows. A static layer allocates its
    buffers on its first write, so a dropped one never held memory."""
    if shrink and len(cache.layers) > num_slots:
        if not any(getattr(layer, "is_initialized", True) for layer in cache.layers[num_slots:]):
            del cache.layers[num_slots:]
    if len(cache.layers) >= num_slots:
        return
    if not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        raise ValueError(
            f"the cache has {len(cache.layers)} slots but this call needs {num_slots} (one per layer "
            "application); build the static cache from a config whose num_recurrences is the largest r you use"
        )
    while len(cache.layers) < num_slots:
        cache.layers.append(DynamicLayer())


def _croppable(cache: Cache) -> bool:
    """Whether every slot can take a write and then drop it again (a KV budget's overwritten
    recurrences, an exit criterion's coda passes): dynamic and static layers can, quantised ones
    cannot."""
    return all(getattr(layer, "is_croppable", False) for layer in cache.layers)


def _check_cache_recurrences(cache: Cache, r: int, kv_budget: int | None = None) -> None:
    """Refuse a cache filled at another r or KV budget: slot a holds application a, and which layer
    (and which recurrence) application a is depends on r, so mixing two r's attends to the wrong
    keys. ``kv_budget`` is the call's effective budget, min(k, r) (``None``: r, no budget); it
    maps recurrences to slots, so it must stay fixed for the life of a cache too.

    The r a cache was filled at is a Python attribute on the cache, so at a fixed r this is a
    constant check that ``torch.compile`` guards on, never a read of the cache's length. Only
    when r changes is the length read, so that an emptied cache (``reset()``, as ``generate``
    does before reusing its static cache) can be reused at a new r.
    """
    k = r if kv_budget is None else kv_budget
    filled_r = getattr(cache, "looped_num_recurrences", None)
    # A cache recorded before KV budgets existed was filled with one slot set per recurrence.
    filled_k = getattr(cache, "looped_kv_budget", filled_r)
    if filled_r == r and filled_k == k:
        return
    if filled_r is not None and (torch.compiler.is_compiling() or cache.get_seq_length() > 0):
        if filled_r != r:
            raise ValueError(
                f"num_recurrences={r}, but this cache was filled at num_recurrences={filled_r}: every "
                "recurrence has its own cache slot, so r must stay fixed for the life of a cache"
            )
        raise ValueError(
            f"kv_budget={k}, but this cache was filled at kv_budget={filled_k} (num_recurrences={r}): the "
            "budget maps recurrences to cache slots, so it must stay fixed for the life of a cache"
        )
    cache.looped_num_recurrences = r
    cache.looped_kv_budget = k


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

    def _injection_split(self, e: torch.Tensor, legacy: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W_e e, W_h) for the linear injection u = W [e; h] = W_e e + W_h h, or ``None``.

        e is the same at every recurrence, so W_e e is computed once per forward instead of a
        concat and a d x 2d matmul per recurrence (r + 1 d x d matmuls instead of 2r, forward and
        backward). Only for a plain ``nn.Linear``: a wrapped adapter (LoRA, quantisation, FSDP)
        must see its own forward called, and gets ``self.injection(cat)`` instead.
        """
        injection = self.injection
        if type(injection) is not nn.Linear or injection.bias is not None:
            return None
        d = self.config.hidden_size
        # The study's order is [e; h] (W = [I | 0] reads e); looped_format 1 concatenated [h; e].
        w_e, w_h = (injection.weight[:, d:], injection.weight[:, :d]) if legacy else (
            injection.weight[:, :d], injection.weight[:, d:]
        )
        return F.linear(e, w_e), w_h

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

    def _resolve_kv_budget(self, kv_budget: int | None, r: int) -> int:
        """The call's effective KV budget, min(k, r): ``kv_budget`` (else ``config.kv_budget``,
        else r, every recurrence keeping its slots). A budget of r or more is the default."""
        k = self.config.kv_budget if kv_budget is None else kv_budget
        if k is None:
            return r
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"kv_budget={k!r}: must be None (every recurrence keeps its KV cache) or an integer >= 1")
        return min(k, r)

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
        budget = self._resolve_kv_budget(kv_budget, r)
        exit_rule = self._resolve_exit(exit_criterion, exit_threshold, min_recurrences, r, exit_head, cache, kwargs)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            # Grow (or refuse) first, so a refused call leaves the cache's recorded r unchanged.
            _grow_cache(cache, config.num_kv_slots(r, budget), shrink=budget < r)
            _check_cache_recurrences(cache, r, budget)
            if budget < r and not _croppable(cache):
                # An overwritten slot is written then cropped back (below); a cache layer that
                # cannot crop (quantised) cannot take a second write of the same positions.
                raise ValueError(
                    f"kv_budget={budget} < num_recurrences={r} needs a cache whose layers can be cropped "
                    f"(DynamicCache or StaticCache); got {type(cache).__name__}"
                )

        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids,
        )
        # What every layer application gets, as Llama's layers do (position_ids: the varlen /
        # packed-sequence attention backends read it).
        layer_kwargs = dict(
            attention_mask=causal_mask, position_embeddings=self.rotary_emb(inputs_embeds, position_ids),
            position_ids=position_ids, cache=cache, **kwargs,
        )

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
        split = self._injection_split(e, legacy) if config.input_injection == "linear" else None
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

            def predict(x: torch.Tensor) -> torch.Tensor:
                """The next-token logits of a state, leaving the cache's coda slots as they were."""
                for i, layer in enumerate(self.coda_layers):
                    x = layer(x, cache_index=coda_start + i, **layer_kwargs)[0]
                    if cache is not None:
                        cache.layers[coda_start + i].crop(-num_new_tokens)
                return exit_head(self.norm(x))

            state = lanes.sum(0) if hc is not None else h
            exit_ = _AdaptiveExit(exit_rule, r, state, exit_kv, predict if exit_head is not None else None)
        for step in range(r):
            if exit_ is not None and exit_.all_exited:
                # Every token has stopped: nothing runs; later tokens will read the latest KV.
                if cache is not None and step >= r - budget:
                    for j in range(K):
                        exit_kv.refill(len(self.prelude_layers) + (step % budget) * K + j)
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

    def _resolve_exit(
        self, criterion: str | None, threshold: float | None, min_recurrences: int | None, r: int,
        head: Callable | None, cache: Cache | None, kwargs: dict,
    ) -> tuple[str, float, int] | None:
        """The call's adaptive-exit rule (``LoopedConfig.exit_settings``), checked against the call."""
        rule = self.config.exit_settings(criterion, threshold, min_recurrences)
        if rule is None:
            return None
        name, _, minimum = rule
        if minimum > r:
            raise ValueError(f"min_recurrences={minimum} exceeds num_recurrences={r} (the cap on recurrences per token)")
        if name in _HEAD_CRITERIA and head is None:
            raise ValueError(
                f"exit_criterion={name!r} reads the next-token distribution, so it needs the LM head: call "
                f"LoopedForCausalLM (or pass exit_head=), or use a state criterion ('cosine', 'latent_diff')"
            )
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # Checkpointed layers drop the cache argument, which carries the stopped tokens' KV, and
            # their replay in backward would see the final exit mask instead of the step's.
            raise ValueError(f"exit_criterion={name!r} cannot be used while training with gradient checkpointing")
        if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
            # Recurrences no token runs record nothing, and the criterion's coda passes would record.
            raise ValueError(
                f"exit_criterion={name!r} cannot be combined with output_hidden_states / output_attentions: use "
                "output_recurrent_states=True (one frozen state per recurrence) and recurrences_used"
            )
        if cache is not None and name in _HEAD_CRITERIA and not _croppable(cache):
            raise ValueError(
                f"exit_criterion={name!r} decodes intermediate states through the coda and crops its KV back out, "
                f"so it needs a cache whose layers can be cropped (DynamicCache or StaticCache); got {type(cache).__name__}"
            )
        return rule


# ---------------------------------------------------------------------------------------------
# generate(): what a looped model adds (recurrences per token, self-speculative drafting)
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopedGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)`` with the looped extras.

    ``recurrences_used``: (batch, new tokens), with adaptive exit, the recurrences run by the
    position whose logits chose each new token. ``num_draft_tokens`` /
    ``num_accepted_draft_tokens``: with ``draft_num_recurrences``, the tokens drafted and the
    tokens of them the model at r accepted (their ratio is the acceptance rate).
    """

    recurrences_used: torch.LongTensor | None = None
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None


class RecurrenceDraftCandidateGenerator(AssistedCandidateGenerator):
    """Self-speculative decoding: the same weights at k recurrences draft, the model at r verifies.

    This is transformers' assisted decoding with the model as its own assistant, run at
    ``num_recurrences=k``: the draft proposes up to ``num_assistant_tokens`` tokens, the model at r
    scores them in one forward, greedy keeps the longest prefix it would itself have chosen (so the
    output is plain greedy at r) and sampling keeps r's distribution (speculative sampling). No
    weights are copied; the draft has its own cache, since a cache is filled at one r.
    """

    def __init__(
        self, model: LoopedForCausalLM, draft_num_recurrences: int, generation_config: GenerationConfig, **kwargs
    ) -> None:
        super().__init__(assistant_model=model, generation_config=generation_config, **kwargs)
        self.assistant_kwargs["num_recurrences"] = draft_num_recurrences
        # The assistant's settings come from the assistant model's generation config; the assistant
        # is this model, so the call's own (num_assistant_tokens=, ... passed to generate) apply.
        self.num_assistant_tokens = generation_config.num_assistant_tokens
        self.assistant_generation_config.num_assistant_tokens_schedule = generation_config.num_assistant_tokens_schedule
        threshold = generation_config.assistant_confidence_threshold
        self.assistant_confidence_threshold = self.generation_config.assistant_confidence_threshold = threshold
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.generation_config.use_cache = self.assistant_kwargs.pop("use_cache", True)

    def _prepare_generation_args(self, input_ids: torch.LongTensor, min_new_tokens: int, max_new_tokens: int) -> dict:
        # The draft's lengths go into (a shallow copy of) its generation config rather than beside
        # it: generate() deprecates mixing the two.
        config = copy.copy(self.generation_config)
        config.min_new_tokens, config.max_new_tokens = min_new_tokens, max_new_tokens
        return {self.input_ids_key: input_ids, "generation_config": config, "logits_processor": self.logits_processor}

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        super().update_candidate_strategy(input_ids, scores, num_matches)
        self.num_draft_tokens += scores.shape[1] - 1  # scores: the candidates + the bonus position
        self.num_accepted_draft_tokens += int(num_matches)


_SELF_DRAFT_DEFAULTS = {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0}


@dataclass
class _GenerationRun:
    """What one ``generate`` call collects besides tokens (calls nest: the draft calls generate)."""

    draft_num_recurrences: int | None = None
    recurrences_used: list[torch.Tensor] = field(default_factory=list)
    drafter: RecurrenceDraftCandidateGenerator | None = None


class LoopedForCausalLM(LoopedPreTrainedModel, GenerationMixin):
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
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

    def logit_lens(self, recurrent_states: tuple[torch.Tensor, ...], through_coda: bool = True) -> list[torch.Tensor]:
        """Decode each intermediate recurrence state to logits (for logit-lens analysis).

        With ``through_coda`` (Huginn's convention) each state runs through the coda, the final
        norm and the head, as if the loop had stopped there; otherwise only norm + head.
        No cache is used; pass states from a call without one or of the whole sequence.
        """
        base = self.model
        out = []
        for state in recurrent_states:
            h = state
            if through_coda and len(base.coda_layers):
                pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
                mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
                pe = base.rotary_emb(h, pos)
                for layer in base.coda_layers:
                    h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)[0]
            out.append(self.logits_from_hidden(base.norm(h)))
        return out

    # -----------------------------------------------------------------------------------------
    # generate(): transformers' loop, with two hooks (no second decoding loop)
    # -----------------------------------------------------------------------------------------
    def generate(self, *args, draft_num_recurrences: int | None = None, **kwargs):
        """transformers' ``generate``, plus the looped model's test-time compute.

        Model keywords go to every forward, as for any model: ``num_recurrences``, ``kv_budget``,
        ``exit_criterion`` / ``exit_threshold`` / ``min_recurrences``. With
        ``return_dict_in_generate=True`` the output is a ``LoopedGenerateOutput``, whose
        ``recurrences_used`` says how many recurrences chose each new token under adaptive exit.
        ``draft_num_recurrences=k`` decodes self-speculatively (``RecurrenceDraftCandidateGenerator``):
        the same model at k recurrences drafts ``num_assistant_tokens`` tokens per round (default 4,
        with ``assistant_confidence_threshold`` 0: no early stop), the model at r verifies them;
        greedy output is the greedy output at r. It needs batch size 1 (as
        assisted decoding), and is refused with adaptive exit or a KV budget below r, whose
        multi-token verification would not reproduce token-by-token decoding.
        """
        run = _GenerationRun(draft_num_recurrences=draft_num_recurrences)
        if draft_num_recurrences is not None:
            self._check_draft(draft_num_recurrences, kwargs)
            kwargs["assistant_model"] = self
            # transformers' assistant defaults (20 tokens, stop below 0.4 confidence) suit a small
            # separate model; a k-recurrence draft of the model itself is cheap and usually right,
            # and 4 tokens without the confidence stop was faster in every setting of
            # benchmarks/bench_test_time.py. Used unless the call or the model's config sets them.
            defaults = {key: value for key, value in _SELF_DRAFT_DEFAULTS.items()
                        if kwargs.get(key) is None and getattr(self.generation_config, key, None) is None}  # fmt: skip
            if len(args) > 1 or kwargs.get("generation_config") is not None:
                # A GenerationConfig passed in: fill its unset fields on a copy (generate() warns
                # when one is mixed with generation keywords).
                args = list(args)
                passed = copy.copy(args[1] if len(args) > 1 else kwargs["generation_config"])
                for key, value in defaults.items():
                    if getattr(passed, key, None) is None:
                        setattr(passed, key, value)
                if len(args) > 1:
                    args[1] = passed
                else:
                    kwargs["generation_config"] = passed
            else:
                kwargs.update(defaults)
        outer = self.__dict__.get("_looped_generation")
        self.__dict__["_looped_generation"] = run
        try:
            out = super().generate(*args, **kwargs)
        finally:
            self.__dict__["_looped_generation"] = outer
        if isinstance(out, GenerateDecoderOnlyOutput) and (run.recurrences_used or run.drafter is not None):
            extras = {}
            if run.recurrences_used:
                # One column per forward of the loop, so one per new token; trim any step the loop
                # ran past a stop and undid. (From inputs_embeds, sequences hold only new tokens.)
                prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
                num_new = out.sequences.shape[1] - (prompt.shape[1] if isinstance(prompt, torch.Tensor) else 0)
                extras["recurrences_used"] = torch.cat(run.recurrences_used, dim=1)[:, :num_new]
            if run.drafter is not None:
                extras["num_draft_tokens"] = run.drafter.num_draft_tokens
                extras["num_accepted_draft_tokens"] = run.drafter.num_accepted_draft_tokens
            out = LoopedGenerateOutput(**out, **extras)
        return out

    def _check_draft(self, k: int, kwargs: dict) -> None:
        """Refuse a ``draft_num_recurrences`` that cannot give the model's own output at r."""
        config = self.config
        r = kwargs.get("num_recurrences")
        r = config.num_recurrences if r is None else r
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= r:
            raise ValueError(f"draft_num_recurrences={k!r}: must be an integer in [1, num_recurrences={r}]")
        if kwargs.get("assistant_model") is not None:
            raise ValueError("draft_num_recurrences drafts with the model itself; do not pass assistant_model too")
        if config.is_recurrence_locked and k != r:
            raise ValueError(
                f"draft_num_recurrences={k}: a hyperconnection model runs only at its trained num_recurrences={r}"
            )
        budget = kwargs.get("kv_budget", config.kv_budget)
        if budget is not None and budget < r:
            raise ValueError(
                f"draft_num_recurrences={k} with kv_budget={budget} < num_recurrences={r}: verifying several drafted "
                "tokens in one forward lets them read each other's fresh KV, which token-by-token decoding under a KV "
                "budget does not, so the output would not be the model's own"
            )
        rule = config.exit_settings(kwargs.get("exit_criterion"), kwargs.get("exit_threshold"), kwargs.get("min_recurrences"))
        if rule is not None:
            raise ValueError(
                f"draft_num_recurrences={k} with exit_criterion={rule[0]!r}: a token's exit depends on whether it is "
                "decoded alone or verified with others, so drafting would change the output; use one or the other"
            )

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        # Hook: transformers' assisted decoding asks for its drafter here.
        run = self.__dict__.get("_looped_generation")
        if run is None or run.draft_num_recurrences is None or assistant_model is not self:
            return super()._get_candidate_generator(
                generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model=assistant_model, target_tokenizer=target_tokenizer,
                assistant_tokenizer=assistant_tokenizer,
            )
        run.drafter = RecurrenceDraftCandidateGenerator(
            self, run.draft_num_recurrences, input_ids=input_ids, generation_config=generation_config,
            model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
        )
        return run.drafter

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict:  # fmt: skip
        # Hook: called after every forward of the decoding loop; records the recurrences run by the
        # positions whose logits choose the new tokens.
        run = self.__dict__.get("_looped_generation")
        used = getattr(outputs, "recurrences_used", None)
        if run is not None and used is not None:
            run.recurrences_used.append(used[:, -num_new_tokens:])
        return super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )

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
