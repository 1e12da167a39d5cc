"""Which attention kernel a training run uses, chosen the way the study's loop chooses it.

The study (nanochat/flash_attention.py) runs FlashAttention-3 on Hopper and PyTorch SDPA
elsewhere; looped_hf adds FlashAttention-2 on Ampere / Ada (sm80-sm89, where FA2 is the fastest
kernel with a backward) and FlashAttention-4 on Blackwell (sm100+, its CuTe kernels' target).
Everything goes through transformers' attention registry: ``flash_attention_2/3/4`` are
transformers' own integrations, which also take the hub kernel (``kernels-community/...``) when
the ``kernels`` package is installed and the pip package is not. A backend that is not installed
or does not load falls back to SDPA with one log line; SDPA gets the causal fast path from the
model itself (no materialised mask for unpadded rows, see ``interface_looped.causal_attention_mask``).

``select_attention_backend`` is the pure decision (device capability and installed packages in,
an ordered list of candidates out), so it is tested on a CPU with any fake GPU;
``apply_attention_backend`` detects the machine, tries the candidates on a model and returns what
was used, for the run record.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from packaging import version

logger = logging.getLogger(__name__)

# The pip distributions that provide each transformers implementation ("kernels" provides all
# three from the Hub). FA2 below 2.3.3 is refused by transformers itself.
PACKAGES: dict[str, str] = {
    "flash_attention_2": "flash-attn",
    "flash_attention_3": "flash-attn-3",
    "flash_attention_4": "flash-attn-4",
    "kernels": "kernels",
}
_FA2_MIN = version.parse("2.3.3")

# What each architecture family prefers, fastest first (compute capability major version).
_PREFERRED: dict[int, tuple[str, ...]] = {
    8: ("flash_attention_2",),  # Ampere sm80/86/87, Ada sm89
    9: ("flash_attention_3",),  # Hopper sm90 (the study's choice)
    10: ("flash_attention_4",),  # Blackwell datacenter sm100/103
}
_FAMILY = {8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell"}


@dataclass(frozen=True)
class AttentionBackend:
    """The attention implementation chosen for a run and why (kept in the run record).

    ``implementation``: what the model was given (``sdpa``, ``flash_attention_3``, or the
    requested name). ``candidates``: what was tried, best first. ``reason``: one line for the log
    and the record. ``device``: the GPU and its compute capability, or ``cpu``.
    """

    implementation: str
    reason: str
    device: str
    candidates: tuple[str, ...] = field(default_factory=tuple)

    def to_record(self) -> dict[str, object]:
        """JSON-ready fields for the run record."""
        record = asdict(self)
        record["candidates"] = list(self.candidates)
        return record


def installed_packages() -> dict[str, bool]:
    """Which of ``PACKAGES`` are installed (by distribution name, so FA2's and FA4's shared
    ``flash_attn`` import name cannot be mistaken for each other)."""
    found = {}
    for key, dist in PACKAGES.items():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[key] = False
            continue
        found[key] = key != "flash_attention_2" or _version_at_least(installed, _FA2_MIN)
    return found


def _version_at_least(text: str, minimum: version.Version) -> bool:
    try:
        return version.parse(text) >= minimum
    except version.InvalidVersion:
        return False


def device_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA ``device`` (default: the current one), or
    None for CPUs, MPS and machines without CUDA."""
    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def select_attention_backend(
    requested: str | None, capability: tuple[int, int] | None, packages: Mapping[str, bool]
) -> tuple[tuple[str, ...], str]:
    """The implementations to try, best first (always ending in ``sdpa`` unless one was
    requested), and one line saying why.

    ``requested`` (a recipe's or caller's ``attn_implementation``) wins as given, except
    ``None`` / ``"auto"``, which choose by ``capability`` ((major, minor) or None without CUDA) and
    the installed ``packages`` (``installed_packages()``'s keys): a preferred flash kernel is a
    candidate when its pip package or ``kernels`` (the hub build) is installed.
    """
    if requested not in (None, "auto"):
        return (requested,), f"{requested} (requested)"
    if capability is None:
        return ("sdpa",), "sdpa (no CUDA device)"
    major, minor = capability
    family = _FAMILY.get(major, f"sm{major}{minor}")
    preferred = _PREFERRED.get(major, ())
    usable = tuple(impl for impl in preferred if packages.get(impl) or packages.get("kernels"))
    if usable:
        source = "pip" if packages.get(usable[0]) else "kernels hub build"
        return (*usable, "sdpa"), f"{usable[0]} ({family} sm{major}{minor}, {source})"
    if preferred:
        missing = " or ".join(f"{PACKAGES[impl]}" for impl in preferred)
        return ("sdpa",), f"sdpa ({family} sm{major}{minor}: {missing} not installed, nor kernels)"
    return ("sdpa",), f"sdpa (sm{major}{minor}: no flash kernel preferred there)"


def _device_name(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return "cpu"
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    return f"{name} (sm{capability[0]}{capability[1]})"


def apply_attention_backend(
    model: torch.nn.Module,
    requested: str | None = None,
    *,
    capability: tuple[int, int] | None | str = "detect",
    packages: Mapping[str, bool] | None = None,
) -> AttentionBackend:
    """Set the best available attention implementation on ``model`` (a transformers model) and
    return what was used; logs one line. A candidate that fails to load (missing CUDA build, hub
    kernel not downloadable offline) falls through to the next, ending at SDPA; a requested
    implementation that fails raises, since the caller asked for exactly that one.

    ``capability`` / ``packages`` default to this machine's (tests pass fakes).
    """
    cap = device_capability() if capability == "detect" else capability
    found = installed_packages() if packages is None else packages
    candidates, reason = select_attention_backend(requested, cap, found)
    failures = []
    for impl in candidates:
        try:
            model.set_attn_implementation(impl)
        except (ImportError, ValueError, RuntimeError, OSError) as err:
            if requested not in (None, "auto"):
                raise
            failures.append(f"{impl} failed to load: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        used = getattr(model.config, "_attn_implementation", impl)
        if failures:
            reason = f"{used} ({'; '.join(failures)})"
        backend = AttentionBackend(
            implementation=used, reason=reason, device=_device_name(cap), candidates=candidates
        )
        # A GPU that has a faster kernel than the one used says so louder (the one line a missing
        # package costs); the expected choice is informational.
        fell_back = used == "sdpa" and cap is not None and cap[0] in _PREFERRED
        logger.log(logging.WARNING if fell_back else logging.INFO, "attention backend: %s", backend.reason)
        return backend
    raise RuntimeError(f"no attention implementation could be set: {'; '.join(failures)}")
