"""Per-loop LoRA in the native vLLM model: a ``looped-hf retrofit --share ... --lora-rank N`` folder
(model type ``looped_loop_lora``, ``looped_hf/loop_lora_looped.py``) served as ``generate()`` computes it.

The HF model adds, at loop t and shared block layer j, ``B_tj A_tj x`` (+ a bias delta) to every
projection's output and ``NormDelta_tj(x)`` to every RMSNorm's (the norm is linear in its scale).
Here the same deltas, under the same tensor names (``model.loop_lora.steps.{t}.{j}.{key}...``: the
module is ``loop_lora_looped.py``'s own ``LoopLoRA``, its shapes read from the HF decoder layers
built on the meta device, ``build_loop_lora``), are added inside the vLLM decoder layers' forward,
as in the HF layers: the loop hands loop t's deltas of layer j to that layer as an argument of its
application (``LoopedRecurrentBlock.block_layer``, in the uniform loop and in the per-request mixed
one alike). No hook: a projection that vLLM's LoRA support replaces with its own wrapper
(``--enable-lora``) still gets its delta, beside the adapter's (``plus`` and ``plus_packed``):

- the packed projections: ``qkv_proj`` gets ``cat(q(x), k(x), v(x))`` (QKVParallelLinear's q | k | v
  order), ``gate_up_proj`` ``cat(gate(x), up(x))``; ``o_proj``, ``down_proj`` (and the squared-ReLU
  MLP's ``up_proj``) their own delta;
- the norms (pre-norms, sublayer-output norms, q/k norms): a norm called with a residual (vLLM's
  fused add + norm) returns ``(norm(x + r), x + r)`` and its delta reads the sum; one called alone
  reads its input.

Under vLLM's torch.compile the step is a Python int at trace time (the loop is unrolled), so a
compiled graph holds each loop's deltas. The loop step is explicit on both sides, so a KV budget
(slots shared across loops) is served as ``generate()`` runs it. What cannot be served is refused by
``servable_problems`` (``loop_lora_problems``): tensor parallelism (the deltas act on whole
projections). A request deeper than the loops that have a LoRA is refused by the config's ceiling.
Nothing here imports torch at import time (``servable_problems`` reads this module's checks).
"""

from __future__ import annotations

from typing import Any

#: The prefix of the per-loop tensors in a folder (``LoopLoRAModel.loop_lora``).
WEIGHT_PREFIX = "model.loop_lora."
#: The packed vLLM projections -> the HF projections they hold, in their output order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def has_loop_lora(config: Any) -> bool:
    """Whether ``config`` is a per-loop LoRA retrofit's (its deltas must be applied)."""
    return getattr(config, "loop_lora_rank", None) is not None


def loop_lora_problems(config: Any, *, tensor_parallel_size: int = 1) -> list[str]:
    """What a per-loop LoRA model cannot be served with, one line each (empty: servable)."""
    if not has_loop_lora(config) or tensor_parallel_size <= 1:
        return []
    return [
        f"tensor_parallel_size={tensor_parallel_size}: the per-loop LoRA deltas act on whole projections; "
        "serve it on one device"
    ]


def build_loop_lora(config: Any, num_layers: int) -> Any:
    """The per-loop deltas of a vLLM model's shared block of ``num_layers`` layers: ``LoopLoRA``
    (``steps[t][j][key]``), the HF model's own module, so the tensors load by the HF names."""
    import torch
    from torch import nn

    from ..decoder_layers_looped import DECODER_LAYERS
    from ..loop_lora_looped import LoopLoRA

    with torch.device("meta"):  # the HF layers only give the shapes and the norm paths
        hf_layers = nn.ModuleList(DECODER_LAYERS[config.norm_placement](config, config.recurrent_num_key_value_heads)
                                  for _ in range(num_layers))  # fmt: skip
    return LoopLoRA(config, hf_layers)


def plus(out: Any, deltas: Any, name: str, x: Any) -> Any:
    """``out`` (a module's output on ``x``) plus its delta, where ``deltas`` (a loop's ``ModuleDict``
    of one layer, or None) has one: ``name`` is a projection's (``o_proj``) or a norm's."""
    if deltas is None:
        return out
    from ..loop_lora_looped import delta_key

    key = name if name in deltas else delta_key(name)
    return out + deltas[key](x) if key in deltas else out


def plus_packed(out: Any, deltas: Any, packed: str, x: Any, sizes: tuple[int, ...]) -> Any:
    """``out`` of a packed projection (``qkv_proj``, ``gate_up_proj``) plus its parts' deltas,
    concatenated in the packed order (a part without a delta adds zeros of its ``sizes`` width)."""
    if deltas is None:
        return out
    import torch

    from ..loop_lora_looped import delta_key

    keys = [delta_key(part) for part in PACKED[packed]]
    if not any(key in deltas for key in keys):
        return out
    parts = [
        deltas[key](x) if key in deltas else x.new_zeros(*x.shape[:-1], size)
        for key, size in zip(keys, sizes)
    ]
    return out + torch.cat(parts, dim=-1)


__all__ = [
    "PACKED",
    "WEIGHT_PREFIX",
    "build_loop_lora",
    "has_loop_lora",
    "loop_lora_problems",
    "plus",
    "plus_packed",
]
