"""The native vLLM implementation of ``LoopedForCausalLM`` (registered by ``plugin.register``).

A file of the same kind as vLLM's own ``model_executor/models/llama.py``: the layers are vLLM's
public ones (``RMSNorm``, ``get_rope``, ``SiluAndMul`` / ``GeluAndMul`` / ``ReLUSquaredActivation``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``, a vocabulary-parallel
embedding and head, the paged ``Attention``), CustomOps that pick each platform's kernel (and that
vLLM's compile fusions match); the QK-norm variants are Qwen3's (per head) and OLMo-2's (over the
whole projection). Only the loop and the KV slot plan are looped_hf's: the loop is modeling_looped's
own ``LoopedRecurrentBlock`` (initial state, injection, hyperconnection lanes, recurrence norm), its
block layers run on the layers here; the embedding multiplier, the post-loop norm, a recurrence
norm that is the final norm (``recurrent_block_looped.loop_norms``) and Ouro's exit gate (its "threshold"
readout: each token's state at its exit step, picked after the loop) run as in ``generate()``.

Each ``norm_placement`` is a decoder-layer class here with the norms of modeling_looped's class of
that placement (``DECODER_LAYERS``: same names, so the checkpoint loads by name) and vLLM's fused
residual add + norm (``RMSNorm(x, residual)``) wherever a norm reads a residual sum: the pre-norm
layer's MLP-input norm (Llama's), the sandwich layer's two post-residual norms, the pre-and-output
layer's MLP-input norm. The sublayer-output layer (OLMo-2) has none: its norms read a sublayer's
output before the add. The add that closes a layer is a plain add (vLLM's Llama carries it into the
next layer's input norm instead): the loop hands one state from layer to layer, because the
injection, the recurrence norm, the hyperconnection lanes and the exit gate read it whole. In
float32 the logits equal ``generate()``'s to float32 rounding (vLLM's RMSNorm sums in another order
than ``F.rms_norm``); the RoPE tables are bit-identical to modeling_looped's for every rope type
served (default, linear, llama3, yarn), ``rope_table_dtype`` included (vLLM rounds the table to the
dtype it is built in, then casts it to the query's, as modeling_looped does).

Head sizes: vLLM's CPU attention runs a few head sizes only (32, 64, 80, ...). Any other head_dim d
attends at the next one up, H: RoPE (``get_rope`` at head size d: its frequencies are d's) and the
QK-norm run on the d-wide heads, then q, k and v are zero-padded from d to H, the softmax scale stays
d**-0.5, and the output's padded columns are cropped before o_proj. Exact: the zero columns add
nothing to q . k, and the padded output columns are a weighted sum of zeros. The KV cache holds H
numbers per head.

LoRA: ``LoopedForCausalLM`` is ``SupportsLoRA`` with Llama's ``packed_modules_mapping`` (q/k/v and
gate/up are fused here, so a peft adapter's ``q_proj`` ... ``up_proj`` land on the fused layers) and
``embedding_modules``; the projections of every layer (prelude, shared block, coda; the shared
block's adapter applies at every recurrence, as in the HF model) serve an adapter through vLLM's
``enable_lora`` and ``LoRARequest``. The injection and the exit gate are plain ``nn.Linear`` modules,
which vLLM's LoRA does not wrap: an adapter that targets them is refused by vLLM when it loads. (In
bfloat16 / float16 the injection's halves W_e and W_h also run as ``injection_e`` and ``injection_h``,
``ReplicatedLinear`` layers filled from ``injection.weight``, for vLLM's GEMM:
``_VllmRecurrentBlock.keep_injection``.)

KV cache: one vLLM ``Attention`` per KV slot of ``KVSlotPlan.for_call(config, r, kv_budget)``, named
``model.kv_slots.{slot}.attn`` (vLLM orders caches by the one integer in the name). A shared block
layer is applied r times and each application attends through its own slot: P + r*K + C caches.
With ``kv_budget = k < r`` recurrence i uses slot P + (i mod k)*K + j, and the slot's cache is
simply written by every recurrence that owns it: vLLM writes a token's KV at its fixed place in
the paged cache, so within one forward recurrence i writes the new tokens' KV, attends (past
tokens: the KV the slot's last writer left there; new tokens: their fresh recurrence-i KV), and a
later recurrence i + k overwrites those places. That is exactly what ``generate()`` computes for the
same split of tokens into forward calls (it writes, attends, and crops an earlier writer's tokens
back out). vLLM splits tokens into calls itself, so with a budget the plugin turns off what would
split them differently from ``generate()``: chunked prefill, and prefix caching, also off for any
server of more than one depth (``engine.engine_args``; an engine built without them is refused
here, ``engine.engine_setting_problems``).
One split remains vLLM's: a request preempted because the KV cache is full is recomputed by
prefilling its prompt and the tokens generated so far in one call, so with a budget its later
tokens are what ``generate()`` gives for that text as one prompt (without a budget a slot's KV does
not depend on the split, and preemption changes nothing). A KV cache sized for the batch
(``VLLM_CPU_KVCACHE_SPACE``, ``gpu_memory_utilization``) never preempts.

Per-request depth: each request's r, kv_budget and exit threshold reach the forward as per-token
tensors (``worker``; docs/serving.md). The engine holds the KV slots of its deepest request
(``depth.ServedDepth.plan``: ``max_num_recurrences`` at the server's budget; the coda's slots follow
the block's of that plan); a request at r with budget k writes block slots P + (i mod min(k, r))*K + j.
A step whose requests all run the served default depth gets no depth tensors and runs the forward
vLLM compiled (unless eager); any other step runs eagerly: a batch whose requests share r and k runs
the loop as one, otherwise recurrence i runs only the tokens of requests with r > i
(``_VllmRecurrentBlock.run_mixed``, ``batch_depth``). What cannot be served exactly is refused by
``looped_hf.serving.servable_problems``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import GeluAndMul, ReLUSquaredActivation, SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import SupportsLoRA
from vllm.model_executor.models.utils import maybe_prefix
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from ..configuration_looped import LoopedConfig
from ..decoder_layers_looped import DECODER_LAYERS
from ..recurrent_block_looped import (
    LoopedRecurrentBlock,
    after_loop,
    build_loop_modules,
    exit_gate_probabilities,
    threshold_readout,
)
from . import vllm_compat
from .batch_depth import BatchDepth
from .depth import ServedDepth
from .engine import check_engine_settings
from .loop_attention_vllm import GatedVllmAttention, build_loop_gates, slot_cache_config
from .loop_lora_vllm import WEIGHT_PREFIX, build_loop_lora, has_loop_lora, plus, plus_packed
from .parcae_vllm import (
    add_value_rows,
    build_parcae_vllm,
    end_forward,
    expand_kv_heads,
    qk_norm_eps,
    serve_kv_heads,
    start_forward,
)
from .servable import check_servable

# hidden_act -> vLLM's activation of the gate/up halves (the gated MLPs); relu2 is not gated.
_GATED_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "gelu": lambda: GeluAndMul(approximate="none"),  # transformers' "gelu": the exact erf form
    "gelu_pytorch_tanh": lambda: GeluAndMul(approximate="tanh"),
}


def attention_head_size(head_dim: int) -> int:
    """The head size the paged attention runs for a model of ``head_dim``: on CPU the smallest size
    vLLM's CPU attention backend runs that holds ``head_dim`` (``check_servable`` refuses a head_dim
    above them all), elsewhere ``head_dim`` itself."""
    if not current_platform.is_cpu():
        return head_dim
    return min(size for size in vllm_compat.cpu_attention_head_sizes() if size >= head_dim)


def _norm(config: LoopedConfig, size: int | None = None) -> RMSNorm:
    """vLLM's RMSNorm of ``size`` (default: the hidden size) with the config's epsilon."""
    return RMSNorm(config.hidden_size if size is None else size, eps=config.rms_norm_eps)


class _LoopedAttention(nn.Module):
    """q/k/v/o of one layer, its RoPE and QK-norm; the KV cache it attends through is passed in per
    call, because a shared layer attends through a different slot at each recurrence."""

    def __init__(self, config: LoopedConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.attn_head_size = attention_head_size(config.head_dim)  # > head_dim: padded (module docstring)
        self.num_heads = config.num_attention_heads // tp
        self.num_kv_heads = max(1, config.num_key_value_heads // tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias or config.qk_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )  # fmt: skip
        if config.qk_bias and not config.attention_bias:
            # qk_bias (Huginn): the fused projection has one bias for q, k and v; the checkpoint fills
            # q's and k's parts, v's stays zero (vLLM allocates parameters uninitialised).
            with torch.no_grad():
                self.qkv_proj.bias.zero_()
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )  # fmt: skip
        # RoPE at the model's own head_dim (before any padding: the padded size's frequencies would
        # rotate other pairs), in the table dtype the model was trained with (rope_table_dtype).
        table_dtype = config.rope_table_dtype
        max_position = max(config.max_position_embeddings, vllm_config.model_config.max_model_len)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=max_position, is_neox_style=True,
            rope_parameters=dict(config.rope_parameters),
            dtype=getattr(torch, table_dtype) if table_dtype else vllm_config.model_config.dtype,
        )  # fmt: skip
        # Chosen here, not branched in forward: the QK-norm before RoPE and the one after it (or None).
        self.norm_before_rope = self.norm_after_rope = None
        if config.qk_norm == "learnable_before_rope":  # Qwen3's: per head
            self.q_norm, self.k_norm = _norm(config, self.head_dim), _norm(config, self.head_dim)
            self.norm_before_rope = self._per_head_norm
        elif config.qk_norm == "learnable_projection_before_rope":
            # OLMo-2's: one norm over all heads of q (of k). Its RMS spans every head, so it needs the
            # whole projection: check_servable refuses tensor parallelism with it.
            self.q_norm, self.k_norm = _norm(config, self.q_size), _norm(config, self.kv_size)
            self.norm_before_rope = self._projection_norm
        elif config.qk_norm == "after_rope":  # the study's: per head, no weight (Parcae's eps: parcae_vllm)
            self.qk_rms = RMSNorm(self.head_dim, eps=qk_norm_eps(config, vllm_config.model_config.dtype),
                                  has_weight=False)  # fmt: skip
            self.norm_after_rope = self._after_rope_norm
        # Parcae's gated value embedding: build_parcae_vllm puts the gate, its table's index and the
        # forward's rows (value_rows) here.
        self.ve_gate: nn.Module | None = None
        self.value_embedding_index: int | None = None

    def _heads(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm`` over each head of ``x`` (tokens, heads * head_dim)."""
        return norm(x.view(*x.shape[:-1], -1, self.head_dim)).view(x.shape)

    # ``deltas``: a per-loop LoRA model's deltas of this layer at this loop, whose ``q_norm``/``k_norm``
    # entries add to the learnable QK-norms (``loop_lora_vllm``); None otherwise.
    def _per_head_norm(self, q: torch.Tensor, k: torch.Tensor, deltas: nn.ModuleDict | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return (self._heads_plus(self.q_norm, q, deltas, "q_norm"),
                self._heads_plus(self.k_norm, k, deltas, "k_norm"))  # fmt: skip

    def _projection_norm(self, q: torch.Tensor, k: torch.Tensor, deltas: nn.ModuleDict | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        q, k = q.contiguous(), k.contiguous()
        return plus(self.q_norm(q), deltas, "q_norm", q), plus(self.k_norm(k), deltas, "k_norm", k)

    def _after_rope_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The study's QK-norm, one weightless norm over every head of q and of k, in one call: the
        norm is per head, so q's and k's heads are rows of one batch. q and k are strided views of
        the fused qkv output, so normalising their heads copies them anyway: one copy of [q; k] and
        one norm call instead of two of each (vLLM's Qwen3 makes two), with the same numbers (the
        norm runs row by row)."""
        qk = torch.cat([q, k], dim=-1)
        qk = self.qk_rms(qk.view(-1, self.head_dim)).view(qk.shape)
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        return q, k

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, heads * head_dim) -> (tokens, heads * attn_head_size), each head zero-padded."""
        padded = F.pad(x.view(x.shape[0], -1, self.head_dim), (0, self.attn_head_size - self.head_dim))
        return padded.view(x.shape[0], -1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, attn: Attention,
                deltas: nn.ModuleDict | None = None) -> torch.Tensor:  # fmt: skip
        """``deltas``: a per-loop LoRA model's deltas of this layer at this loop (``loop_lora_vllm``)."""
        qkv, _ = self.qkv_proj(hidden_states)
        qkv = plus_packed(qkv, deltas, "qkv_proj", hidden_states, (self.q_size, self.kv_size, self.kv_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.ve_gate is not None:
            v = add_value_rows(self, hidden_states, v)
        if self.norm_before_rope is not None:
            q, k = self.norm_before_rope(q, k, deltas)
        q, k = self.rotary_emb(positions, q, k)
        if self.norm_after_rope is not None:
            q, k = self.norm_after_rope(q, k)
        if self.attn_head_size == self.head_dim:
            out = attn(q, k, v)
        else:
            out = attn(self._pad(q), self._pad(k), self._pad(v))
            out = out.view(-1, self.num_heads, self.attn_head_size)[..., : self.head_dim].reshape(
                out.shape[0], -1
            )
        attended = out
        out, _ = self.o_proj(attended)
        return plus(out, deltas, "o_proj", attended)

    def _heads_plus(self, norm: nn.Module, x: torch.Tensor, deltas: nn.ModuleDict | None, key: str) -> torch.Tensor:
        """``_heads(norm, x)`` plus the per-loop delta of that norm, also per head."""
        out = self._heads(norm, x)
        if deltas is None or key not in deltas:
            return out
        return out + self._heads(deltas[key], x)


class _LoopedMLP(nn.Module):
    """A gated MLP (gate and up fused, as vLLM's Llama, with vLLM's activation-and-mul) or the study's
    squared ReLU (up, down: vLLM's ``ReLUSquaredActivation``)."""

    def __init__(self, config: LoopedConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gated = config.hidden_act != "relu2"
        self.intermediate = f // get_tensor_model_parallel_world_size()  # this rank's width of gate / up
        if not self.gated:
            self.up_proj = ColumnParallelLinear(
                d, f, bias=bias, quant_config=quant_config, prefix=f"{prefix}.up_proj"
            )
            self.act_fn = ReLUSquaredActivation()
            # Parcae's 0.5 relu(x)^2 (config.mlp_activation_scale; None: no scaling op).
            scale = getattr(config, "mlp_activation_scale", 1.0)
            self.activation_scale = scale if scale != 1.0 else None
        else:
            self.gate_up_proj = MergedColumnParallelLinear(
                d, [f, f], bias=bias, quant_config=quant_config, prefix=f"{prefix}.gate_up_proj"
            )
            self.act_fn = _GATED_ACTIVATIONS[config.hidden_act]()
        self.down_proj = RowParallelLinear(
            f, d, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor, deltas: nn.ModuleDict | None = None) -> torch.Tensor:
        """``deltas``: a per-loop LoRA model's deltas of this layer at this loop (``loop_lora_vllm``)."""
        if self.gated:
            up, _ = self.gate_up_proj(x)
            up = plus_packed(up, deltas, "gate_up_proj", x, (self.intermediate, self.intermediate))
        else:
            up, _ = self.up_proj(x)
            up = plus(up, deltas, "up_proj", x)
        hidden = self.act_fn(up)
        if not self.gated and self.activation_scale is not None:
            hidden = hidden.mul(self.activation_scale)
        out, _ = self.down_proj(hidden)
        return plus(out, deltas, "down_proj", hidden)


class _DecoderLayer(nn.Module):
    """One decoder layer on vLLM's layers: attention, MLP and the norms of modeling_looped's layer of
    this placement (``placement``, names from ``DECODER_LAYERS``, so the weights load by name). Each
    subclass is one ``norm_placement`` and writes its residual steps; ``forward(h, positions, attn)``
    runs it with ``attn``, the vLLM ``Attention`` of the application's KV slot.

    ``RMSNorm(x, residual)`` returns (norm(x + residual), x + residual) and may write both into its
    inputs (vLLM's GPU kernel does), so a layer's input is not read after the layer: the loop copies
    the inputs it keeps (``_VllmRecurrentBlock``)."""

    placement: str

    def __init__(self, config: LoopedConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.self_attn = _LoopedAttention(config, vllm_config, f"{prefix}.self_attn")
        self.mlp = _LoopedMLP(config, vllm_config, f"{prefix}.mlp")
        for name in DECODER_LAYERS[self.placement].norm_names:
            setattr(self, name, _norm(config))

    def normed(self, name: str, x: torch.Tensor, deltas: nn.ModuleDict | None,
               residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Norm ``name`` of ``x`` (with ``residual``: vLLM's fused add + norm, (norm(x + r), x + r)),
        plus its per-loop delta (``deltas``, a per-loop LoRA model's; it reads the sum when fused).
        Alone, the delta is taken first: the norm may not be read after a kernel wrote its input."""
        norm = getattr(self, name)
        if residual is None:
            if deltas is None or name not in deltas:
                return norm(x)
            delta = deltas[name](x)
            return norm(x) + delta
        out, summed = norm(x, residual)
        return plus(out, deltas, name, summed), summed


class _PreNormLayer(_DecoderLayer):
    """Llama's, the study's: x = x + attn(n1 x); x = x + mlp(n2 x), n2 fused with the first add."""

    placement = "pre"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn: Attention,
                deltas: nn.ModuleDict | None = None) -> torch.Tensor:  # fmt: skip
        out = self.self_attn(positions, self.normed("input_layernorm", h, deltas), attn, deltas)
        out, residual = self.normed("post_attention_layernorm", out, deltas, h)
        return residual + self.mlp(out, deltas)


class _SandwichLayer(_DecoderLayer):
    """Huginn's: x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x)), n2 and n4 fused with their adds."""

    placement = "sandwich"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn: Attention,
                deltas: nn.ModuleDict | None = None) -> torch.Tensor:  # fmt: skip
        out = self.self_attn(positions, self.normed("input_layernorm", h, deltas), attn, deltas)
        h, _ = self.normed("post_attention_residual_layernorm", out, deltas, h)
        out = self.mlp(self.normed("pre_feedforward_layernorm", h, deltas), deltas)
        return self.normed("post_feedforward_residual_layernorm", out, deltas, h)[0]


class _SublayerOutputNormLayer(_DecoderLayer):
    """OLMo-2's: x = x + n1(attn x); x = x + n2(mlp x). No fused add + norm: each norm reads a
    sublayer's output, before its residual add."""

    placement = "sublayer_output"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn: Attention,
                deltas: nn.ModuleDict | None = None) -> torch.Tensor:  # fmt: skip
        h = h + self.normed("post_attention_layernorm", self.self_attn(positions, h, attn, deltas), deltas)
        return h + self.normed("post_feedforward_layernorm", self.mlp(h, deltas), deltas)


class _PreAndOutputNormLayer(_DecoderLayer):
    """Ouro's, Gemma-2's: x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x)), n3 fused with the first add."""

    placement = "pre_and_output"

    def forward(self, h: torch.Tensor, positions: torch.Tensor, attn: Attention,
                deltas: nn.ModuleDict | None = None) -> torch.Tensor:  # fmt: skip
        attended = self.self_attn(positions, self.normed("input_layernorm", h, deltas), attn, deltas)
        out = self.normed("post_attention_layernorm", attended, deltas)
        out, residual = self.normed("pre_feedforward_layernorm", out, deltas, h)
        return residual + self.normed("post_feedforward_layernorm", self.mlp(out, deltas), deltas)


#: ``LoopedConfig.norm_placement`` -> this file's decoder layer (modeling_looped's ``DECODER_LAYERS``).
VLLM_DECODER_LAYERS: dict[str, type[_DecoderLayer]] = {
    layer.placement: layer
    for layer in (_PreNormLayer, _SandwichLayer, _SublayerOutputNormLayer, _PreAndOutputNormLayer)
}


class _KVSlot(nn.Module):
    """One KV-cache slot: a module named ``kv_slots.{slot}`` holding vLLM's ``Attention``, at the
    attention head size (padded head_dim; the softmax scale is the true head_dim's)."""

    def __init__(self, config: LoopedConfig, vllm_config: VllmConfig, prefix: str, cache_config=None) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        # ``cache_config``: a later recurrence's sliding window under loop_attention (loop_attention_vllm).
        self.attn = Attention(
            config.num_attention_heads // tp, attention_head_size(config.head_dim), config.head_dim**-0.5,
            num_kv_heads=max(1, config.num_key_value_heads // tp),
            cache_config=cache_config if cache_config is not None else vllm_config.cache_config,
            quant_config=vllm_config.quant_config, prefix=f"{prefix}.attn",
        )  # fmt: skip


class _VllmRecurrentBlock(LoopedRecurrentBlock):
    """modeling_looped's loop (``LoopedRecurrentBlock``: initial state, injection, hyperconnection
    lanes, recurrence norm), its block layers run on vLLM's layers: each attends through the vLLM
    ``Attention`` of its planned slot, which writes the paged cache itself (no transformers cache,
    nothing to crop, no exit, inference only). Built once with the model; ``run`` hands it the
    call's positions.

    A recurrence's first layer may write into its input (the fused add + norm, ``_DecoderLayer``),
    and the loop reads that input again where it keeps it: the state after each recurrence (the exit
    gate reads them all) and the 0.1.0 hyperconnection's read (its write takes the block's change).
    There the first layer gets a copy."""

    def __init__(self, model: LoopedVllmModel) -> None:
        # The recurrence norm is the model's own or (recurrence_norm_weight "final") its final norm:
        # the base class reads them by name.
        super().__init__(model, model.default_plan, layer_kwargs={}, num_new_tokens=0)
        self.default_plan = model.default_plan
        self.kv_slots = model.kv_slots
        self.value_rows = model.value_rows
        self.loop_gates = model.gate_projections
        self.positions: torch.Tensor | None = None
        self.keeps_inputs = False
        self.w_h: torch.Tensor | None = None  # W_h, contiguous (``keep_injection``), once loaded
        # W_e and W_h as vLLM layers (bfloat16 / float16), else None; filled by ``keep_injection``.
        self.injection_e, self.injection_h = model.injection_e, model.injection_h
        self.injection_on_vllm = False

    def run(self, e: torch.Tensor, positions: torch.Tensor, depth: BatchDepth | None, keep_states: bool = False,
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """(the state the coda reads, from the prelude output ``e``; the state after every recurrence
        when ``keep_states``, for the exit gate). ``depth``: the batch's per-request depths (None: every
        token at the served default r and budget). A batch whose requests share r and k runs as one
        (the base class's loop); otherwise ``run_mixed``."""
        self.positions = positions
        self.keeps_inputs = keep_states or (self.hyperconnection is not None and self.legacy)
        plan = depth.uniform_plan if depth is not None else self.default_plan
        try:
            if plan is not None:
                self.plan = plan
                h, states, _ = self(e, exit_rule=None, predict=None, output_recurrent_states=keep_states)
                return h, states
            return self.run_mixed(e, depth, keep_states)
        finally:
            self.positions = None  # no tensor of a finished call kept alive
            self.plan = self.default_plan

    def run_mixed(self, e: torch.Tensor, depth: BatchDepth, keep_states: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The loop over requests at different depths: recurrence i runs only the tokens of requests
        with r > i, one group per KV slot (``BatchDepth.groups``), gathered and scattered back; each
        group's attention sees only its requests (``BatchDepth.attend``). A token past its r keeps its
        state, so the states after every recurrence hold, for it, its last one. ``block_layer``'s copy
        rule (``keeps_inputs``) holds here too: a group of the whole batch hands the state kept in
        ``states`` to the block."""
        h, lanes, split = self.begin(e)  # the block's driver (begin, recurrence, state_of), over groups
        positions, states, stops = self.positions, [], depth.stops
        for step in range(depth.max_recurrences):
            if stops is not None:  # the gate's exit: stopped tokens offer their latest KV (batch_depth)
                stops.refill(step, self.kv_slots, len(self.layers))
            for group in depth.groups(step):
                self.plan = group.plan
                attention = [self.kv_slots[group.plan.block(step, j)].attn for j in range(len(self.layers))]
                if self.loop_gates is not None and step > 0:  # the global reads see the group too
                    attention += [self.kv_slots[group.plan.block(0, j)].attn for j in range(len(self.layers))]
                idx = group.tokens
                if idx is None:
                    with depth.attend(group, attention, e.dtype):
                        h, lanes = self.recurrence(step, h, lanes, e, split)
                    continue
                stopped = stops.stopped[idx] if stops is not None else None
                sub_split = (split[0][idx], split[1]) if split is not None else None
                sub_lanes = lanes[:, idx] if lanes is not None else None
                self.positions = positions[idx]
                if self.value_rows is not None:
                    self.value_rows.select(idx)  # Parcae's value embeddings of these tokens (parcae_vllm)
                with depth.attend(group, attention, e.dtype, stopped):
                    sub_h, sub_lanes = self.recurrence(step, h[idx], sub_lanes, e[idx], sub_split)
                self.positions = positions
                if self.value_rows is not None:
                    self.value_rows.select(None)
                if stopped is not None:  # a stopped token's state stays frozen
                    sub_h = torch.where(stopped[:, None], h[idx], sub_h)
                    if lanes is not None:
                        sub_lanes = torch.where(stopped[None, :, None], lanes[:, idx], sub_lanes)
                h = h.index_copy(0, idx, sub_h)
                if lanes is not None:
                    lanes = lanes.index_copy(1, idx, sub_lanes)
            if keep_states or stops is not None:
                states.append(self.state_of(h, lanes))
            if stops is not None:
                stops.after(step, states[-1])
        return self.state_of(h, lanes), states

    def keep_injection(self) -> list[str]:
        """Keep the linear injection's halves W_e and W_h where their matmuls run fast (``load_weights``
        calls this once the weights are in; returns the parameters it filled). In bfloat16 / float16
        they go into the model's ``injection_e`` and ``injection_h``, vLLM ``ReplicatedLinear`` layers:
        vLLM's prepacked GEMM, 2-6x faster per call on CPU than PyTorch's bfloat16 matmul (W_e e once
        per forward, W_h h once per recurrence). In float32 W_h stays PyTorch's matmul, on a contiguous
        copy: the base class's W_h is a slice of W's columns, strided, and each recurrence's matmul with
        it took 20-40% longer; the copy gives the same numbers (the result does not depend on the
        operand's layout: tests/test_serving_parity.py)."""
        self.w_h, self.injection_on_vllm = None, False
        if self.injection is None or self.config.input_injection != "linear":
            return []
        # The base class decides whether the split applies and which columns are W_e and W_h (one owner
        # of both). Asked with the identity, its first part is W_e's transpose, exactly (each entry is one
        # product with 1).
        weight = self.injection.weight
        identity = torch.eye(self.config.hidden_size, dtype=weight.dtype, device=weight.device)
        split = super().injection_split(identity)
        if split is None:
            return []
        w_e, w_h = split[0].T, split[1]
        if self.injection_h is None:
            self.w_h = w_h.contiguous()
            return []
        default_weight_loader(self.injection_e.weight, w_e.contiguous())
        default_weight_loader(self.injection_h.weight, w_h.contiguous())
        self.injection_on_vllm = True
        return ["model.injection_e.weight", "model.injection_h.weight"]

    def injection_split(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The base class's (W_e e, W_h): W_e e from ``injection_e`` where ``keep_injection`` put the
        halves on vLLM's layers, W_h the contiguous copy where it made one."""
        if self.injection_on_vllm:
            return self.injection_e(e)[0], self.injection_h.weight
        split = super().injection_split(e)
        if split is None or self.w_h is None:
            return split
        return split[0], self.w_h

    def inject(
        self, h: torch.Tensor, e: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """The base class's, with W_h h from ``injection_h`` where ``keep_injection`` put W_h there."""
        if split is not None and self.injection_on_vllm:
            return split[0] + self.injection_h(h)[0]
        return super().inject(h, e, split)

    def block_layer(self, layer: nn.Module, x: torch.Tensor, step: int, j: int) -> torch.Tensor:
        if j == 0 and self.keeps_inputs:
            x = x.clone()
        attn = self.kv_slots[self.plan.block(step, j)].attn
        gates = self.loop_gates
        if gates is not None and step > 0:  # IQuest's gated global + local read (loop_attention_vllm)
            attn = GatedVllmAttention(self.kv_slots[self.plan.block(0, j)].attn, attn, gates[j], layer.self_attn)
        # A per-loop LoRA retrofit's deltas of loop `step`, handed to the layer (loop_lora_vllm).
        return layer(x, self.positions, attn, self.loop_deltas(step, j))


# torch.compile (when vLLM compiles: not with --enforce-eager) traces this forward once, with no depth
# tensors (vLLM's dummy run): the graph runs every token at the served default depth. A step whose
# requests all run that depth gets no depth tensors from the runner (``worker``) and runs the graph;
# any other step is data-dependent Python (which tokens each recurrence runs, the subset's attention
# metadata) and runs this forward eagerly (``LoopedForCausalLM.forward``).
@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class LoopedVllmModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LoopedConfig = vllm_config.model_config.hf_config
        parallel = vllm_config.parallel_config
        check_servable(config, pipeline_parallel_size=parallel.pipeline_parallel_size,
                       tensor_parallel_size=parallel.tensor_parallel_size,
                       device="cpu" if current_platform.is_cpu() else None)  # fmt: skip
        # Before any weight loads: an engine built without engine_args' settings is refused here.
        check_engine_settings(vllm_config, on_cpu=current_platform.is_cpu())
        # Parcae's MHA block beside a GQA prelude / coda: every layer at the block's KV heads (parcae_vllm).
        self.kv_heads_served_from = serve_kv_heads(config)
        self.config = config
        served = ServedDepth.from_config(config)
        self.plan = served.plan(config)  # the engine's slots: the deepest request's (depth.py)
        self.default_plan = served.default_plan(config)  # a step without depth tensors runs the default
        self.embed_tokens = VocabParallelEmbedding(config.padded_vocab_size, config.hidden_size,
                                                   quant_config=vllm_config.quant_config,
                                                   prefix=f"{prefix}.embed_tokens")  # fmt: skip
        norm = lambda: _norm(config)  # noqa: E731
        self.embedding_norm = norm() if config.embedding_norm else None
        layer = VLLM_DECODER_LAYERS[config.norm_placement]

        def stack(name: str, n: int) -> nn.ModuleList:
            return nn.ModuleList(layer(config, vllm_config, f"{prefix}.{name}.{j}") for j in range(n))

        self.prelude_layers = stack("prelude_layers", config.num_prelude_layers)
        self.recurrent_layers = stack("recurrent_layers", config.num_recurrent_layers)
        self.coda_layers = stack("coda_layers", config.num_coda_layers)
        # A per-loop LoRA retrofit's deltas on the shared block (loop_lora_vllm), else None.
        self.loop_lora = build_loop_lora(config, config.num_recurrent_layers) if has_loop_lora(config) else None
        # The injection, lanes, norms and exit gate under LoopedModel's names and sharing (a "final"
        # norm is model.norm itself), from LoopedModel's own builder, with vLLM's RMSNorm.
        build_loop_modules(self, config, norm)
        # Parcae's prelude norm, C and value embeddings (parcae_vllm), each None unless configured.
        self.value_rows = build_parcae_vllm(self, config, norm)
        # W_e and W_h of the linear injection as vLLM layers, so they run vLLM's GEMM (prepacked on CPU) like
        # every other projection; filled from ``injection.weight`` when the weights load (``keep_injection``).
        # Not in float32, where vLLM's GEMM would round differently from the matmul generate() runs.
        self.injection_e = self.injection_h = None
        dtype = vllm_config.model_config.dtype
        if config.input_injection == "linear" and config.looped_format != 1 and dtype != torch.float32:
            d = config.hidden_size
            self.injection_e = ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.injection_e")
            self.injection_h = ReplicatedLinear(d, d, bias=False, prefix=f"{prefix}.injection_h")
        # Ouro's exit gate. Its "threshold" readout picks each token's state at its exit step after the
        # loop (every recurrence runs and writes its KV either way, as in generate()): exact, at the
        # request's r. "last" reads the r-th state; "weighted" is refused (check_servable).
        self.exit_threshold = None
        if config.exit_gate and config.exit_gate_output == "threshold":
            self.exit_threshold = float(config.exit_gate_threshold)
        self.kv_slots = nn.ModuleList(
            _KVSlot(config, vllm_config, f"{prefix}.kv_slots.{slot}", slot_cache_config(vllm_config, config, self.plan, slot))
            for slot in range(self.plan.num_slots)
        )  # fmt: skip
        self.gate_projections = build_loop_gates(config)  # IQuest's loop-attention gates, or None
        self.loop = _VllmRecurrentBlock(self)  # not a module: it runs the modules above by name

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
        token_gate_exit: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states of the batch's tokens, each run at its request's depth: ``token_recurrences``
        (r), ``token_kv_budgets`` (min(k, r)) and, for the threshold readout, ``token_exit_thresholds``
        and ``token_gate_exit`` (the gate stops the token: ``batch_depth.GateStops``), per token
        (``worker.depth_kwargs``; None, as in vLLM's dummy runs and in a step whose requests
        all run the served default: every token at the default r and budget and the config's threshold)."""
        plan = self.plan
        depth = None
        if token_recurrences is not None and vllm_compat.has_attention_metadata():
            num_tokens = positions.shape[0]
            depth = BatchDepth(token_recurrences, token_kv_budgets, plan, num_tokens, token_gate_exit)
            if token_gate_exit is not None:
                depth.stop_with_gate(self.exit_gate, token_exit_thresholds, self.config.min_recurrences)
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        multiplier = self.config.embedding_multiplier
        if multiplier != 1.0:
            h = h * multiplier  # after the lookup: the tied head reads the table unscaled
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        start_forward(self, input_ids)  # Parcae's value-embedding rows of these tokens
        for j, layer in enumerate(self.prelude_layers):
            h = layer(h, positions, self.kv_slots[plan.prelude(j)].attn)
        if self.prelude_norm is not None:
            h = self.prelude_norm(h)
        h, states = self.loop.run(h, positions, depth, keep_states=self.exit_threshold is not None)
        if self.exit_threshold is not None:
            # generate()'s threshold readout (threshold_readout, as LoopedForCausalLM's), per token: the
            # state at the first step whose exit CDF reaches the threshold (no coda: the config refuses
            # one with this readout), among its own request's r states and at its own threshold. The
            # norms after the loop are row-wise, so they run on the pick.
            if depth is not None and token_exit_thresholds is not None:
                h = depth.threshold_readout(states, self.exit_gate, token_exit_thresholds)
            else:
                probabilities = exit_gate_probabilities(self.exit_gate, states)
                h, _ = threshold_readout(states, probabilities, self.exit_threshold)

        def coda(x: torch.Tensor) -> torch.Tensor:
            for j, layer in enumerate(self.coda_layers):
                x = layer(x, positions, self.kv_slots[plan.coda(j)].attn)
            return x

        h = after_loop(self, h, coda)  # the modules after the loop, as LoopedModel's forward
        end_forward(self)
        return h


class LoopedForCausalLM(nn.Module, SupportsLoRA):
    """vLLM's entry class for architecture ``LoopedForCausalLM`` (see the module docstring)."""

    # LoRA (and the quantized loaders): the fused layers and the checkpoint / adapter names they hold.
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: LoopedConfig = vllm_config.model_config.hf_config
        self.config = config
        self.model = LoopedVllmModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.padded_vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))  # fmt: skip
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        # The padded rows are cropped (org_vocab_size) before the soft-cap (compute_logits), as
        # logits_from_hidden does.
        self.logits_processor = LogitsProcessor(config.padded_vocab_size, config.vocab_size)

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
        token_gate_exit: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``LoopedVllmModel.forward``: each token at its request's depth (per-token tensors from the
        runner, ``worker.depth_kwargs``). Without them (every request at the served default) the model
        runs as vLLM set it up, compiled unless eager; with them, eagerly (the decorator's ``forward``:
        the compiled graph was traced without depth tensors and would ignore them)."""
        if token_recurrences is None:
            return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        forward = vllm_compat.eager_forward(self.model)
        return forward(input_ids, positions, intermediate_tensors, inputs_embeds, token_recurrences,
                       token_kv_budgets, token_exit_thresholds, token_gate_exit)  # fmt: skip

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The head's logits, cropped to the vocabulary, then the soft-cap as ``generate()`` runs it
        (modeling_looped's ``_SoftCap``: cap * tanh(logits / cap) in float32), so the logits are float32
        in any dtype, which vLLM's sampler reads them in. Not vLLM's ``soft_cap``: it runs in the model's
        dtype, where tanh is slow on CPU (bfloat16, 32 x 4,096 logits on one thread: 290 us, against 90
        us for this float32 one in place). In float32 the same three operations, in the same order."""
        logits = self.logits_processor(self.lm_head, hidden_states)
        cap = self.config.logit_softcap
        if logits is None or cap is None:
            return logits
        # In place: the head's output is this call's own (in float32 .float() is the same tensor).
        return logits.float().div_(cap).tanh_().mul_(cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load looped_hf's safetensors names (``model.prelude_layers.0.self_attn.q_proj.weight``...),
        fusing q/k/v and gate/up (``packed_modules_mapping``'s shards). A name the model does not
        have is an error, not a skip."""
        config = self.config
        shards = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
        if config.hidden_act != "relu2":
            shards.update(gate_proj=0, up_proj=1)
        fused_of = {part: fused for fused, parts in self.packed_modules_mapping.items() for part in parts}
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        weights = expand_kv_heads(config, self.model.kv_heads_served_from, weights)  # Parcae's GQA prelude / coda
        for name, weight in weights:
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head is the embedding
            if name == "model.hyperconnection.alpha" and weight.shape[0] != config.num_recurrences:
                raise ValueError(
                    f"num_recurrences={config.num_recurrences}: this checkpoint's hyperconnection parameters were "
                    f"trained for num_recurrences={weight.shape[0]}, the only r it can run at"
                )
            loop_lora = name.startswith(WEIGHT_PREFIX)  # per-loop LoRA tensors load by name (loop_lora_vllm)
            module, _, leaf = name.rpartition(".")
            path, _, part = module.rpartition(".")
            if part in shards and not loop_lora:
                target = f"{path}.{fused_of[part]}.{leaf}"
                param = params[target]
                param.weight_loader(param, weight, shards[part])
                loaded.add(target)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r}: the looped vLLM model has no such parameter")
            getattr(param, "weight_loader", default_weight_loader)(param, weight)
            loaded.add(name)
        loaded.update(self.model.loop.keep_injection())
        return loaded
