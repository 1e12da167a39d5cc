"""A looped (depth-recurrent) decoder for transformers 5.x.

    tokens -> embed [-> norm] -> prelude (P layers) = e -> h_0 = init(e)
           -> r times: h = block(inject(h, e)) [-> norm]     block: K shared layers
           -> coda (C layers) -> norm -> lm_head [-> soft-cap]

Top to bottom: Llama's layer (pre-norm, RoPE, GQA) with the study's switches (squared-ReLU MLP,
QK-norm, logit soft-cap), the hyperconnection lanes, the models, the standard heads. The loop
itself is ``LoopedRecurrentBlock`` (``recurrent_block_looped.py``), which ``LoopedModel.forward``
runs between the prelude and the coda. Where the study's code (kschwethelm/looped-lm-scaling,
nanochat/gpt.py) fixes a convention, this file follows it and says so; ``config.looped_format ==
1`` keeps looped_hf 0.1.0's forward for its checkpoints. Every layer *application* (P + r*K + C
per token) owns a KV-cache slot, placed by the call's ``KVSlotPlan`` (``LoopedConfig.slot_plan``).

It behaves like transformers 5.24's Llama wherever a looped model can (``cache=``, tuples with
``return_dict=False``, per-application hidden states and attentions, ``torch.compile(fullgraph=
True)`` at a fixed r); an unknown keyword raises ``TypeError``. Beside it, shipped with every
checkpoint as remote code: ``recurrent_block_looped.py`` (the loop), ``interface_looped.py``
(outputs, keywords, the attention mask), ``generation_looped.py`` (KV budget, adaptive exit,
self-drafting) and ``accounting_looped.py`` (parameters and FLOPs). It imports only torch,
transformers and those modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils.generic import TransformersKwargs, can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .accounting_looped import inference_flops_per_token, num_scaling_params, training_flops_per_token
from .configuration_looped import LoopedConfig
from .generation_looped import (
    LoopedGenerateOutput,
    LoopedGenerationMixin,
    RecurrenceDraftCandidateGenerator,
    coda_predictor,
    prepare_cache,
    resolve_exit_rule,
)
from .interface_looped import (
    _LOSS_KWARGS,
    CheckpointingLayer,
    LoopedCausalLMOutputWithPast,
    LoopedModelOutputWithPast,
    _checked_kwargs,
    _select_hidden_states_at_r,
    accepts_past_key_values,
    causal_attention_mask,
    check_token_ids,
    warn_past_positions,
)
from .recurrent_block_looped import LoopedRecurrentBlock, LoopNorms, after_loop, loop_norms

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
    largest tensors of a training step; the derivative is 1 - tanh^2(x / cap), one
    ``tanh_backward`` from the saved tanh. The gradient equals
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
        self.qk_norm = config.qk_norm
        self.qk_norm_eps = config.rms_norm_eps
        if self.qk_norm == "learnable_before_rope":
            self.q_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LoopedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        elif self.qk_norm == "learnable_projection_before_rope":
            self.q_norm = LoopedRMSNorm(h * self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LoopedRMSNorm(kv * self.head_dim, eps=config.rms_norm_eps)
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
        query_states, key_states = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if self.qk_norm == "learnable_projection_before_rope":
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.view(hidden_shape), key_states.view(hidden_shape)
        if self.qk_norm == "learnable_before_rope":
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        # RoPE and the QK-norm run on the projections' own (batch, seq, heads, head_dim) layout and
        # only then turn into attention's (batch, heads, seq, head_dim) view: the same values bit for
        # bit (elementwise ops and a norm over head_dim), without norming a strided view.
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

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.self_attn = LoopedAttention(config)
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
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = hidden_states
        attn, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, cache_index, **kwargs
        )
        hidden_states = residual + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, attn_weights


class LoopedSandwichDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="sandwich"`` (Huginn's SandwichBlock): a norm before each sublayer and one
    after each residual add, x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))."""

    norm_names = ("input_layernorm", "post_attention_residual_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_residual_layernorm")  # fmt: skip

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                **kwargs):  # fmt: skip
        attn, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, cache_index, **kwargs
        )
        hidden_states = self.post_attention_residual_layernorm(attn + hidden_states)
        hidden_states = self.post_feedforward_residual_layernorm(
            self.mlp(self.pre_feedforward_layernorm(hidden_states)) + hidden_states
        )
        return hidden_states, attn_weights


class LoopedSublayerOutputNormDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="sublayer_output"`` (OLMo-2): no input norms, each sublayer's output normed
    before the residual add, x = x + n1(attn x); x = x + n2(mlp x)."""

    norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                **kwargs):  # fmt: skip
        attn, attn_weights = self.self_attn(
            hidden_states, position_embeddings, attention_mask, cache, cache_index, **kwargs
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        hidden_states = hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, attn_weights


class LoopedPreAndOutputNormDecoderLayer(LoopedDecoderLayer):
    """``norm_placement="pre_and_output"`` (Ouro, Gemma-2): four norms, on each sublayer's input and
    on its output before the residual add, x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x))."""

    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")  # fmt: skip

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, cache_index=0,
                **kwargs):  # fmt: skip
        attn, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, cache_index, **kwargs
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        hidden_states = hidden_states + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(hidden_states))
        )
        return hidden_states, attn_weights


#: ``LoopedConfig.norm_placement`` -> the decoder layer class that places its norms so.
DECODER_LAYERS: dict[str, type[LoopedDecoderLayer]] = {
    "pre": LoopedDecoderLayer,
    "sandwich": LoopedSandwichDecoderLayer,
    "sublayer_output": LoopedSublayerOutputNormDecoderLayer,
    "pre_and_output": LoopedPreAndOutputNormDecoderLayer,
}


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


def exit_gate_probabilities(gate: nn.Module, states: list[torch.Tensor]) -> torch.Tensor:
    """Ouro's exit distribution over the r recurrences, (batch, tokens, r), in float32 (a bf16
    product of r survival terms would lose the small exit probabilities).

    ``gate`` is ``LoopedModel.exit_gate``, Linear(hidden -> 1, with bias), read on each
    recurrence's state s_t (after the recurrence norm): lambda_t = sigmoid(gate(s_t)) is the chance
    of stopping at step t having reached it, so p_t = lambda_t * prod_(j<t) (1 - lambda_j), the
    last step taking what is left (p sums to 1 whatever the last gate says). A plain function of
    the module, not a method of a subclass, so a LoRA-wrapped gate still runs its own forward."""
    remaining = None
    probabilities = []
    for t, state in enumerate(states):
        if t == len(states) - 1:
            probabilities.append(remaining if remaining is not None else torch.ones_like(state[..., 0], dtype=torch.float32))
            break
        stop = torch.sigmoid(gate(state).squeeze(-1).float())
        probabilities.append(stop if remaining is None else stop * remaining)
        remaining = 1.0 - stop if remaining is None else remaining * (1.0 - stop)
    return torch.stack(probabilities, dim=-1)


def threshold_exit_steps(probabilities: torch.Tensor, threshold: float) -> torch.LongTensor:
    """Per token, the 0-based step at which the exit CDF first reaches ``threshold`` (Ouro's
    threshold exit); the last step where it never does (the CDF rounds to just under 1)."""
    reached = probabilities.cumsum(dim=-1) >= threshold
    first = reached.to(torch.uint8).argmax(dim=-1)  # argmax returns the first maximum
    return torch.where(reached.any(dim=-1), first, probabilities.shape[-1] - 1)


def exit_gate_loss(
    step_logits: list[torch.Tensor], probabilities: torch.Tensor, labels: torch.LongTensor | None, beta: float,
    ignore_index: int = -100, shift_labels: torch.LongTensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Ouro's training objective, per labelled token sum_t p_t L_t - beta H(p), averaged over the
    labelled tokens (or divided by ``num_items_in_batch``, as transformers' loss is under gradient
    accumulation). L_t is the cross-entropy of step t's logits, H(p) = -sum_t p_t log p_t. The
    entropy term keeps the gate from collapsing onto one step early in training (the Ouro paper's
    uniform-prior regulariser); labels shift as ``ForCausalLMLoss``'s do."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(probabilities.device)
    losses = torch.stack([
        F.cross_entropy(logits.float().flatten(0, -2), shift_labels.flatten(), ignore_index=ignore_index,
                        reduction="none").view(shift_labels.shape)
        for logits in step_logits
    ], dim=-1)  # fmt: skip
    entropy = -(probabilities * probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny).log()).sum(-1)
    per_token = (probabilities * losses).sum(-1) - beta * entropy
    labelled = shift_labels != ignore_index
    total = per_token.masked_fill(~labelled, 0.0).sum()
    count = labelled.sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    return total / count


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class LoopedPreTrainedModel(PreTrainedModel):
    config: LoopedConfig
    config_class = LoopedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = [cls.__name__ for cls in DECODER_LAYERS.values()]
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


class LoopedModel(LoopedPreTrainedModel):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size, self.padding_idx)
        self.embedding_norm = LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if config.embedding_norm else None
        layer = DECODER_LAYERS[config.norm_placement]
        self.prelude_layers = nn.ModuleList(layer(config) for _ in range(config.num_prelude_layers))
        self.recurrent_layers = nn.ModuleList(layer(config) for _ in range(config.num_recurrent_layers))
        self.coda_layers = nn.ModuleList(layer(config) for _ in range(config.num_coda_layers))
        # The linear injection adapter is a plain nn.Linear(2d -> d) so LoRA and tensor parallelism
        # see it like any projection; its weight keeps 0.1.0's key (``model.injection.weight``).
        self.injection = None
        if config.input_injection == "linear":
            self.injection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
            self.injection.looped_study_init = "injection"
        self.hyperconnection = LoopedHyperConnection(config) if config.input_injection == "hyperconnection" else None
        # A norm whose weight is the final norm's ("final") is no module of its own: one tensor, one
        # checkpoint key (model.norm.weight); the forward and the loop call ``self.norm`` there.
        own = config.recurrence_norm and config.recurrence_norm_weight == "own"
        self.recurrence_norm = LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if own else None
        own = config.post_loop_norm == "own"
        self.post_loop_norm = LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if own else None
        self.norm = LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Ouro's exit gate (LoopedConfig.exit_gate): one logit per token on each recurrence's state.
        self.exit_gate = nn.Linear(config.hidden_size, 1, bias=True) if config.exit_gate else None
        self.rotary_emb = LoopedRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def loop_norms(self) -> LoopNorms:
        """(the recurrence norm, the post-loop norm, the norm after the coda): ``loop_norms``."""
        return loop_norms(self)

    @accepts_past_key_values
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
        r = config.resolve_num_recurrences(num_recurrences)
        plan = config.slot_plan(r, kv_budget)
        exit_rule = resolve_exit_rule(self, exit_criterion, exit_threshold, min_recurrences, r, exit_head, cache, kwargs)
        if exit_rule is not None and self.exit_gate is not None:
            raise ValueError(f"exit_criterion={exit_rule[0]!r}: refused with exit_gate=True (the gate decides each "
                             "token's exit; use exit_gate_output='threshold')")  # fmt: skip

        if inputs_embeds is None:
            check_token_ids(config, input_ids, self.training and torch.is_grad_enabled())
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            prepare_cache(cache, plan)

        positions_given = position_ids is not None
        past_seen_tokens = None
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        warn_past_positions(config, inputs_embeds.shape[1], past_seen_tokens,
                            "input_ids" if input_ids is not None else "inputs_embeds")  # fmt: skip
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

        h = inputs_embeds
        if config.embedding_multiplier != 1.0:
            h = h * config.embedding_multiplier  # Huginn: sqrt(d); the tied head reads the table unscaled
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        for j, layer in enumerate(self.prelude_layers):
            h = layer(h, cache_index=plan.prelude(j), **layer_kwargs)[0]
        num_new_tokens = inputs_embeds.shape[1]
        predict = None  # the distribution exit criteria's decoder: after_loop (coda cropped back), head
        if exit_rule is not None and exit_head is not None:
            predict = coda_predictor(self, exit_head, plan.coda(0), layer_kwargs, num_new_tokens)
        loop = LoopedRecurrentBlock(self, plan, layer_kwargs, num_new_tokens)
        # The gate reads every recurrence's state, so the loop keeps them when there is one.
        h, recurrent_states, used = loop(h, exit_rule, predict, output_recurrent_states or self.exit_gate is not None)
        exit_probabilities = None
        if self.exit_gate is not None:
            exit_probabilities = exit_gate_probabilities(self.exit_gate, recurrent_states)

        def coda(x: torch.Tensor) -> torch.Tensor:
            for j, layer in enumerate(self.coda_layers):
                x = layer(x, cache_index=plan.coda(j), **layer_kwargs)[0]
            return x

        h = after_loop(self, h, coda)

        return LoopedModelOutputWithPast(
            last_hidden_state=h,
            cache=cache if use_cache else None,
            recurrent_states=tuple(recurrent_states) if output_recurrent_states else None,
            recurrences_used=used,
            exit_probabilities=exit_probabilities,
        )

    def step_output(
        self, state: torch.Tensor, coda: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """What ``last_hidden_state`` would be if the loop stopped at ``state`` (a recurrence's
        state): the modules after the loop (``recurrent_block_looped.after_loop``), with ``coda``
        running the coda layers as the caller's cache needs (``None``: no coda pass; the exit gate's
        readouts, refused with coda layers). The logit lens and the exit criteria decode through it."""
        return after_loop(self, state, coda)


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

    @accepts_past_key_values
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
        exit_gate_output: str | None = None,
        exit_gate_threshold: float | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LoopedCausalLMOutputWithPast:
        r"""Causal-LM forward. ``num_recurrences`` overrides r for this call (``generate`` passes it
        through, as it does ``kv_budget``, the KV-cache budget of ``LoopedConfig.kv_budget``);
        ``output_recurrent_states`` returns the state after every recurrence; ``exit_criterion``,
        ``exit_threshold`` and ``min_recurrences`` set per-token adaptive exit (``LoopedConfig``;
        ``recurrences_used`` in the output says how many recurrences each token ran); ``labels`` are NOT
        shifted by the caller (the loss shifts them; -100 is ignored). ``ignore_index`` and
        ``shift_labels`` go to the loss (a loss is computed when either labels or shift_labels is
        given), ``return_dict=False`` returns a tuple, and an unknown keyword raises ``TypeError``.
        With an exit gate (``LoopedConfig.exit_gate``), ``exit_gate_output`` and
        ``exit_gate_threshold`` override the config's readout for this call, and the output carries
        ``exit_probabilities``."""
        loss_kwargs = {key: kwargs.pop(key) for key in _LOSS_KWARGS if key in kwargs}
        kwargs = _checked_kwargs(self, kwargs)  # so an error names the class the caller called
        readout = self.config.exit_gate_settings(exit_gate_output, exit_gate_threshold)  # None: no gate
        wants_loss = labels is not None or loss_kwargs.get("shift_labels") is not None
        beta = self.config.exit_gate_entropy_beta if readout is not None and wants_loss else None
        # Only a gate readout other than the last step, or Ouro's loss, reads every step's state.
        per_step = readout is not None and (readout[0] != "last" or beta is not None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            num_recurrences=num_recurrences,
            output_recurrent_states=output_recurrent_states or per_step,
            kv_budget=kv_budget,
            exit_criterion=exit_criterion,
            exit_threshold=exit_threshold,
            min_recurrences=min_recurrences,
            exit_head=self.logits_from_hidden,
            return_dict=True,  # the tuple, if asked for, is made here (config.return_dict=False too)
            **kwargs,
        )
        used = outputs.recurrences_used
        loss = None
        if per_step:
            logits, used, loss = self._exit_gate_readout(outputs, readout, beta, labels, logits_to_keep, loss_kwargs,
                                                         kwargs.get("num_items_in_batch"))  # fmt: skip
        else:
            hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
            logits = self.logits_from_hidden(hidden_states)
        if loss is None and wants_loss:
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
            recurrent_states=outputs.recurrent_states if output_recurrent_states else None,
            recurrences_used=used,
            exit_probabilities=outputs.exit_probabilities,
        )

    def _exit_gate_readout(
        self, outputs: LoopedModelOutputWithPast, readout: tuple[str, float], beta: float | None,
        labels: torch.LongTensor | None, logits_to_keep: int | torch.Tensor, loss_kwargs: dict,
        num_items_in_batch: torch.Tensor | int | None,
    ) -> tuple[torch.Tensor, torch.LongTensor | None, torch.Tensor | None]:
        """(logits, recurrences_used, loss) from every recurrence's state: the gate's threshold
        or weighted readout (``LoopedConfig.exit_gate_output``) and, with ``beta``, Ouro's loss."""
        output, threshold = readout
        states = [self.model.step_output(slice_logits_to_keep(s, logits_to_keep)) for s in outputs.recurrent_states]
        probabilities = slice_logits_to_keep(outputs.exit_probabilities, logits_to_keep)
        step_logits = None
        if output == "weighted" or beta is not None:
            step_logits = [self.logits_from_hidden(state) for state in states]
        used = None
        if output == "threshold":
            # Each token's state (or, when every step's logits exist anyway, its logits) at its
            # exit step: one head pass, not one per step.
            steps = threshold_exit_steps(probabilities, threshold)
            stacked = torch.stack(step_logits if step_logits is not None else states, dim=2)
            index = steps[..., None, None].expand(-1, -1, 1, stacked.shape[-1])
            picked = stacked.gather(2, index).squeeze(2)
            logits = picked if step_logits is not None else self.logits_from_hidden(picked)
            used = steps + 1
        elif output == "weighted":
            # sum_t p_t logits_t, accumulated in step order (as Ouro's code does).
            logits = step_logits[0] * probabilities[..., 0:1].to(step_logits[0].dtype)
            for t in range(1, len(step_logits)):
                logits = logits + step_logits[t] * probabilities[..., t : t + 1].to(step_logits[t].dtype)
        else:
            logits = step_logits[-1]
        loss = None
        if beta is not None:
            loss = exit_gate_loss(step_logits, probabilities, labels, beta, num_items_in_batch=num_items_in_batch,
                                  **loss_kwargs)  # fmt: skip
        return logits, used, loss

    # The study's accounting, for users; accounting_looped.py owns it (training, planning and cards call it).
    def num_scaling_params(self) -> dict[str, int]:
        """Parameters in the study's groups: ``once``, ``recurrent``, ``embedding``, ``lm_head``,
        ``total`` (``accounting_looped.num_scaling_params``)."""
        return num_scaling_params(self)

    def training_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Training FLOPs per token at ``seq_len`` and r (``accounting_looped.training_flops_per_token``)."""
        return training_flops_per_token(self, seq_len, num_recurrences)

    def inference_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Forward FLOPs per token at context ``seq_len`` and r (``accounting_looped.inference_flops_per_token``)."""
        return inference_flops_per_token(self, seq_len, num_recurrences)


# ---------------------------------------------------------------------------------------------
# The standard heads: transformers' generic ones on the looped trunk (as Llama's in 5.24)
# ---------------------------------------------------------------------------------------------


# The generic heads build their trunk with ``AutoModel.from_config``, which cannot resolve the looped
# trunk as remote code without looped_hf installed; so each builds ``LoopedModel`` itself.


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
