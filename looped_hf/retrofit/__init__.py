"""Retrofit a pretrained dense transformers LM into a looped one: ``looped-hf retrofit PARENT_DIR``.

Two published methods, over one core (``core.py``: read the parent tensor by tensor, build the
looped model, write a Hub-ready folder with ``retrofit.json`` and a card naming the parent):

* retrofitted recurrence (McLeish et al. 2025): ``--layers P,R,C`` / explicit ranges (prelude,
  recurrent block, coda; the layers between prelude and block dropped) or ``--loop-in-place``
  (every layer kept), with a ``[state; embedding]`` adapter (``--adapter-init``) and the paper's
  initial state (``--state-init``);
* Relaxed Recursive Transformers (Bae et al. 2024): ``--share stepwise|average|lower --blocks K``,
  optionally ``--lora-rank N`` (a LoRA per loop position from the SVD of the residual,
  ``lora_init.py``; the model type is ``looped_hf/loop_lora_looped.py``).

The layer choices are small functions in ``plan.py``; each parent family is one module
(``llama.py``: Llama, Mistral; ``qwen.py``: Qwen2, Qwen3; ``olmo2.py``), mapped by the config's
``architectures`` name. See docs/retrofit.md.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names -> their submodule, loaded on first access: a command package, imported only by the
# command that runs it (the converters and the publisher behind ``core`` are heavy).
_LAZY = {
    "ConversionError": "..convert.common",
    "main": ".cli",
    "FAMILIES": ".core",
    "build_retrofit": ".core",
    "default_out": ".core",
    "retrofit": ".core",
    "LayerPlan": ".plan",
    "explicit": ".plan",
    "loop_in_place": ".plan",
    "paper_rule": ".plan",
    "share": ".plan",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "FAMILIES",
    "ConversionError",
    "LayerPlan",
    "build_retrofit",
    "default_out",
    "explicit",
    "loop_in_place",
    "main",
    "paper_rule",
    "retrofit",
    "share",
]
