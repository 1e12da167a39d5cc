"""Recipes: the dataclasses a training run is made of (`looped_hf.arguments` reads a recipe into them).

A recipe is one flat YAML mapping (the same convention as TRL / alignment-handbook recipes) whose
keys are the fields of:

- `LoopedConfig`: the model. A recipe sets any of its fields but the ones the tokenizer gives
  (vocabulary size, special tokens) and the ones loading derives; each keeps the config's default
  when the recipe leaves it out, and the config validates them (`ModelArguments` carries the
  model section to it). `max_position_embeddings` left out is max(seq_len, 2048), and
  `num_attention_heads` left out with a `head_dim` given is hidden_size // head_dim.
- `looped_hf.data.DataArguments`: corpus, tokenizer, `seq_len`, held-out split.
- `LoopedTrainingArguments` (below): `transformers.TrainingArguments` plus the study's optimizer,
  schedule and a training length in tokens or FLOPs.

Command-line flags (`--num_recurrences 8`) override the file. A data or training value is checked
against its field's declarations (type and rule, ``Annotated[int, AT_LEAST_1]``;
``metadata["choices"]``: `looped_hf.field_checks`), a model value by `LoopedConfig` itself; then the dataclasses check how
fields go together. An unknown key, a value of the wrong kind or range, or a budget that cannot
buy one optimizer step fails before any training with one line that names the recipe field and
its value (and the file's line); `looped-hf train RECIPE --check` runs every check and trains
nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from transformers import TrainingArguments
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

from looped_hf.configuration_looped import LoopedConfig
from looped_hf.field_checks import (
    AT_LEAST_0,
    AT_LEAST_1,
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    UNIT,
    RecipeError,
    below_one,
    check_declared_fields,
    declared_fields,
    names_dir,
    names_file,
    non_empty,
    show,
    steps_or_unset,
)
from looped_hf.fileio import first_line
from looped_hf.recurrence import CURRICULUM_SHAPES, RECURRENCE_SAMPLINGS

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
# LoopedConfig fields a recipe does not set: the tokenizer gives the vocabulary and the special
# tokens, loading sets looped_format, num_hidden_layers is derived, and rope_parameters is a
# mapping the flat recipe format leaves at the config's default.
NOT_RECIPE_FIELDS = frozenset(
    {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "looped_format", "num_hidden_layers",
     "rope_parameters"}
)  # fmt: skip
# Retrofit training fields (docs/retrofit.md) that a recipe may set only together with the field
# that switches their feature on: {field: (switch, what the switch must be)}.
RETROFIT_DEPENDENT_FIELDS = {
    "curriculum_start": "recurrence_curriculum", "curriculum_fraction": "recurrence_curriculum",
    "lora_alpha": "lora_rank", "distill_alpha": "distill_from", "distill_temperature": "distill_from",
}  # fmt: skip


def fraction_of_run(value: Any) -> None:
    """In (0, 1]: a fraction of the run's optimizer steps."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 < value <= 1:  # NaN too
        raise ValueError("must be a finite number in (0, 1]")


def _attention_functions() -> list[str]:
    # Imported here: the registry lives in modeling_utils, which recipe parsing need not load.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sorted(ALL_ATTENTION_FUNCTIONS)


def _known_attention(name: str) -> bool:
    """Whether transformers can be asked for ``name`` (whether its kernel is installed is found
    when the model is built, with a fallback only for the automatic choice)."""
    return name in ("auto", "eager") or name in _attention_functions() or "/" in name.strip("/")


ATTN_HELP = (
    "Attention kernel. None / auto: the study's rule (FlashAttention-3 on Hopper, -2 on Ampere/Ada, -4 on "
    "Blackwell when installed, else sdpa), logged and kept in the run record; or a transformers name (eager, "
    "sdpa, flash_attention_2, ...) or a hub kernel (org/repo), used as given."
)


@functools.cache
def model_fields() -> dict[str, dataclasses.Field]:
    """The `LoopedConfig` fields a recipe sets: the config's own, less `NOT_RECIPE_FIELDS` and any
    name a data or training field owns (TrainingArguments' use_cache)."""
    others = {name for dtype in (_data_arguments_class(), LoopedTrainingArguments) for name in declared_fields(dtype)}
    own = set(LoopedConfig.__annotations__) - NOT_RECIPE_FIELDS - others
    return {f.name: f for f in dataclasses.fields(LoopedConfig) if f.name in own}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class ModelArguments:
    """The model section of a recipe: the `LoopedConfig` fields it sets (`settings`; every other
    field keeps the config's default), and the attention kernel, which is not a config field.

    `vocab_size`, `bos/eos/pad_token_id` come from the tokenizer, so a recipe cannot contradict
    its own data; `max_position_embeddings` defaults to max(seq_len, 2048).
    """

    settings: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        for name in self.settings:
            if name not in model_fields():
                raise RecipeError(f"ModelArguments.settings: {name!r} is not a LoopedConfig field a recipe sets")
        if self.attn_implementation is not None and not (
            isinstance(self.attn_implementation, str) and _known_attention(self.attn_implementation)
        ):
            raise RecipeError(
                f"attn_implementation={self.attn_implementation!r}: must be auto, eager, one of transformers' "
                f"attention functions ({', '.join(_attention_functions())}) or a hub kernel org/repo"
            )

    def replace(self, **settings: Any) -> ModelArguments:
        """These arguments with `settings` changed (a sweep's run: its width, r, ...)."""
        return ModelArguments({**self.settings, **settings}, self.attn_implementation)

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
        kwargs = dict(self.settings)
        head_dim = kwargs.get("head_dim")
        if kwargs.get("num_attention_heads") is None and _is_int(head_dim) and head_dim > 0:
            hidden = kwargs.get("hidden_size", model_fields()["hidden_size"].default)
            if _is_int(hidden) and hidden % head_dim:
                raise RecipeError(f"LoopedConfig.head_dim={head_dim}: does not divide hidden_size={hidden}")
            if _is_int(hidden):
                kwargs["num_attention_heads"] = hidden // head_dim
        # Not the training seq_len: RoPE has no learned table, and lm-eval / pipelines truncate every
        # context to max_position_embeddings, so a model trained on 64-token blocks would accept
        # only 64 tokens. LoopedConfig's default (2048) unless the data is longer.
        max_pos = kwargs.get("max_position_embeddings")
        if max_pos is None:
            kwargs["max_position_embeddings"] = max(seq_len, model_fields()["max_position_embeddings"].default)
        elif _is_int(max_pos) and max_pos < seq_len:
            raise RecipeError(f"LoopedConfig.max_position_embeddings={max_pos}: smaller than seq_len={seq_len}")
        try:
            return LoopedConfig(
                vocab_size=vocab_size,
                bos_token_id=bos_token_id,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                **kwargs,
            )
        except (TypeError, ValueError, OverflowError) as err:
            raise RecipeError(first_line(err)) from err


def _declare(name: str, **metadata: Any) -> Any:
    """A TrainingArguments field declared again (its rule goes in the annotation, ``choices`` here):
    its default and help stay transformers'."""
    parent = TrainingArguments.__dataclass_fields__[name]
    if parent.default_factory is not dataclasses.MISSING:
        return field(default_factory=parent.default_factory, metadata={**parent.metadata, **metadata})
    return field(default=parent.default, metadata={**parent.metadata, **metadata})


@dataclass
class LoopedTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the study's optimizer and schedule, and a run length in tokens/FLOPs.

    `output_dir` is the RUN directory: the final model, tokenizer, `run_record.json` and
    `recipe.yaml` go there; Trainer checkpoints go to `<output_dir>/checkpoints/`.
    Give at most one of `max_steps`, `train_tokens`, `train_flops_budget`.
    """

    # TrainingArguments' fields that a recipe gets wrong most easily, declared again with their
    # rule (`_declare`: transformers' default and help), so --check and --help read it here.
    max_steps: Annotated[int, steps_or_unset] = _declare("max_steps")
    num_train_epochs: Annotated[float, POSITIVE] = _declare("num_train_epochs")
    per_device_train_batch_size: Annotated[int, AT_LEAST_1] = _declare("per_device_train_batch_size")
    per_device_eval_batch_size: Annotated[int, AT_LEAST_1] = _declare("per_device_eval_batch_size")
    gradient_accumulation_steps: Annotated[int, AT_LEAST_1] = _declare("gradient_accumulation_steps")
    eval_accumulation_steps: Annotated[int | None, AT_LEAST_1] = _declare("eval_accumulation_steps")
    learning_rate: Annotated[float, POSITIVE] = _declare("learning_rate")
    weight_decay: Annotated[float, NON_NEGATIVE] = _declare("weight_decay")
    max_grad_norm: Annotated[float, NON_NEGATIVE] = _declare("max_grad_norm")
    label_smoothing_factor: Annotated[float, below_one] = _declare("label_smoothing_factor")
    warmup_steps: Annotated[float, NON_NEGATIVE] = _declare("warmup_steps")
    neftune_noise_alpha: Annotated[float | None, POSITIVE] = _declare("neftune_noise_alpha")
    logging_steps: Annotated[float, POSITIVE] = _declare("logging_steps")
    save_steps: Annotated[float, POSITIVE] = _declare("save_steps")
    eval_steps: Annotated[float | None, POSITIVE] = _declare("eval_steps")
    eval_delay: Annotated[float, NON_NEGATIVE] = _declare("eval_delay")
    save_total_limit: Annotated[int | None, AT_LEAST_0] = _declare("save_total_limit")
    torch_empty_cache_steps: Annotated[int | None, AT_LEAST_1] = _declare("torch_empty_cache_steps")
    seed: Annotated[int, SEED] = _declare("seed")
    data_seed: Annotated[int | None, SEED] = _declare("data_seed")
    dataloader_num_workers: Annotated[int, AT_LEAST_0] = _declare("dataloader_num_workers")
    dataloader_prefetch_factor: Annotated[int | None, AT_LEAST_1] = _declare("dataloader_prefetch_factor")
    ddp_timeout: Annotated[int, AT_LEAST_1] = _declare("ddp_timeout")
    ddp_bucket_cap_mb: Annotated[int | None, AT_LEAST_1] = _declare("ddp_bucket_cap_mb")
    run_name: Annotated[str | None, non_empty] = _declare("run_name")
    resume_from_checkpoint: Annotated[str | None, names_dir] = _declare("resume_from_checkpoint")
    # A string names a JSON file that transformers opens.
    accelerator_config: Annotated[dict | str | None, names_file] = _declare("accelerator_config")
    deepspeed: Annotated[dict | str | None, names_file] = _declare("deepspeed")
    fsdp_config: Annotated[dict[str, Any] | str | None, names_file] = _declare("fsdp_config")
    # Choices transformers checks only once training starts; declared, they fail up front.
    report_to: None | str | list[str] = _declare("report_to", choices=("all", "none", *sorted(INTEGRATION_TO_CALLBACK)))
    include_num_input_tokens_seen: str | bool = _declare(
        "include_num_input_tokens_seen", choices=("all", "non_padding", "no")
    )
    dataloader_multiprocessing_context: str | None = _declare(
        "dataloader_multiprocessing_context", choices=("fork", "spawn", "forkserver")
    )
    torch_compile_mode: str | None = _declare(
        "torch_compile_mode", choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    )

    output_dir: Annotated[str | None, non_empty] = field(
        default="runs/looped", metadata={"help": "The run directory."}
    )
    # Unset (None) until __post_init__ knows the optimizer: so a value the recipe writes, even
    # TrainingArguments' own 0.9, is told apart from one it leaves to the optimizer's default.
    adam_beta1: Annotated[float | None, below_one] = field(
        default=None,
        metadata={"help": "AdamW beta1; unset: 0.9, the study's 0.8 under muonh."},
    )
    adam_beta2: Annotated[float | None, below_one] = field(
        default=None,
        metadata={"help": "AdamW beta2; unset: 0.999, the study's 0.95 under muonh."},
    )
    adam_epsilon: Annotated[float | None, POSITIVE] = field(
        default=None,
        metadata={"help": "AdamW epsilon; unset: 1e-8, the study's 1e-10 under muonh."},
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
    muon_learning_rate: Annotated[float, POSITIVE] = field(
        default=0.014,
        metadata={
            "help": "Matrix lr of muon / muonh (the study's 0.014, scripts/base_train.py --matrix-lr)."
        },
    )
    embedding_learning_rate: Annotated[float, POSITIVE] = field(
        default=0.3, metadata={"help": "muonh: AdamW lr of the token embedding (the study's 0.3)."}
    )
    lm_head_learning_rate: Annotated[float, POSITIVE] = field(
        default=0.004, metadata={"help": "muonh: AdamW lr of lm_head (the study's unembedding lr 0.004)."}
    )
    norm_learning_rate: Annotated[float, POSITIVE] = field(
        default=0.005, metadata={"help": "muonh: AdamW lr of every RMSNorm scale (the study's 0.005)."}
    )
    hyperconnection_learning_rate: Annotated[float, POSITIVE] = field(
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
    final_lr_ratio: Annotated[float, UNIT] = field(default=0.1, metadata={"help": "Last lr / peak lr for the study schedule."})
    train_tokens: Annotated[int | None, AT_LEAST_1] = field(
        default=None, metadata={"help": "Train for ceil(train_tokens / tokens_per_step) optimizer steps."}
    )
    train_flops_budget: Annotated[float | None, POSITIVE] = field(
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
    torch_num_threads: Annotated[int | None, AT_LEAST_1] = field(
        default=None,
        metadata={
            "help": "CPU threads for torch (None: torch's default). On a small or shared CPU, 1 avoids "
            "OpenMP oversubscription, which slows tiny models several-fold."
        },
    )
    peak_flops: Annotated[float | None, POSITIVE] = field(
        default=None,
        metadata={
            "help": "Dense bf16 peak of one training device in FLOP/s, for the MFU the run logs (e.g. 989e12 for "
            "an H100 SXM). None: looped_hf.hardware's table by device name; a CPU or an unlisted GPU then logs "
            "tokens/s and model FLOPs/s but no MFU."
        },
    )
    run_id: Annotated[str | None, non_empty] = field(
        default=None, metadata={"help": "Name of the run (default: output_dir's name)."}
    )
    arch: Annotated[str | None, non_empty] = field(
        default=None, metadata={"help": "Label: 'base' for r=1 or N_rec=0, else 'loop<r>'."}
    )
    variant: Annotated[str, non_empty] = field(
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
            "choices": RECURRENCE_SAMPLINGS,
            "help": "fixed: every step runs num_recurrences. poisson_lognormal: Huginn's scheme "
            "(looped_hf.recurrence): each optimizer step runs r = 1 + Poisson(LogNormal(log(num_recurrences - 1) "
            "- 1/8, 1/2)), mean num_recurrences, the same r on every process and micro-batch of the step "
            "(drawn from the run seed and the step); backprop_recurrences caps backprop at the last k. "
            "Evaluation runs at num_recurrences."
        },
    )
    results_file: Annotated[str | None, non_empty] = field(
        default=None, metadata={"help": "Also append the run record to this JSONL file (atomic, locked)."}
    )
    # --- retrofit training (docs/retrofit.md): start from a looped folder, the paper's recipe ----
    init_from: Annotated[str | None, names_dir] = field(
        default=None,
        metadata={
            "help": "A looped checkpoint folder (config.json + safetensors: `looped-hf retrofit`'s output, a run "
            "directory, a converted folder) whose weights and config the run starts from. Model fields the "
            "recipe sets override the folder's config (num_recurrences, backprop_recurrences, ...); a change "
            "of shape is refused when the weights load."
        },
    )
    recurrence_curriculum: str = field(
        default="none",
        metadata={
            "choices": CURRICULUM_SHAPES,
            "help": "none, linear or 1-sqrt: the mean r rises from curriculum_start to num_recurrences over the "
            "first curriculum_fraction of the steps (McLeish et al. 2025: 1 -> 4, 0.75, 1-sqrt). Step s of "
            "W = ceil(fraction x max_steps) runs mean max(start, ceil(max x f)), f = s/W (linear) or "
            "1 - sqrt(1 - s/W) (1-sqrt), 1 after W; recurrence_sampling draws each step's r around it "
            "(looped_hf.recurrence).",
        },
    )
    curriculum_start: Annotated[int, AT_LEAST_1] = field(
        default=1, metadata={"help": "The curriculum's first mean r (the paper's `start`, 1)."}
    )
    curriculum_fraction: Annotated[float, fraction_of_run] = field(
        default=0.75,
        metadata={"help": "Fraction of the run's steps over which the mean r rises (the paper's 0.75)."},
    )
    freeze_backbone: bool = field(
        default=False,
        metadata={
            "help": "Train only the injection adapter ([state; embedding] -> state); every other "
            "weight stays as loaded (the paper's freeze_backbone)."
        },
    )
    lora_rank: Annotated[int | None, AT_LEAST_1] = field(
        default=None,
        metadata={
            "help": "Train peft LoRA adapters of this rank on every linear layer but lm_head (peft's "
            "all-linear; the paper's later code: rank 16, alpha 32, no dropout); the base weights stay "
            "frozen and the run directory gets the merged model. Needs optimizer adamw (the paper's code "
            "refuses LoRA with Muon)."
        },
    )
    lora_alpha: Annotated[float, POSITIVE] = field(
        default=32.0, metadata={"help": "LoRA alpha (the paper's 32)."}
    )
    distill_from: Annotated[str | None, names_dir] = field(
        default=None,
        metadata={
            "help": "A dense transformers checkpoint folder (the retrofit's parent): the loss becomes "
            "distill_alpha x CE + (1 - distill_alpha) x T^2 x KL between the teacher's and the student's "
            "softened next-token distributions (looped_hf.trainer.distillation_loss); the teacher's forward "
            "counts in train_flops."
        },
    )
    distill_alpha: Annotated[float, UNIT] = field(
        default=0.5,
        metadata={"help": "Weight of the cross-entropy in the distillation loss (the paper's 0.5)."},
    )
    distill_temperature: Annotated[float, POSITIVE] = field(
        default=2.0, metadata={"help": "Distillation temperature T (the paper's 2)."}
    )

    def __post_init__(self):
        # Types, ranges and choices: the fields' declarations, which recipes are checked against
        # too; below only how the fields go together.
        check_declared_fields(self)
        self._check_optimizer_fields()
        self._check_retrofit_fields()
        self._check_recurrence_sampling()
        given = [name for name in LENGTH_FIELDS if getattr(self, name) not in (None, -1)]
        if len(given) > 1:
            raise RecipeError(
                f"LoopedTrainingArguments: {' and '.join(given)} are all set; a run length takes exactly one"
            )
        super().__post_init__()

    def _check_retrofit_fields(self) -> None:
        """No retrofit field silently unused; one way to choose what trains; LoRA with AdamW; a
        curriculum run recorded under a variant of its own (it is no point of a fixed-r sweep)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.init}
        switched_on = {"recurrence_curriculum": self.recurrence_curriculum != "none",
                       "lora_rank": self.lora_rank is not None, "distill_from": self.distill_from is not None}  # fmt: skip
        for name, switch in RETROFIT_DEPENDENT_FIELDS.items():
            if getattr(self, name) != defaults[name] and not switched_on[switch]:
                raise RecipeError(
                    f"LoopedTrainingArguments.{name}={show(getattr(self, name))}: used only with {switch} set "
                    f"({switch}={show(getattr(self, switch))})"
                )
        if self.freeze_backbone and self.lora_rank is not None:
            raise RecipeError(
                f"LoopedTrainingArguments.lora_rank={self.lora_rank}: freeze_backbone trains the adapter alone and "
                "LoRA trains low-rank updates of every linear layer; choose one"
            )
        if self.lora_rank is not None and self.optimizer != "adamw":
            raise RecipeError(
                f"LoopedTrainingArguments.optimizer={self.optimizer!r}: LoRA (lora_rank={self.lora_rank}) trains with "
                "adamw (the paper's code refuses LoRA with Muon: orthogonalised low-rank factors are not LoRA)"
            )
        if self.recurrence_curriculum != "none" and self.variant == "base":
            sampled = self.recurrence_sampling != "fixed"
            self.variant = "curriculum_sampled_r" if sampled else "curriculum"

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


def _data_arguments_class() -> type:
    # Imported here so that `looped_hf.arguments` can be read (and its errors tested) on its own.
    from looped_hf.data import DataArguments

    return DataArguments


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
    "LENGTH_FIELDS",
    "ModelArguments",
    "LoopedTrainingArguments",
    "RecipeError",
    "check_declared_fields",
    "model_fields",
    "steps_for_tokens",
    "tokens_per_step",
]
