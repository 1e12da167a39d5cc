"""looped_hf: looped (depth-recurrent) language models in the HuggingFace ecosystem.

Importing the package registers ``LoopedConfig`` / ``LoopedForCausalLM`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (so saved checkpoints load without ``trust_remote_code`` when looped_hf
is installed) and marks them for remote code (so ``save_pretrained`` ships the two model files
and ``auto_map``, and the checkpoint loads anywhere with ``trust_remote_code=True``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

__version__ = "0.1.0"

AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
AutoModel.register(LoopedConfig, LoopedModel, exist_ok=True)
AutoModelForCausalLM.register(LoopedConfig, LoopedForCausalLM, exist_ok=True)
LoopedConfig.register_for_auto_class()
LoopedModel.register_for_auto_class("AutoModel")
LoopedForCausalLM.register_for_auto_class("AutoModelForCausalLM")
# The standard heads (transformers' generic ones on the looped trunk), local and as remote code.
for _auto, _head in (
    (AutoModelForSequenceClassification, LoopedForSequenceClassification),
    (AutoModelForTokenClassification, LoopedForTokenClassification),
    (AutoModelForQuestionAnswering, LoopedForQuestionAnswering),
):
    _auto.register(LoopedConfig, _head, exist_ok=True)
    _head.register_for_auto_class(_auto.__name__)

if TYPE_CHECKING:
    from .callback import LoopedComputeCallback
    from .recurrence import RecurrenceSamplingCallback
    from .trainer import LoopedTrainer

# Heavier pieces (Trainer, datasets) load on first use, so `import looped_hf` stays quick.
_LAZY = {
    "LoopedComputeCallback": "callback",
    "LoopedTrainer": "trainer",
    "RecurrenceSamplingCallback": "recurrence",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

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
