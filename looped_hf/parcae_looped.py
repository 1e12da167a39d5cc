"""Parcae's design as looped_hf modules (Sandy Research, "Parcae", arXiv 2604.12946; its code
sandyresearch/parcae, ``parcae_lm/``), each chosen when the model is built, a module or ``None``:

* ``DiagonalInjection`` (``input_injection="diagonal"``): the stable diagonal injection
  h <- exp(-softplus(dt_bias) * exp(A_log)) * h + softplus(dt_bias) * (e B^T). Its decay lies in
  (0, 1) for every parameter value, so the recurrence is a contraction in the state and cannot
  blow up however many steps run;
* ``like_init_state`` (``state_init="like_init"``): Parcae's random h_0, drawn with Parcae's own
  RNG calls so a seed gives its state bit for bit;
* ``prelude_norm`` (an RMSNorm on the prelude output) and ``post_loop_projection`` (``C``, a d x d
  map on the loop's last state before the coda): built by ``build_parcae_modules``;
* gated value embeddings (``value_embedding_layers``): per chosen unique layer a table
  ``model.value_embeddings.<i>`` and a gate ``self_attn.ve_gate`` (Linear(c -> KV heads), no
  bias); the layer's values become v + 2 sigmoid(gate(x[..., :c])) * E_i[ids] (``add_value_embedding``).

The squared-ReLU MLP's 0.5 (``mlp_activation_scale``), the parameter-free QK norm's eps
(``qk_norm_eps``) and the block's own KV heads (``recurrent_num_key_value_heads``) are read by the
decoder layers themselves. Parcae's interleaved-pair RoPE needs no module: the converter permutes
the q / k rows into rotate-half order (``convert.huginn_raven.permute_heads``), which is exact.

Shipped beside ``modeling_looped.py`` in every checkpoint (remote code follows the relative
import), so it imports only torch, transformers and the looped modules it names.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .configuration_looped import LoopedConfig

#: Parcae's initial decay exp(-dt A) of every channel (parcae_lm/models/parcae/init.py ssm_decay).
PARCAE_INITIAL_DECAY = math.sqrt(1.0 / 5.0)


class DiagonalInjection(nn.Module):
    """Parcae's ``DiagonalInjection`` (parcae_lm/modules/injection.py), state width = hidden_size:
    h <- h * exp(-softplus(dt_bias) exp(A_log)) + softplus(dt_bias) * (e @ B^T), op for op as
    Parcae computes it (so float32 logits match its code to rounding)."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.A_log = nn.Parameter(torch.empty(d))
        self.dt_bias = nn.Parameter(torch.empty(d))
        self.B = nn.Parameter(torch.empty(d, d))

    def reset_parameters(self) -> None:
        """Parcae's init: A_log = 0 (A = 1), dt = -log(decay) through the inverse softplus (each
        channel's decay starts at sqrt(1/5)), B = I."""
        dt = torch.full_like(self.dt_bias, -math.log(PARCAE_INITIAL_DECAY), device="cpu")
        init.zeros_(self.A_log)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        init.copy_(self.B, torch.eye(self.B.shape[0], self.B.shape[1]))

    def decay(self) -> torch.Tensor:
        """exp(-softplus(dt_bias) exp(A_log)), per channel, in (0, 1)."""
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(self.dt_bias)
        decay = torch.exp(-dt * torch.exp(self.A_log))
        return h * decay + dt * (e @ self.B.T)


def like_init_state(e: torch.Tensor, std: float, multiplier: float = 1.0) -> torch.Tensor:
    """Parcae's ``state_init="like-init"`` h_0 (``Parcae.initialize_state``): a ``randn`` of e's
    shape overwritten by ``trunc_normal_`` (N(0, std) truncated at +-3 std), times the embedding
    multiplier. Both draws come from the global RNG exactly as Parcae makes them, so
    ``torch.manual_seed(s)`` before a forward gives the state Parcae draws after the same seed."""
    h = torch.randn(tuple(e.shape), device=e.device, dtype=e.dtype)
    torch.nn.init.trunc_normal_(h, mean=0.0, std=std, a=-3 * std, b=3 * std)
    return h * multiplier if multiplier != 1.0 else h


def like_init_initial_state(config: LoopedConfig, e: torch.Tensor) -> torch.Tensor:
    """``state_init="like_init"`` as an ``INITIAL_STATES`` rule (recurrent_block_looped.py): Parcae's
    h_0 at ``state_init_std``, times the embedding multiplier. Kept on torch's own ``trunc_normal_``
    (not the inverse-CDF draw of ``"truncated_normal"``): only Parcae's RNG calls give its state."""
    return like_init_state(e, config.state_init_std, config.embedding_multiplier)


def diagonal_injection(block: object, h: torch.Tensor, e: torch.Tensor,
                       split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """``input_injection="diagonal"`` as an ``INJECTIONS`` rule: the block's ``DiagonalInjection``
    (``block.injection``) on (h, e); it has no weight to split, so ``split`` is ``None``."""
    return block.injection(h, e)


def layer_kv_heads(config: LoopedConfig, stage: str) -> int:
    """The KV heads of a layer of ``stage`` ("prelude", "recurrent", "coda"): the block's own
    (``recurrent_num_key_value_heads``) or ``num_key_value_heads``."""
    if stage == "recurrent" and config.recurrent_num_key_value_heads is not None:
        return config.recurrent_num_key_value_heads
    return config.num_key_value_heads


def unique_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(stage, layer) of every unique layer of ``model`` in ``value_embedding_layers`` order:
    prelude, block, coda."""
    return [(stage, layer) for stage in ("prelude", "recurrent", "coda")
            for layer in getattr(model, f"{stage}_layers")]  # fmt: skip


def build_parcae_modules(model: nn.Module, config: LoopedConfig, norm: Callable[[], nn.Module]) -> None:
    """Parcae's model-level modules on ``model`` (``LoopedModel`` or the vLLM model), each ``None``
    where the config has none: ``prelude_norm``, ``post_loop_projection`` (``C``) and the value
    embedding tables (``value_embeddings``, a ``ModuleDict`` keyed by unique-layer index), with
    each chosen layer's gate put on its attention (``self_attn.ve_gate``). Call it after the layers
    exist. ``norm()`` makes an RMSNorm of width ``hidden_size``."""
    model.prelude_norm = norm() if config.prelude_norm else None
    d = config.hidden_size
    model.post_loop_projection = nn.Linear(d, d, bias=False) if config.post_loop_projection else None
    model.value_embeddings = None
    if config.value_embedding_layers is None:
        return
    layers = unique_layers(model)
    tables = {}
    for i in sorted(config.value_embedding_layers):
        stage, layer = layers[i]
        kv = layer_kv_heads(config, stage)
        tables[str(i)] = nn.Embedding(config.padded_vocab_size, kv * config.head_dim)
        attention = layer.self_attn
        attention.ve_gate = nn.Linear(config.value_embedding_gate_channels, kv, bias=False)
        attention.value_embedding_index = i
    model.value_embeddings = nn.ModuleDict(tables)


def value_embedding_lookup(
    model: nn.Module, input_ids: torch.LongTensor | None
) -> dict[int, torch.Tensor] | None:
    """Each table's rows for ``input_ids`` (unique-layer index -> (batch, tokens, kv * head_dim)),
    looked up once per forward (a block layer reads the same rows at every recurrence); ``None``
    for a model without value embeddings. They are a function of the token ids, so a call with
    ``inputs_embeds`` instead is refused."""
    tables = model.value_embeddings
    if tables is None:
        return None
    if input_ids is None:
        raise ValueError("inputs_embeds=...: this model adds value embeddings of the token ids "
                         "(config.value_embedding_layers), so it needs input_ids")  # fmt: skip
    return {int(i): table(input_ids) for i, table in tables.items()}


def add_value_embedding(
    gate: nn.Module, x: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """v + 2 sigmoid(gate(x[..., :c])) * rows, per KV head: ``v`` (batch, tokens, kv, head_dim),
    ``x`` the layer's normed input, ``rows`` the layer's value-embedding rows (Parcae's
    ``CausalSelfAttention``, op for op)."""
    c = gate.in_features if isinstance(gate, nn.Linear) else gate.weight.shape[-1]
    weight = 2 * torch.sigmoid(gate(x[..., :c]))
    return v + weight.unsqueeze(-1) * rows.view(v.shape)


def post_loop_projection(model: nn.Module, state: torch.Tensor) -> torch.Tensor:
    """``C`` on the loop's last state where the model has one (``after_loop`` runs it first)."""
    projection = getattr(model, "post_loop_projection", None)
    return projection(state) if projection is not None else state


__all__ = [
    "PARCAE_INITIAL_DECAY",
    "DiagonalInjection",
    "add_value_embedding",
    "build_parcae_modules",
    "diagonal_injection",
    "layer_kv_heads",
    "like_init_initial_state",
    "like_init_state",
    "post_loop_projection",
    "unique_layers",
    "value_embedding_lookup",
]
