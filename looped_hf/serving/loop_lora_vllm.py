"""Per-loop LoRA in the native vLLM model: a ``looped-hf retrofit --share ... --lora-rank N`` folder
(model type ``looped_loop_lora``, ``retrofit/loop_lora.py``) served as ``generate()`` computes it.

The HF model adds, at loop t and shared block layer j, ``B_tj A_tj x`` (+ a bias delta) to every
projection's output and ``NormDelta_tj(x)`` to every RMSNorm's (the norm is linear in its scale).
Here the same deltas, under the same tensor names (``loop_lora.steps.{t}.{j}.{key}...``: the module
is ``retrofit/loop_lora.py``'s own ``LoopLoRA``, its shapes read from the HF decoder layers built on
the meta device), act on vLLM's layers by forward hooks on the shared block's modules
(``attach_loop_lora``):

- the packed projections: ``qkv_proj`` gets ``cat(q(x), k(x), v(x))`` (QKVParallelLinear's q | k | v
  order), ``gate_up_proj`` ``cat(gate(x), up(x))``; ``o_proj``, ``down_proj`` (and the squared-ReLU
  MLP's ``up_proj``) their own delta; each returns ``(output, bias)``, the delta goes on the output;
- the norms (pre-norms, sublayer-output norms, q/k norms): a norm called with a residual (vLLM's
  fused add + norm) returns ``(norm(x + r), x + r)`` and its delta reads the sum; one called alone
  reads its input.

The vLLM model sets the module's ``step`` before each block layer runs
(``_VllmRecurrentBlock.block_layer``: it knows the loop index), so the hooks of layer j read loop
``step``'s deltas, in the uniform loop and in the per-request mixed one alike. Under vLLM's
torch.compile the step is a Python int at trace time (the loop is unrolled), so a compiled graph
holds each loop's deltas. What cannot be served is refused by ``servable_problems``
(``loop_lora_problems``): a KV budget (a loop finds its deltas by its own slots, as in the HF model)
and tensor parallelism (the deltas act on whole projections). A request deeper than the loops that
have a LoRA is refused by the config's ceiling (``max_recurrences`` is the number of loops).
Nothing here imports torch at import time (``servable_problems`` reads this module's checks).
"""

from __future__ import annotations

from typing import Any

#: The prefix of the per-loop tensors in a folder (``LoopLoRAForCausalLM.loop_lora``).
WEIGHT_PREFIX = "loop_lora."
#: The packed vLLM projections -> the HF projections they hold, in their output order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def has_loop_lora(config: Any) -> bool:
    """Whether ``config`` is a per-loop LoRA retrofit's (its deltas must be applied)."""
    return getattr(config, "loop_lora_rank", None) is not None


def loop_lora_problems(config: Any, *, tensor_parallel_size: int = 1) -> list[str]:
    """What a per-loop LoRA model cannot be served with, one line each (empty: servable)."""
    if not has_loop_lora(config):
        return []
    problems = []
    if config.kv_budget is not None:
        problems.append(
            f"kv_budget={config.kv_budget}: a per-loop LoRA model needs every recurrence's KV slots (loop t finds its "
            "deltas by its own); serve it without a KV budget"
        )
    if tensor_parallel_size > 1:
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: the per-loop LoRA deltas act on whole projections; "
            "serve it on one device"
        )
    return problems


def attach_loop_lora(config: Any, layers: Any) -> Any:
    """The per-loop deltas of the vLLM model's shared block ``layers`` (an ``nn.ModuleList`` of its
    decoder layers): ``retrofit/loop_lora.py``'s ``LoopLoRA`` (``steps[t][j][key]``), hooked onto
    each layer's projections and norms. Its ``step`` attribute (0 here) is the loop whose deltas
    the hooks add; the block sets it before each layer."""
    import torch
    from torch import nn

    from ..decoder_layers_looped import DECODER_LAYERS
    from ..retrofit.loop_lora import LoopLoRA, norm_keys

    with torch.device("meta"):  # the HF layers only give the shapes and the norm paths
        hf_layers = nn.ModuleList(DECODER_LAYERS[config.norm_placement](config) for _ in layers)
    deltas = LoopLoRA(config, hf_layers)
    deltas.step = 0
    norms = norm_keys(hf_layers[0]) if len(hf_layers) else {}

    def projection_hook(j: int, keys: tuple[str, ...]):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
            step, x = deltas.steps[deltas.step][j], args[0]
            delta = torch.cat([step[key](x) for key in keys], dim=-1) if len(keys) > 1 else step[keys[0]](x)
            return (output[0] + delta, *output[1:])

        return hook

    def norm_hook(j: int, key: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            delta = deltas.steps[deltas.step][j][key]
            if isinstance(output, tuple):  # fused add + norm: (norm(x + r), x + r); the delta reads the sum
                return (output[0] + delta(output[1]), output[1])
            return output + delta(args[0])

        return hook

    for j, layer in enumerate(layers):
        targets = {target.rsplit(".", 1)[-1]: target for target in config.loop_lora_targets}
        for packed, parts in PACKED.items():
            owner = layer.get_submodule("self_attn" if packed == "qkv_proj" else "mlp")
            if hasattr(owner, packed):
                getattr(owner, packed).register_forward_hook(projection_hook(j, parts))
                for part in parts:
                    targets.pop(part, None)
        for key, target in targets.items():  # o_proj, down_proj, a squared-ReLU MLP's up_proj
            layer.get_submodule(target).register_forward_hook(projection_hook(j, (key,)))
        for key, path in norms.items():
            layer.get_submodule(path).register_forward_hook(norm_hook(j, key))
    return deltas


__all__ = ["PACKED", "WEIGHT_PREFIX", "attach_loop_lora", "has_loop_lora", "loop_lora_problems"]
