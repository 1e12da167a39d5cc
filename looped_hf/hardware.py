"""Peak dense bf16 throughput of the accelerators MFU is reported for.

MFU = model FLOPs per second / the device's dense (no sparsity) bf16 peak. The numbers are the
vendors' datasheet values; a device not listed here has no known peak, and then nothing is
reported as MFU unless a recipe gives ``peak_flops`` itself.
"""

from __future__ import annotations

import torch

# Matched against torch.cuda.get_device_name() in order: the first substring that occurs wins, so
# the more specific names come first. FLOP/s, dense bf16 tensor-core peak per device.
DENSE_BF16_PEAK: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.5e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),  # SXM5 / HBM3
    ("H800", 989.4e12),
    ("A100", 312e12),
    ("A800", 312e12),
)


def peak_flops_for_name(name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of a device called ``name`` (as CUDA reports it), or None."""
    for key, peak in DENSE_BF16_PEAK:
        if key.lower() in name.lower():
            return peak
    return None


def device_peak_flops(device: torch.device | str | None = None) -> float | None:
    """The dense bf16 peak of ``device`` (default: the current CUDA device), or None where it is not
    known: CPUs, MPS, and GPUs outside the table."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))
