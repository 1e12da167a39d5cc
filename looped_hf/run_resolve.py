"""Resolving a run before it trains: the recipe's model config (a fresh config or an `init_from` folder's),
the run's length in optimizer steps, the curriculum, what trains (the whole model, the injection adapter, LoRA),
and the report `looped-hf train RECIPE --check` prints. Nothing here trains or writes; `looped_hf.train` runs
what it resolves.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from looped_hf.arguments import (
    LoopedTrainingArguments,
    ModelArguments,
    RecipeError,
    parse_recipe,
    steps_for_tokens,
    tokens_per_step,
)
from looped_hf.fileio import (
    check_output_path,
    first_line,
)
from looped_hf.run_callbacks import (  # noqa: F401
    PROGRESS_NAME,
    NonFiniteLossGuard,
    ProgressFileCallback,
    compile_forward,
    uncompile_forward,
)
from looped_hf.teacher import (  # noqa: F401
    BIDIRECTIONAL_TYPES,
    check_teacher,
    teacher_flops,
)


def arch_name(config: Any) -> str:
    """'base' for a model without a loop (r = 1 or an empty block), else 'loop<r>'."""
    if config.num_recurrences == 1 or config.num_recurrent_layers == 0:
        return "base"
    return f"loop{config.num_recurrences}"


def resolve_max_steps(
    training_args: LoopedTrainingArguments, flops_per_token: float, seq_len: int
) -> tuple[int, int]:
    """`(max_steps, tokens_per_step)` from whichever of max_steps / train_tokens /
    train_flops_budget is set (rounded to whole steps by `train_steps_rounding`: up, or to the
    nearest as the study; see `steps_for_tokens`)."""
    step_tokens = tokens_per_step(training_args, seq_len)
    rounding = training_args.train_steps_rounding
    if training_args.train_flops_budget is not None:
        budget = training_args.train_flops_budget
        tokens = budget / flops_per_token
        steps = steps_for_tokens(
            tokens, step_tokens, "train_flops_budget", f"{budget:.4g}", rounding=rounding
        )
        return steps, step_tokens
    if training_args.train_tokens is not None:
        steps = steps_for_tokens(
            training_args.train_tokens,
            step_tokens,
            "train_tokens",
            training_args.train_tokens,
            rounding=rounding,
        )
        return steps, step_tokens
    if training_args.max_steps is None or training_args.max_steps <= 0:
        raise RecipeError(
            "LoopedTrainingArguments: give the run a length: max_steps, train_tokens or train_flops_budget"
        )
    return training_args.max_steps, step_tokens


@dataclass
class ResolvedRun:
    """What a recipe resolves to before anything trains (`resolve_run`): `train` runs it, and
    `looped-hf train RECIPE --check` prints it."""

    tokenizer: Any
    config: Any
    flops_per_token: float
    max_steps: int
    step_tokens: int
    lr_tokens: float
    lr_scaling: dict[str, Any] | None
    source: str
    n_once: int
    n_rec: int
    #: The teacher's forward FLOPs per token (0 without distillation); included in `flops_per_token`.
    teacher_flops_per_token: float = 0.0


def resolve_run(
    model_args: ModelArguments, data_args: Any, training_args: LoopedTrainingArguments
) -> ResolvedRun:
    """Check everything about a parsed recipe that can be checked without data or training: the
    data source's name, the tokenizer, the model config (its FLOPs on the meta device), the run's
    length and the optimizer's per-run lrs. Raises `RecipeError` naming the field; reads no data,
    allocates no weights. `train` calls it first; `--check` calls only it."""
    from transformers.initialization import no_init_weights

    from looped_hf.data import load_tokenizer
    from looped_hf.data.sources import describe_source, token_upper_bound
    from looped_hf.model_types import causal_lm_class
    from looped_hf.optim import hyperp_learning_rates, lr_train_tokens, muonh_parameter_groups, peft_base

    seq_len = data_args.seq_len
    try:  # a file there, a parent that is a file, a place nothing can be made, a name too long
        check_output_path(training_args.output_dir, "LoopedTrainingArguments.output_dir", directory=True)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    try:
        source = describe_source(data_args)
        bound = token_upper_bound(data_args)
    except ValueError as err:
        raise RecipeError(str(err)) from err
    except (OSError, RuntimeError) as err:  # too long, unreadable, ~user unknown: the OS's one line
        shown = str(data_args.dataset)[:80]
        raise RecipeError(f"DataArguments.dataset={shown!r}: cannot be read ({first_line(err)})") from None
    if bound is not None and data_args.eval_blocks * seq_len > bound:
        raise RecipeError(
            f"DataArguments.eval_blocks={data_args.eval_blocks}: {data_args.eval_blocks:,} held-out blocks of "
            f"seq_len={seq_len} need {data_args.eval_blocks * seq_len:,} tokens; {source} holds fewer than "
            f"{bound:,}"
        )
    try:
        tokenizer = load_tokenizer(data_args.tokenizer)
    except (OSError, ValueError, TypeError) as err:  # no such file, not on the Hub, offline, malformed
        raise RecipeError(f"tokenizer={data_args.tokenizer!r}: cannot be loaded: {first_line(err)}") from err
    config = start_config(model_args, training_args, tokenizer, seq_len)
    if training_args.init_from is not None and Path(training_args.init_from).is_dir():
        # The weights against this config (keys, shapes, dtypes) before output_dir is written: a
        # refused run leaves nothing behind.
        from looped_hf.model_types import check_weights

        try:
            check_weights(training_args.init_from, config)
        except ValueError as err:
            raise RecipeError(f"LoopedTrainingArguments.init_from={training_args.init_from!r}: its weights do not "
                              f"load into this config ({first_line(err)})") from None  # fmt: skip
    if training_args.lora_rank is not None and importlib.util.find_spec("peft") is None:
        raise RecipeError(
            f"LoopedTrainingArguments.lora_rank={training_args.lora_rank}: LoRA needs peft (pip install peft), "
            "which is not installed"
        )
    try:
        # Shapes are all that is read: on the meta device, without initialisation, nothing is allocated.
        with torch.device("meta"), no_init_weights():
            model = causal_lm_class(config)(config)
        params = model.num_scaling_params()
        # Counted as it will train: a frozen backbone or LoRA runs no weight gradient for the frozen
        # weights (accounting_looped), so the plan and the compute callback give one number.
        flops_per_token = peft_base(what_trains(model, training_args)).training_flops_per_token(seq_len)
    except (RuntimeError, ValueError, OverflowError) as err:  # sizes past what torch can index
        raise RecipeError(
            f"the model of this recipe cannot be built (hidden_size={config.hidden_size}, "
            f"intermediate_size={config.intermediate_size}, layers {config.num_hidden_layers}): {first_line(err)}"
        ) from err
    sampling = training_args.recurrence_sampling
    if sampling != "fixed":
        # A budget in FLOPs buys tokens at the mean r (E[r] = num_recurrences); the record keeps the
        # FLOPs of the r actually run.
        if config.is_recurrence_locked:
            raise RecipeError(
                f"LoopedTrainingArguments.recurrence_sampling={sampling!r}: input_injection="
                f"{config.input_injection!r} is r-locked (parameters indexed by recurrence step); use 'fixed'"
            )
        if config.num_recurrences < 2:
            raise RecipeError(
                f"LoopedConfig.num_recurrences={config.num_recurrences}: recurrence_sampling={sampling!r} "
                "needs a mean r >= 2"
            )
    if training_args.recurrence_curriculum != "none":
        check_curriculum(training_args, config)
    teacher_fpt = 0.0
    if training_args.distill_from is not None:
        teacher_fpt = teacher_flops(training_args.distill_from, config, seq_len)
        flops_per_token += teacher_fpt
    max_steps, step_tokens = resolve_max_steps(training_args, flops_per_token, seq_len)
    # muonh's per-run lrs (HyperP) from this run's batch, tokens and width, before any training:
    # a bad lr setting is a recipe error. `lr_tokens` is T of the data scaling (the target tokens).
    lr_tokens = lr_train_tokens(training_args, flops_per_token, max_steps, step_tokens)
    lr_scaling = None
    if training_args.optimizer == "muonh":
        try:
            lr_scaling = hyperp_learning_rates(
                training_args, config, tokens_per_step=step_tokens, train_tokens=lr_tokens
            ).to_dict()
            muonh_parameter_groups(model)  # a parameter no group takes
        except ValueError as err:
            raise RecipeError(str(err)) from err
    return ResolvedRun(
        tokenizer, config, flops_per_token, max_steps, step_tokens, lr_tokens, lr_scaling, source,
        n_once=int(params["once"]), n_rec=int(params["recurrent"]), teacher_flops_per_token=teacher_fpt,
    )  # fmt: skip


def start_config(
    model_args: ModelArguments, training_args: LoopedTrainingArguments, tokenizer: Any, seq_len: int
) -> Any:
    """The run's `LoopedConfig`: the recipe's model fields over the defaults, or (``init_from``) over
    the folder's config, whose vocabulary, special tokens and rope settings then stay."""
    from looped_hf.model_types import load_config, with_overrides

    if training_args.init_from is None:
        return model_args.to_config(
            len(tokenizer), seq_len,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    where = f"LoopedTrainingArguments.init_from={training_args.init_from!r}"
    try:
        base = load_config(training_args.init_from)  # a per-loop LoRA retrofit's config class too
    except (OSError, ValueError, TypeError) as err:
        raise RecipeError(f"{where}: not a looped checkpoint folder ({first_line(err)})") from None
    try:
        config = with_overrides(base, model_args.settings)
    except (TypeError, ValueError, OverflowError) as err:
        raise RecipeError(first_line(err)) from err
    if config.max_position_embeddings < seq_len:
        raise RecipeError(
            f"DataArguments.seq_len={seq_len}: longer than the max_position_embeddings="
            f"{config.max_position_embeddings} of {training_args.init_from!r}"
        )
    if len(tokenizer) > config.vocab_size:
        raise RecipeError(
            f"DataArguments.tokenizer={getattr(tokenizer, 'name_or_path', '?')!r}: {len(tokenizer):,} tokens, more "
            f"than the vocab_size={config.vocab_size:,} of {training_args.init_from!r} (use the folder's tokenizer)"
        )
    return config


def check_curriculum(training_args: LoopedTrainingArguments, config: Any) -> None:
    """A curriculum needs a model whose r can change, and a start no higher than its max
    (``num_recurrences``)."""
    if config.is_recurrence_locked:
        raise RecipeError(
            f"LoopedTrainingArguments.recurrence_curriculum={training_args.recurrence_curriculum!r}: input_injection="
            f"{config.input_injection!r} is r-locked (parameters indexed by recurrence step); use 'none'"
        )
    if training_args.curriculum_start > config.num_recurrences:
        raise RecipeError(
            f"LoopedTrainingArguments.curriculum_start={training_args.curriculum_start}: above the curriculum's max, "
            f"num_recurrences={config.num_recurrences}"
        )


def curriculum_of(training_args: LoopedTrainingArguments, config: Any, max_steps: int) -> Any:
    """The run's `RecurrenceCurriculum`, or None."""
    from looped_hf.recurrence import RecurrenceCurriculum

    if training_args.recurrence_curriculum == "none":
        return None
    return RecurrenceCurriculum(
        training_args.recurrence_curriculum, training_args.curriculum_start, int(config.num_recurrences),
        float(training_args.curriculum_fraction), max_steps,
    )  # fmt: skip


def trainable_adapter(model: torch.nn.Module) -> list[str]:
    """``freeze_backbone``: every weight frozen but the injection adapter's; returns what trains.
    A model without an adapter with weights is a `RecipeError`."""
    injection = getattr(model.model, "injection", None)
    if injection is None or not any(True for _ in injection.parameters()):
        raise RecipeError(
            f"LoopedTrainingArguments.freeze_backbone=True: input_injection={model.config.input_injection!r} "
            "has no adapter weights to train (use 'linear')"
        )
    model.requires_grad_(False)
    injection.requires_grad_(True)
    return [name for name, p in model.named_parameters() if p.requires_grad]


def build_student(config: Any, training_args: LoopedTrainingArguments) -> torch.nn.Module:
    """The model the run trains: new (initialised by the seed), or ``init_from``'s weights in
    float32; then `what_trains`."""
    from looped_hf.model_types import causal_lm_class

    if training_args.init_from is None:
        model = causal_lm_class(config)(config)
    else:
        try:  # a local folder's weights were checked against this config by resolve_run
            model = causal_lm_class(config).from_pretrained(
                training_args.init_from, config=config, dtype=torch.float32
            )
        except (OSError, ValueError, RuntimeError) as err:  # missing weights, shapes the recipe changed
            raise RecipeError(
                f"LoopedTrainingArguments.init_from={training_args.init_from!r}: its weights do not load into this "
                f"config ({first_line(err)})"
            ) from None
    return what_trains(model, training_args)


def what_trains(model: torch.nn.Module, training_args: LoopedTrainingArguments) -> torch.nn.Module:
    """``model`` frozen but its adapter (``freeze_backbone``) or wrapped in peft LoRA (``lora_rank``:
    every linear layer but lm_head, no dropout), or as it is; the one place both are applied, for
    the run's model and for the meta-device model its FLOPs are planned on."""
    if training_args.freeze_backbone:
        trainable_adapter(model)
    if training_args.lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=training_args.lora_rank, lora_alpha=training_args.lora_alpha,
                          target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")  # fmt: skip
        model = get_peft_model(model, lora)
    return model


def check_recipe(
    recipe: str | os.PathLike | dict[str, Any] | None, argv: list[str] | None = None
) -> tuple[tuple[ModelArguments, Any, LoopedTrainingArguments], ResolvedRun]:
    """Validate a recipe completely and train nothing: every value's type and range, the config,
    the data source's name, the tokenizer, the run's length and the optimizer's lrs
    (`parse_recipe` then `resolve_run`). Raises `RecipeError` naming the field."""
    parsed = parse_recipe(recipe, argv)
    return parsed, resolve_run(*parsed)


def _millions(n: float) -> str:
    return f"{n / 1e6:.3g}M" if n >= 1e5 else f"{n:,.0f}"


def describe_check(
    where: str, parsed: tuple[ModelArguments, Any, LoopedTrainingArguments], resolved: ResolvedRun
) -> str:
    """What `looped-hf train RECIPE --check` prints: the recipe is valid, and what it resolved to."""
    _, data_args, training_args = parsed
    config, seq_len = resolved.config, data_args.seq_len
    tokens = resolved.max_steps * resolved.step_tokens
    if training_args.train_flops_budget is not None:
        length = f"train_flops_budget {training_args.train_flops_budget:.4g}, rounded {training_args.train_steps_rounding}"
    elif training_args.train_tokens is not None:
        length = f"train_tokens {training_args.train_tokens:,}, rounded {training_args.train_steps_rounding}"
    else:
        length = "max_steps"
    if resolved.lr_scaling is not None:
        groups = ("matrix", "embedding", "lm_head", "norm", "hyperconnection")
        lrs = f"muonh, lr_scaling {resolved.lr_scaling['scaling']}: " + ", ".join(
            f"{g} {resolved.lr_scaling[g]:.4g}" for g in groups
        )
    elif training_args.optimizer == "muon":
        lrs = (
            f"muon, matrix lr {training_args.muon_learning_rate:g}, AdamW lr {training_args.learning_rate:g}"
        )
    else:
        lrs = f"adamw, lr {training_args.learning_rate:g}, weight decay {training_args.weight_decay:g}"
    schedule = (
        f"study schedule (warmup {training_args.warmup_steps:g}, decay to {training_args.final_lr_ratio:g} x peak)"
        if training_args.lr_schedule == "study"
        else f"Trainer schedule {getattr(training_args.lr_scheduler_type, 'value', training_args.lr_scheduler_type)}"
    )
    layers = f"{config.num_prelude_layers} + {config.num_recurrent_layers} x {config.num_recurrences} + {config.num_coda_layers}"
    lines = [
        f"{where}: valid; nothing was trained.",
        f"  model      {arch_name(config)}: hidden {config.hidden_size}, {config.num_attention_heads} heads x "
        f"{config.head_dim}, layers {layers} = {config.effective_num_layers} applied, {config.input_injection} "
        f"injection; N_once {_millions(resolved.n_once)}, N_rec {_millions(resolved.n_rec)}",
        f"  data       {resolved.source}",
        f"  tokenizer  {getattr(resolved.tokenizer, 'name_or_path', data_args.tokenizer)} ({len(resolved.tokenizer):,} tokens); "
        f"blocks of {seq_len:,}; held-out {data_args.eval_blocks:,} blocks "
        f"({data_args.eval_blocks * seq_len:,} tokens), split seed {data_args.split_seed}",
        f"  length     {resolved.max_steps:,} optimizer steps x {resolved.step_tokens:,} tokens = {tokens:,} tokens "
        f"({length}); {resolved.flops_per_token:.4g} FLOPs/token, {resolved.flops_per_token * tokens:.4g} FLOPs",
        f"  optimizer  {lrs}; {schedule}; max_grad_norm {training_args.max_grad_norm:g}",
    ]
    retrofit = _describe_retrofit(training_args, resolved)
    if retrofit:
        lines.append(f"  retrofit   {retrofit}")
    lines.append(f"  output     {training_args.output_dir}")
    return "\n".join(lines)


def _describe_retrofit(training_args: LoopedTrainingArguments, resolved: ResolvedRun) -> str:
    """The retrofit fields a recipe sets, in one line of `--check` ("" when none is)."""
    parts = []
    if training_args.init_from is not None:
        parts.append(f"starts from {training_args.init_from}")
    curriculum = curriculum_of(training_args, resolved.config, resolved.max_steps)
    if curriculum is not None:
        parts.append(f"mean r {curriculum.start} -> {curriculum.maximum} over the first {curriculum.warmup_steps:,} "
                     f"steps ({curriculum.shape})")  # fmt: skip
    if training_args.freeze_backbone:
        parts.append("trains the injection adapter only")
    if training_args.lora_rank is not None:
        parts.append(f"LoRA rank {training_args.lora_rank}, alpha {training_args.lora_alpha:g}")
    if training_args.distill_from is not None:
        parts.append(f"distils from {training_args.distill_from} (a {training_args.distill_alpha:g}, "
                     f"T {training_args.distill_temperature:g}; its forward "
                     f"{resolved.teacher_flops_per_token:.4g} FLOPs/token counted)")  # fmt: skip
    return "; ".join(parts)
