"""Recipes: the dataclasses a training run is made of, and YAML loading with validation.

A recipe is one flat YAML mapping whose keys are the fields of three dataclasses, parsed with
`transformers.HfArgumentParser` (the same convention as TRL / alignment-handbook recipes):

- `ModelArguments` (below): the `LoopedConfig` fields a recipe chooses; vocabulary size and
  special tokens come from the tokenizer; `max_position_embeddings` is at least 2048 (not tied to `seq_len`).
- `looped_hf.data.DataArguments`: corpus, tokenizer, `seq_len`, held-out split.
- `LoopedTrainingArguments` (below): `transformers.TrainingArguments` plus the study's optimizer,
  schedule and a training length in tokens or FLOPs.

Command-line flags (`--num_recurrences 8`) override the file. Every value is checked for its
field's type, range and choices (`looped_hf.field_checks`: one table) before
any dataclass is built, then the dataclasses check how fields go together. An unknown key, a
value of the wrong kind or range, or a budget that cannot buy one optimizer step fails before
any training with one line that names the recipe field and its value (and the file's line);
`looped-hf train RECIPE --check` runs every check and trains nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from looped_hf.configuration_looped import (
    EXIT_GATE_OUTPUTS,
    INIT_SCHEMES,
    NORM_PLACEMENTS,
    QK_NORMS,
    SHARED_NORM_WEIGHTS,
    LoopedConfig,
)
from looped_hf.field_checks import (
    FIELD_LIMITS,
    TYPE_OVERRIDES,
    Limit,
    RecipeError,
    _field_types,
    _from_text,
    _show,
    check_declared_fields,
    check_value,
    declared_choices,
)
from looped_hf.fileio import first_line, yaml_load

OPTIMIZERS = ("adamw", "muon", "muonh")
LR_SCALINGS = ("hyperp", "none")
# The study's AdamW settings under MuonH (nanochat/gpt.py setup_optimizer: betas (0.8, 0.95),
# eps 1e-10), and TrainingArguments' own for the other optimizers: the value of each field a
# recipe leaves unset (null). A value the recipe writes is kept, even one equal to a default.
MUONH_ADAM = {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-10}
TRAINER_ADAM = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.name in MUONH_ADAM}
# Fields read only by muonh (set with another optimizer, they would be silently unused).
MUONH_ONLY_FIELDS = ("embedding_learning_rate", "lm_head_learning_rate", "norm_learning_rate")
LR_SCHEDULES = ("study", "trainer")
# The keys that set a run's length; a command-line flag for one of them replaces the others
# given in the file ("flags override the file" would otherwise produce a conflict error).
LENGTH_FIELDS = ("max_steps", "train_tokens", "train_flops_budget")
# How a token target becomes whole optimizer steps (`steps_for_tokens`): up = ceil, nearest = round.
STEPS_ROUNDINGS = ("up", "nearest")


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

    # The published designs' options (LoopedConfig's docstring says what each does); the sweep's
    # probe recipes (recipes/iso_depth_tiny_sandwich.yaml, _ouro.yaml) set them for every run.
    norm_placement: str = field(
        default="pre",
        metadata={"choices": NORM_PLACEMENTS, "help": "Where a layer's norms sit: pre (the study), sandwich "
                  "(Huginn), sublayer_output (OLMo-2), pre_and_output (Ouro)."},
    )  # fmt: skip
    embedding_multiplier: float = field(default=1.0, metadata={"help": "Scale of the token embeddings."})
    post_loop_norm: str | None = field(
        default=None,
        metadata={"choices": SHARED_NORM_WEIGHTS, "help": "RMSNorm after the loop: own weight, final (the final "
                  "norm's), or None."},
    )  # fmt: skip
    recurrence_norm_weight: str = field(
        default="own",
        metadata={"choices": SHARED_NORM_WEIGHTS, "help": "The recurrence norm's weight: own, or final (Ouro)."},
    )
    qk_bias: bool = field(default=False, metadata={"help": "A bias on q and k only (Huginn)."})
    exit_gate: bool = field(default=False, metadata={"help": "Ouro's learned exit gate, Linear(hidden -> 1)."})
    exit_gate_output: str = field(
        default="last",
        metadata={"choices": EXIT_GATE_OUTPUTS, "help": "The gate's readout: last, threshold, weighted."},
    )
    exit_gate_threshold: float = field(default=0.5, metadata={"help": "Exit CDF threshold of the readout."})
    exit_gate_entropy_beta: float | None = field(
        default=None, metadata={"help": "Ouro's loss sum_t p_t L_t - beta H(p); None: the loss of the logits."}
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
                norm_placement=self.norm_placement,
                embedding_multiplier=self.embedding_multiplier,
                post_loop_norm=self.post_loop_norm,
                recurrence_norm_weight=self.recurrence_norm_weight,
                qk_bias=self.qk_bias,
                exit_gate=self.exit_gate,
                exit_gate_output=self.exit_gate_output,
                exit_gate_threshold=self.exit_gate_threshold,
                exit_gate_entropy_beta=self.exit_gate_entropy_beta,
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


@functools.cache
def field_choices() -> dict[str, tuple[str, ...]]:
    """The strings each choice field of a recipe takes (`field_checks.declared_choices` of the
    three dataclasses)."""
    return declared_choices(ModelArguments, _data_arguments_class(), LoopedTrainingArguments)


def recipe_field_types() -> dict[str, Any]:
    """Every field a recipe may set, with its type annotation (model, data, training)."""
    out: dict[str, Any] = {}
    for dtype in (ModelArguments, _data_arguments_class(), LoopedTrainingArguments):
        out.update(_field_types(dtype))
    out.update(TYPE_OVERRIDES)
    return out


def yaml_key_lines(path: str | os.PathLike, text: str | None = None) -> dict[str, int]:
    """Line (1-based) of each top-level key of a YAML mapping file, for error messages (`text`:
    the file's text, when already read)."""
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8") if text is None else text)
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
    message = first_line(err)
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


def load_yaml(path: str | os.PathLike, what: str = "recipe", text: str | None = None) -> dict[str, Any]:
    """Read a YAML mapping (duplicate keys and alias bombs refused); anything else is an error
    naming the file. `text`: the file's text, when already read (`read_recipe_text`): parsed
    instead of reading the file again."""
    if text is None:
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
            value = _from_text(data[name], types_[name])
            data[name] = check_value(name, value, types_[name], origin, choices=field_choices())
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
        values[name] = check_value(name, values[name], types_[name], origin, choices=field_choices())
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
    "field_choices",
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
