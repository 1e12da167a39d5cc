"""Per-loop LoRA for a shared (RRT) looped model: loop t runs the shared block with its own low-rank
delta on every linear layer (Relaxed Recursive Transformers, Bae et al. 2024; the init is the
Mixture-of-Recursions code's ``relaxation/lora/svd_init.py``).

For shared block layer j at loop t (standing for parent layer t*K + j) and each projection W:
``y = W_shared x + B_tj A_tj x`` with ``B A`` the rank-N truncated SVD of ``W_parent - W_shared``
(A = V_N^T, B = U_N S_N). At full rank (N >= min(out, in)) ``B A = W_parent - W_shared``: the
looped model computes the parent's function (norms and biases stay shared, as in RRT; they agree
wherever the tied parent layers' do).

Design (looped_hf's ``LoopedConfig`` has no per-step parameters for linear layers): a small
``nn.Module`` of A / B pairs, applied by forward hooks on the shared block's projections. The loop
step comes from the KV slot each block-layer call is given (``KVSlotPlan.block``: slot P + t*K + j
when every recurrence keeps its slots), so it is right under activation checkpointing (the
recomputation gets the same slot) and in cached generation; a call with ``kv_budget`` < r (slots
shared across loops) is refused, and the config's ``max_recurrences`` is the number of loops with a
LoRA. The classes carry their own ``model_type`` (``looped_loop_lora``), so a folder cannot load
silently as a plain looped model without its deltas: it loads with ``trust_remote_code=True``, this
file shipped beside ``modeling_looped.py``. Imports only torch, transformers and the looped modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:  # in a saved folder: this file sits beside the looped model's own remote code
    from .accounting_looped import parameter_groups
    from .configuration_looped import LoopedConfig
    from .modeling_looped import LoopedForCausalLM
except ImportError:  # inside the looped_hf package
    from looped_hf.accounting_looped import parameter_groups
    from looped_hf.configuration_looped import LoopedConfig
    from looped_hf.modeling_looped import LoopedForCausalLM

#: The projections of a decoder layer that get a per-loop delta (every linear layer, as RRT).
LOOP_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


class LoopLoRAConfig(LoopedConfig):
    """``LoopedConfig`` plus ``loop_lora_rank`` (N) and ``loop_lora_targets`` (the projections), under
    its own model type so that only the class that applies the deltas loads it."""

    model_type = "looped_loop_lora"
    _auto_class = None  # the folder's remote code is written by the retrofit, not by save_pretrained


class LoRAPair(nn.Module):
    """One low-rank delta ``B A`` (A: rank x in, B: out x rank)."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B)


def _target_key(target: str) -> str:
    return target.rsplit(".", 1)[-1]


class LoopLoRA(nn.Module):
    """Every loop's deltas: ``steps[t][j][proj]`` for loop t, block layer j, projection ``proj``."""

    def __init__(self, config: LoopedConfig, layers: nn.ModuleList) -> None:
        super().__init__()
        rank, targets = int(config.loop_lora_rank), tuple(config.loop_lora_targets)
        loops = config.max_recurrences or config.num_recurrences

        def pairs(layer: nn.Module) -> nn.ModuleDict:
            out = nn.ModuleDict()
            for target in targets:
                linear = layer.get_submodule(target)
                n = min(rank, linear.in_features, linear.out_features)
                out[_target_key(target)] = LoRAPair(linear.in_features, linear.out_features, n)
            return out

        self.steps = nn.ModuleList(nn.ModuleList(pairs(layer) for layer in layers) for _ in range(loops))


class LoopLoRAForCausalLM(LoopedForCausalLM):
    """A looped causal LM whose shared block runs loop t with ``loop_lora.steps[t]`` (see the module
    docstring). Everything else is ``LoopedForCausalLM``."""

    config_class = LoopLoRAConfig
    _auto_class = None

    def __init__(self, config: LoopLoRAConfig) -> None:
        for field in ("loop_lora_rank", "loop_lora_targets"):
            if getattr(config, field, None) is None:
                raise ValueError(
                    f"LoopLoRAConfig.{field}: missing (the per-loop LoRA needs its rank and targets)"
                )
        super().__init__(config)
        self.loop_lora = LoopLoRA(config, self.model.recurrent_layers)
        self._loop_step = [0] * config.num_recurrent_layers
        self._register_loop_hooks()
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, LoRAPair):  # zero delta until the retrofit writes the SVD init
            nn.init.zeros_(module.A)
            nn.init.zeros_(module.B)
        else:
            super()._init_weights(module)

    def num_scaling_params(self) -> dict[str, int]:
        """``LoopedForCausalLM.num_scaling_params`` plus ``loop_lora``, apart: each loop runs only its
        own deltas, so they are neither run-once nor run r times. The parts sum to the real count."""
        groups = {
            name: sum(p.numel() for p in params) for name, params in parameter_groups(self.model).items()
        }
        groups["loop_lora"] = sum(p.numel() for p in self.loop_lora.parameters())
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        groups["lm_head"] = 0 if tied else self.lm_head.weight.numel()
        groups["total"] = sum(groups.values())
        real = sum(p.numel() for p in self.parameters())
        if groups["total"] != real:
            raise RuntimeError(f"parameter groups sum to {groups['total']} but the model has {real}")
        return groups

    def _register_loop_hooks(self) -> None:
        config = self.config
        self.model.register_forward_pre_hook(self._check_call, with_kwargs=True)
        for j, layer in enumerate(self.model.recurrent_layers):
            layer.register_forward_pre_hook(self._step_hook(j), with_kwargs=True)
            for target in config.loop_lora_targets:
                layer.get_submodule(target).register_forward_hook(self._delta_hook(j, _target_key(target)))

    def _check_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.config.resolve_num_recurrences(kwargs.get("num_recurrences"))
        budget = kwargs.get("kv_budget") or self.config.kv_budget
        if budget is not None and budget < r:
            raise ValueError(f"kv_budget={budget}: a per-loop LoRA model needs every recurrence's KV slots "
                             f"(kv_budget None or >= num_recurrences={r})")  # fmt: skip

    def _step_hook(self, j: int):
        prelude, block = self.config.num_prelude_layers, self.config.num_recurrent_layers

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._loop_step[j] = (kwargs["cache_index"] - prelude) // block

        return hook

    def _delta_hook(self, j: int, key: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            return output + self.loop_lora.steps[self._loop_step[j]][j][key](args[0])

        return hook


__all__ = ["LOOP_LORA_TARGETS", "LoRAPair", "LoopLoRA", "LoopLoRAConfig", "LoopLoRAForCausalLM"]
