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

``_init_model_kwargs`` and the runner's request state are private to vLLM: reached through
``vllm_compat`` (listed there with the version they were read from, and tested). ``engine.engine_args`` names it (``worker_cls``, ``--worker-cls``) on CPU
for a server of more than one depth. On GPU, Model Runner V2's public ``ModelState`` is the path (docs/serving.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import vllm_compat
from .depth import RequestDepth, ServedDepth

# vLLM's own CPU worker and runner: this module is imported on CPU only (engine_args' worker_cls).
CPUWorker, CPUModelRunner = vllm_compat.cpu_worker_classes()


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

    def _depth(self, req_id: str, extra_args: dict[str, Any] | None) -> RequestDepth:
        depth = self._depths.get(req_id)
        if depth is None:
            live = vllm_compat.live_request_ids(self)
            if len(self._depths) > 2 * len(live) + 64:  # forget finished requests now and then
                self._depths = {key: value for key, value in self._depths.items() if key in live}
            # Admission checked these fields already (plugin's guard); resolve() cannot fail here.
            depth = self._depths[req_id] = self.served_depth.resolve(extra_args)
        return depth

    def step_depth_kwargs(self, num_reqs: int | None) -> dict[str, Any]:
        """This step's depth tensors (``depth_kwargs``), added to vLLM's own keyword arguments of the
        forward (``vllm_compat.add_model_kwargs``); none for a dummy run (``num_reqs`` 0: every token at
        the deepest r), a single-depth server, or a step whose requests all run the default depth."""
        served = self.served_depth
        if num_reqs == 0 or served.single_depth:
            return {}
        requests = vllm_compat.step_requests(self)
        if not requests:
            return {}
        depths = [self._depth(req_id, extra_args) for req_id, extra_args in requests]
        if all(depth == served.default for depth in depths):  # the forward's own depth: the compiled graph
            return {}
        starts = vllm_compat.step_query_starts(self, len(requests))
        return depth_kwargs(depths, np.diff(starts), served.exit_threshold is not None)


vllm_compat.add_model_kwargs(LoopedModelRunner, LoopedModelRunner.step_depth_kwargs)


class LoopedCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner is ``LoopedModelRunner`` (V1; the V2 runner does not run on CPU)."""

    def init_device(self) -> None:
        super().init_device()
        if not getattr(self, "use_v2_model_runner", False):
            self.model_runner = LoopedModelRunner(self.vllm_config, torch.device("cpu"))


__all__ = ["LoopedCPUWorker", "LoopedModelRunner", "depth_kwargs"]
