"""The distillation teacher of a run (`distill_from`): the checks a foreign folder gets before anything is
written, and its forward FLOPs per token at the r it runs (`looped_hf.trainer.DistillingTrainer` runs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from looped_hf.arguments import (
    RecipeError,
)
from looped_hf.fileio import (
    first_line,
)

#: transformers encoders whose causal-LM class is causal only with ``is_decoder: true`` (their
#: folders, saved as encoders, say false: the attention then sees the tokens to the right).
BIDIRECTIONAL_TYPES = frozenset({
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
})  # fmt: skip


def teacher_flops(folder: str, config: Any, seq_len: int) -> float:
    """The teacher's forward FLOPs per token, at the r it runs (a looped teacher's own
    ``num_recurrences``: `DistillingTrainer` calls it without one), from its config on the meta
    device, after the checks of a foreign folder (`check_teacher`). Any refusal is a `RecipeError`."""
    from looped_hf.accounting_looped import teacher_flops_per_token

    teacher = check_teacher(folder, config)
    if hasattr(teacher, "inference_flops_per_token"):  # a looped teacher: P + r*K + C layer applications
        return float(teacher.inference_flops_per_token(seq_len))
    return teacher_flops_per_token(teacher, seq_len)


def check_teacher(folder: str, config: Any) -> Any:
    """The ``distill_from`` teacher on the meta device, checked before anything is written: a
    causal LM (the class its config.json's ``architectures`` names is the one
    ``AutoModelForCausalLM`` builds, so a BERT folder or a bare ``LlamaModel`` with a random head
    is refused; an encoder config with ``is_decoder: false`` too) with the student's vocabulary.
    A local folder goes through the foreign-folder checks (`convert.loader.Checkpoint`: the
    layer count against the weight files, RoPE, the tie flag against the files,
    generation_config) and its weights are checked against the model (`weight_files.
    check_model_weights`: a tensor missing, one the model lacks as when the config drops a layer,
    a shape, a dtype; a key in two shards is refused by the reader); a looped folder as eval reads
    it (`model_types.check_weights`)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from looped_hf.convert.loader import Checkpoint, ConversionError
    from looped_hf.fileio import LOOPED_MODEL_TYPES, CheckpointError
    from looped_hf.model_types import check_weights, load_config
    from looped_hf.weight_files import WeightFiles, check_model_weights

    where = f"LoopedTrainingArguments.distill_from={folder!r}"
    local = Path(folder).is_dir()
    try:
        checkpoint = Checkpoint(folder) if local else None
        raw = checkpoint.config if checkpoint is not None else {}
        looped = raw.get("model_type") in LOOPED_MODEL_TYPES
        if looped:
            teacher_config = load_config(folder)
            check_weights(folder, teacher_config)
        else:
            if checkpoint is not None:
                checkpoint.check_layer_count()  # before a model of 10**12 layers is built
            teacher_config = AutoConfig.from_pretrained(folder)
            if checkpoint is not None:
                checkpoint.check_foreign(tie_default=bool(getattr(teacher_config, "tie_word_embeddings", False)))
        with torch.device("meta"), no_init_weights():
            teacher = AutoModelForCausalLM.from_config(teacher_config)
        if checkpoint is not None and not looped:
            architectures, name = raw.get("architectures"), type(teacher).__name__
            if not isinstance(architectures, list) or name not in architectures:
                raise RecipeError(f"{where}: config.json architectures={architectures!r}: not a causal LM (the folder "
                                  f"must hold a {name}, whose head the distillation reads)")  # fmt: skip
            check_model_weights(WeightFiles(folder).entries, teacher, f"{where}: the weights are not the model its "
                                "config.json builds")  # fmt: skip
        if teacher_config.model_type in BIDIRECTIONAL_TYPES and not getattr(teacher_config, "is_decoder", False):
            raise RecipeError(f"{where}: model_type={teacher_config.model_type!r} with is_decoder=False: a "
                              "bidirectional encoder, not a causal LM")  # fmt: skip
    except (ConversionError, CheckpointError) as err:
        raise RecipeError(f"{where}: {first_line(err)}") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        if isinstance(err, RecipeError):
            raise
        raise RecipeError(f"{where}: not a transformers causal LM folder ({first_line(err)})") from None
    vocab = teacher.get_input_embeddings().weight.shape[0]
    if vocab != config.vocab_size:
        raise RecipeError(
            f"{where}: vocab_size={vocab:,}, the student's is {config.vocab_size:,}; they must match"
        )
    return teacher
