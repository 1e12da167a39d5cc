"""Serving looped_hf checkpoints with vLLM (docs/serving.md).

``plugin.register`` is the ``vllm.general_plugins`` entry point: vLLM calls it in each of its
processes, and it registers ``vllm_model.LoopedForCausalLM`` (lazily, by name), ``LoopedConfig`` and,
on CPU, vLLM's CPU RMSNorm kernels as an IR implementation (``cpu_norm``). ``engine_args`` (from
``engine``) gives the engine settings a looped folder needs: ``vllm.LLM(FOLDER, **engine_args(FOLDER))``.
Nothing here imports vLLM (or torch) at import time: ``import looped_hf.serving`` works without
vLLM installed, and ``check_servable`` reads only the config (``servable``: the names every module
of the package reads, a leaf, so nothing here is imported back by the modules it names).
"""

from __future__ import annotations

from typing import Any

from .servable import (
    CALL_DEPENDENT_ROPE_TYPES,
    CPU_HEAD_SIZES,
    CPU_NORM_OPS,
    CPU_NORM_PROVIDER,
    VLLM_ARCHITECTURE,
    VLLM_ARCHITECTURES,
    VLLM_MODEL_CLASS,
    check_servable,
    servable_problems,
)


def __getattr__(name: str) -> Any:
    # engine_args on first use: engine.py imports vLLM-facing names a plain ``import looped_hf.serving``
    # does not need.
    if name == "engine_args":
        from .engine import engine_args

        return engine_args
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CALL_DEPENDENT_ROPE_TYPES",
    "CPU_HEAD_SIZES",
    "CPU_NORM_OPS",
    "CPU_NORM_PROVIDER",
    "VLLM_ARCHITECTURE",
    "VLLM_ARCHITECTURES",
    "VLLM_MODEL_CLASS",
    "check_servable",
    "engine_args",
    "servable_problems",
]
