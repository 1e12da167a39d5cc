"""Parcae's options (``parcae_looped.py``) on the native vLLM model (``vllm_model.py``).

The modules are modeling_looped's own, built by the same builder (``build_parcae_modules``): the
prelude norm (vLLM's RMSNorm), ``C`` after the loop (run by ``after_loop``, as in ``generate()``),
the diagonal injection (``build_loop_modules``, run by the shared loop) and the value-embedding
tables with each chosen layer's gate on its attention. What is vLLM-specific is where the tables'
rows travel: vLLM's layers take (positions, hidden states, attention) only, so a forward's rows
are looked up once and held in a ``ValueRows`` that the gated attentions read by their table's
index; when the mixed-depth loop (``_VllmRecurrentBlock.run_mixed``) runs a recurrence on a subset
of the tokens, it selects the same subset there.

A block with KV heads of its own (``recurrent_num_key_value_heads``: Parcae's MHA core beside a GQA
prelude and coda) is served with every layer at the block's KV heads (``serve_kv_heads``): one
KV-cache layout for every slot, and each prelude / coda KV head, its gate row and its value-embedding
columns repeated for the query heads that share it (``expand_kv_heads``, as the loaded weights
stream in). Exact: a query head attends to the same keys and values as under GQA.

What cannot be served exactly is refused by ``parcae_servable_problems`` (``servable_problems``
lists it): Parcae's random initial state (drawn per forward call, which vLLM splits differently
from ``generate()``), a block with fewer KV heads than the prelude and coda, and tensor
parallelism with value embeddings or a block of its own KV heads.

Imports no vLLM: ``looped_hf.serving`` and the CLI import this file without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..parcae_looped import add_value_embedding, build_parcae_modules, unique_layers, value_embedding_lookup


class ValueRows:
    """The value-embedding rows of one forward's tokens (unique-layer index -> (tokens, kv * head_dim)),
    and the subset of tokens the running recurrence computes (``select``; None: all)."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] | None = None
        self.index: torch.Tensor | None = None

    def set(self, rows: dict[int, torch.Tensor] | None) -> None:
        self.rows, self.index = rows, None

    def select(self, index: torch.Tensor | None) -> None:
        self.index = index

    def __getitem__(self, layer: int) -> torch.Tensor:
        rows = self.rows[layer]
        return rows if self.index is None else rows[self.index]


def build_parcae_vllm(model: nn.Module, config: Any, norm: Callable[[], nn.Module]) -> ValueRows | None:
    """``build_parcae_modules`` on the vLLM model (after its layers exist), and the ``ValueRows`` its
    gated attentions read (``value_rows`` on each); ``None`` without value embeddings."""
    build_parcae_modules(model, config, norm)
    if model.value_embeddings is None:
        return None
    holder = ValueRows()
    for _, layer in unique_layers(model):
        if layer.self_attn.ve_gate is not None:
            layer.self_attn.value_rows = holder
    return holder


def start_forward(model: nn.Module, input_ids: torch.Tensor | None) -> None:
    """Look up this forward's value-embedding rows (``model.value_rows``; nothing without them)."""
    if model.value_rows is not None:
        model.value_rows.set(value_embedding_lookup(model, input_ids))


def end_forward(model: nn.Module) -> None:
    """Drop the forward's rows (no tensor of a finished call kept alive)."""
    if model.value_rows is not None:
        model.value_rows.set(None)


def add_value_rows(attention: nn.Module, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention's values ``v`` (tokens, kv * head_dim) with its gated value embedding added
    (``parcae_looped.add_value_embedding``, on the layer's normed input ``x``)."""
    rows = attention.value_rows[attention.value_embedding_index]
    heads = v.view(v.shape[0], -1, attention.head_dim)
    return add_value_embedding(attention.ve_gate, x, heads, rows).view(v.shape)


def qk_norm_eps(config: Any, dtype: torch.dtype) -> float:
    """The parameter-free QK norm's eps in a model of ``dtype``: ``qk_norm_eps``, or ``rms_norm_eps``
    (None), or torch's default for the dtype ("torch_default": what ``F.rms_norm`` uses)."""
    eps = getattr(config, "qk_norm_eps", None)
    if eps is None:
        return config.rms_norm_eps
    return torch.finfo(dtype).eps if eps == "torch_default" else eps


def serve_kv_heads(config: Any) -> int | None:
    """Make every layer of the served model use the block's own KV heads (``recurrent_num_key_value_heads``,
    a multiple of ``num_key_value_heads``: ``parcae_servable_problems``); returns the prelude / coda's
    KV heads that ``expand_kv_heads`` repeats up to them (``None``: nothing to expand). Changes
    ``config`` (the engine's own copy of the folder's config) before the layers are built."""
    own = getattr(config, "recurrent_num_key_value_heads", None)
    if own is None or own == config.num_key_value_heads:
        return None
    served_from = config.num_key_value_heads
    config.num_key_value_heads = own
    return served_from


def expand_kv_heads(config: Any, served_from: int | None,
                    weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """The checkpoint's weights with each prelude / coda KV head repeated to the block's count
    (``serve_kv_heads``): k / v projection rows (and biases), value-gate rows and value-embedding
    columns; the block's own weights and everything else pass through."""
    if served_from is None:
        yield from weights
        return
    repeat, hd = config.num_key_value_heads // served_from, config.head_dim
    core = range(config.num_prelude_layers, config.num_prelude_layers + config.num_recurrent_layers)
    for name, weight in weights:
        parts = name.split(".")
        outside = len(parts) > 2 and parts[1] in ("prelude_layers", "coda_layers")
        if outside and parts[3:5] in (["self_attn", "k_proj"], ["self_attn", "v_proj"]):
            weight = (
                weight.reshape(served_from, hd, *weight.shape[1:]).repeat_interleave(repeat, 0).flatten(0, 1)
            )
        elif outside and parts[3:5] == ["self_attn", "ve_gate"]:
            weight = weight.repeat_interleave(repeat, 0)
        elif parts[:2] == ["model", "value_embeddings"] and int(parts[2]) not in core:
            rows = weight.reshape(weight.shape[0], served_from, hd).repeat_interleave(repeat, 1)
            weight = rows.reshape(weight.shape[0], -1)
        yield name, weight


def parcae_servable_problems(config: Any, tensor_parallel_size: int = 1) -> list[str]:
    """Why the vLLM model cannot serve ``config``'s Parcae options exactly (one line each; see the
    module docstring)."""
    problems = []
    if config.state_init == "like_init" and config.state_init_std > 0:
        problems.append(
            f"state_init='like_init' with state_init_std={config.state_init_std!r}: h_0 is drawn from the global "
            "RNG on every forward, so vLLM's forward calls cannot reproduce generate(); convert with the "
            "deterministic zero state (looped-hf convert parcae without --state-init)"
        )
    kv = getattr(config, "recurrent_num_key_value_heads", None)
    if kv is not None and kv != config.num_key_value_heads and kv % config.num_key_value_heads:
        problems.append(
            f"recurrent_num_key_value_heads={kv}: the block's KV heads are served by repeating the prelude's and "
            f"coda's num_key_value_heads={config.num_key_value_heads}, so they must be a multiple of them"
        )
    own_heads = kv is not None and kv != config.num_key_value_heads
    if (getattr(config, "value_embedding_layers", None) or own_heads) and tensor_parallel_size != 1:
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: value embeddings (value_embedding_layers) and a block of "
            "its own KV heads (recurrent_num_key_value_heads) are served on one device"
        )
    return problems


__all__ = [
    "ValueRows",
    "add_value_rows",
    "build_parcae_vllm",
    "end_forward",
    "expand_kv_heads",
    "parcae_servable_problems",
    "qk_norm_eps",
    "serve_kv_heads",
    "start_forward",
]
