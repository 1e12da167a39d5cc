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

A request that asks for the gate's exit (``exit_criterion="gate"``, a gated model) loses its tokens
as the gate stops them (``GateStops``: the rule is ``GateExit``'s, generate()'s): once all its tokens
have stopped it leaves the groups, and a stopped token's KV slots of the later recurrences get its
latest KV, as ``_ExitKV`` fills them: the key and value its attention backend wrote at its exit step
(kept as the backend ran, ``GateStops.record``), written again by each later slot's backend
(``GateStops.refill``; the CPU backend stores blocks in its own layout, so the cache is never copied
by hand). A request with only some tokens stopped (a prefill) keeps them in its group, since vLLM's
CPU kernel takes a request's queries as the last ``query_len`` tokens of its sequence: their latest
KV is written before the attention call and their own write goes to the null block (``NULL_SLOT``);
their rows are computed and their state stays frozen (no saving is counted for them).

CPU only (``CPUAttentionMetadata``); the GPU backends' metadata is documented in docs/serving.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..generation_looped import KVSlotPlan
from ..recurrent_block_looped import GateExit, exit_gate_probabilities, threshold_readout
from . import vllm_compat
from .vllm_compat import NULL_SLOT  # vLLM's null block: a write there is read by no attention

# vLLM's CPU attention metadata (``CPUAttentionMetadata``), its forward context, its backends' KV write
# and the CPU kernel's scheduler metadata are vLLM internals, reached through ``vllm_compat``.


@dataclass
class StepGroup:
    """Requests that run recurrence ``step`` through the same KV slots: ``plan`` gives their slots,
    ``tokens`` their tokens in the batch (None: every token of the batch, no subset)."""

    plan: KVSlotPlan
    requests: tuple[int, ...]
    tokens: torch.Tensor | None


def subset_metadata(
    meta: Any, requests: torch.Tensor, tokens: torch.Tensor, layer: torch.nn.Module, dtype: torch.dtype
) -> Any:
    """The CPU attention metadata of ``requests`` (indices into ``meta``'s requests) alone, their
    ``tokens`` (indices into the batch) in order."""
    starts = meta.query_start_loc
    query_lens = (starts[1:] - starts[:-1])[requests]
    query_start_loc = torch.zeros(len(requests) + 1, dtype=starts.dtype)
    torch.cumsum(query_lens, 0, out=query_start_loc[1:])
    seq_lens = meta.seq_lens[requests]
    return vllm_compat.subset_metadata(
        meta, layer, dtype, num_actual_tokens=len(tokens), max_query_len=int(query_lens.max()),
        query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=meta.block_table[requests], slot_mapping=meta.slot_mapping[tokens],
    )  # fmt: skip


class BatchDepth:
    """The depths of one forward's requests (from the runner's per-token tensors, ``worker.depth_kwargs``)
    and the groups each recurrence runs."""

    def __init__(
        self, token_recurrences: torch.Tensor, token_kv_budgets: torch.Tensor, plan: KVSlotPlan,
        num_tokens: int, token_gate_exit: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        # Every KV-cache group's metadata has the same requests and query layout; the groups differ in
        # their block tables (full-attention and sliding-window layers: loop_attention_vllm).
        self.meta = vllm_compat.step_attention_metadata()  # vLLM's CPUAttentionMetadata
        starts = self.meta.query_start_loc.tolist()
        self.starts = starts
        first = torch.tensor(starts[:-1], dtype=torch.long)
        self.recurrences = token_recurrences[first].tolist()
        self.kv_budgets = token_kv_budgets[first].tolist()
        self.token_recurrences = token_recurrences
        self.engine_plan = plan
        self.num_tokens = num_tokens
        self.max_recurrences = max(self.recurrences)
        # (requests, id of a KV-cache group's metadata) -> that group's metadata of the requests alone
        self._metadata: dict[tuple[tuple[int, ...], int], Any] = {}
        asks = token_gate_exit[first].tolist() if token_gate_exit is not None else None
        self.gate_exit = asks or [False] * len(self.recurrences)  # per request: does the gate stop it
        self.stops: GateStops | None = None  # set by stop_with_gate
        self.dropped: set[int] = set()  # gate-exit requests whose every token has stopped

    @property
    def uniform_plan(self) -> KVSlotPlan | None:
        """The one plan every request runs, when they all share r and k (the batch runs as one)."""
        if len(set(self.recurrences)) == 1 and len(set(self.kv_budgets)) == 1 and not any(self.gate_exit):
            return self._plan(self.recurrences[0], self.kv_budgets[0])
        return None

    def _plan(self, r: int, k: int) -> KVSlotPlan:
        plan = self.engine_plan
        return KVSlotPlan(plan.num_prelude, plan.num_recurrent, plan.num_coda, r, k)

    def groups(self, step: int) -> list[StepGroup]:
        """The groups that run recurrence ``step`` (0-based): active requests, one group per KV slot."""
        by_slot: dict[int, list[int]] = {}
        for i, (r, k) in enumerate(zip(self.recurrences, self.kv_budgets)):
            if r > step and i not in self.dropped:
                by_slot.setdefault(step % k, []).append(i)
        out = []
        for requests in by_slot.values():
            k = self.kv_budgets[requests[0]]
            plan = self._plan(self.max_recurrences, k)
            everyone = len(requests) == len(self.recurrences) and self.starts[-1] == self.num_tokens
            everyone = everyone and self.stops is None
            tokens = None if everyone else self._tokens(requests)
            out.append(StepGroup(plan, tuple(requests), tokens))
        return out

    def _tokens(self, requests: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(self.starts[i], self.starts[i + 1]) for i in requests])

    @contextlib.contextmanager
    def attend(self, group: StepGroup, layers: list[torch.nn.Module], dtype: torch.dtype,
               stopped: torch.Tensor | None = None) -> Iterator[None]:  # fmt: skip
        """While the group runs, ``layers`` (its vLLM ``Attention``s) see only its requests; the
        ``stopped`` tokens of the group (a mask) write their fresh KV to ``NULL_SLOT``, not their slot,
        and under the gate's exit every layer's KV write is kept as the tokens' latest (``GateStops``)."""
        if group.tokens is None:
            yield
            return
        tokens = group.tokens
        metadata = []
        for layer in layers:
            source = vllm_compat.layer_attention_metadata(layer)
            key = (group.requests, id(source))  # each layer's own KV-cache group
            if key not in self._metadata:
                requests = torch.tensor(group.requests, dtype=torch.long)
                self._metadata[key] = subset_metadata(source, requests, tokens, layer, dtype)
            metadata.append(self._metadata[key])
        slot_mappings = []
        for layer in layers:
            slots = vllm_compat.step_slot_mapping(layer)
            if slots is not None:
                slots = slots[tokens] if stopped is None else slots[tokens].masked_fill(stopped, NULL_SLOT)
            slot_mappings.append(slots)
        with vllm_compat.attention_for(layers, metadata, slot_mappings):
            try:
                if self.stops is not None:
                    for j, layer in enumerate(layers):
                        self.stops.record(j, layer, tokens, stopped)
                yield
            finally:
                if self.stops is not None:
                    for layer in layers:
                        vllm_compat.unwrap_kv_cache_update(layer)

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


    def stop_with_gate(self, gate: torch.nn.Module, thresholds: torch.Tensor, minimum: int) -> None:
        """Let the gate stop the tokens of the requests that ask for it (``GateStops``)."""
        self.stops = GateStops(self, gate, thresholds, minimum)

    def request_plan(self, i: int) -> KVSlotPlan:
        return self._plan(self.max_recurrences, self.kv_budgets[i])


class GateStops:
    """The gate's exit for one forward (``exit_criterion="gate"``): which tokens of the requests that
    ask for it have stopped, and at which recurrence. The rule is ``GateExit``'s (generate()'s): after
    recurrence c >= ``minimum`` (1-based), a running token whose exit CDF reaches its request's
    threshold stops, unless c is its r anyway."""

    def __init__(
        self, depth: BatchDepth, gate: torch.nn.Module, thresholds: torch.Tensor, minimum: int
    ) -> None:
        n = depth.num_tokens
        self.depth = depth
        self.requests = [i for i, asks in enumerate(depth.gate_exit) if asks]
        self.rows = torch.cat([torch.arange(depth.starts[i], depth.starts[i + 1]) for i in self.requests])
        self.exit = GateExit(gate, thresholds[:n][self.rows].unsqueeze(-1))
        self.row_r = depth.token_recurrences[:n][self.rows].long()
        self.minimum = minimum
        self.exit_step = torch.zeros(n, dtype=torch.long)  # 0: running; else the recurrences it ran
        # Per block layer j: every token's latest (key, value), as its attention backend wrote them.
        self.latest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def stopped(self) -> torch.Tensor:
        return self.exit_step > 0

    def after(self, step: int, h: torch.Tensor) -> None:
        """Read the gate on the states after recurrence ``step`` (0-based); stop who it stops."""
        c = step + 1
        fires = self.exit(h[self.rows])
        if c < self.minimum:
            return
        new = fires & (self.exit_step[self.rows] == 0) & (self.row_r > c)
        if bool(new.any()):
            self.exit_step[self.rows[new]] = c
            depth = self.depth
            for i in self.requests:
                own = self.exit_step[depth.starts[i] : depth.starts[i + 1]]
                if i not in depth.dropped and bool((own > 0).all()):
                    depth.dropped.add(i)

    def record(
        self, j: int, layer: torch.nn.Module, tokens: torch.Tensor, stopped: torch.Tensor | None
    ) -> None:
        """While block layer j's ``Attention`` (``layer``) runs ``tokens``, keep the KV it writes for the
        running ones as their latest: its backend's own write is wrapped (``vllm_compat.wrap_kv_cache_update``),
        so the KV is the cache's, in whatever layout the backend stores it."""

        def keeping(write):
            def keep(attn, key, value, kv_cache, slot_mapping):
                n = len(tokens)
                running = slice(None) if stopped is None else ~stopped
                if j not in self.latest:
                    shape = (self.depth.num_tokens, *key.shape[1:])
                    self.latest[j] = (key.new_zeros(shape), value.new_zeros(shape))
                self.latest[j][0][tokens[running]] = key[:n][running]
                self.latest[j][1][tokens[running]] = value[:n][running]
                return write(attn, key, value, kv_cache, slot_mapping)

            return keep

        vllm_compat.wrap_kv_cache_update(layer, keeping)

    def refill(self, step: int, kv_slots: torch.nn.ModuleList, num_layers: int) -> None:
        """Before recurrence ``step``: every stopped token of a request still at its r gets its latest
        KV (its exit recurrence's) in this recurrence's slots, as ``_ExitKV`` gives it, written by the
        slot's backend (``vllm_compat.write_kv``)."""
        depth = self.depth
        for i in self.requests:  # each request at its own plan (its budget)
            if depth.recurrences[i] <= step:
                continue
            own = torch.arange(depth.starts[i], depth.starts[i + 1])
            own = own[self.exit_step[own] > 0]
            if len(own) == 0:
                continue
            plan = depth.request_plan(i)
            for j in range(num_layers):
                attn = kv_slots[plan.block(step, j)].attn
                key, value = self.latest[j]
                slots = depth.meta.slot_mapping[own]
                vllm_compat.write_kv(attn, key[own], value[own], slots)


__all__ = ["NULL_SLOT", "BatchDepth", "GateStops", "StepGroup", "subset_metadata"]
