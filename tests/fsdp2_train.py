"""4 training steps of a tiny looped model, sharded with FSDP2's ``fully_shard`` (one unit per
decoder layer, then the root) when run by ``torchrun`` on several CPU processes over gloo, or
unsharded in one process: ``run(optimizer)`` (tests/test_distributed.py compares the two).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp2_train.py adamw|muonh

prints ``{"losses": [...], "params": {name: sum |p|}}`` on rank 0.

FSDP2 through accelerate needs a GPU-class distributed type: accelerate 1.16 turns a CPU launch
into MULTI_CPU and drops the FSDP plugin silently (it trains as DDP). So this applies the layer
wrapping fsdp2.yaml asks for with torch's fully_shard directly, on a CPU device mesh.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.optim import MuonH


def run(optimizer: str, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """Train 4 steps on 4 rows (this rank's ``4 / world`` of them; ``world > 1``: sharded, the
    process group initialised); the mean loss of every step and ``sum |p|`` of every parameter."""
    torch.manual_seed(0)
    config = LoopedConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_prelude_layers=1,
                          num_recurrent_layers=2, num_coda_layers=1, num_recurrences=3, use_cache=False)  # fmt: skip
    model = LoopedForCausalLM(config)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for module in model.modules():
            if type(module).__name__ in model._no_split_modules:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if optimizer == "muonh":  # the paper recipes' optimizer: MuonH on the matrices, AdamW on the rest
        matrices = [p for p in model.parameters() if p.ndim == 2 and p.shape[0] != 64]
        rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
        # fp32 orthogonalisation: the default bf16 one rounds differently for gathered shards (~1e-3).
        opts = [MuonH(matrices, lr=1e-2, ortho_dtype=torch.float32), torch.optim.AdamW(rest, lr=1e-2)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    rows = ids[rank * 4 // world : (rank + 1) * 4 // world]
    losses = []
    for _ in range(4):
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().abs().sum().item()
              for n, p in model.named_parameters()}  # fmt: skip
    return {"losses": losses, "params": params}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = run(sys.argv[1], rank, world)
    if rank == 0:
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads can abort the interpreter's own teardown ("terminate called without an
    # active exception", SIGABRT; seen once in ~10 runs); the results are out, so leave without it.
    os._exit(0)
