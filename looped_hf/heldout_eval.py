"""The held-out loss of a model: token-weighted next-token loss over held-out blocks, exact under any batch or
process split. Training's final `loss`, the test-time curves and the cards all read it here.
"""

from __future__ import annotations

import math
from typing import Any

import torch


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    dataset: Any,
    batch_size: int,
    accelerator: Any = None,
    num_recurrences: int | None = None,
) -> tuple[float, int]:
    """Token-weighted mean next-token loss (nats/token) over `dataset`, and the tokens predicted.

    Each process takes every world_size-th block; sums of (loss x tokens) and tokens are reduced
    across processes, so the mean is exact whatever the batch split. `num_recurrences` runs the
    model at that r (None: its configured r), for test-time scaling curves (`looped_hf.recurrence_curves`);
    left None, the call passes no r at all, so a dense transformers model (a retrofit's parent) is
    measured on the same held-out blocks by the same loop.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    indices = list(range(rank, len(dataset), world))
    for start in range(0, len(indices), batch_size):
        rows = dataset[indices[start : start + batch_size]]["input_ids"]
        ids = torch.as_tensor(rows, dtype=torch.long, device=device)
        labels = ids.clone()
        at_r = {} if num_recurrences is None else {"num_recurrences": num_recurrences}
        out = model(input_ids=ids, labels=labels, **at_r)
        loss = out.loss
        if getattr(model.config, "exit_gate_entropy_beta", None) is not None:
            # An exit gate trained with Ouro's objective returns sum_t p_t L_t - beta H(p) as its
            # loss (the entropy bonus lowers it); held out, the model is judged by the
            # cross-entropy of the logits it returns, as every other model is.
            loss = model.loss_function(logits=out.logits, labels=labels, vocab_size=model.config.vocab_size)
        # The model's loss is the mean over the shifted targets: B x (T - 1) of them.
        n = (labels[:, 1:] != -100).sum()
        total += torch.stack([loss.double() * n, n.double()])
    if accelerator is not None and world > 1:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    loss_sum, n_tokens = total.tolist()
    return (loss_sum / n_tokens if n_tokens else math.nan), int(n_tokens)
