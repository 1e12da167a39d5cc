"""``--share ... --lora-rank N``: the RRT retrofit with a per-loop LoRA initialised from the SVD of
the residual (the Mixture-of-Recursions code's ``relaxation/lora/svd_init.py``: A = V_N^T,
B = U_N S_N of ``W_parent - W_shared``) and the full delta of every norm scale and projection bias
(``v_parent - v_shared``: full rank is the parent whatever its per-layer vectors), written as a
folder that loads with ``trust_remote_code=True`` (``loop_lora.py`` shipped beside the looped
model's own remote code)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..convert.common import ConversionError, check_target
from ..convert.loader import Checkpoint
from ..publish import PathLike
from .core import RECORD_FILE, build_retrofit, default_out, parent_family, write_retrofit
from .loop_lora import LOOP_LORA_TARGETS, LoopLoRAForCausalLM, LoRAPair, norm_keys
from .parent import open_parent
from .plan import LayerPlan


def svd_delta(residual: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B), rank x in and out x rank, with B A the best rank-``rank`` approximation of
    ``residual`` (``W_parent - W_shared``; exact at rank min(out, in)); computed in float32."""
    u, s, vh = torch.linalg.svd(residual.float(), full_matrices=False)
    return vh[:rank].contiguous(), (u[:, :rank] * s[:rank]).contiguous()


@torch.no_grad()
def init_loop_lora(
    model: LoopLoRAForCausalLM, parent: Checkpoint, plan: LayerPlan, zero_init: tuple[str, ...] = ()
) -> None:
    """Every loop's deltas from the parent layer it stands for (``plan.unrolled``), one tensor at a
    time: each projection's rank-N SVD of ``W_parent - W_shared`` and its bias delta, each norm's
    scale delta ``w_parent - w_shared``. ``zero_init``: the family's tensors the parent lacks (zero in
    every layer, so their delta is zero)."""
    layers = model.model.recurrent_layers
    paths = {target.rsplit(".", 1)[-1]: target for target in model.config.loop_lora_targets}
    paths.update(norm_keys(layers[0]))

    def residual(source: int, j: int, name: str) -> torch.Tensor:
        shared = layers[j].get_parameter(name)
        if name in zero_init:
            return torch.zeros_like(shared, dtype=torch.float32) - shared.float()
        return parent.get_tensor(f"model.layers.{source}.{name}").float() - shared.float()

    for t, row in enumerate(plan.unrolled):
        for j, source in enumerate(row):
            for key, delta in model.loop_lora.steps[t][j].items():
                path = paths[key]
                if isinstance(delta, LoRAPair):
                    a, b = svd_delta(residual(source, j, f"{path}.weight"), delta.A.shape[0])
                    delta.A.copy_(a)
                    delta.B.copy_(b)
                    if delta.bias is not None:
                        delta.bias.copy_(residual(source, j, f"{path}.bias"))
                else:
                    delta.weight.copy_(residual(source, j, f"{path}.weight"))


def vector_names(model: LoopLoRAForCausalLM) -> list[str]:
    """The shared-layer vectors each loop carries a delta of (``retrofit.json`` records them)."""
    layer = model.model.recurrent_layers[0]
    biases = [f"{t}.bias" for t in model.config.loop_lora_targets if layer.get_submodule(t).bias is not None]
    return [f"{path}.weight" for path in norm_keys(layer).values()] + biases


def retrofit_shared_lora(parent_dir: PathLike, out: PathLike | None, plan_for: Callable[[int], LayerPlan], *,
                         rank: int, repo_id: str | None = None, license: str | None = None,
                         overwrite: bool = False) -> Path:  # fmt: skip
    """Write the RRT retrofit of ``parent_dir`` with a rank-``rank`` LoRA per loop position (the layer
    plan must be a ``share`` plan) and return the folder. Refuses a rank above the width."""
    dest = check_target(parent_dir, default_out(parent_dir) if out is None else out, overwrite=overwrite,
                        repo_id=repo_id, written_by=RECORD_FILE)  # fmt: skip
    parent = open_parent(parent_dir)
    family = parent_family(parent.config, parent.folder)
    plan = plan_for(parent.config["num_hidden_layers"])  # checked by open_parent
    if plan.share is None:
        raise ConversionError(f"--lora-rank={rank}: only with --share (per-loop LoRA relaxes a shared stack)")
    width = parent.config.get("hidden_size")
    if (
        not isinstance(rank, int)
        or isinstance(rank, bool)
        or rank < 1
        or (isinstance(width, int) and rank > width)
    ):
        raise ConversionError(f"--lora-rank={rank}: must be in [1, the width hidden_size={width}] (a delta of a "
                              "projection has rank at most its smaller side)")  # fmt: skip
    extra = {"loop_lora_rank": rank, "loop_lora_targets": list(LOOP_LORA_TARGETS),
             "max_recurrences": plan.num_recurrences}  # fmt: skip
    model, record = build_retrofit(parent, plan, extra_config=extra, model_class=LoopLoRAForCausalLM,
                                   own=("loop_lora.",))  # fmt: skip
    init_loop_lora(model, parent, plan, family.zero_init)
    record["lora"] = {"rank": rank, "targets": list(LOOP_LORA_TARGETS), "init": "svd of W_parent - W_shared",
                      "vectors": vector_names(model),
                      "vectors_init": "v_parent - v_shared (full, per loop)",
                      "code": "loop_lora.py (forward hooks keyed on the loop step)"}  # fmt: skip
    # The model's save_pretrained ships loop_lora.py and the looped modules (LoopLoRAForCausalLM).
    return write_retrofit(model, record, parent, dest, repo_id=repo_id, license=license)


__all__ = ["init_loop_lora", "retrofit_shared_lora", "svd_delta", "vector_names"]
