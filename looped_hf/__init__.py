"""looped_hf: looped (depth-recurrent) language models in the HuggingFace ecosystem.

Importing the package registers ``LoopedConfig`` / ``LoopedModel`` / ``LoopedForCausalLM`` and the
standard heads with ``AutoConfig`` and the ``AutoModel*`` classes (so saved checkpoints load
without ``trust_remote_code`` when looped_hf is installed), and marks them for remote code (so
``save_pretrained`` ships the two model files and ``auto_map``, and the checkpoint loads anywhere
with ``trust_remote_code=True``). It is the plain plugin way: the registration runs once, here, at
``import looped_hf``, with ``exist_ok=True`` (vLLM's plugin entry point,
``looped_hf.serving.plugin:register``, imports this package first and registers again harmlessly);
nothing is installed into the import system.

Why eager, and the price. transformers has no lazy registration (its Auto mappings hold classes,
not import paths), so registering means importing torch and transformers (about 4 s on two cores)
in every process that imports any ``looped_hf`` module, ``looped-hf fit`` included: Python runs
this file before any submodule. The alternatives that keep ``fit`` torch-free in a full install
are an import hook (what this file used to be: a ``sys.meta_path`` finder reading CPython's
private import state, in every process, vLLM's workers included) or moving the numeric core and
the command line into a second top-level package (a new public import path for every user of
``looped_hf.scaling``). We pay the seconds instead.

What stays true: the numeric core (``looped_hf.scaling``, ``looped-hf fit``, a cached ``plan``)
imports neither torch nor transformers itself, so it runs where they are not installed: the
registration is skipped when either is missing (a numpy/scipy analysis box). Where both are
installed, a broken install raises here, at import, rather than at the first ``from_pretrained``.
The names that registration does not need (the trainer, the callbacks) load on first use through a
PEP 562 ``__getattr__``: they pull in the Trainer stack (accelerate, datasets).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from .callback import LoopedComputeCallback
    from .recurrence import RecurrenceSamplingCallback
    from .trainer import LoopedTrainer

# Public names registration does not need -> their submodule, loaded on first access.
_LAZY = {
    "LoopedComputeCallback": "callback",
    "LoopedTrainer": "trainer",
    "RecurrenceSamplingCallback": "recurrence",
}


def _model_stack_installed() -> bool:
    """Both of torch and transformers can be imported (``find_spec`` looks, it does not import)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


if _model_stack_installed():
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    from .configuration_looped import LoopedConfig
    from .modeling_looped import (
        LoopedForCausalLM,
        LoopedForQuestionAnswering,
        LoopedForSequenceClassification,
        LoopedForTokenClassification,
        LoopedModel,
        LoopedPreTrainedModel,
    )

    AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
    LoopedConfig.register_for_auto_class()
    # The trunk, the LM and the standard heads (transformers' generic ones on the looped trunk),
    # local and as remote code.
    for _auto, _model in (
        (AutoModel, LoopedModel),
        (AutoModelForCausalLM, LoopedForCausalLM),
        (AutoModelForSequenceClassification, LoopedForSequenceClassification),
        (AutoModelForTokenClassification, LoopedForTokenClassification),
        (AutoModelForQuestionAnswering, LoopedForQuestionAnswering),
    ):
        _auto.register(LoopedConfig, _model, exist_ok=True)
        _model.register_for_auto_class(_auto.__name__)
    del _auto, _model


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'looped_hf' has no attribute {name!r}")


__all__ = [
    "LoopedConfig",
    "LoopedModel",
    "LoopedPreTrainedModel",
    "LoopedForCausalLM",
    "LoopedForSequenceClassification",
    "LoopedForTokenClassification",
    "LoopedForQuestionAnswering",
    "LoopedComputeCallback",
    "LoopedTrainer",
    "RecurrenceSamplingCallback",
    "__version__",
]
