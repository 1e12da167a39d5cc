"""Recipes: the dataclasses a training run is made of, and YAML loading with validation.

A recipe is one flat YAML mapping whose keys are the fields of three dataclasses, parsed with
`transformers.HfArgumentParser` (the same convention as TRL / alignment-handbook recipes):

- `ModelArguments` (below): the `LoopedConfig` fields a recipe chooses; vocabulary size and
  special tokens come from the tokenizer; `max_position_embeddings` is at least 2048 (not tied to `seq_len`).
- `looped_hf.data.DataArguments`: corpus, tokenizer, `seq_len`, held-out split.
- `LoopedTrainingArguments` (below): `transformers.TrainingArguments` plus the study's optimizer,
  schedule and a training length in tokens or FLOPs.

Command-line flags (`--num_recurrences 8`) override the file. Every value is checked for its
field's type and range (`check_value`: `FIELD_LIMITS`, `field_choices`, finite numbers) before
any dataclass is built, then the dataclasses check how fields go together. An unknown key, a
value of the wrong kind or range, or a budget that cannot buy one optimizer step fails before
any training with one line that names the recipe field and its value (and the file's line);
`looped-hf train RECIPE --check` runs every check and trains nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import functools
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from looped_hf.configuration_looped import INIT_SCHEMES, QK_NORMS, LoopedConfig
from looped_hf.fileio import yaml_load

OPTIMIZERS = ("adamw", "muon", "muonh")
LR_SCALINGS = ("hyperp", "none")
# The study's AdamW settings under MuonH (nanochat/gpt.py setup_optimizer: betas (0.8, 0.95),
# eps 1e-10), and TrainingArguments' own for the other optimizers: the value of each field a
# recipe leaves unset (null). A value the recipe writes is kept, even one equal to a default.
MUONH_ADAM = {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-10}
TRAINER_ADAM = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
# Fields read only by muonh (set with another optimizer, they would be silently unused).
MUONH_ONLY_FIELDS = ("embedding_learning_rate", "lm_head_learning_rate", "norm_learning_rate")
LR_SCHEDULES = ("study", "trainer")
# The keys that set a run's length; a command-line flag for one of them replaces the others
# given in the file ("flags override the file" would otherwise produce a conflict error).
LENGTH_FIELDS = ("max_steps", "train_tokens", "train_flops_budget")
# How a token target becomes whole optimizer steps (`steps_for_tokens`): up = ceil, nearest = round.
STEPS_ROUNDINGS = ("up", "nearest")


class RecipeError(ValueError):
    """A recipe (YAML file or flags) that cannot be trained; the message names the field."""


def _attention_functions() -> list[str]:
    # Imported here: the registry lives in modeling_utils, which recipe parsing need not load.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sorted(ALL_ATTENTION_FUNCTIONS)


def _known_attention(name: str) -> bool:
    """Whether transformers can be asked for ``name`` (whether its kernel is installed is found
    when the model is built, with a fallback only for the automatic choice)."""
    return name in ("auto", "eager") or name in _attention_functions() or "/" in name.strip("/")


@dataclass
class ModelArguments:
    """The model half of a recipe: `LoopedConfig` fields (see that class for their meaning).

    `vocab_size`, `bos/eos/pad_token_id` come from the tokenizer, so a recipe cannot contradict
    its own data; `max_position_embeddings` defaults to max(seq_len, 2048).
    """

    hidden_size: int = field(default=64, metadata={"help": "Width d (residual stream)."})
    num_attention_heads: int | None = field(
        default=None, metadata={"help": "Query heads; None = hidden_size // head_dim."}
    )
    head_dim: int | None = field(
        default=None, metadata={"help": "Per-head width; None = hidden_size // heads."}
    )
    num_key_value_heads: int | None = field(default=None, metadata={"help": "KV heads (GQA); None = heads."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP width; None = 4d (relu2)."})
    hidden_act: str = field(
        default="relu2", metadata={"help": "relu2 (study), silu, gelu, gelu_pytorch_tanh."}
    )
    num_prelude_layers: int = field(default=2, metadata={"help": "P: unique layers before the loop."})
    num_recurrent_layers: int = field(default=4, metadata={"help": "K: layers of the shared block."})
    num_coda_layers: int = field(default=2, metadata={"help": "C: unique layers after the loop."})
    num_recurrences: int = field(default=4, metadata={"help": "r: passes through the block."})
    input_injection: str = field(default="linear", metadata={"help": "linear, add, none, hyperconnection."})
    num_hyperconnection_lanes: int = field(default=2, metadata={"help": "Lanes for hyperconnection."})
    state_init: str | None = field(
        default=None, metadata={"help": "h_0: prelude, zeros, noise; None = the study's (0 for add, else e)."}
    )
    backprop_recurrences: int | None = field(
        default=None, metadata={"help": "k: backprop through the last k recurrences only; None = all."}
    )
    recurrence_norm: bool = field(default=True, metadata={"help": "RMSNorm after every recurrence."})
    qk_norm: str = field(
        default="after_rope",
        metadata={"help": "after_rope (the study: parameter-free RMSNorm of q and k after RoPE), "
                  "learnable_before_rope (looped_hf 0.1.0's learnable per-head scale), or none. "
                  "true / false are read as after_rope / none."},
    )  # fmt: skip
    init_scheme: str = field(
        default="hf",
        metadata={"choices": INIT_SCHEMES, "help": "hf: transformers' normal(0, initializer_range); study: the study's init "
                  "(embedding N(0,1), lm_head N(0,0.001), uniform 1/sqrt(fan-in) matrices)."},
    )  # fmt: skip
    logit_softcap: float | None = field(default=15.0, metadata={"help": "tanh soft-cap of the logits."})
    embedding_norm: bool = field(default=True, metadata={"help": "RMSNorm after the embedding."})
    tie_word_embeddings: bool = field(default=False, metadata={"help": "Share embedding and lm_head."})
    initializer_range: float = field(default=0.02, metadata={"help": "Std of the normal weight init."})
    max_position_embeddings: int | None = field(
        default=None, metadata={"help": "None = max(seq_len, 2048), LoopedConfig's default."}
    )
    pad_vocab_size_to_multiple_of: int = field(
        default=1,
        metadata={"help": "Embedding and head rows: the vocabulary rounded up to this multiple (the study: 64; "
                  "logits keep vocab_size columns; the padded head rows count in the FLOPs). 1: no padding."},
    )  # fmt: skip
    rope_table_dtype: str | None = field(
        default=None,
        metadata={
            "help": "None: full-precision rotary tables; bfloat16: rounded to bf16, as the study's model."
        },
    )

    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention kernel. None / auto: the study's rule (FlashAttention-3 on Hopper, -2 on "
                  "Ampere/Ada, -4 on Blackwell when installed, else sdpa), logged and kept in the run "
                  "record; or a transformers name (eager, sdpa, flash_attention_2, ...) or a hub kernel "
                  "(org/repo), used as given."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.attn_implementation is not None and not _known_attention(self.attn_implementation):
            raise RecipeError(
                f"ModelArguments.attn_implementation={self.attn_implementation!r}: must be auto, eager, one of "
                f"transformers' attention functions ({', '.join(_attention_functions())}) or a hub kernel org/repo"
            )
        # Recipes written for looped_hf 0.1.0 say `qk_norm: true/false` (YAML booleans, or the
        # strings a command-line flag gives): read them as the study's form / off.
        if isinstance(self.qk_norm, bool) or str(self.qk_norm).lower() in ("true", "false"):
            self.qk_norm = "after_rope" if str(self.qk_norm).lower() == "true" else "none"
        if self.qk_norm not in QK_NORMS:
            raise RecipeError(
                f"ModelArguments.qk_norm={self.qk_norm!r}: must be one of {QK_NORMS} (or true/false)"
            )
        check_declared_fields(self)

    def to_config(
        self,
        vocab_size: int,
        seq_len: int,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> LoopedConfig:
        """Build the `LoopedConfig`; its own validation errors name the offending field."""
        heads, head_dim = self.num_attention_heads, self.head_dim
        if heads is None:
            if head_dim is None:
                raise RecipeError(
                    "ModelArguments.num_attention_heads=None: give num_attention_heads or head_dim"
                )
            if self.hidden_size % head_dim:
                raise RecipeError(
                    f"ModelArguments.head_dim={head_dim}: does not divide hidden_size={self.hidden_size}"
                )
            heads = self.hidden_size // head_dim
        # Not the training seq_len: RoPE has no learned table, and lm-eval / pipelines truncate every
        # context to max_position_embeddings, so a model trained on 64-token blocks would accept
        # only 64 tokens. LoopedConfig's default (2048) unless the data is longer.
        max_pos = self.max_position_embeddings or max(seq_len, LoopedConfig.max_position_embeddings)
        if max_pos < seq_len:
            raise RecipeError(
                f"ModelArguments.max_position_embeddings={max_pos}: smaller than seq_len={seq_len}"
            )
        try:
            return LoopedConfig(
                vocab_size=vocab_size,
                hidden_size=self.hidden_size,
                num_attention_heads=heads,
                head_dim=head_dim,
                num_key_value_heads=self.num_key_value_heads,
                intermediate_size=self.intermediate_size,
                hidden_act=self.hidden_act,
                max_position_embeddings=max_pos,
                num_prelude_layers=self.num_prelude_layers,
                num_recurrent_layers=self.num_recurrent_layers,
                num_coda_layers=self.num_coda_layers,
                num_recurrences=self.num_recurrences,
                input_injection=self.input_injection,
                num_hyperconnection_lanes=self.num_hyperconnection_lanes,
                state_init=self.state_init,
                backprop_recurrences=self.backprop_recurrences,
                recurrence_norm=self.recurrence_norm,
                qk_norm=self.qk_norm,
                init_scheme=self.init_scheme,
                logit_softcap=self.logit_softcap,
                embedding_norm=self.embedding_norm,
                tie_word_embeddings=self.tie_word_embeddings,
                initializer_range=self.initializer_range,
                pad_vocab_size_to_multiple_of=self.pad_vocab_size_to_multiple_of,
                rope_table_dtype=self.rope_table_dtype,
                bos_token_id=bos_token_id,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            )
        except ValueError as err:
            if isinstance(err, RecipeError):
                raise
            raise RecipeError(str(err)) from err


@dataclass
class LoopedTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the study's optimizer and schedule, and a run length in tokens/FLOPs.

    `output_dir` is the RUN directory: the final model, tokenizer, `run_record.json` and
    `recipe.yaml` go there; Trainer checkpoints go to `<output_dir>/checkpoints/`.
    Give at most one of `max_steps`, `train_tokens`, `train_flops_budget`.
    """

    output_dir: str | None = field(default="runs/looped", metadata={"help": "The run directory."})
    # Unset (None) until __post_init__ knows the optimizer: so a value the recipe writes, even
    # TrainingArguments' own 0.9, is told apart from one it leaves to the optimizer's default.
    adam_beta1: float | None = field(
        default=None, metadata={"help": "AdamW beta1; unset: 0.9, the study's 0.8 under muonh."}
    )
    adam_beta2: float | None = field(
        default=None, metadata={"help": "AdamW beta2; unset: 0.999, the study's 0.95 under muonh."}
    )
    adam_epsilon: float | None = field(
        default=None, metadata={"help": "AdamW epsilon; unset: 1e-8, the study's 1e-10 under muonh."}
    )
    optimizer: str = field(
        default="adamw",
        metadata={"choices": OPTIMIZERS,
            "help": "adamw (default): AdamW over every parameter at learning_rate. muon: torch's Muon for the "
            "2-D weights inside the layers at muon_learning_rate, AdamW (learning_rate) for the rest. muonh: "
            "the study's HyperP recipe (nanochat/optim.py): MuonH for the 2-D weights inside the layers and "
            "the injection adapter (Nesterov 0.95, Polar-Express, update scaled to and weight projected back "
            "onto its initial Frobenius norm, no weight decay) at muon_learning_rate; AdamW groups lm_head, "
            "embedding, norm scales and hyperconnection gains at their own *_learning_rate; adam_beta1/2 and "
            "adam_epsilon left unset are the study's 0.8, 0.95, 1e-10 (a value the recipe sets is kept); "
            "learning_rate and weight_decay are not used (an error if set)."
        },
    )
    muon_learning_rate: float = field(
        default=0.014,
        metadata={
            "help": "Matrix lr of muon / muonh (the study's 0.014, scripts/base_train.py --matrix-lr)."
        },
    )
    embedding_learning_rate: float = field(
        default=0.3, metadata={"help": "muonh: AdamW lr of the token embedding (the study's 0.3)."}
    )
    lm_head_learning_rate: float = field(
        default=0.004, metadata={"help": "muonh: AdamW lr of lm_head (the study's unembedding lr 0.004)."}
    )
    norm_learning_rate: float = field(
        default=0.005, metadata={"help": "muonh: AdamW lr of every RMSNorm scale (the study's 0.005)."}
    )
    hyperconnection_learning_rate: float = field(
        default=0.01, metadata={"help": "AdamW lr of the hyperconnection mixing parameters (study: 0.01)."}
    )
    lr_scaling: str | None = field(
        default=None,
        metadata={"choices": LR_SCALINGS,
            "help": "muonh only. hyperp (the default for muonh): the five lrs above are the study's reference "
            "values and each run scales them (HyperP, arXiv 2603.28743, as scripts/base_train.py): every lr "
            "by (B / 262144)^0.558 (B = tokens per optimizer step), the matrix lr by (T / D_REF)^-0.32 (T = "
            "the run's training tokens, D_REF = 10 x the scaling params of the size-10 reference model of "
            "the same kind), the AdamW lrs by (d / 640)^-0.5. none: every group trains at exactly the lr "
            "given (the sweep planner writes the lrs it computed this way)."
        },
    )
    lr_schedule: str = field(
        default="study",
        metadata={"choices": LR_SCHEDULES,
            "help": "study: `warmup_steps` (default 0) then linear decay to final_lr_ratio; "
            "trainer: Trainer's own lr_scheduler_type."
        },
    )
    final_lr_ratio: float = field(default=0.1, metadata={"help": "Last lr / peak lr for the study schedule."})
    train_tokens: int | None = field(
        default=None, metadata={"help": "Train for ceil(train_tokens / tokens_per_step) optimizer steps."}
    )
    train_flops_budget: float | None = field(
        default=None,
        metadata={
            "help": "Train for budget / training_flops_per_token tokens (whole steps: train_steps_rounding)."
        },
    )
    train_steps_rounding: str = field(
        default="up",
        metadata={"choices": STEPS_ROUNDINGS,
            "help": "How train_tokens / train_flops_budget become whole optimizer steps. up: ceil (never fewer "
            "tokens than the target, at most one step more); nearest: round(tokens / tokens_per_step), as the "
            "study's base_train.py (round(C / (flops_per_token x B)))."
        },
    )
    torch_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU threads for torch (None: torch's default). On a small or shared CPU, 1 avoids "
            "OpenMP oversubscription, which slows tiny models several-fold."
        },
    )
    peak_flops: float | None = field(
        default=None,
        metadata={
            "help": "Dense bf16 peak of one training device in FLOP/s, for the MFU the run logs (e.g. 989e12 for "
            "an H100 SXM). None: looped_hf.hardware's table by device name; a CPU or an unlisted GPU then logs "
            "tokens/s and model FLOPs/s but no MFU."
        },
    )
    run_id: str | None = field(
        default=None, metadata={"help": "Name of the run (default: output_dir's name)."}
    )
    arch: str | None = field(
        default=None, metadata={"help": "Label: 'base' for r=1 or N_rec=0, else 'loop<r>'."}
    )
    variant: str = field(
        default="base",
        metadata={
            "help": "Sweep variant: base, truncated, hyperconnection; a run with a sampled r is 'sampled_r' "
            "(set for it when left at base) or any name containing 'sampled', so a fit never mixes it into "
            "a fixed-r sweep."
        },
    )
    recurrence_sampling: str = field(
        default="fixed",
        metadata={
            "help": "fixed: every step runs num_recurrences. poisson_lognormal: Huginn's scheme "
            "(looped_hf.recurrence): each optimizer step runs r = 1 + Poisson(LogNormal(log(num_recurrences - 1) "
            "- 1/8, 1/2)), mean num_recurrences, the same r on every process and micro-batch of the step "
            "(drawn from the run seed and the step); backprop_recurrences caps backprop at the last k. "
            "Evaluation runs at num_recurrences."
        },
    )
    results_file: str | None = field(
        default=None, metadata={"help": "Also append the run record to this JSONL file (atomic, locked)."}
    )

    def __post_init__(self):
        # Types, ranges and choices: the one table (FIELD_LIMITS, field_choices) that recipes are
        # checked against too; below only how the fields go together.
        check_declared_fields(self)
        self._check_optimizer_fields()
        self._check_recurrence_sampling()
        given = [name for name in LENGTH_FIELDS if getattr(self, name) not in (None, -1)]
        if len(given) > 1:
            raise RecipeError(
                f"LoopedTrainingArguments: {' and '.join(given)} are all set; a run length takes exactly one"
            )
        super().__post_init__()

    def _check_recurrence_sampling(self) -> None:
        """A known scheme, and a sampled-r run recorded under a variant of its own (the fit's filter)."""
        if self.recurrence_sampling == "fixed":
            return
        if self.variant == "base":
            # A sampled-r run is not a point of the fixed-r sweep: recorded apart, fitted only on request.
            self.variant = "sampled_r"
        elif "sampled" not in self.variant:
            raise RecipeError(
                f"LoopedTrainingArguments.variant={self.variant!r}: a run with recurrence_sampling="
                f"{self.recurrence_sampling!r} must not be recorded as a fixed-r variant; use 'sampled_r' or a "
                f"name containing 'sampled' (e.g. '{self.variant}_sampled_r')"
            )

    def _check_optimizer_fields(self) -> None:
        """Optimizer-specific fields: no field is silently unused, and muonh gets the study's AdamW."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
        for name, default in (MUONH_ADAM if self.optimizer == "muonh" else TRAINER_ADAM).items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.optimizer != "muonh":
            if self.lr_scaling is not None:
                raise RecipeError(
                    f"LoopedTrainingArguments.lr_scaling={self.lr_scaling!r}: only optimizer 'muonh' scales its lrs "
                    f"per run (optimizer={self.optimizer!r} trains at learning_rate / muon_learning_rate)"
                )
            for name in MUONH_ONLY_FIELDS:
                if getattr(self, name) != defaults[name]:
                    raise RecipeError(
                        f"LoopedTrainingArguments.{name}={getattr(self, name)!r}: used only by optimizer 'muonh' "
                        f"(optimizer={self.optimizer!r})"
                    )
            return
        if self.lr_scaling is None:
            self.lr_scaling = "hyperp"
        if self.learning_rate != defaults["learning_rate"]:
            raise RecipeError(
                f"LoopedTrainingArguments.learning_rate={self.learning_rate!r}: not used by optimizer 'muonh', "
                f"whose lrs are muon_learning_rate, {', '.join(MUONH_ONLY_FIELDS)} and "
                "hyperconnection_learning_rate; remove it"
            )
        if self.weight_decay != 0:
            raise RecipeError(
                f"LoopedTrainingArguments.weight_decay={self.weight_decay!r}: optimizer 'muonh' has no weight decay "
                "(MuonH keeps every matrix on its Frobenius sphere, where decay is a first-order no-op; the "
                "study's AdamW groups use none); set 0"
            )


# ---------------------------------------------------------------------------------------------
# Value checks: every recipe value's type and range, before any dataclass sees it
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limit:
    """The range a number of a recipe field must lie in (for a list: each of its numbers).

    Every number must also be finite: NaN and infinity are never a setting. `special` lists
    values outside the range that the field gives a meaning (`max_steps: -1`, unset).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()

    def admits(self, x: float) -> bool:
        if x in self.special:
            return True
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_show(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_show(self.high)}")
        text = " and ".join(parts)
        if self.special:
            text += f", or {' or '.join(_show(s) for s in self.special)}"
        return text


_AT_LEAST_0, _AT_LEAST_1, _POSITIVE = Limit(0), Limit(1), Limit(0, low_open=True)
_UNIT, _UNIT_OPEN, _BETA = Limit(0, 1), Limit(0, 1, True, True), Limit(0, 1, high_open=True)
# Seeds feed numpy's RandomState, which takes 0 .. 2**32 - 1.
_SEED = Limit(0, 2**32 - 1)

#: Ranges of the recipe fields that take numbers (model, data and training fields alike). A
#: number field not listed here is still checked for its type and for being finite.
FIELD_LIMITS: dict[str, Limit] = {
    # model
    "hidden_size": _AT_LEAST_1, "num_attention_heads": _AT_LEAST_1, "head_dim": _AT_LEAST_1,
    "num_key_value_heads": _AT_LEAST_1, "intermediate_size": _AT_LEAST_1,
    "num_prelude_layers": _AT_LEAST_0, "num_recurrent_layers": _AT_LEAST_0, "num_coda_layers": _AT_LEAST_0,
    "num_recurrences": _AT_LEAST_1, "num_hyperconnection_lanes": _AT_LEAST_1,
    "backprop_recurrences": _AT_LEAST_1, "logit_softcap": _POSITIVE, "initializer_range": _POSITIVE,
    "max_position_embeddings": Limit(2), "pad_vocab_size_to_multiple_of": _AT_LEAST_1,
    # data
    "seq_len": Limit(2), "eval_blocks": _AT_LEAST_1, "split_seed": _SEED, "pack_batch_docs": _AT_LEAST_1,
    "shuffle_buffer": _AT_LEAST_0, "num_proc": _AT_LEAST_1, "streaming_eval_fraction": _UNIT_OPEN,
    # training length and batch
    "max_steps": Limit(1, special=(-1,)), "train_tokens": _AT_LEAST_1, "train_flops_budget": _POSITIVE,
    "num_train_epochs": _POSITIVE, "per_device_train_batch_size": _AT_LEAST_1,
    "per_device_eval_batch_size": _AT_LEAST_1, "gradient_accumulation_steps": _AT_LEAST_1,
    "eval_accumulation_steps": _AT_LEAST_1,
    # optimizer and schedule
    "learning_rate": _POSITIVE, "muon_learning_rate": _POSITIVE, "embedding_learning_rate": _POSITIVE,
    "lm_head_learning_rate": _POSITIVE, "norm_learning_rate": _POSITIVE,
    "hyperconnection_learning_rate": _POSITIVE, "weight_decay": _AT_LEAST_0, "adam_beta1": _BETA,
    "adam_beta2": _BETA, "adam_epsilon": _POSITIVE, "max_grad_norm": _AT_LEAST_0,
    "label_smoothing_factor": _BETA, "warmup_steps": _AT_LEAST_0, "final_lr_ratio": _UNIT,
    "neftune_noise_alpha": _POSITIVE,
    # logging, saving, evaluation
    "logging_steps": _POSITIVE, "save_steps": _POSITIVE, "eval_steps": _POSITIVE, "eval_delay": _AT_LEAST_0,
    "save_total_limit": _AT_LEAST_0, "torch_empty_cache_steps": _AT_LEAST_1,
    # processes and loading
    "seed": _SEED, "data_seed": _SEED, "dataloader_num_workers": _AT_LEAST_0,
    "dataloader_prefetch_factor": _AT_LEAST_1, "ddp_timeout": _AT_LEAST_1, "ddp_bucket_cap_mb": _AT_LEAST_1,
    "torch_num_threads": _AT_LEAST_1, "peak_flops": _POSITIVE,
}  # fmt: skip

#: String fields for which an empty string is never a setting (a name, a path, a choice).
NON_EMPTY_FIELDS = frozenset({
    "hidden_act", "input_injection", "state_init", "qk_norm", "init_scheme", "rope_table_dtype",
    "dataset", "dataset_config", "dataset_split", "dataset_revision", "text_column", "text_sample_by",
    "tokenizer", "data_cache_dir", "eval_split",
    "output_dir", "optimizer", "lr_scaling", "lr_schedule", "train_steps_rounding", "run_id", "arch", "variant",
    "recurrence_sampling", "results_file", "resume_from_checkpoint", "run_name", "logging_dir",
})  # fmt: skip

#: Types a field accepts beyond its annotation: `qk_norm: true / false` (recipes written for
#: looped_hf 0.1.0; ModelArguments reads them as after_rope / none).
TYPE_OVERRIDES: dict[str, Any] = {"qk_norm": str | bool}

#: Fields whose string value is the path of a JSON/YAML file that transformers opens.
FILE_FIELDS = ("accelerator_config", "deepspeed", "fsdp_config")
#: Fields whose string value is the path of a directory that must exist.
DIR_FIELDS = ("resume_from_checkpoint",)


@functools.cache
def field_choices() -> dict[str, tuple[str, ...]]:
    """The strings each choice field takes: the choices the dataclasses declare in their field
    metadata (where argparse and --help read them too), and those that TrainingArguments checks
    only once training starts (report_to, the multiprocessing context, the compile mode), so they
    fail up front."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from looped_hf.recurrence import RECURRENCE_SAMPLINGS

    out: dict[str, tuple[str, ...]] = {}
    for dtype in (ModelArguments, _data_arguments_class(), LoopedTrainingArguments):
        for f in dataclasses.fields(dtype):
            if f.init and f.metadata.get("choices"):
                out[f.name] = tuple(str(c) for c in f.metadata["choices"])
    out.update(
        # qk_norm also takes true / false, which argparse choices would refuse; recurrence_sampling's
        # list lives with the schedule (looped_hf.recurrence imports torch).
        qk_norm=QK_NORMS, recurrence_sampling=tuple(RECURRENCE_SAMPLINGS),
        report_to=("all", "none", *sorted(INTEGRATION_TO_CALLBACK)),
        include_num_input_tokens_seen=("all", "non_padding", "no"),
        dataloader_multiprocessing_context=("fork", "spawn", "forkserver"),
        torch_compile_mode=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )  # fmt: skip
    return out


def _show(value: Any) -> str:
    """A value as a recipe would spell it: 0 not np.float64(0.0), nan, inf, 'text', [1, 2]."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, float) or (hasattr(value, "dtype") and hasattr(value, "item")):
        number = value.item() if hasattr(value, "item") else value
        if isinstance(number, float) and number.is_integer() and abs(number) < 1e16:
            return str(int(number))
        return repr(number)
    return repr(value)


_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a mapping", type(None): "null"}  # fmt: skip


def _plural(annotation: Any) -> str:
    """'integers', 'lists of integers', 'values from [...]': what a list's items must be."""
    if annotation in _PLURALS:
        return _PLURALS[annotation]
    if typing.get_origin(annotation) is list and typing.get_args(annotation):
        return f"lists of {_plural(typing.get_args(annotation)[0])}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"values from {[m.value for m in annotation]}"
    return _kind(annotation)


def _kind(annotation: Any) -> str:
    """What an annotation asks for, in words (for error messages)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
            members = [m for m in members if m is not str]  # the enum's values are the strings it takes
        text = " or ".join(dict.fromkeys(_kind(m) for m in members))
        return f"{text} (or null)" if type(None) in typing.get_args(annotation) else text
    if origin is typing.Literal:
        return " or ".join(_show(a) for a in typing.get_args(annotation))
    if origin is list or annotation is list:
        args = typing.get_args(annotation)
        if not args:
            return "a list"
        return f"a list of {_plural(args[0])}"
    if origin is dict or annotation is dict:
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"one of {[m.value for m in annotation]}"
    return f"a {getattr(annotation, '__name__', str(annotation))}"


def _from_text(value: Any, annotation: Any) -> Any:
    """A recipe file's string for a number or boolean field, as that number or boolean.

    YAML reads `1e-3` and `1.0e5` (no sign in the exponent) as strings; argparse would convert
    them, but its error would name a flag the user never gave. Anything else is returned as is.
    """
    if not isinstance(value, str):
        return value
    members = (
        set(typing.get_args(annotation))
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else {annotation}
    )
    if str in members or any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
        return value
    text = value.strip()
    if bool in members and text.lower() in ("true", "false", "yes", "no", "1", "0"):
        return text.lower() in ("true", "yes", "1")
    if members & {int, float}:
        try:
            return int(text) if int in members and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            return value
    return value


class _Mismatch(Exception):
    """A value that does not have its field's type (internal: becomes a RecipeError)."""


def _coerce(value: Any, annotation: Any) -> Any:
    """`value` as the type `annotation` asks for, or `_Mismatch`. Whole floats are accepted for
    integers (YAML's 1.5e+8 for train_tokens); strings are never numbers here (argparse has
    already converted the ones a recipe file or flag gave for a number field)."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        # A string for an enum-typed field must be one of its values, even where str is allowed too.
        enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
        if isinstance(value, str) and enums and not any(value in {e.value for e in m} for m in enums):
            raise _Mismatch
        for member in sorted(members, key=lambda m: m is not type(value)):  # exact type first
            try:
                return _coerce(value, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(annotation)):
            return value
        raise _Mismatch
    if origin is list or annotation is list:
        if not isinstance(value, list):
            raise _Mismatch
        args = typing.get_args(annotation)
        return [_coerce(v, args[0]) for v in value] if args else value
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        args = typing.get_args(annotation)
        if args:
            # Keys from JSON are strings ("2" for r = 2): read them as the key type asks.
            return {_coerce(_from_text(k, args[0]), args[0]): _coerce(v, args[1]) for k, v in value.items()}
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _Mismatch
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(annotation, type):
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            try:
                return annotation(value)
            except ValueError:
                raise _Mismatch from None
        if isinstance(value, annotation):
            return value
        raise _Mismatch
    return value  # an annotation we cannot check (a forward reference): left to the dataclass


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    return []


def _is(test: Any, text: str) -> bool:
    """`test` (Path.is_file, Path.is_dir) of a user's path; a name the OS cannot even look up
    (too long, a NUL byte) is simply not one."""
    try:
        return bool(test(Path(text).expanduser()))
    except (OSError, ValueError, RuntimeError):  # RuntimeError: ~user that does not exist
        return False


def check_value(
    name: str, value: Any, annotation: Any, where: str, limits: Mapping[str, Limit] | None = None
) -> Any:
    """Check one recipe value against its field's type and range; return it (whole floats of an
    integer field as ints). Raises `RecipeError` with one line: where, field, value, and why.

    `where` says where the value came from (the file and line, or the flag); `limits` defaults to
    `FIELD_LIMITS`.
    """
    limit = (FIELD_LIMITS if limits is None else limits).get(name.rsplit(".", 1)[-1])

    def bad(why: str) -> RecipeError:
        return RecipeError(f"{where}: {name}={_show(value)}: {why}")

    try:
        checked = _coerce(value, annotation)
    except _Mismatch:
        got = _TYPE_NAMES.get(type(value), type(value).__name__)
        wanted = "a mapping or the path of a JSON file" if name in FILE_FIELDS else _kind(annotation)
        if limit is not None and wanted.removesuffix(" (or null)") in ("an integer", "a number"):
            # "an integer >= 1 (or null)": the range belongs to the number, before the null.
            plain = wanted.removesuffix(" (or null)")
            wanted = wanted.replace(plain, f"{plain} {limit.describe()}", 1)
        raise bad(f"must be {wanted}, got {got}") from None
    for x in _numbers(checked):
        if not math.isfinite(x):
            raise bad("must be a finite number")
        if isinstance(x, int) and not -(2**63) <= x < 2**63:
            raise bad("is too large: integers must fit 64 bits (numpy, torch)")
        if limit is not None and not limit.admits(x):
            shown = "" if x == checked else f" (contains {_show(x)})"
            raise bad(f"must be {limit.describe()}{shown}")
    if isinstance(checked, str):
        if not checked and name in NON_EMPTY_FIELDS:
            raise bad("must not be empty")
        if name in FILE_FIELDS and not _is(Path.is_file, checked):
            raise bad("names no file (give a mapping, or the path of a JSON file)")
        if name in DIR_FIELDS and not _is(Path.is_dir, checked):
            raise bad("no such directory")
    choices = field_choices().get(name) if limits is None else None
    if choices is not None and name != "qk_norm":  # qk_norm also takes true / false (ModelArguments)
        words = [checked] if isinstance(checked, str) else checked if isinstance(checked, list) else []
        for word in words:
            if isinstance(word, str) and word not in choices:
                raise bad(f"must be one of {list(choices)}")
    return checked


@functools.cache
def _field_types(dtype: type) -> dict[str, Any]:
    hints = typing.get_type_hints(dtype)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(dtype) if f.init}


def recipe_field_types() -> dict[str, Any]:
    """Every field a recipe may set, with its type annotation (model, data, training)."""
    out: dict[str, Any] = {}
    for dtype in (ModelArguments, _data_arguments_class(), LoopedTrainingArguments):
        out.update(_field_types(dtype))
    out.update(TYPE_OVERRIDES)
    return out


def check_declared_fields(obj: Any) -> None:
    """Check a dataclass instance built in Python against the one table a recipe is checked
    against (`check_value`: the annotation's type, `FIELD_LIMITS`, `field_choices`): its own fields
    and every inherited one the table gives a range or choices. Raises `RecipeError` naming the
    class, the field and the value; whole floats of integer fields become ints."""
    types_ = {**_field_types(type(obj)), **{k: v for k, v in TYPE_OVERRIDES.items() if k in _field_types(type(obj))}}
    own = set(vars(type(obj)).get("__annotations__", {}))
    ruled = set(FIELD_LIMITS) | set(field_choices()) | NON_EMPTY_FIELDS
    for name, annotation in types_.items():
        if name in own or name in ruled:
            setattr(obj, name, check_value(name, getattr(obj, name), annotation, type(obj).__name__))


def yaml_key_lines(path: str | os.PathLike) -> dict[str, int]:
    """Line (1-based) of each top-level key of a YAML mapping file, for error messages."""
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, ValueError):  # ValueError: not UTF-8 (load_yaml names it)
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(key.value): key.start_mark.line + 1 for key, _ in node.value}


def _data_arguments_class() -> type:
    # Imported here so that `looped_hf.arguments` can be read (and its errors tested) on its own.
    from looped_hf.data import DataArguments

    return DataArguments


class _RecipeParser(HfArgumentParser):
    # argparse exits the process on a bad value; a library call should raise instead.
    def error(self, message: str):
        raise RecipeError(message)


def recipe_parser() -> HfArgumentParser:
    """The parser of a flat recipe: model, data and training fields (names must not collide)."""
    return _RecipeParser((ModelArguments, _data_arguments_class(), LoopedTrainingArguments))


def _blame(dtype: type, inputs: dict[str, Any], given: list[str], err: Exception) -> str:
    """An error from a dataclass's own checks (TrainingArguments': "Your setup doesn't support
    bf16/gpu") as one line that names the recipe field it is about: the given field that alone
    raises the same error, or else every given field of that dataclass."""
    message = (str(err).strip().splitlines() or [type(err).__name__])[0]
    names = [n for n in given if n in inputs]
    if any(n in message for n in names):
        return message
    for name in names:
        try:
            dtype(**{name: inputs[name]})
        except (TypeError, ValueError, ImportError) as alone:
            if str(alone) == str(err):
                return f"{name}={_show(inputs[name])}: {message}"
    return f"{message} (fields set: {', '.join(names)})"


@functools.cache
def _shared_parser() -> HfArgumentParser:
    # Building the parser of ~190 fields takes ~25 ms; `parse_recipe` only reads it.
    return recipe_parser()


def _known_fields(parser: HfArgumentParser) -> set[str]:
    return {f.name for dtype in parser.dataclass_types for f in dataclasses.fields(dtype) if f.init}


def read_recipe_text(path: str | os.PathLike, what: str = "recipe") -> str:
    """The text of a recipe file; a missing file, a folder or a binary file is a `RecipeError`."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{what} {str(path)!r}: is a directory, not a YAML file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{what} {str(path)!r}: no such file") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{what} {str(path)!r}: not UTF-8 text (byte {err.start}); is it a binary file?") from None
    except OSError as err:
        raise RecipeError(f"{what} {str(path)!r}: cannot be read ({err.strerror or err})") from None


def load_yaml(path: str | os.PathLike, what: str = "recipe") -> dict[str, Any]:
    """Read a YAML mapping (duplicate keys and alias bombs refused); anything else is an error
    naming the file."""
    text = read_recipe_text(path, what)
    try:
        data = yaml_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"{what} {str(path)!r}{at}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise RecipeError(
            f"{what} {str(path)!r}: must be a YAML mapping of field: value, got {type(data).__name__}"
        )
    return data


def check_fields(data: dict[str, Any], known: set[str], where: str) -> None:
    """Reject unknown keys with an error naming them (and the closest known names)."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise RecipeError(
                f"{where}: unknown field {key!r} (not a model, data or training argument){hint}"
            )


def _flag_names(argv: list[str]) -> set[str]:
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            names.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return names


def parse_recipe(
    recipe: str | os.PathLike | dict[str, Any] | None = None,
    argv: list[str] | None = None,
    *,
    where: str | None = None,
    lines: Mapping[str, int] | None = None,
) -> tuple[ModelArguments, Any, LoopedTrainingArguments]:
    """Parse a recipe (YAML path or mapping) with command-line overrides into the three dataclasses.

    Values from the file become the parser's defaults, so flags given in `argv` win. Every value
    the file or a flag gives is checked for its field's type and range (`check_value`) before any
    dataclass is built; then the dataclasses check how the fields go together. Raises
    `RecipeError` with one line naming the field and the value. `where` and `lines` (field ->
    line) say where a mapping came from, for those messages (a sweep passes its file's).
    """
    argv = list(argv or [])
    parser = _shared_parser()
    known = _known_fields(parser)
    if recipe is None:
        data, label = {}, "recipe"
    elif isinstance(recipe, dict):
        data, label = dict(recipe), "recipe"
    else:
        data, label = load_yaml(recipe), f"recipe {str(recipe)!r}"
        lines = yaml_key_lines(recipe) if lines is None else lines
    where = label if where is None else where
    lines = {} if lines is None else lines
    if "sweep" in data:
        raise RecipeError(
            f"{where}: has a 'sweep' section; run it with `looped-hf sweep`, not `train` "
            "(`looped-hf sweep RECIPE --dry-run` checks it and prints its plan)"
        )
    check_fields(data, known, where)
    overridden = _flag_names(argv)
    if overridden & set(LENGTH_FIELDS):
        for name in LENGTH_FIELDS:
            if name not in overridden:
                data.pop(name, None)
    types_ = recipe_field_types()
    for name in list(data):
        if name not in overridden:  # a flag replaces the file's value: only the flag's is checked
            origin = f"{where}, line {lines[name]}" if name in lines else where
            data[name] = check_value(name, _from_text(data[name], types_[name]), types_[name], origin)
    try:
        # The file's values, already checked, are the namespace argparse starts from: it fills in
        # the defaults of the fields the file does not set and converts the flags to their types.
        # (The shared parser itself is never changed, so building it once serves every recipe.)
        namespace, rest = parser.parse_known_args(args=argv, namespace=argparse.Namespace(**data))
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None
    if rest:
        raise RecipeError(f"{where}: unknown command-line arguments {rest}")
    values = vars(namespace)
    for name in sorted(overridden & known):
        origin = f"{where}: flag --{name}" if recipe is not None else f"flag --{name}"
        values[name] = check_value(name, values[name], types_[name], origin)
    outputs = []
    given = [*data, *sorted(overridden & known - set(data))]
    for dtype in parser.dataclass_types:
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        inputs = {k: v for k, v in values.items() if k in names}
        try:
            outputs.append(dtype(**inputs))
        except RecipeError:
            raise
        except (TypeError, ValueError, ImportError) as err:  # ImportError: deepspeed, fsdp, ... not installed
            raise RecipeError(f"{where}: {_blame(dtype, inputs, given, err)}") from err
    model_args, data_args, training_args = outputs
    return model_args, data_args, training_args


def resolved_recipe(model_args: Any, data_args: Any, training_args: TrainingArguments) -> dict[str, Any]:
    """A flat mapping that `parse_recipe` turns back into the same run: every model and data field,
    and the training fields that differ from their defaults (TrainingArguments has ~150)."""
    out: dict[str, Any] = {}
    for obj in (model_args, data_args):
        for f in dataclasses.fields(obj):
            if f.init:
                out[f.name] = _plain(getattr(obj, f.name))
    for f in dataclasses.fields(training_args):
        raw = getattr(training_args, f.name) if f.init else None
        if not f.init:
            continue
        if dataclasses.is_dataclass(raw):
            # Built in __post_init__ from a mapping (accelerator_config): the keys set away from
            # the defaults, which parse_recipe accepts back as a mapping.
            changed = _changed_fields(raw)
            if changed:
                out[f.name] = changed
            continue
        value = _plain(raw)
        if f.default is not dataclasses.MISSING:
            default = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _plain(f.default_factory())
        else:
            default = object()
        if value != default and not f.name.endswith("_token") and f.name != "hub_token":
            out[f.name] = value
    return out


def _changed_fields(obj: Any) -> dict[str, Any]:
    """The fields of dataclass instance `obj` that differ from a default-built one (plain values)."""
    try:
        default = type(obj)()
    except TypeError:  # required fields: record them all
        default = None
    return {
        f.name: _plain(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if f.init and (default is None or _plain(getattr(obj, f.name)) != _plain(getattr(default, f.name)))
    }


def _plain(value: Any) -> Any:
    """YAML/JSON-safe form of a dataclass value (enums to their value, tuples to lists)."""
    if (
        hasattr(value, "value")
        and type(value).__module__ != "builtins"
        and not isinstance(value, (int, float))
    ):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def tokens_per_step(training_args: TrainingArguments, seq_len: int, world_size: int | None = None) -> int:
    """Tokens in one optimizer step: batch x accumulation x processes x sequence length."""
    world = training_args.world_size if world_size is None else world_size
    return (
        training_args.per_device_train_batch_size
        * training_args.gradient_accumulation_steps
        * world
        * seq_len
    )


def steps_for_tokens(
    tokens: float, step_tokens: int, field_name: str, value: Any, rounding: str = "up"
) -> int:
    """Optimizer steps for a token target: ceil(tokens / step_tokens), or round() for "nearest".

    Rounding up (the default) means a run never trains on less than its target; it overshoots by
    less than one step (recorded: `tokens` and `train_flops` in the run record are the actual
    counts). "nearest" is the study's rule (base_train.py: round(C / (flops_per_token x B))), off
    by at most half a step either way. A target below one full step is an error naming `field_name`.
    """
    if rounding not in STEPS_ROUNDINGS:
        raise ValueError(f"rounding={rounding!r}: must be one of {STEPS_ROUNDINGS}")
    if tokens < step_tokens:
        raise RecipeError(
            f"{field_name}={value}: buys {tokens:.4g} tokens, less than one optimizer step "
            f"({step_tokens} tokens = batch x accumulation x processes x seq_len)"
        )
    if rounding == "nearest":
        return round(tokens / step_tokens)
    return math.ceil(tokens / step_tokens - 1e-9)


__all__ = [
    "FIELD_LIMITS",
    "LENGTH_FIELDS",
    "Limit",
    "ModelArguments",
    "LoopedTrainingArguments",
    "RecipeError",
    "check_fields",
    "check_declared_fields",
    "check_value",
    "load_yaml",
    "read_recipe_text",
    "parse_recipe",
    "recipe_field_types",
    "recipe_parser",
    "resolved_recipe",
    "steps_for_tokens",
    "tokens_per_step",
    "yaml_key_lines",
]
