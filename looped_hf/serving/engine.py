"""The vLLM engine settings a looped checkpoint needs, and the model's check that an engine has them.

    from vllm import LLM
    from looped_hf.serving import engine_args

    llm = LLM("runs/tiny/publish", **engine_args("runs/tiny/publish", num_recurrences=8, kv_budget=2))

``engine_args`` is the one owner of these settings: ``vllm.LLM`` takes its dict as keyword arguments,
``looped-hf serve`` turns the same dict into vLLM's command-line flags (``engine_flags``), and the
vLLM model refuses, when it is built, an engine that lacks any of them (``engine_setting_problems``),
in one line naming each setting, its flag and this fix. vLLM (0.32) has no public per-model hook
that could set them when a looped folder is loaded: its per-architecture hooks are a private table
(``vllm.model_executor.models.config.MODELS_CONFIG_MAP``), ``ModelRegistry.register_model`` takes the
model class only, and vLLM reads no engine setting from a model class or its config. So they are
arguments the user passes, and an engine built without them never serves a request at a depth other
than the one it asked for: ``vllm serve FOLDER`` or ``vllm.LLM(FOLDER)`` without them stops while vLLM
builds the engine's config, before any engine process starts (``check_engine_config``, the one
entry of that private table the plugin adds, through ``vllm_compat``: it refuses, it sets nothing).

The settings, each only where the served depths need it (``depth.ServedDepth``):

- ``enable_prefix_caching=False`` when requests may run at different depths: a request at r = 2
  leaves slots 2.. empty and its coda's KV is not r = 8's, so one depth's cached prefix is not another's;
- ``enable_chunked_prefill=False`` with a ``kv_budget``: a budget below r makes a token's KV at a
  shared slot depend on which tokens shared its forward call, so prompts are prefilled whole, as
  ``generate()`` does (vLLM then raises ``max_num_batched_tokens`` to ``max_model_len`` itself);
- ``worker_cls`` on CPU when requests may run at different depths: vLLM's V1 CPU runner plus each
  request's depth in the forward (``worker``);
- ``logits_processors``: the request guard (``plugin``), whose admission check refuses a request's
  depth the server cannot honour; always, since even a server of one depth must refuse a request for
  another;
- ``ir_op_priority`` on CPU: vLLM's CPU ``_C`` kernels for ``RMSNorm`` (``cpu_norm``), which vLLM
  0.32 registers for GPUs only; a speed setting, not a correctness one, so the model does not
  require it.

Nothing here imports vLLM or torch at import time (``looped-hf serve --dry-run`` runs without vLLM).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from . import CPU_NORM_OPS, CPU_NORM_PROVIDER, check_servable
from .depth import MAX_KEY, ServedDepth
from .plugin import remember

#: The CPU worker that hands each request's depth to the model (``worker.LoopedCPUWorker``).
WORKER_CLS = "looped_hf.serving.worker.LoopedCPUWorker"


def cpu_norm_priority() -> dict[str, list[str]]:
    """vLLM's ``ir_op_priority`` (``--ir-op-priority``) that runs ``RMSNorm`` on the CPU build's ``_C``
    kernels where they take the arguments, else vLLM's PyTorch implementation. Any model served on
    CPU may use it (bench_serve gives the Llama the same)."""
    return {op: [CPU_NORM_PROVIDER, "native"] for op in CPU_NORM_OPS}


def on_cpu() -> bool:
    """Whether vLLM will run on CPU here: no CUDA device (torch is imported only for this)."""
    import torch

    return not torch.cuda.is_available()


def _served_config(model: Any, overrides: Mapping[str, Any]) -> Any:
    """``model``'s ``LoopedConfig`` (read from a folder or Hub id, or the config given, of its own class:
    a per-loop LoRA retrofit's too) with ``overrides``, the engine's ``hf_overrides``, applied by
    ``model_types.with_overrides`` (a copy; the config given is unchanged). A key that is neither a config
    field nor ``max_num_recurrences`` is refused: vLLM would set it and nothing would read it."""
    from ..configuration_looped import LoopedConfig
    from ..model_types import load_config, with_overrides

    if isinstance(model, str | os.PathLike):
        model = load_config(model)
    elif not isinstance(model, LoopedConfig):
        raise TypeError(f"model={model!r}: give a looped checkpoint's folder (or Hub id) or its LoopedConfig")
    return with_overrides(model, overrides, extra=(MAX_KEY,))


def engine_args(model: Any, *, device: str | None = None, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` (``vllm.EngineArgs``) that serving ``model`` needs.

    ``model``: a looped checkpoint's folder or Hub id, or its ``LoopedConfig``. ``overrides``: the
    served config's changes (``num_recurrences``, ``kv_budget``, ``max_num_recurrences``,
    ``exit_gate_threshold``, ...), returned as ``hf_overrides``. ``device``: ``"cpu"`` or another vLLM
    device (default: CPU when torch sees no CUDA device). The module docstring lists the settings
    and why; only the ones the served depths need are returned. Raises ``ValueError`` in one line
    naming the field for a checkpoint or override that cannot be served."""
    if isinstance(model, str | os.PathLike) and os.path.isdir(model):
        # The folder's generation_config.json sets the served default depth, as it does generate()'s.
        from ..generation_looped import saved_generation_depth

        saved = saved_generation_depth(model)
        overrides = {key: saved[key] for key in ("num_recurrences", "kv_budget") if key in saved} | overrides
    config = _served_config(model, overrides)
    cpu = device == "cpu" if device is not None else on_cpu()
    check_servable(config, device="cpu" if cpu else None)
    served = ServedDepth.from_config(config, per_request=cpu)
    args: dict[str, Any] = {}
    if not served.single_depth:
        args["enable_prefix_caching"] = False
    if served.kv_budget is not None:
        args["enable_chunked_prefill"] = False
    if cpu and not served.single_depth:
        args["worker_cls"] = WORKER_CLS
    args["logits_processors"] = [guard_processor(served)]
    if cpu:
        args["ir_op_priority"] = cpu_norm_priority()
    if overrides:
        args["hf_overrides"] = dict(overrides)
    return args


def guard_processor(served: ServedDepth) -> str:
    """The request guard of a server of ``served`` depths, as vLLM loads a logits processor by name (its
    bounds kept in this process: ``plugin.remember``)."""
    return f"{remember.__module__}:{remember(served)}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_flags(args: Mapping[str, Any]) -> list[str]:
    """``engine_args``'s dict as vLLM's command-line flags (``vllm serve``, its OpenAI server module):
    ``--no-enable-prefix-caching``, ``--worker-cls C``, ``--logits-processors P``, ``--hf-overrides
    JSON``, ``--ir-op-priority JSON``."""
    flags: list[str] = []
    for name, value in args.items():
        if isinstance(value, bool):
            flags.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        elif isinstance(value, list):
            flags += [_flag(name), *map(str, value)]
        elif isinstance(value, Mapping):
            flags += [_flag(name), json.dumps(value, separators=(",", ":"))]
        else:
            flags += [_flag(name), str(value)]
    return flags


def _resolve(qualname: str) -> Any:
    """The object a vLLM setting names by ``module.attr`` or ``module:attr``; None if it does not import."""
    module, sep, attr = qualname.rpartition(":") if ":" in qualname else qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None


def _names_guard(processor: Any, guard: str) -> bool:
    if isinstance(processor, str):
        return processor == guard or processor.replace(":", ".") == guard.replace(":", ".")
    return f"{processor.__module__}:{processor.__name__}" == guard


def engine_setting_problems(vllm_config: Any, on_cpu: bool) -> list[str]:
    """Each setting of ``engine_args`` that the engine of ``vllm_config`` lacks and that its requests'
    depths need, one line each naming the setting, why and its flag (empty: none). The vLLM model
    calls this when it is built (``on_cpu``: vLLM's platform is the CPU)."""
    served = ServedDepth.from_config(vllm_config.model_config.hf_config, per_request=on_cpu)
    problems = []
    if vllm_config.cache_config.enable_prefix_caching and not served.single_depth:
        problems.append(
            f"enable_prefix_caching=True: requests may run at different depths (num_recurrences 1 .. "
            f"{served.max_num_recurrences}, kv_budget={served.kv_budget}), and one depth's cached prefix is not "
            "another's (--no-enable-prefix-caching)"
        )
    if vllm_config.scheduler_config.enable_chunked_prefill and served.kv_budget is not None:
        problems.append(
            f"enable_chunked_prefill=True: with kv_budget={served.kv_budget} (a request's budget below its r) "
            "prompts are prefilled whole, as generate() does (--no-enable-chunked-prefill)"
        )
    worker = vllm_config.parallel_config.worker_cls
    if on_cpu and not served.single_depth:
        chosen, needed = _resolve(worker), _resolve(WORKER_CLS)
        if not (isinstance(chosen, type) and issubclass(chosen, needed)):
            problems.append(
                f"worker_cls={worker!r}: only {WORKER_CLS} (or a subclass) hands each request's depth to the "
                f"model (--worker-cls {WORKER_CLS})"
            )
    guard = guard_processor(served)
    if not any(_names_guard(p, guard) for p in vllm_config.model_config.logits_processors or ()):
        problems.append(
            f"logits_processors has no {guard}: without it a request's num_recurrences, kv_budget or "
            f"exit_threshold outside the server's bounds is not refused (--logits-processors {guard})"
        )
    return problems


def check_engine_settings(vllm_config: Any, on_cpu: bool) -> None:
    """Raise ``ValueError`` in one line naming every missing setting (``engine_setting_problems``)
    and the fix: ``engine_args`` for ``vllm.LLM``, the flags for ``vllm serve``."""
    problems = engine_setting_problems(vllm_config, on_cpu)
    if problems:
        raise ValueError(
            "this looped engine lacks settings its requests' depths need: " + "; ".join(problems)
            + ". Build it with vllm.LLM(FOLDER, **looped_hf.serving.engine_args(FOLDER, ...)), or serve it "
            "with `looped-hf serve` (it passes them)"
        )  # fmt: skip


class LoopedEngineError(RuntimeError):
    """An engine's config that cannot serve a looped folder, refused while vLLM builds it (one line).
    Not a ``ValueError``: vLLM's config is a pydantic dataclass, which folds a ``ValueError`` raised
    while it is built into a multi-line ``ValidationError``."""


def check_engine_config(vllm_config: Any) -> None:
    """vLLM's check of an engine's config for the looped architectures (``plugin.register`` adds it,
    ``vllm_compat.check_config_on_build``): run while vLLM builds the config of ``vllm serve`` or
    ``vllm.LLM``, before any engine process starts. Refuses, in one ``LoopedEngineError`` line, a config
    the model cannot serve (``check_servable``) or one built without ``engine_args``' settings
    (``engine_setting_problems``), naming ``looped-hf serve`` and ``engine_args(FOLDER)``; keeps the
    served depths as the request guard's bounds in this process (``plugin.remember``). Changes nothing."""
    model_config = vllm_config.model_config
    on_cpu = vllm_config.device_config.device_type == "cpu"
    parallel = vllm_config.parallel_config
    try:
        check_servable(model_config.hf_config, pipeline_parallel_size=parallel.pipeline_parallel_size,
                       tensor_parallel_size=parallel.tensor_parallel_size, device="cpu" if on_cpu else None)  # fmt: skip
        remember(ServedDepth.from_config(model_config.hf_config, per_request=on_cpu))
        check_engine_settings(vllm_config, on_cpu=on_cpu)
    except ValueError as err:
        _one_line_when_uncaught()
        raise LoopedEngineError(f"{model_config.model}: {err}") from None


def _one_line_when_uncaught() -> None:
    """Print an uncaught ``LoopedEngineError`` as its one line, not a traceback through vLLM's config
    code (``vllm serve FOLDER`` ends with it); any other exception goes to the hook there was."""
    previous = sys.excepthook
    if getattr(previous, "looped_hf", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        if issubclass(kind, LoopedEngineError):
            print(f"{kind.__name__}: {error}", file=sys.stderr)
        else:
            previous(kind, error, traceback)

    hook.looped_hf = True  # type: ignore[attr-defined]
    sys.excepthook = hook


__all__ = [
    "LoopedEngineError",
    "WORKER_CLS",
    "check_engine_config",
    "on_cpu",
    "check_engine_settings",
    "cpu_norm_priority",
    "engine_args",
    "engine_flags",
    "engine_setting_problems",
    "guard_processor",
]
