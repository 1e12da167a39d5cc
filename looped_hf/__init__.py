"""looped_hf: looped (depth-recurrent) language models in the HuggingFace ecosystem.

``register()`` makes ``LoopedConfig`` / ``LoopedModel`` / ``LoopedForCausalLM`` and the standard
heads known to ``AutoConfig`` and the ``AutoModel*`` classes (so saved checkpoints load without
``trust_remote_code`` when looped_hf is installed), and marks them for remote code (so
``save_pretrained`` ships the model files and ``auto_map``, and the checkpoint loads anywhere with
``trust_remote_code=True``). It imports torch and transformers (about 4 s of CPU on two cores),
runs once per process (``exist_ok=True``: vLLM's plugin entry point,
``looped_hf.serving.plugin:register``, imports this package and registers again harmlessly), and
runs:

- at ``import looped_hf``, the plain plugin way (the README's quick start), where torch and
  transformers are installed; skipped where either is missing (a numpy/scipy analysis box);
- else on first use of a model name (``looped_hf.LoopedConfig``, ``from looped_hf import
  LoopedForCausalLM``): PEP 562 ``__getattr__``. Every command of the package reaches the model
  through these names, so whatever builds, loads or saves a model registers first.

The one process that skips the registration at import is the ``looped-hf`` console script running
a command that needs no model (``fit``, a cached ``plan``, the help): its launcher
(``looped_hf_launcher``, a module outside this package, since Python runs this file before any
``looped_hf.*`` module) sets ``defer_registration`` before it imports the package, and this file
reads it through ``sys.modules``. Nothing is installed into the import system. The price:
``import looped_hf.scaling`` in your own Python process imports torch and transformers where they
are installed (the scaling modules themselves import neither, and run where they are missing).
docs/development.md gives the measurements behind this choice.

The names that registration does not need (the trainer, the callbacks) also load on first use:
they pull in the Trainer stack (accelerate, datasets).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from .callback import LoopedComputeCallback
    from .configuration_looped import LoopedConfig
    from .depth import at_depth
    from .modeling_looped import (
        LoopedForCausalLM,
        LoopedForQuestionAnswering,
        LoopedForSequenceClassification,
        LoopedForTokenClassification,
        LoopedModel,
        LoopedPreTrainedModel,
    )
    from .recurrence import RecurrenceSamplingCallback
    from .trainer import LoopedTrainer

# The model's public names -> their module: bound in this module by `register()`, which reading one
# runs first.
_MODEL_NAMES = {
    "LoopedConfig": "configuration_looped",
    "LoopedModel": "modeling_looped",
    "LoopedPreTrainedModel": "modeling_looped",
    "LoopedForCausalLM": "modeling_looped",
    "LoopedForSequenceClassification": "modeling_looped",
    "LoopedForTokenClassification": "modeling_looped",
    "LoopedForQuestionAnswering": "modeling_looped",
}
# Public names registration does not need -> their submodule, loaded on first access.
_LAZY = {
    "LoopedComputeCallback": "callback",
    "LoopedTrainer": "trainer",
    "RecurrenceSamplingCallback": "recurrence",
    # Imports neither torch nor transformers: a depth for any registered looped class (depth.py).
    "at_depth": "depth",
}
# The console script's launcher (looped_hf_launcher); its `defer_registration` is read at import.
_LAUNCHER = "looped_hf_launcher"
_registered = False


def register() -> None:
    """Register the looped config, trunk, LM and heads with transformers' Auto API, local and as
    remote code; idempotent. Runs at ``import looped_hf`` (see the module docstring for when not);
    call it yourself only after ``looped-hf``'s launcher deferred it, or let a model name do it."""
    global _registered
    if _registered:
        return
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
    )

    AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
    LoopedConfig.register_for_auto_class()
    # The trunk, the LM and the standard heads (transformers' generic ones on the looped trunk),
    # local and as remote code.
    for auto, model in (
        (AutoModel, LoopedModel),
        (AutoModelForCausalLM, LoopedForCausalLM),
        (AutoModelForSequenceClassification, LoopedForSequenceClassification),
        (AutoModelForTokenClassification, LoopedForTokenClassification),
        (AutoModelForQuestionAnswering, LoopedForQuestionAnswering),
    ):
        auto.register(LoopedConfig, model, exist_ok=True)
        model.register_for_auto_class(auto.__name__)
    # The per-loop LoRA retrofit (model_types.py), local only: its save_pretrained writes its own
    # remote code and auto_map (retrofit/loop_lora.py), so its classes are not marked for remote code.
    from .retrofit.loop_lora import LoopLoRAConfig, LoopLoRAForCausalLM

    AutoConfig.register(LoopLoRAConfig.model_type, LoopLoRAConfig, exist_ok=True)
    AutoModelForCausalLM.register(LoopLoRAConfig, LoopLoRAForCausalLM, exist_ok=True)
    globals().update(
        {name: getattr(sys.modules[f"{__name__}.{module}"], name) for name, module in _MODEL_NAMES.items()}
    )
    _registered = True


def _register_at_import() -> bool:
    """Torch and transformers are installed (``find_spec`` looks, it does not import), and the
    ``looped-hf`` launcher did not defer the registration to a model name's first use."""
    if getattr(sys.modules.get(_LAUNCHER), "defer_registration", False):
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


if _register_at_import():
    register()


def __getattr__(name: str) -> Any:
    if name in _MODEL_NAMES:
        register()  # binds the model names in this module's globals
        return globals()[name]
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'looped_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODEL_NAMES, *_LAZY})


# Spelled out (not built from the tables above) so that type checkers and IDEs read it.
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
    "at_depth",
    "register",
    "__version__",
]
