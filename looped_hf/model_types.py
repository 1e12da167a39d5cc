"""The classes of every checkpoint looped_hf reads, by its config.json ``model_type``
(``fileio.LOOPED_MODEL_TYPES`` is the one list of the names, read without torch):

* ``looped``: ``LoopedConfig`` / ``LoopedForCausalLM``;
* ``looped_loop_lora``: the per-loop LoRA retrofit's ``LoopLoRAConfig`` / ``LoopLoRAForCausalLM``
  (``retrofit/loop_lora.py``: the RRT share with ``--lora-rank``).

``looped_hf.register()`` registers the per-loop LoRA pair with transformers' Auto classes too (so
its folder loads without ``trust_remote_code`` where looped_hf is installed, and still with it where
looped_hf is not). Eval, test-time, publish and serve read a checkpoint through
`config_from_dict` / `load_config` / `load_causal_lm`, and train's ``init_from`` through `load_config` /
``causal_lm_class``, so a folder of either type works in each.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from .fileio import check_model_type


def looped_classes() -> dict[str, tuple[type, type]]:
    """``model_type`` -> (config class, causal-LM class), for every type in ``fileio.LOOPED_MODEL_TYPES``
    (in its order)."""
    from .configuration_looped import LoopedConfig
    from .modeling_looped import LoopedForCausalLM
    from .retrofit.loop_lora import LoopLoRAConfig, LoopLoRAForCausalLM

    return {
        LoopedConfig.model_type: (LoopedConfig, LoopedForCausalLM),
        LoopLoRAConfig.model_type: (LoopLoRAConfig, LoopLoRAForCausalLM),
    }


def causal_lm_class(config: Any) -> type:
    """The causal-LM class of a config object (a ``LoopedConfig`` or a subclass listed above)."""
    return looped_classes()[config.model_type][1]


def classes_for(config: dict[str, Any], where: str | os.PathLike) -> tuple[type, type]:
    """(config class, causal-LM class) of a raw config.json dict; another ``model_type`` is a
    ``CheckpointError`` naming ``where`` and the value (``fileio.check_model_type``)."""
    return looped_classes()[check_model_type(config, where)]


def config_from_dict(config: dict[str, Any], where: str | os.PathLike) -> Any:
    """The config object of a raw config.json dict, of its model type's class (a ``ValueError``
    naming the field for a value the class refuses)."""
    return classes_for(config, where)[0].from_dict(config)


def with_overrides(config: Any, overrides: Mapping[str, Any], *, extra: Iterable[str] = ()) -> Any:
    """A copy of ``config`` with ``overrides`` applied: the one way looped_hf changes a loaded config's
    fields (``looped-hf serve``'s flags, ``engine_args``' ``hf_overrides``, train's ``init_from``
    settings). The copy is built by the config's own class from its dict merged with ``overrides``, so
    every rule of the class checks the result and derived fields follow (``num_hidden_layers`` from
    ``num_recurrences``), and ``config`` itself is unchanged. A key that is not a field of the config
    (nor one of ``extra``, settings the caller reads beside the fields) is a ``ValueError`` naming it:
    nothing would read it. A value the class refuses raises its own one-line error."""
    fields = config.to_dict()
    allowed = set(extra)
    for key, value in overrides.items():
        if key not in fields and key not in allowed:
            also = f" (nor {', '.join(sorted(allowed))})" if allowed else ""
            raise ValueError(f"{key}={value!r}: not a {type(config).__name__} field{also}")
    return type(config).from_dict({**fields, **overrides})


def _raw_config(source: str | os.PathLike) -> dict[str, Any]:
    from transformers import PreTrainedConfig

    return PreTrainedConfig.get_config_dict(str(source))[0]


def load_config(source: str | os.PathLike, **kwargs: Any) -> Any:
    """The config of a checkpoint folder or Hub id, of its model type's class (``kwargs`` go to
    ``from_pretrained``)."""
    return classes_for(_raw_config(source), f"{source}/config.json")[0].from_pretrained(str(source), **kwargs)


def load_causal_lm(source: str | os.PathLike, **kwargs: Any) -> Any:
    """The causal LM of a checkpoint folder or Hub id, of its model type's class (``kwargs`` go to
    ``from_pretrained``: ``dtype``, ``config``, ...). A local folder's weights are checked against
    the model its config builds first (`check_weights`)."""
    config_class, model_class = classes_for(_raw_config(source), f"{source}/config.json")
    if os.path.isdir(source):
        config = kwargs.pop("config", None) or config_class.from_pretrained(str(source))
        check_weights(source, config)
        kwargs["config"] = config
    return model_class.from_pretrained(str(source), **kwargs)


def check_weights(folder: str | os.PathLike, config: Any) -> None:
    """Refuse, in one ``CheckpointError`` line, a folder whose safetensors do not hold exactly the
    weights that the causal LM of ``config`` (`causal_lm_class`) has, each in its shape and in a
    floating dtype (read from the headers and the model built on the meta device: nothing is
    allocated or read; `weight_files.check_model_weights`).

    transformers' ``from_pretrained`` would load such a folder with a report and go on: a weight
    the files lack is initialised at random, one the model lacks is dropped (config.json edited to
    fewer layers), an int8 tensor is cast, and only a shape mismatch raises. Each of these makes
    eval, test-time and publish score a model that is not the one saved. A tied weight (``lm_head``
    of a model with ``tie_word_embeddings``) may be absent, as transformers saves it. The files
    are read through `weight_files.WeightFiles`, the converters' reader too, which refuses a
    sharded folder whose index and shards disagree."""
    import torch

    from .weight_files import WeightFiles, check_model_weights

    files = WeightFiles(folder).entries
    with torch.device("meta"):
        model = causal_lm_class(config)(config)
    where = f"checkpoint {str(folder)!r}: the weights are not the model its config.json builds"
    check_model_weights(files, model, where)


__all__ = [
    "causal_lm_class",
    "check_weights",
    "classes_for",
    "config_from_dict",
    "load_causal_lm",
    "load_config",
    "looped_classes",
    "with_overrides",
]
