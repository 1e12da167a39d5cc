"""looped_hf: looped (depth-recurrent) language models in the HuggingFace ecosystem.

Importing the package makes ``LoopedConfig`` / ``LoopedForCausalLM`` (and the standard heads)
known to ``AutoConfig`` and the ``AutoModel*`` classes (so saved checkpoints load without
``trust_remote_code`` when looped_hf is installed) and marks them for remote code (so
``save_pretrained`` ships the two model files and ``auto_map``, and the checkpoint loads anywhere
with ``trust_remote_code=True``).

The registration is deferred, not dropped: ``import looped_hf`` imports neither torch nor
transformers, so the numpy/scipy parts (``looped-hf fit``, the scaling package) start in a
fraction of a second; Python runs this file before any ``looped_hf.*`` submodule, so an eager
registration here would put ~3.5 s of torch and transformers in front of every fit. The Auto
classes are registered, with no call from the user, as soon as the program uses transformers'
Auto machinery or looped_hf's model classes:

- at once, if transformers' Auto classes are already imported;
- else when an import of a ``transformers.*`` or ``looped_hf.*`` module completes while
  transformers' Auto configuration module or looped_hf's configuration module is loaded, and no
  other module of either package is half-way through its own import (registering then would
  import ``modeling_looped`` against a half-initialised transformers: transformers imports its
  Auto modules from inside ``modeling_utils``);
- on first access of a model class through this package (``looped_hf.LoopedForCausalLM``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from .callback import LoopedComputeCallback
    from .configuration_looped import LoopedConfig
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

# Public name -> the submodule that defines it; loaded on first use (``import looped_hf`` stays
# torch-free, see the module docstring).
_LAZY = {
    "LoopedConfig": "configuration_looped",
    "LoopedModel": "modeling_looped",
    "LoopedPreTrainedModel": "modeling_looped",
    "LoopedForCausalLM": "modeling_looped",
    "LoopedForSequenceClassification": "modeling_looped",
    "LoopedForTokenClassification": "modeling_looped",
    "LoopedForQuestionAnswering": "modeling_looped",
    "LoopedComputeCallback": "callback",
    "LoopedTrainer": "trainer",
    "RecurrenceSamplingCallback": "recurrence",
}

# Either module loaded means the program works with models: time to register.
_TRIGGERS = ("transformers.models.auto.configuration_auto", f"{__name__}.configuration_looped")
_registered = False


def _register_auto_classes() -> None:
    """Register the looped classes with transformers' Auto classes and for remote code (once)."""
    global _registered
    if _registered:
        return
    _registered = True  # set first: the imports below re-enter the import hook
    try:
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
    except BaseException:
        _registered = False  # retried at the next trigger
        raise
    AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
    AutoModel.register(LoopedConfig, LoopedModel, exist_ok=True)
    AutoModelForCausalLM.register(LoopedConfig, LoopedForCausalLM, exist_ok=True)
    LoopedConfig.register_for_auto_class()
    LoopedModel.register_for_auto_class("AutoModel")
    LoopedForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    # The standard heads (transformers' generic ones on the looped trunk), local and as remote code.
    for auto, head in (
        (AutoModelForSequenceClassification, LoopedForSequenceClassification),
        (AutoModelForTokenClassification, LoopedForTokenClassification),
        (AutoModelForQuestionAnswering, LoopedForQuestionAnswering),
    ):
        auto.register(LoopedConfig, head, exist_ok=True)
        head.register_for_auto_class(auto.__name__)
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def _watched(name: str) -> bool:
    return name == "transformers" or name.startswith(("transformers.", f"{__name__}."))


def _safe_to_register(finishing: str | None) -> bool:
    """Whether registering now imports nothing half-initialised: no transformers or looped_hf
    module (other than ``finishing``, whose code has run, and this package) is mid-import."""
    for name, module in list(sys.modules.items()):
        if name in (finishing, __name__) or not _watched(name):
            continue
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False):
            return False
    return True


def _maybe_register(finishing: str | None = None) -> None:
    if _registered or not any(t in sys.modules for t in _TRIGGERS) or not _safe_to_register(finishing):
        return
    if finishing is None:
        _register_auto_classes()
        return
    try:
        _register_auto_classes()
    except (ImportError, AttributeError):
        pass  # something it needs is mid-import after all: the next completed import retries


class _RegisterWhenReady(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader of each ``transformers.*`` / ``looped_hf.*``
    module so that, after the module's code has run, :func:`_maybe_register` is tried."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if _registered or not _watched(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        # Path-based loaders are one instance per module, so the wrapper is set on that instance
        # (the module's __loader__ stays the real loader); shared loaders are left alone.
        if exec_module is None or not isinstance(loader, _PATH_LOADERS):
            return spec

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _maybe_register(fullname)

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


_PATH_LOADERS = (
    importlib.machinery.SourceFileLoader,
    importlib.machinery.SourcelessFileLoader,
    importlib.machinery.ExtensionFileLoader,
)
_HOOK = _RegisterWhenReady()
_maybe_register()
if not _registered:
    sys.meta_path.insert(0, _HOOK)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        if _LAZY[name] in ("configuration_looped", "modeling_looped"):
            _maybe_register()
        return value
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
