"""The attention backend a run uses: the study's choice per GPU family, tested with fake devices.

FA3 on Hopper, FA2 on Ampere / Ada, FA4 on Blackwell, SDPA elsewhere; a flash kernel counts as
available from its pip package or from the ``kernels`` hub build; a requested implementation is
used as given; a backend that does not load falls back to SDPA with one log line.
"""

from __future__ import annotations

import logging

import pytest
from conftest import tiny_looped_model

from looped_hf.attention_backends import (
    PACKAGES,
    AttentionBackend,
    apply_attention_backend,
    installed_packages,
    select_attention_backend,
)

NOTHING = dict.fromkeys(PACKAGES, False)


def _with(*names: str) -> dict[str, bool]:
    return {**NOTHING, **dict.fromkeys(names, True)}


@pytest.mark.parametrize(
    ("capability", "packages", "first"),
    [
        ((9, 0), _with("flash_attention_3"), "flash_attention_3"),  # H100 / H200: the study's FA3
        ((9, 0), _with("kernels"), "flash_attention_3"),  # ... from the hub build
        ((9, 0), _with("flash_attention_2"), "sdpa"),  # FA2 is not Hopper's choice: SDPA (cuDNN)
        ((8, 0), _with("flash_attention_2"), "flash_attention_2"),  # A100
        ((8, 9), _with("kernels"), "flash_attention_2"),  # L40S / RTX 4090 (Ada)
        ((8, 6), NOTHING, "sdpa"),
        ((10, 0), _with("flash_attention_4"), "flash_attention_4"),  # B200
        ((12, 0), _with("flash_attention_4", "kernels"), "sdpa"),  # consumer Blackwell: none preferred
        ((7, 5), _with("flash_attention_2", "kernels"), "sdpa"),  # Turing
        (None, _with("flash_attention_3", "kernels"), "sdpa"),  # no CUDA
    ],
)
def test_each_gpu_family_gets_its_kernel_and_sdpa_behind_it(capability, packages, first) -> None:
    candidates, reason = select_attention_backend(None, capability, packages)
    assert candidates[0] == first
    assert candidates[-1] == "sdpa", "SDPA is always the last resort"
    assert reason.startswith(first)


def test_the_reason_names_the_missing_package() -> None:
    candidates, reason = select_attention_backend("auto", (9, 0), NOTHING)
    assert candidates == ("sdpa",)
    assert "flash-attn-3" in reason and "Hopper" in reason


def test_a_requested_implementation_is_used_as_given() -> None:
    assert select_attention_backend("eager", (9, 0), _with("flash_attention_3"))[0] == ("eager",)


def test_installed_packages_reads_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    """By distribution name, with FA2's minimum version (2.3.3) applied."""
    import importlib.metadata

    versions = {"flash-attn": "2.1.0", "kernels": "0.10.0"}

    def fake_version(dist: str) -> str:
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    assert installed_packages() == {**NOTHING, "kernels": True}
    versions["flash-attn"] = "2.8.3"
    assert installed_packages()["flash_attention_2"] is True


def test_a_kernel_that_does_not_load_falls_back_to_sdpa_with_one_log_line(caplog) -> None:
    """Here the fake Hopper claims FA3 but this machine has no FA3 (nor CUDA): transformers
    refuses it, the model keeps working on SDPA, and one warning says what happened."""
    model = tiny_looped_model()
    model.set_attn_implementation("eager")
    with caplog.at_level(logging.INFO, logger="looped_hf.attention_backends"):
        backend = apply_attention_backend(model, capability=(9, 0), packages=_with("flash_attention_3"))
    assert backend.implementation == "sdpa" == model.config._attn_implementation
    assert backend.candidates == ("flash_attention_3", "sdpa")
    assert "flash_attention_3 failed to load" in backend.reason
    lines = [r for r in caplog.records if r.name == "looped_hf.attention_backends"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    record = backend.to_record()
    assert record["implementation"] == "sdpa" and record["device"].endswith("(sm90)")


def test_on_this_cpu_the_choice_is_sdpa_and_recorded() -> None:
    model = tiny_looped_model()
    backend = apply_attention_backend(model)
    assert backend == AttentionBackend("sdpa", "sdpa (no CUDA device)", "cpu", ("sdpa",))
    assert backend.to_record() == {"implementation": "sdpa", "reason": "sdpa (no CUDA device)", "device": "cpu",
                                   "candidates": ["sdpa"]}  # fmt: skip


def test_a_requested_implementation_that_fails_raises() -> None:
    with pytest.raises((ImportError, ValueError)):
        apply_attention_backend(tiny_looped_model(), "flash_attention_2", capability=(8, 0), packages=NOTHING)
