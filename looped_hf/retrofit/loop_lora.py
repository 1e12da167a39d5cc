"""Per-loop LoRA for a shared (RRT) looped model: loop t runs the shared block with its own low-rank
delta on every linear layer (Relaxed Recursive Transformers, Bae et al. 2024; the init is the
Mixture-of-Recursions code's ``relaxation/lora/svd_init.py``).

For shared block layer j at loop t (standing for parent layer t*K + j) and each projection W:
``y = W_shared x + B_tj A_tj x + (b_parent - b_shared)`` with ``B A`` the rank-N truncated SVD of
``W_parent - W_shared`` (A = V_N^T, B = U_N S_N). The layer's vectors, which differ between the tied
parent layers too, get a full per-loop delta: every RMSNorm scale of the layer (pre-norms, OLMo-2's
sublayer-output norms, Qwen3's and OLMo-2's q/k norm scales) runs as ``norm_shared(x) +
norm_delta_tj(x)`` (an RMSNorm is linear in its scale, so this is the norm with scale ``w_shared +
(w_parent - w_shared)``), and a projection with a bias adds the bias delta. At full rank (N >=
min(out, in)) the looped model computes the parent's function, whatever its per-layer norms and
biases. The vectors cost ``r * K * (sum of the layer's norm and bias sizes)`` parameters and
elementwise FLOPs only (docs/retrofit.md).

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

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn

try:  # in a saved folder: this file sits beside the looped model's own remote code
    from .configuration_looped import LoopedConfig, _one_line_errors
    from .decoder_layers_looped import LoopedRMSNorm
    from .modeling_looped import LoopedForCausalLM
except ImportError:  # inside the looped_hf package
    from looped_hf.configuration_looped import LoopedConfig, _one_line_errors
    from looped_hf.decoder_layers_looped import LoopedRMSNorm
    from looped_hf.modeling_looped import LoopedForCausalLM

#: The projections of a decoder layer that get a per-loop delta (every linear layer, as RRT).
LOOP_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


@_one_line_errors
@strict
class LoopLoRAConfig(LoopedConfig):
    """``LoopedConfig`` plus ``loop_lora_rank`` (N) and ``loop_lora_targets`` (the projections), under
    its own model type so that only the class that applies the deltas loads it.

    Decorated as ``LoopedConfig`` is: ``@strict`` runs every ``validate_*`` rule (``LoopedConfig``'s
    and ``validate_loop_lora``) when a config is built, as a transformers config subclass must
    re-apply it to be checked at construction, and the refusals are one line."""

    model_type = "looped_loop_lora"
    _auto_class = None  # its remote code is written by LoopLoRAForCausalLM.save_pretrained, not transformers

    def validate_loop_lora(self) -> None:
        """``loop_lora_rank`` an integer >= 1 and ``loop_lora_targets`` a list of distinct names from
        ``LOOP_LORA_TARGETS`` (each None in a config that has no deltas yet; the model refuses it)."""
        rank, targets = getattr(self, "loop_lora_rank", None), getattr(self, "loop_lora_targets", None)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"LoopLoRAConfig.loop_lora_rank={rank!r}: must be an integer >= 1")
        if targets is None:
            return
        if (not isinstance(targets, (list, tuple)) or not targets or len(set(map(str, targets))) != len(targets)
                or any(target not in LOOP_LORA_TARGETS for target in targets)):  # fmt: skip
            raise ValueError(f"LoopLoRAConfig.loop_lora_targets={targets!r}: must be a list of distinct names from "
                             f"{list(LOOP_LORA_TARGETS)}")  # fmt: skip

    def resolve_num_recurrences(self, num_recurrences: int | None = None) -> int:
        """``LoopedConfig.resolve_num_recurrences``, with an r past the loops that have a LoRA
        (``max_recurrences``) refused as such: no config change lets this model run it."""
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        loops = self.max_recurrences
        if isinstance(r, int) and not isinstance(r, bool) and loops is not None and r > loops:
            raise ValueError(f"num_recurrences={r}: a per-loop LoRA model runs at most its {loops} loops with a "
                             "LoRA (max_recurrences)")  # fmt: skip
        return super().resolve_num_recurrences(num_recurrences)

    def num_kv_slots(self, num_recurrences: int | None = None, kv_budget: int | None = None) -> int:
        """``LoopedConfig.num_kv_slots``, with a KV budget below r refused: loop t finds its deltas
        from its KV slot (the module docstring), so every recurrence keeps slots of its own. Eval and
        serving check each r here before running any."""
        slots = super().num_kv_slots(num_recurrences, kv_budget)
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        budget = self.kv_budget if kv_budget is None else kv_budget
        if budget is not None and budget < r:
            raise ValueError(f"kv_budget={budget}: a per-loop LoRA model needs every recurrence's KV slots "
                             f"(kv_budget None or >= num_recurrences={r})")  # fmt: skip
        return slots


class LoRAPair(nn.Module):
    """One low-rank delta ``B A`` (A: rank x in, B: out x rank), plus a bias delta (out) when the
    projection has a bias."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A), self.B, self.bias)


class NormDelta(LoopedRMSNorm):
    """The per-loop delta of one RMSNorm scale: ``norm_shared(x) + NormDelta(x)`` is the norm with
    scale ``w_shared + weight`` (the norm is linear in its scale). Zero until the retrofit sets it."""


def norm_keys(layer: nn.Module) -> dict[str, str]:
    """Key in a loop's ``ModuleDict`` -> path in ``layer`` of each RMSNorm with a scale (pre-norms,
    sublayer-output norms, q/k norms): the layer's last path part, unique within a decoder layer."""
    return {
        name.rsplit(".", 1)[-1]: name
        for name, module in layer.named_modules()
        if isinstance(module, LoopedRMSNorm)
    }


def _target_key(target: str) -> str:
    return target.rsplit(".", 1)[-1]


class LoopLoRA(nn.Module):
    """Every loop's deltas: ``steps[t][j][key]`` for loop t, block layer j and ``key`` a projection
    (``q_proj``: a ``LoRAPair``) or a norm (``input_layernorm``, ``q_norm``: a ``NormDelta``)."""

    def __init__(self, config: LoopedConfig, layers: nn.ModuleList) -> None:
        super().__init__()
        rank, targets = int(config.loop_lora_rank), tuple(config.loop_lora_targets)
        loops = config.max_recurrences or config.num_recurrences

        def pairs(layer: nn.Module) -> nn.ModuleDict:
            out = nn.ModuleDict()
            for target in targets:
                linear = layer.get_submodule(target)
                n = min(rank, linear.in_features, linear.out_features)
                bias = linear.bias is not None
                out[_target_key(target)] = LoRAPair(linear.in_features, linear.out_features, n, bias)
            for key, path in norm_keys(layer).items():
                norm = layer.get_submodule(path)
                out[key] = NormDelta(norm.weight.shape[0], eps=norm.variance_epsilon)
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

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """``PreTrainedModel.save_pretrained``, then the remote code beside the weights
        (`ship_remote_code`), so that every folder of this model (a retrofit, a trained run, a
        published copy) loads with ``trust_remote_code=True`` where looped_hf is not installed.
        transformers' own copy (``_auto_class``) would look for the looped modules beside this file,
        where they are only in a saved folder. ``push_to_hub=True`` is refused: it would upload the
        folder before its code is there (save, then upload the folder)."""
        if kwargs.get("push_to_hub"):
            raise ValueError("LoopLoRAForCausalLM.save_pretrained(push_to_hub=True): save the folder, then upload it "
                             "(looped-hf publish --push)")  # fmt: skip
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            ship_remote_code(Path(save_directory))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (LoRAPair, NormDelta)):  # zero delta until the retrofit writes its init
            for param in module.parameters(recurse=False):
                nn.init.zeros_(param)
        else:
            super()._init_weights(module)

    def _register_loop_hooks(self) -> None:
        config = self.config
        self.model.register_forward_pre_hook(self._check_call, with_kwargs=True)
        for j, layer in enumerate(self.model.recurrent_layers):
            layer.register_forward_pre_hook(self._step_hook(j), with_kwargs=True)
            for target in config.loop_lora_targets:
                layer.get_submodule(target).register_forward_hook(self._delta_hook(j, _target_key(target)))
            for key, path in norm_keys(layer).items():
                layer.get_submodule(path).register_forward_hook(self._delta_hook(j, key))

    def _check_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.config.resolve_num_recurrences(kwargs.get("num_recurrences"))
        self.config.num_kv_slots(r, kwargs.get("kv_budget"))

    def _step_hook(self, j: int):
        prelude, block = self.config.num_prelude_layers, self.config.num_recurrent_layers

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._loop_step[j] = (kwargs["cache_index"] - prelude) // block

        return hook

    def _delta_hook(self, j: int, key: str):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            return output + self.loop_lora.steps[self._loop_step[j]][j][key](args[0])

        return hook


def ship_remote_code(folder: Path) -> list[str]:
    """Copy the looped model's modules (``modeling_looped.py`` and what it imports relatively) and
    this file into ``folder``, and point its config's ``auto_map`` at the classes above; returns the
    file names written. Works where this file was imported from (looped_hf, or a saved folder
    loaded as remote code, where the looped modules sit beside it)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    modeling = sys.modules[LoopedForCausalLM.__module__].__file__
    files = {Path(modeling), Path(__file__), *map(Path, get_relative_import_files(modeling))}
    for file in files:
        shutil.copyfile(file, folder / file.name)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = {
        "AutoConfig": f"{Path(__file__).stem}.{LoopLoRAConfig.__name__}",
        "AutoModelForCausalLM": f"{Path(__file__).stem}.{LoopLoRAForCausalLM.__name__}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sorted(file.name for file in files)


__all__ = [
    "LOOP_LORA_TARGETS",
    "LoRAPair",
    "LoopLoRA",
    "LoopLoRAConfig",
    "LoopLoRAForCausalLM",
    "NormDelta",
    "norm_keys",
    "ship_remote_code",
]
