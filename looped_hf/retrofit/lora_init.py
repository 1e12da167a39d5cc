"""``--share ... --lora-rank N``: the RRT retrofit with a per-loop LoRA initialised from the SVD of
the residual (the Mixture-of-Recursions code's ``relaxation/lora/svd_init.py``: A = V_N^T,
B = U_N S_N of ``W_parent - W_shared``), written as a folder that loads with
``trust_remote_code=True`` (``loop_lora.py`` shipped beside the looped model's own remote code)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..convert.common import ConversionError, check_target
from ..publish import PathLike
from .core import build_retrofit, default_out, parent_family, write_retrofit
from .loop_lora import LOOP_LORA_TARGETS, LoopLoRAForCausalLM
from .parent import ParentCheckpoint, open_parent
from .plan import LayerPlan


def svd_delta(original: torch.Tensor, shared: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B), rank x in and out x rank, with B A the best rank-``rank`` approximation of
    ``original - shared`` (exact at rank min(out, in)); computed in float32."""
    u, s, vh = torch.linalg.svd(original.float() - shared.float(), full_matrices=False)
    return vh[:rank].contiguous(), (u[:, :rank] * s[:rank]).contiguous()


@torch.no_grad()
def init_loop_lora(model: LoopLoRAForCausalLM, parent: ParentCheckpoint, plan: LayerPlan) -> None:
    """Every loop's deltas from the parent layer it stands for (``plan.unrolled``), one tensor at a time."""
    layers = model.model.recurrent_layers
    for t, row in enumerate(plan.unrolled):
        for j, source in enumerate(row):
            for target in model.config.loop_lora_targets:
                pair = model.loop_lora.steps[t][j][target.rsplit(".", 1)[-1]]
                shared = layers[j].get_submodule(target).weight
                a, b = svd_delta(
                    parent.tensor(f"model.layers.{source}.{target}.weight"), shared, pair.A.shape[0]
                )
                pair.A.copy_(a)
                pair.B.copy_(b)


def ship_loop_lora_code(folder: Path) -> list[str]:
    """Copy the looped model's remote code and ``loop_lora.py`` into ``folder`` and point its
    ``auto_map`` at the per-loop LoRA classes; returns the file names written."""
    from transformers.dynamic_module_utils import get_relative_import_files

    import looped_hf.modeling_looped as modeling

    from . import loop_lora

    files = {
        Path(modeling.__file__),
        Path(loop_lora.__file__),
        *map(Path, get_relative_import_files(modeling.__file__)),
    }
    for file in files:
        shutil.copyfile(file, folder / file.name)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = {
        "AutoConfig": "loop_lora.LoopLoRAConfig",
        "AutoModelForCausalLM": "loop_lora.LoopLoRAForCausalLM",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return sorted(file.name for file in files)


def retrofit_shared_lora(parent_dir: PathLike, out: PathLike | None, plan_for: Callable[[int], LayerPlan], *,
                         rank: int, repo_id: str | None = None, license: str | None = None,
                         overwrite: bool = False) -> Path:  # fmt: skip
    """Write the RRT retrofit of ``parent_dir`` with a rank-``rank`` LoRA per loop position (the layer
    plan must be a ``share`` plan) and return the folder. Refuses a rank above the width."""
    dest = check_target(parent_dir, default_out(parent_dir) if out is None else out, overwrite=overwrite,
                        repo_id=repo_id)  # fmt: skip
    parent = open_parent(parent_dir)
    parent_family(parent.config, parent.path)
    plan = plan_for(int(parent.config.get("num_hidden_layers") or 0))
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
    with parent:
        model, record = build_retrofit(parent, plan, extra_config=extra, model_class=LoopLoRAForCausalLM,
                                       own=("loop_lora.",))  # fmt: skip
        init_loop_lora(model, parent, plan)
        record["lora"] = {"rank": rank, "targets": list(LOOP_LORA_TARGETS), "init": "svd of W_parent - W_shared",
                          "code": "loop_lora.py (forward hooks keyed on the loop step)"}  # fmt: skip
        return write_retrofit(model, record, parent.path, dest, repo_id=repo_id, license=license,
                              extra_files=ship_loop_lora_code)  # fmt: skip


__all__ = ["init_loop_lora", "retrofit_shared_lora", "ship_loop_lora_code", "svd_delta"]
