"""The native vLLM implementation of ``LoopedForCausalLM`` (registered by ``plugin.register``).

The forward is ``modeling_looped.LoopedModel``'s, op for op, on vLLM's layers: tensor-parallel
projections (q/k/v and the gated MLP's two inputs fused, as vLLM's Llama), a vocabulary-parallel
embedding and head, and vLLM's paged ``Attention``; the loop itself is modeling_looped's own
``LoopedRecurrentBlock``, its block layers run on those, and each layer's norms and residual adds are
modeling_looped's own decoder-layer forward for the config's ``norm_placement`` (pre-norm, sandwich,
sublayer-output, pre-and-output), run on a module whose attention and MLP are vLLM's. The norm
weights, the rotary tables and the hyperconnection gains are looped_hf's own modules, so their
values are the same bit for bit; the embedding multiplier, the post-loop norm, a recurrence norm
that is the final norm (``LoopedModel.loop_norms``) and Ouro's exit gate (its "threshold" readout:
each token's state at its exit step, picked after the loop) run as in ``generate()``. In
every dtype the RMSNorms (the parameter-free QK-norm included) and RoPE run as vLLM's kernels on
those values, one call where PyTorch's ops take several per layer and recurrence (RoPE through the
``cos | sin`` table vLLM's Llama uses, in the model's dtype): in float32 equal to ``generate()``'s ops
to float32 rounding (the kernels sum and multiply in another order). The modules, the loop object
and the RoPE table are built once, in ``__init__``.

Head sizes: vLLM's CPU attention runs a few head sizes only (32, 64, 80, ...). Any other head_dim d
attends at the next one up, H: q, k and v are zero-padded from d to H after RoPE and the QK-norm,
the softmax scale stays d**-0.5, and the output's padded columns are cropped before o_proj. Exact:
the zero columns add nothing to q . k, and the padded output columns are a weighted sum of zeros.
The KV cache holds H numbers per head.

KV cache: one vLLM ``Attention`` per KV slot of ``LoopedConfig.slot_plan(r, kv_budget)``, named
``model.kv_slots.{slot}.attn`` (vLLM orders caches by the one integer in the name). A shared block
layer is applied r times and each application attends through its own slot: P + r*K + C caches.
With ``kv_budget = k < r`` recurrence i uses slot P + (i mod k)*K + j, and the slot's cache is
simply written by every recurrence that owns it: vLLM writes a token's KV at its fixed place in
the paged cache, so within one forward recurrence i writes the new tokens' KV, attends (past
tokens: the KV the slot's last writer left there; new tokens: their fresh recurrence-i KV), and a
later recurrence i + k overwrites those places. That is exactly what ``generate()`` computes for the
same split of tokens into forward calls (it writes, attends, and crops an earlier writer's tokens
back out). vLLM splits tokens into calls itself, so with a budget the plugin turns off what would
split them differently from ``generate()``: prefix caching and chunked prefill (``plugin.py``).
One split remains vLLM's: a request preempted because the KV cache is full is recomputed by
prefilling its prompt and the tokens generated so far in one call, so with a budget its later
tokens are what ``generate()`` gives for that text as one prompt (without a budget a slot's KV does
not depend on the split, and preemption changes nothing). A KV cache sized for the batch
(``VLLM_CPU_KVCACHE_SPACE``, ``gpu_memory_utilization``) never preempts.

Per-request depth: each request's r, kv_budget and exit threshold reach the forward as per-token
tensors (``worker``; docs/serving.md). The engine holds the KV slots of its deepest request
(``depth.ServedDepth.plan``: ``max_num_recurrences`` at the server's budget; the coda's slots follow
the block's of that plan); a request at r with budget k writes block slots P + (i mod min(k, r))*K + j.
A batch whose requests share r and k runs the loop as one; otherwise recurrence i runs only the
tokens of requests with r > i (``_VllmRecurrentBlock.run_mixed``, ``batch_depth``). What cannot be
served exactly is refused by ``looped_hf.serving.servable_problems``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from ..configuration_looped import LoopedConfig
from ..modeling_looped import (
    DECODER_LAYERS,
    LoopedHyperConnection,
    LoopedModel,
    LoopedRMSNorm,
    LoopedRotaryEmbedding,
    apply_rotary_pos_emb,
    exit_gate_probabilities,
    threshold_exit_steps,
)
from ..recurrent_block_looped import LoopedRecurrentBlock
from . import check_servable
from .batch_depth import BatchDepth
from .depth import ServedDepth

# vLLM's kernels (RMSNorm, neox RoPE), the ones its Llama's RMSNorm and RoPE dispatch to: on CPU they
# replace a dozen small aten ops per layer and recurrence, the cost that made the looped model slower
# than the Llama of its depth. A build without them (no ``_C``) runs PyTorch's ops instead.
_C = getattr(torch.ops, "_C", None)
_HAS_KERNELS = _C is not None and hasattr(_C, "rms_norm") and hasattr(_C, "rotary_embedding")


def _rms_norm_width_multiples() -> dict[torch.dtype, int]:
    """Per dtype, the row widths vLLM's RMSNorm kernel takes are the multiples of this (absent: none,
    PyTorch's op runs). The CPU kernel reads a row in SIMD vectors and refuses a width that is not a
    whole number of them (8 floats on x86 today: head_dim 4's QK-norm); probed once rather than
    assumed, since the vector width is the build's."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if not _HAS_KERNELS:
        return {}
    if not current_platform.is_cpu():
        return dict.fromkeys(dtypes, 1)
    widths = {}
    for dtype in dtypes:
        for width in (1, 2, 4, 8, 16, 32, 64):
            try:
                x = torch.ones(1, width, dtype=dtype)
                _C.rms_norm(torch.empty_like(x), x, None, 1e-6)
            except (RuntimeError, NotImplementedError):  # a width (or dtype) this build refuses
                continue
            widths[dtype] = width
            break
    return widths


_RMS_NORM_WIDTH = _rms_norm_width_multiples()


def attention_head_size(head_dim: int) -> int:
    """The head size the paged attention runs for a model of ``head_dim``: on CPU the smallest size
    vLLM's CPU attention backend runs that holds ``head_dim`` (``check_servable`` refuses a head_dim
    above them all), elsewhere ``head_dim`` itself."""
    if not current_platform.is_cpu():
        return head_dim
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return min(size for size in CPUAttentionBackend.get_supported_head_sizes() if size >= head_dim)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (``weight`` None: the parameter-free norm) with vLLM's kernel, else
    ``F.rms_norm`` (a width the kernel does not take, or a weight of another dtype). The kernel reads
    ``x`` as contiguous rows, so a strided ``x`` is copied first."""
    multiple = _RMS_NORM_WIDTH.get(x.dtype)
    if multiple and x.shape[-1] % multiple == 0 and (weight is None or weight.dtype == x.dtype):
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        _C.rms_norm(out, rows, weight, eps)
        return out.view(x.shape)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class _KernelRMSNorm(LoopedRMSNorm):
    """``LoopedRMSNorm`` (same weight name and values) whose forward is vLLM's kernel where it takes
    ``x`` (``_rms_norm``), else its own: the decoder layers' own residual code (modeling_looped's placements) and the
    loop call these norms as modules."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        multiple = _RMS_NORM_WIDTH.get(hidden_states.dtype)
        if multiple and hidden_states.shape[-1] % multiple == 0 and self.weight.dtype == hidden_states.dtype:
            return _rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


def _rope_table(config: LoopedConfig, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``cos | sin`` (first halves: modeling_looped's tables repeat them) per position 0 .. length - 1,
    from looped_hf's own ``LoopedRotaryEmbedding`` (so the values are the same, rope_table_dtype and
    scaling included), in ``dtype``: the table vLLM's RoPE kernel reads, as its Llama's
    ``RotaryEmbedding.cos_sin_cache`` in the model's dtype. Fixed tables only: those that depend on the
    call's length (dynamic/longrope) are refused by check_servable."""
    cos, sin = LoopedRotaryEmbedding(config)(torch.empty(0, dtype=torch.float32), torch.arange(length))
    half = config.head_dim // 2
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).to(dtype)


def _apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on q and k of shape (tokens, heads * head_dim): vLLM's kernel, in place on q and k
    (views of qkv, or normed copies), q1 cos - q2 sin, q2 cos + q1 sin, which is modeling_looped's
    q cos + rotate_half(q) sin with the same tables. Without the kernel, modeling_looped's op on the
    table's rows. Returns (q, k)."""
    if _HAS_KERNELS:
        _C.rotary_embedding(positions, q, k, head_dim, table, True)
        return q, k
    num_tokens = q.shape[0]
    cos, sin = table[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    q, k = apply_rotary_pos_emb(q.view(num_tokens, -1, head_dim), k.view(num_tokens, -1, head_dim), cos, sin)
    return q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)


class _LoopedAttention(nn.Module):
    """q/k/v/o of one layer (the weights); the KV cache it attends through is passed in per call,
    because a shared layer attends through a different slot at each recurrence."""

    def __init__(self, config: LoopedConfig, quant_config, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.attn_head_size = attention_head_size(config.head_dim)  # > head_dim: padded (module docstring)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qk_bias_only = config.qk_bias and not config.attention_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias or config.qk_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        if qk_bias_only:
            # qk_bias (Huginn): the fused projection has one bias for q, k and v; the checkpoint fills
            # q's and k's parts, v's stays zero (vLLM allocates parameters uninitialised).
            with torch.no_grad():
                self.qkv_proj.bias.zero_()
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        self.qk_norm = config.qk_norm
        self.qk_norm_eps = config.rms_norm_eps
        if self.qk_norm == "learnable_before_rope":
            self.q_norm = _KernelRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = _KernelRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        elif self.qk_norm == "learnable_projection_before_rope":
            # OLMo-2's: one norm over all heads of q (of k). Its RMS spans every head, so it needs the
            # whole projection: check_servable refuses tensor parallelism with it.
            self.q_norm = _KernelRMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = _KernelRMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def _pad(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(tokens, heads * head_dim) -> (tokens, heads * attn_head_size), each head zero-padded."""
        num_tokens = x.shape[0]
        padded = F.pad(x.view(num_tokens, heads, self.head_dim), (0, self.attn_head_size - self.head_dim))
        return padded.view(num_tokens, -1)

    def forward(
        self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: None,
        attn: Attention, cache_index: int = 0,
    ) -> tuple[torch.Tensor, None]:
        """``LoopedAttention``'s call signature, so modeling_looped's decoder layers call it as their own:
        ``position_embeddings`` is (positions, the model's ``cos | sin`` table, ``_rope_table``), the
        cache is the vLLM ``Attention`` of the application's slot (no mask: vLLM's metadata has it).
        Returns (output, None)."""
        positions, rope = position_embeddings
        qkv, _ = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        if self.qk_norm == "learnable_before_rope":
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)).reshape(num_tokens, -1)
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, -1)
        elif self.qk_norm == "learnable_projection_before_rope":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _apply_rope(positions, q, k, self.head_dim, rope)
        if self.qk_norm == "after_rope":
            if _HAS_KERNELS:
                # q and k are still adjacent in qkv (roped in place): one norm over their heads.
                qk = qkv[:, : self.q_size + self.kv_size].reshape(-1, self.head_dim)
                qk = _rms_norm(qk, None, self.qk_norm_eps).view(num_tokens, -1)
                q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            else:
                q = _rms_norm(q.reshape(-1, self.head_dim), None, self.qk_norm_eps).view(num_tokens, -1)
                k = _rms_norm(k.reshape(-1, self.head_dim), None, self.qk_norm_eps).view(num_tokens, -1)
        if self.attn_head_size == self.head_dim:
            out = attn(q, k, v)
        else:
            out = attn(self._pad(q, self.num_heads), self._pad(k, self.num_kv_heads), self._pad(v, self.num_kv_heads))
            out = out.view(num_tokens, self.num_heads, self.attn_head_size)[..., : self.head_dim].reshape(num_tokens, -1)
        out, _ = self.o_proj(out)
        return out, None


class _LoopedMLP(nn.Module):
    """The study's squared ReLU (up, down) or a gated MLP (gate and up fused, as vLLM's Llama)."""

    def __init__(self, config: LoopedConfig, quant_config, prefix: str) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.hidden_act != "relu2"
        if self.gated:
            self.gate_up_proj = MergedColumnParallelLinear(
                d, [f, f], bias=bias, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
            )
            self.act_fn = ACT2FN[config.hidden_act]
        else:
            self.up_proj = ColumnParallelLinear(d, f, bias=bias, quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(f, d, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate_up, _ = self.gate_up_proj(x)
            gate, up = gate_up.chunk(2, dim=-1)
            y = self.act_fn(gate) * up
        else:
            y = F.relu(self.up_proj(x)[0]).square()
        return self.down_proj(y)[0]


class _LoopedDecoderLayer(nn.Module):
    """One decoder layer on vLLM's projections: its norms and residual adds are modeling_looped's own
    for the config's ``norm_placement`` (``DECODER_LAYERS``: pre-norm, sandwich, sublayer-output,
    pre-and-output), whose forward runs on this module as is; only the attention (``_LoopedAttention``,
    which takes the slot's vLLM ``Attention`` where the transformers layer takes its cache) and the
    MLP are vLLM's. The norms keep the placement's names, so the checkpoint's weights load by name."""

    def __init__(self, config: LoopedConfig, quant_config, prefix: str) -> None:
        super().__init__()
        placement = DECODER_LAYERS[config.norm_placement]
        self.residual_forward = placement.forward  # modeling_looped's, called with this module as self
        self.self_attn = _LoopedAttention(config, quant_config, f"{prefix}.self_attn")
        self.mlp = _LoopedMLP(config, quant_config, f"{prefix}.mlp")
        for name in placement.norm_names:
            setattr(self, name, _KernelRMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, attn: Attention) -> torch.Tensor:
        return self.residual_forward(self, h, None, (positions, rope), attn, 0)[0]


class _KVSlot(nn.Module):
    """One KV-cache slot: a module named ``kv_slots.{slot}`` holding vLLM's ``Attention``, at the
    attention head size (padded head_dim; the softmax scale is the true head_dim's)."""

    def __init__(self, config: LoopedConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.attn = Attention(
            config.num_attention_heads // tp, attention_head_size(config.head_dim), config.head_dim**-0.5,
            num_kv_heads=max(1, config.num_key_value_heads // tp), cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.attn",
        )  # fmt: skip


class _VllmRecurrentBlock(LoopedRecurrentBlock):
    """modeling_looped's loop (``LoopedRecurrentBlock``: initial state, injection, hyperconnection
    lanes, recurrence norm), its block layers run on vLLM's layers: each attends through the vLLM
    ``Attention`` of its planned slot, which writes the paged cache itself (no transformers cache,
    nothing to crop, no exit, inference only). Built once with the model; ``run`` hands it the
    call's positions and RoPE table."""

    def __init__(self, model: LoopedVllmModel) -> None:
        # The recurrence norm is the model's own or (recurrence_norm_weight "final") its final norm,
        # both kernel norms: the base class reads them by name.
        super().__init__(model, model.plan, layer_kwargs={}, num_new_tokens=0)
        self.engine_plan = model.plan
        self.kv_slots = model.kv_slots
        self.positions: torch.Tensor | None = None
        self.rope: torch.Tensor | None = None

    def run(self, e: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor, depth: BatchDepth | None,
            keep_states: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """(the state the coda reads, from the prelude output ``e``; the state after every recurrence
        when ``keep_states``, for the exit gate). ``depth``: the batch's per-request depths (None: every
        token at the engine's deepest r). A batch whose requests share r and k runs as one (the base
        class's loop); otherwise ``run_mixed``."""
        self.positions, self.rope = positions, rope
        plan = depth.uniform_plan if depth is not None else self.engine_plan
        try:
            if plan is not None:
                self.plan = plan
                h, states, _ = self(e, exit_rule=None, predict=None, output_recurrent_states=keep_states)
                return h, states
            return self.run_mixed(e, depth, keep_states)
        finally:
            self.positions = self.rope = None  # no tensor of a finished call kept alive
            self.plan = self.engine_plan

    def run_mixed(self, e: torch.Tensor, depth: BatchDepth, keep_states: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loop over requests at different depths: recurrence i runs only the tokens of requests
        with r > i, one group per KV slot (``BatchDepth.groups``), gathered and scattered back; each
        group's attention sees only its requests (``BatchDepth.attend``). A token past its r keeps its
        state, so the states after every recurrence hold, for it, its last one."""
        hc = self.hyperconnection
        h = self.initial_state(e)
        lanes = h.unsqueeze(0).expand(hc.num_lanes, *h.shape) if hc is not None else None
        split = self.injection_split(e) if self.config.input_injection == "linear" else None
        positions, states = self.positions, []
        for step in range(depth.max_recurrences):
            for group in depth.groups(step):
                self.plan = group.plan
                attention = [self.kv_slots[group.plan.block(step, j)].attn for j in range(len(self.layers))]
                idx = group.tokens
                if idx is None:
                    with depth.attend(group, attention, e.dtype):
                        h, lanes = self.recurrence(step, h, lanes, e, split)
                    continue
                sub_split = (split[0][idx], split[1]) if split is not None else None
                sub_lanes = lanes[:, idx] if lanes is not None else None
                self.positions = positions[idx]
                with depth.attend(group, attention, e.dtype):
                    sub_h, sub_lanes = self.recurrence(step, h[idx], sub_lanes, e[idx], sub_split)
                self.positions = positions
                h = h.index_copy(0, idx, sub_h)
                if lanes is not None:
                    lanes = lanes.index_copy(1, idx, sub_lanes)
            if keep_states:
                states.append(lanes.sum(0) if hc is not None else h)
        if hc is not None:
            h = lanes.sum(0)  # lanes are summed before the coda
        return h, states

    def block_layer(self, layer: nn.Module, x: torch.Tensor, step: int, j: int) -> torch.Tensor:
        return layer(x, self.positions, self.rope, self.kv_slots[self.plan.block(step, j)].attn)


def _single_depth(vllm_config: VllmConfig) -> bool:
    """torch.compile traces one graph for every batch (fullgraph), and per-request depth is data-dependent
    Python (which tokens each recurrence runs, the subset's attention metadata): a server that runs more
    than one depth runs eager; one that runs a single depth compiles as before."""
    return ServedDepth.from_config(vllm_config.model_config.hf_config).single_depth


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0},
    enable_if=_single_depth,
)
class LoopedVllmModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LoopedConfig = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        check_servable(config, pipeline_parallel_size=parallel.pipeline_parallel_size,
                       tensor_parallel_size=parallel.tensor_parallel_size,
                       device="cpu" if current_platform.is_cpu() else None)  # fmt: skip
        quant_config = vllm_config.quant_config
        self.config = config
        self.plan = ServedDepth.from_config(config).plan(config)  # the deepest request's slots (depth.py)
        self.embed_tokens = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")  # fmt: skip
        norm = lambda: _KernelRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # noqa: E731
        self.embedding_norm = norm() if config.embedding_norm else None

        def stack(name: str, n: int) -> nn.ModuleList:
            return nn.ModuleList(_LoopedDecoderLayer(config, quant_config, f"{prefix}.{name}.{j}") for j in range(n))

        self.prelude_layers = stack("prelude_layers", config.num_prelude_layers)
        self.recurrent_layers = stack("recurrent_layers", config.num_recurrent_layers)
        self.coda_layers = stack("coda_layers", config.num_coda_layers)
        self.injection = None
        if config.input_injection == "linear":
            self.injection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.hyperconnection = LoopedHyperConnection(config) if config.input_injection == "hyperconnection" else None
        # The norms under LoopedModel's names and sharing (a "final" norm is model.norm itself, no
        # module of its own): see LoopedModel.loop_norms, which the forward calls on this model.
        own = config.recurrence_norm and config.recurrence_norm_weight == "own"
        self.recurrence_norm = norm() if own else None
        self.post_loop_norm = norm() if config.post_loop_norm == "own" else None
        self.norm = norm()
        # Ouro's exit gate. Its "threshold" readout picks each token's state at its exit step after the
        # loop (every recurrence runs and writes its KV either way, as in generate()): exact, at the
        # request's r. "last" reads the r-th state; "weighted" is refused (check_servable).
        self.exit_gate = nn.Linear(config.hidden_size, 1, bias=True) if config.exit_gate else None
        self.exit_threshold = None
        if config.exit_gate and config.exit_gate_output == "threshold":
            self.exit_threshold = float(config.exit_gate_threshold)
        model_config = vllm_config.model_config
        length = max(config.max_position_embeddings, model_config.max_model_len)
        self.register_buffer("rope_cache", _rope_table(config, length, model_config.dtype), persistent=False)
        self.kv_slots = nn.ModuleList(
            _KVSlot(config, vllm_config, f"{prefix}.kv_slots.{slot}") for slot in range(self.plan.num_slots)
        )
        self.loop = _VllmRecurrentBlock(self)  # not a module: it runs the modules above by name

    loop_norms = LoopedModel.loop_norms  # (recurrence, post-loop, final) norm, from the same attributes

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_recurrences: torch.Tensor | None = None,
        token_kv_budgets: torch.Tensor | None = None,
        token_exit_thresholds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states of the batch's tokens, each run at its request's depth: ``token_recurrences``
        (r), ``token_kv_budgets`` (min(k, r)) and, for the threshold readout, ``token_exit_thresholds``,
        per token (``worker.depth_kwargs``; None, as in vLLM's dummy runs: every token at the engine's
        deepest r and budget and the config's threshold)."""
        plan, rope = self.plan, self.rope_cache
        depth = None
        if token_recurrences is not None and get_forward_context().attn_metadata is not None:
            num_tokens = positions.shape[0]
            depth = BatchDepth(token_recurrences, token_kv_budgets, plan, num_tokens)
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        multiplier = self.config.embedding_multiplier
        if multiplier != 1.0:
            h = h * multiplier  # after the lookup: the tied head reads the table unscaled
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        for j, layer in enumerate(self.prelude_layers):
            h = layer(h, positions, rope, self.kv_slots[plan.prelude(j)].attn)
        h, states = self.loop.run(h, positions, rope, depth, keep_states=self.exit_threshold is not None)
        _, post_loop, final = self.loop_norms()
        if self.exit_threshold is not None:
            # generate()'s threshold readout (LoopedForCausalLM._exit_gate_readout), per token: the
            # state at the first step whose exit CDF reaches the threshold (no coda: the config refuses
            # one with this readout), among its own request's r states and at its own threshold. The
            # norms after the loop are row-wise, so they run on the pick.
            if depth is not None and token_exit_thresholds is not None:
                steps = depth.exit_steps(states, self.exit_gate, token_exit_thresholds)
            else:
                steps = threshold_exit_steps(exit_gate_probabilities(self.exit_gate, states), self.exit_threshold)
            h = torch.stack(states, dim=1).gather(1, steps.view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)
        if post_loop is not None:
            h = post_loop(h)
        for j, layer in enumerate(self.coda_layers):
            h = layer(h, positions, rope, self.kv_slots[plan.coda(j)].attn)
        return self.norm(h) if final is not None else h


class LoopedForCausalLM(nn.Module):
    """vLLM's entry class for architecture ``LoopedForCausalLM`` (see the module docstring)."""

    # q/k/v and gate/up are fused on load: looped_hf's names -> (vLLM's parameter, shard).
    _STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"))
    _STACKED_GATED = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LoopedConfig = vllm_config.model_config.hf_config
        self.config = config
        self.model = LoopedVllmModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.padded_vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        # The padded rows are cropped (org_vocab_size) before the soft-cap, as logits_from_hidden does.
        self.logits_processor = LogitsProcessor(config.padded_vocab_size, config.vocab_size, soft_cap=config.logit_softcap)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_recurrences: torch.Tensor | None = None,
        token_kv_budgets: torch.Tensor | None = None,
        token_exit_thresholds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``LoopedVllmModel.forward``: each token at its request's depth (per-token tensors from the
        runner, ``worker.depth_kwargs``)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds, token_recurrences,
                          token_kv_budgets, token_exit_thresholds)  # fmt: skip

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load looped_hf's safetensors names (``model.prelude_layers.0.self_attn.q_proj.weight``...),
        fusing q/k/v and gate/up. A name the model does not have is an error, not a skip."""
        config = self.config
        stacked = self._STACKED + (self._STACKED_GATED if config.hidden_act != "relu2" else ())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head is the embedding
            if name == "model.hyperconnection.alpha" and weight.shape[0] != config.num_recurrences:
                raise ValueError(
                    f"num_recurrences={config.num_recurrences}: this checkpoint's hyperconnection parameters were "
                    f"trained for num_recurrences={weight.shape[0]}, the only r it can run at"
                )
            for fused, part, shard in stacked:
                if part in name:
                    target = name.replace(part, fused)
                    param = params[target]
                    param.weight_loader(param, weight, shard)
                    loaded.add(target)
                    break
            else:
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r}: the looped vLLM model has no such parameter")
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
                loaded.add(name)
        return loaded
