"""One forward, requests at different depths: which tokens each recurrence runs, and the attention
metadata of that subset.

The batch runs to its deepest request's r. Recurrence i runs only the tokens whose request has r > i
(a request's tokens are contiguous in vLLM's batch), gathered, run through the block and scattered
back: a shallow request's tokens cost nothing after its r. Requests at step i that write different
KV slots (their budgets k differ: slot P + (i mod k)*K + j) run as separate groups, so each
``Attention`` call writes and reads one slot.

The attention of a subset sees only its requests: vLLM's attention layers read their metadata from
the forward context by layer name, so for the group's layers the context holds, during the call, the
subset's metadata (``subset_metadata``: the requests' rows of ``query_start_loc``, ``seq_lens`` and
the block table, their tokens' slot mapping, and the CPU kernel's scheduler metadata rebuilt for
them, as ``CPUAttentionMetadataBuilder.build`` builds it) and the subset's KV slot mapping. Exact: a
request's attention reads only its own queries, KV blocks and length, whichever requests share the call.

CPU only (``CPUAttentionMetadata``); the GPU backends' metadata is documented in docs/serving.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

from ..generation_looped import KVSlotPlan
from ..recurrent_block_looped import exit_gate_probabilities, threshold_readout


@dataclass
class StepGroup:
    """Requests that run recurrence ``step`` through the same KV slots: ``plan`` gives their slots,
    ``tokens`` their tokens in the batch (None: every token of the batch, no subset)."""

    plan: KVSlotPlan
    requests: tuple[int, ...]
    tokens: torch.Tensor | None


def subset_metadata(
    meta: CPUAttentionMetadata, requests: torch.Tensor, tokens: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype
) -> CPUAttentionMetadata:
    """The CPU attention metadata of ``requests`` (indices into ``meta``'s requests) alone, their
    ``tokens`` (indices into the batch) in order."""
    starts = meta.query_start_loc
    query_lens = (starts[1:] - starts[:-1])[requests]
    query_start_loc = torch.zeros(len(requests) + 1, dtype=starts.dtype)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    seq_lens = meta.seq_lens[requests]
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests), num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_size,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=meta.causal,
        sliding_window_size=-1, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=layer.kv_cache_dtype,
    )  # fmt: skip
    return dataclasses.replace(
        meta, num_actual_tokens=len(tokens), max_query_len=int(query_lens.max()), query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=meta.block_table[requests],
        slot_mapping=meta.slot_mapping[tokens], scheduler_metadata=scheduler_metadata,
    )  # fmt: skip


class BatchDepth:
    """The depths of one forward's requests (from the runner's per-token tensors, ``worker.depth_kwargs``)
    and the groups each recurrence runs."""

    def __init__(
        self, token_recurrences: torch.Tensor, token_kv_budgets: torch.Tensor, plan: KVSlotPlan, num_tokens: int
    ) -> None:
        context = get_forward_context()
        metadata = context.attn_metadata
        self.context = context
        self.meta: CPUAttentionMetadata = next(iter(metadata.values()))  # one KV-cache group: one metadata
        starts = self.meta.query_start_loc.tolist()
        self.starts = starts
        first = torch.tensor(starts[:-1], dtype=torch.long)
        self.recurrences = token_recurrences[first].tolist()
        self.kv_budgets = token_kv_budgets[first].tolist()
        self.token_recurrences = token_recurrences
        self.engine_plan = plan
        self.num_tokens = num_tokens
        self.max_recurrences = max(self.recurrences)
        self._metadata: dict[tuple[int, ...], tuple[CPUAttentionMetadata, torch.Tensor]] = {}

    @property
    def uniform_plan(self) -> KVSlotPlan | None:
        """The one plan every request runs, when they all share r and k (the batch runs as one)."""
        if len(set(self.recurrences)) == 1 and len(set(self.kv_budgets)) == 1:
            return self._plan(self.recurrences[0], self.kv_budgets[0])
        return None

    def _plan(self, r: int, k: int) -> KVSlotPlan:
        plan = self.engine_plan
        return KVSlotPlan(plan.num_prelude, plan.num_recurrent, plan.num_coda, r, k)

    def groups(self, step: int) -> list[StepGroup]:
        """The groups that run recurrence ``step`` (0-based): active requests, one group per KV slot."""
        by_slot: dict[int, list[int]] = {}
        for i, (r, k) in enumerate(zip(self.recurrences, self.kv_budgets)):
            if r > step:
                by_slot.setdefault(step % k, []).append(i)
        out = []
        for requests in by_slot.values():
            k = self.kv_budgets[requests[0]]
            plan = self._plan(self.max_recurrences, k)
            everyone = len(requests) == len(self.recurrences) and self.starts[-1] == self.num_tokens
            tokens = None if everyone else self._tokens(requests)
            out.append(StepGroup(plan, tuple(requests), tokens))
        return out

    def _tokens(self, requests: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(self.starts[i], self.starts[i + 1]) for i in requests])

    @contextlib.contextmanager
    def attend(self, group: StepGroup, layers: list[torch.nn.Module], dtype: torch.dtype) -> Iterator[None]:
        """While the group runs, ``layers`` (its vLLM ``Attention``s) see only its requests."""
        if group.tokens is None:
            yield
            return
        cached = self._metadata.get(group.requests)
        if cached is None:
            requests = torch.tensor(group.requests, dtype=torch.long)
            cached = (subset_metadata(self.meta, requests, group.tokens, layers[0], dtype), group.tokens)
            self._metadata[group.requests] = cached
        meta, tokens = cached
        attn_metadata, slot_mapping = self.context.attn_metadata, self.context.slot_mapping
        saved = [(layer.layer_name, attn_metadata[layer.layer_name], slot_mapping.get(layer.layer_name)) for layer in layers]
        try:
            for name, _, slots in saved:
                attn_metadata[name] = meta
                if slots is not None:
                    slot_mapping[name] = slots[tokens]
            yield
        finally:
            for name, old_meta, slots in saved:
                attn_metadata[name] = old_meta
                if slots is not None:
                    slot_mapping[name] = slots

    def threshold_readout(self, states: list[torch.Tensor], gate: torch.nn.Module, thresholds: torch.Tensor,
                          ) -> torch.Tensor:  # fmt: skip
        """Per token, the threshold readout (``threshold_readout``: the state at the step where the exit
        CDF first reaches its threshold) among its own request's r states (``exit_gate_probabilities``
        of states 1 .. r, per r in the batch), at its own request's threshold (``thresholds``)."""
        num_tokens = states[0].shape[0]
        token_r = self.token_recurrences[:num_tokens]
        out = torch.empty_like(states[0])
        for r in sorted(set(self.recurrences)):
            rows = (token_r == r).nonzero().squeeze(-1)
            own = [s[rows] for s in states[:r]]
            probabilities = exit_gate_probabilities(gate, own)
            out[rows], _ = threshold_readout(own, probabilities, thresholds[rows].unsqueeze(-1))
        return out


__all__ = ["BatchDepth", "StepGroup", "subset_metadata"]
