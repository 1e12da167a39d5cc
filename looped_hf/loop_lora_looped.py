"""Per-loop LoRA for a shared (RRT) looped model: loop t runs the shared block with its own low-rank
delta on every linear layer (Relaxed Recursive Transformers, Bae et al. 2024; the init is the
Mixture-of-Recursions code's ``relaxation/lora/svd_init.py``, written by ``looped-hf retrofit
--share ... --lora-rank N``, ``retrofit/lora_init.py``).

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

Design: the deltas are a module of the trunk, ``model.loop_lora.steps[t][j][key]``, and the loop
hands loop t's deltas of layer j to that layer as an argument of each application
(``LoopedRecurrentBlock.block_layer``, ``loop_deltas=``), which adds them inside its forward
(``decoder_layers_looped.with_delta``). No hook and no state: the step is part of the computation
that activation checkpointing replays, a deep copy holds its own deltas, ``torch.compile`` sees a
plain forward, and a KV budget (slots shared across loops) changes nothing about which deltas a loop
reads. The projection deltas are named ``{name}_delta`` (``q_proj_delta``...), so peft's usual
``target_modules`` (``q_proj``, ..., ``down_proj``) wrap the shared block's projections, not the
deltas. ``loop_lora_loops`` is the number of loops with a LoRA (the module layout);
``max_recurrences`` keeps its one meaning, the r ceiling (a config without ``loop_lora_loops``,
written before it existed, reads its loops from ``max_recurrences``). The vLLM model runs the same
deltas the same way (``looped_hf/serving/loop_lora_vllm.py``).

The classes carry their own ``model_type`` (``looped_loop_lora``), so a folder cannot load silently
as a plain looped model without its deltas. Shipped beside ``modeling_looped.py`` in every
checkpoint of this type (``save_pretrained`` copies it and the files it imports, and writes
``auto_map``), so it imports only torch, transformers and the looped modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationMixin

from .configuration_looped import (
    MAX_NUM_RECURRENCES,
    RECURRENCE_CEILING_FACTOR,
    LoopedConfig,
    _one_line_errors,
)
from .decoder_layers_looped import LoopedRMSNorm
from .modeling_looped import (
    LoopedForCausalLM,
    LoopedForQuestionAnswering,
    LoopedForSequenceClassification,
    LoopedForTokenClassification,
    LoopedModel,
)

#: The projections of a decoder layer that get a per-loop delta (every linear layer, as RRT).
LOOP_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
#: The suffix of a projection's delta key (``q_proj`` -> ``q_proj_delta``): not a peft target name.
DELTA_SUFFIX = "_delta"


@_one_line_errors
@strict
class LoopLoRAConfig(LoopedConfig):
    """``LoopedConfig`` plus ``loop_lora_rank`` (N), ``loop_lora_targets`` (the projections) and
    ``loop_lora_loops`` (how many loops have a LoRA), under its own model type so that only the
    class that applies the deltas loads it.

    Decorated as ``LoopedConfig`` is: ``@strict`` runs every ``validate_*`` rule (``LoopedConfig``'s
    and ``validate_loop_lora``) when a config is built, as a transformers config subclass must
    re-apply it to be checked at construction, and the refusals are one line."""

    model_type = "looped_loop_lora"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # A folder written before ``loop_lora_loops`` existed: its loops were ``max_recurrences``.
        if (
            getattr(self, "loop_lora_rank", None) is not None
            and getattr(self, "loop_lora_loops", None) is None
        ):
            self.loop_lora_loops = (
                self.max_recurrences if self.max_recurrences is not None else self.num_recurrences
            )

    def validate_loop_lora(self) -> None:
        """``loop_lora_rank`` an integer >= 1, ``loop_lora_targets`` a list of distinct names from
        ``LOOP_LORA_TARGETS`` (each None in a config that has no deltas yet; the model refuses it),
        ``loop_lora_loops`` an integer in [num_recurrences, 4096] and no smaller than
        ``max_recurrences`` (an r the ceiling allows must have its deltas)."""
        rank, targets = getattr(self, "loop_lora_rank", None), getattr(self, "loop_lora_targets", None)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"LoopLoRAConfig.loop_lora_rank={rank!r}: must be an integer >= 1")
        loops = getattr(self, "loop_lora_loops", None)
        if loops is not None:
            if (
                isinstance(loops, bool)
                or not isinstance(loops, int)
                or not self.num_recurrences <= loops <= 4096
            ):
                raise ValueError(f"LoopLoRAConfig.loop_lora_loops={loops!r}: must be an integer in "
                                 f"[num_recurrences={self.num_recurrences}, 4096] (the loops with a LoRA)")  # fmt: skip
            if self.max_recurrences is not None and self.max_recurrences > loops:
                raise ValueError(f"LoopLoRAConfig.max_recurrences={self.max_recurrences!r}: must be <= "
                                 f"loop_lora_loops={loops} (a per-loop LoRA model has deltas for {loops} loops)")  # fmt: skip
        if targets is None:
            return
        if (not isinstance(targets, (list, tuple)) or not targets or len(set(map(str, targets))) != len(targets)
                or any(target not in LOOP_LORA_TARGETS for target in targets)):  # fmt: skip
            raise ValueError(f"LoopLoRAConfig.loop_lora_targets={targets!r}: must be a list of distinct names from "
                             f"{list(LOOP_LORA_TARGETS)}")  # fmt: skip
        if "mlp.gate_proj" in targets and self.hidden_act == "relu2":
            raise ValueError(f"LoopLoRAConfig.loop_lora_targets={targets!r}: names mlp.gate_proj, which "
                             "hidden_act='relu2' (a non-gated MLP) does not have")  # fmt: skip

    def resolve_num_recurrences(self, num_recurrences: int | None = None) -> int:
        """``LoopedConfig.resolve_num_recurrences``, with an r past the loops that have a LoRA
        (``loop_lora_loops``) refused as such: no config change lets this model run it."""
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        loops = getattr(self, "loop_lora_loops", None)
        if isinstance(r, int) and not isinstance(r, bool) and loops is not None and r > loops:
            raise ValueError(f"num_recurrences={r}: a per-loop LoRA model runs at most its {loops} loops with a "
                             "LoRA (loop_lora_loops)")  # fmt: skip
        return super().resolve_num_recurrences(num_recurrences)

    @property
    def recurrence_ceiling(self) -> int:
        """``LoopedConfig.recurrence_ceiling``, capped at ``loop_lora_loops``: the most r that
        ``resolve_num_recurrences`` accepts, so a sampled depth (``recurrence.py``) never draws
        an r past the loops with a LoRA."""
        # Spelled out, not ``super().recurrence_ceiling``: torch.compile traces this at every forward
        # (resolve_num_recurrences) and does not trace a property read through super().
        if self.max_recurrences is not None:
            return self.max_recurrences  # validate_loop_lora: at most loop_lora_loops
        ceiling = min(RECURRENCE_CEILING_FACTOR * self.num_recurrences, MAX_NUM_RECURRENCES)
        loops = getattr(self, "loop_lora_loops", None)
        return min(ceiling, loops) if isinstance(loops, int) and not isinstance(loops, bool) else ceiling


class LoRAPair(nn.Module):
    """One low-rank delta ``B A`` (A: rank x in, B: out x rank), plus a bias delta (out) when the
    projection has a bias. Zero until the retrofit sets it."""

    looped_study_init = "zeros"  # LoopedPreTrainedModel._init_weights

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

    looped_study_init = "zeros"


def norm_keys(layer: nn.Module) -> dict[str, str]:
    """Key in a loop's ``ModuleDict`` -> path in ``layer`` of each RMSNorm with a scale (pre-norms,
    sublayer-output norms, q/k norms): the layer's last path part, unique within a decoder layer."""
    return {
        name.rsplit(".", 1)[-1]: name
        for name, module in layer.named_modules()
        if isinstance(module, LoopedRMSNorm) and not isinstance(module, NormDelta)
    }


def delta_key(target: str) -> str:
    """The key of a projection's delta in a loop's ``ModuleDict``: ``self_attn.q_proj`` -> ``q_proj_delta``."""
    return target.rsplit(".", 1)[-1] + DELTA_SUFFIX


def delta_paths(layer: nn.Module, targets: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Key in a loop's ``ModuleDict`` -> path in ``layer`` of the module it is the delta of."""
    return {**{delta_key(target): target for target in targets}, **norm_keys(layer)}


class LoopLoRA(nn.Module):
    """Every loop's deltas: ``steps[t][j][key]`` for loop t, block layer j and ``key`` a projection's
    (``q_proj_delta``: a ``LoRAPair``) or a norm's (``input_layernorm``, ``q_norm``: a ``NormDelta``)."""

    def __init__(self, config: LoopLoRAConfig, layers: nn.ModuleList) -> None:
        super().__init__()
        rank, targets = int(config.loop_lora_rank), tuple(config.loop_lora_targets)

        def pairs(layer: nn.Module) -> nn.ModuleDict:
            out = nn.ModuleDict()
            for target in targets:
                linear = layer.get_submodule(target)
                n = min(rank, linear.in_features, linear.out_features)
                out[delta_key(target)] = LoRAPair(
                    linear.in_features, linear.out_features, n, linear.bias is not None
                )
            for key, path in norm_keys(layer).items():
                norm = layer.get_submodule(path)
                out[key] = NormDelta(norm.weight.shape[0], eps=norm.variance_epsilon)
            return out

        loops = config.loop_lora_loops
        self.steps = nn.ModuleList(nn.ModuleList(pairs(layer) for layer in layers) for _ in range(loops))


class LoopLoRAModel(LoopedModel):
    """The looped trunk plus every loop's deltas (``loop_lora``), which its loop hands to the shared
    block's layers (the module docstring)."""

    config_class = LoopLoRAConfig

    def __init__(self, config: LoopLoRAConfig, exit_gate: bool = True) -> None:
        for field in ("loop_lora_rank", "loop_lora_targets"):
            if getattr(config, field, None) is None:
                raise ValueError(
                    f"LoopLoRAConfig.{field}: missing (the per-loop LoRA needs its rank and targets)"
                )
        super().__init__(config, exit_gate=exit_gate)
        self.loop_lora = LoopLoRA(config, self.recurrent_layers)
        self.post_init()


class LoopLoRAForCausalLM(LoopedForCausalLM, GenerationMixin):
    """A looped causal LM whose shared block runs loop t with ``model.loop_lora.steps[t]`` (see the
    module docstring). Everything else is ``LoopedForCausalLM``'s; ``GenerationMixin`` is named
    here too, as transformers asks of every causal LM (it is ``LoopedGenerationMixin``'s base)."""

    config_class = LoopLoRAConfig
    trunk_class = LoopLoRAModel


class LoopLoRAForSequenceClassification(LoopedForSequenceClassification):
    config_class = LoopLoRAConfig
    trunk_class = LoopLoRAModel


class LoopLoRAForTokenClassification(LoopedForTokenClassification):
    config_class = LoopLoRAConfig
    trunk_class = LoopLoRAModel


class LoopLoRAForQuestionAnswering(LoopedForQuestionAnswering):
    config_class = LoopLoRAConfig
    trunk_class = LoopLoRAModel


__all__ = [
    "DELTA_SUFFIX",
    "LOOP_LORA_TARGETS",
    "LoRAPair",
    "LoopLoRA",
    "LoopLoRAConfig",
    "LoopLoRAForCausalLM",
    "LoopLoRAForQuestionAnswering",
    "LoopLoRAForSequenceClassification",
    "LoopLoRAForTokenClassification",
    "LoopLoRAModel",
    "NormDelta",
    "delta_key",
    "delta_paths",
    "norm_keys",
]
