"""One training run from a recipe: `looped-hf train`, `python -m looped_hf.train`, `accelerate launch`.

    looped-hf train recipes/tiny.yaml
    looped-hf train recipes/tiny.yaml --num_recurrences 8 --dataset roneneldan/TinyStories
    accelerate launch -m looped_hf.train recipes/tiny.yaml        # many processes / GPUs

The run is `LoopedTrainer` (the `transformers.Trainer` less per-step bookkeeping nobody reads,
`looped_hf.trainer`) plus `LoopedComputeCallback`; the optimizer is
AdamW, Muon + AdamW, or the study's MuonH + AdamW groups with HyperP per-run lrs (`optimizer:
muonh`), with the study's schedule (`looped_hf.optim`); the record keeps the peak lr of each group. The run's
length is `max_steps`, `train_tokens` or `train_flops_budget` (FLOPs from the model's own
`training_flops_per_token`). At the end the held-out loss is measured token-weighted (our own
loop: Trainer's `eval_loss` is a mean of batch means) and the run directory (`output_dir`) gets:

    config.json, model.safetensors, configuration_looped.py, modeling_looped.py (+ the two files it imports),
    generation_config.json, tokenizer files      (save_pretrained: loads with trust_remote_code)
    run_record.json                               (the record below; the fit's columns; the run's average
                                                   tokens/s, model FLOPs/s and MFU where the device's peak is known)
    recipe.yaml                                   (the resolved recipe: reruns this run)
    checkpoints/                                  (Trainer checkpoints; a rerun resumes from the last)

A rerun with the same `output_dir` resumes from the last checkpoint in `checkpoints/`.

Retrofit training (docs/retrofit.md): `init_from` starts from a looped folder's weights,
`recurrence_curriculum` raises the mean r over the run (`looped_hf.recurrence`), `freeze_backbone`
trains the injection adapter alone, `lora_rank` trains peft LoRA (the merged model is saved), and
`distill_from` adds a frozen dense teacher (`looped_hf.trainer.DistillingTrainer`) whose forward
counts in `train_flops`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, set_seed

from looped_hf.arguments import (
    LoopedTrainingArguments,
    ModelArguments,
    RecipeError,
    parse_recipe,
    recipe_parser,
    resolved_recipe,
    steps_for_tokens,
    tokens_per_step,
)
from looped_hf.attention_backends import apply_attention_backend
from looped_hf.fileio import (
    RECORD_NAME,
    append_jsonl,
    check_output_path,
    current_umask,
    first_line,
    sha256_file,
    write_json_atomic,
    write_yaml_atomic,
)

RECIPE_NAME = "recipe.yaml"
#: The lineage `looped-hf retrofit` writes (parent, its sha256, layer map, method); a run that
#: starts from such a folder keeps it in its record and its own folder.
RETROFIT_NAME = "retrofit.json"
CHECKPOINTS_DIR = "checkpoints"
PROGRESS_NAME = "progress.json"

#: Keys of every run record, in order (the scaling fit's columns are the first six).
RECORD_KEYS = (
    "loss", "tokens", "n_once", "n_rec", "num_recurrences", "train_flops",
    "budget", "arch", "variant", "hidden_size", "seed", "status", "error",
    "effective_num_layers", "backprop_recurrences", "eval_perplexity", "eval_tokens",
    "train_loss", "train_runtime_s", "train_flops_per_token", "trainer_total_flos", "max_steps", "tokens_per_step",
    "seq_len", "num_processes", "config", "recipe", "versions", "wall_time_s", "run_id", "run_dir",
    "learning_rates", "recurrence_sampling", "sampled_recurrences",
    "tokens_per_second", "model_flops_per_second", "mfu", "peak_flops",
    "init_from", "trainable", "distillation", "retrofit", "parent_loss",
)  # fmt: skip


def arch_name(config: Any) -> str:
    """'base' for a model without a loop (r = 1 or an empty block), else 'loop<r>'."""
    if config.num_recurrences == 1 or config.num_recurrent_layers == 0:
        return "base"
    return f"loop{config.num_recurrences}"


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Versions that make a result reproducible: python, torch, transformers, looped_hf, + ``extra``."""
    import importlib

    import transformers

    import looped_hf

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "looped_hf": getattr(looped_hf, "__version__", "unknown"),
    }
    out.update({name: importlib.import_module(name).__version__ for name in extra})
    return out


def _has_accelerator() -> bool:
    """Whether torch sees a GPU (or other accelerator) that pinned host memory could feed."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


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


def last_checkpoint(checkpoint_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-<step>` (one with trainer_state.json), or None."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    done = []
    for path in root.glob("checkpoint-*"):
        suffix = path.name.split("-")[-1]
        if suffix.isdigit() and (path / "trainer_state.json").exists():
            done.append((int(suffix), path))
    return str(max(done)[1]) if done else None


def compile_forward(model: torch.nn.Module, training_args: LoopedTrainingArguments, sampled: bool) -> bool:
    """`torch_compile: true`: compile the model's `forward` here instead of letting the Trainer
    compile the whole module; returns whether it did (undo with `uncompile_forward`).

    Why not the Trainer's `torch.compile(model)`: that traces the module's forward pre-hooks too, and
    the hooks of `RecurrenceSamplingCallback` (numpy's RNG: graph breaks) and `LoopedComputeCallback`
    (Python counters) belong outside the graph. Compiling `forward` keeps every hook eager and the
    whole loop in one graph (the model is `_can_compile_fullgraph`; r is a Python int, so each r
    is its own graph). A sampled r therefore compiles at most one graph per distinct r: the
    recompile limit is raised so that no r falls back to eager. The recipe still records
    `torch_compile: true`; backend and mode come from `torch_compile_backend` / `_mode`.
    """
    if not training_args.torch_compile:
        return False
    kwargs = {
        "backend": training_args.torch_compile_backend or "inductor",
        "mode": training_args.torch_compile_mode,
    }
    # Switch the Trainer's (accelerate's) own compile off: the flag, and the environment that
    # TrainingArguments.__post_init__ set for accelerate's TorchDynamoPlugin.
    training_args.torch_compile = False
    training_args.torch_compile_backend = training_args.torch_compile_mode = None
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):
        os.environ.pop(name, None)
    if sampled:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    model.forward = torch.compile(model.forward, **kwargs)
    return True


def uncompile_forward(model: torch.nn.Module) -> None:
    """Back to the class's eager forward (held-out evaluation and saving run eagerly)."""
    model.__dict__.pop("forward", None)


class NonFiniteLossGuard(TrainerCallback):
    """Stops training at the first logged non-finite loss (the run is then recorded as failed)."""

    def __init__(self) -> None:
        self.error: str | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.error = f"non-finite training loss {loss} at step {state.global_step}"
            control.should_training_stop = True


class ProgressFileCallback(TrainerCallback):
    """Keeps `<run_dir>/progress.json` ({"step", "max_steps", "loss", "started", "time"}) current, so a sweep
    runner can show every running run's step and latest loss whatever process trains it (in
    process, a worker, `accelerate launch`, a submitit job). Advisory: replaced atomically (a
    reader never sees half a file), not fsynced."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / PROGRESS_NAME
        self.loss: float | None = None
        self.started = time.time()

    def _write(self, state: Any) -> None:
        if not state.is_world_process_zero:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        data = {"step": state.global_step, "max_steps": state.max_steps, "loss": self.loss,
                "started": self.started, "time": time.time()}  # fmt: skip
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.time()
        self._write(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if (logs or {}).get("loss") is not None:
            self.loss = float(logs["loss"])
        self._write(state)


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    dataset: Any,
    batch_size: int,
    accelerator: Any = None,
    num_recurrences: int | None = None,
) -> tuple[float, int]:
    """Token-weighted mean next-token loss (nats/token) over `dataset`, and the tokens predicted.

    Each process takes every world_size-th block; sums of (loss x tokens) and tokens are reduced
    across processes, so the mean is exact whatever the batch split. `num_recurrences` runs the
    model at that r (None: its configured r), for test-time scaling curves (`looped_hf.recurrence_curves`);
    left None, the call passes no r at all, so a dense transformers model (a retrofit's parent) is
    measured on the same held-out blocks by the same loop.
    """
    rank = accelerator.process_index if accelerator is not None else 0
    world = accelerator.num_processes if accelerator is not None else 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    indices = list(range(rank, len(dataset), world))
    for start in range(0, len(indices), batch_size):
        rows = dataset[indices[start : start + batch_size]]["input_ids"]
        ids = torch.as_tensor(rows, dtype=torch.long, device=device)
        labels = ids.clone()
        at_r = {} if num_recurrences is None else {"num_recurrences": num_recurrences}
        out = model(input_ids=ids, labels=labels, **at_r)
        loss = out.loss
        if getattr(model.config, "exit_gate_entropy_beta", None) is not None:
            # An exit gate trained with Ouro's objective returns sum_t p_t L_t - beta H(p) as its
            # loss (the entropy bonus lowers it); held out, the model is judged by the
            # cross-entropy of the logits it returns, as every other model is.
            loss = model.loss_function(logits=out.logits, labels=labels, vocab_size=model.config.vocab_size)
        # The model's loss is the mean over the shifted targets: B x (T - 1) of them.
        n = (labels[:, 1:] != -100).sum()
        total += torch.stack([loss.double() * n, n.double()])
    if accelerator is not None and world > 1:
        total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    loss_sum, n_tokens = total.tolist()
    return (loss_sum / n_tokens if n_tokens else math.nan), int(n_tokens)


def retrofit_lineage(init_from: str | None) -> dict[str, Any] | None:
    """The `retrofit.json` of the folder a run starts from (None: no folder, or not a retrofit)."""
    if init_from is None or not (Path(init_from) / RETROFIT_NAME).is_file():
        return None
    return json.loads((Path(init_from) / RETROFIT_NAME).read_text(encoding="utf-8"))


def lineage_parent(init_from: str | None, lineage: dict[str, Any] | None) -> str | None:
    """The retrofit parent of a run's ``init_from`` folder, for its reference loss: ``retrofit.json``
    names it by folder name (never a path, `retrofit.core`), looked for beside ``init_from`` and
    then in the working directory (a path, as older records hold, is taken as it is), and taken
    only where its weight files have the digests the record holds. None: not found."""
    parent = (lineage or {}).get("parent") or {}
    name, digests = parent.get("path"), parent.get("weights_sha256")
    if not isinstance(name, str) or not name or init_from is None:
        return None
    for candidate in dict.fromkeys([Path(init_from).parent / name, Path(name)]):
        if not candidate.is_dir():
            continue
        if not isinstance(digests, dict) or all(
            (candidate / file).is_file() and sha256_file(candidate / file) == digest for file, digest in digests.items()
        ):
            return str(candidate)
    return None


def parent_heldout_loss(
    parent_dir: str, dataset: Any, batch_size: int, accelerator: Any = None, model: Any = None
) -> dict[str, Any]:
    """``{"path", "loss", "eval_tokens"}`` of a dense transformers parent on ``dataset`` (the run's
    held-out blocks, `heldout_loss`). ``model``: the parent already loaded (a distillation teacher)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.float32)
        if accelerator is not None:
            model = model.to(accelerator.device)
    loss, tokens = heldout_loss(model, dataset, batch_size, accelerator)
    return {"path": str(parent_dir), "loss": loss, "eval_tokens": tokens}


def _empty_record(training_args: LoopedTrainingArguments, run_dir: Path) -> dict[str, Any]:
    record: dict[str, Any] = dict.fromkeys(RECORD_KEYS)
    record.update(
        run_id=training_args.run_id or run_dir.name,
        run_dir=str(run_dir),
        variant=training_args.variant,
        recurrence_sampling=training_args.recurrence_sampling,
        budget=training_args.train_flops_budget,
        seed=training_args.seed,
        status="failed",
    )
    return record


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
    from looped_hf.model_types import load_config

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
        config = type(base).from_dict({**base.to_dict(), **model_args.settings})
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


def train(
    model_args: ModelArguments,
    data_args: Any,
    training_args: LoopedTrainingArguments,
    callbacks: list[TrainerCallback] | None = None,
    trainer_class: type[Trainer] | None = None,
) -> dict[str, Any]:
    """Train one model and return its run record (also written to `<output_dir>/run_record.json`).

    `trainer_class` (default `LoopedTrainer`): a `Trainer` subclass to run instead, e.g. the vanilla
    `transformers.Trainer` to compare against.

    Recipe errors (`RecipeError`: bad field, budget below one step) are raised before training.
    Failures during training (exception, out of memory, non-finite loss) do not raise: the record
    has `status="failed"` and `error`.
    """
    from looped_hf.callback import LoopedComputeCallback
    from looped_hf.data import TokenBlocks, build_datasets, collator
    from looped_hf.optim import build_optimizer_and_scheduler, learning_rates
    from looped_hf.trainer import LoopedTrainer

    started = time.time()
    run_dir = Path(training_args.output_dir)
    recipe = resolved_recipe(model_args, data_args, training_args)
    record = _empty_record(training_args, run_dir)
    seq_len = data_args.seq_len

    if training_args.torch_num_threads is not None:
        torch.set_num_threads(training_args.torch_num_threads)
    # --- everything that can be wrong with the recipe fails here, before any training ----------
    resolved = resolve_run(model_args, data_args, training_args)
    tokenizer, config, sampling = resolved.tokenizer, resolved.config, training_args.recurrence_sampling
    flops_per_token, max_steps, step_tokens = (
        resolved.flops_per_token,
        resolved.max_steps,
        resolved.step_tokens,
    )
    lr_tokens, lr_scaling = resolved.lr_tokens, resolved.lr_scaling
    record.update(
        arch=training_args.arch or arch_name(config),
        hidden_size=config.hidden_size,
        num_recurrences=config.num_recurrences,
        effective_num_layers=config.effective_num_layers,
        backprop_recurrences=config.backprop_recurrences,
        config=json.loads(config.to_json_string()),
        recipe=recipe,
        versions=versions(),
        max_steps=max_steps,
        tokens_per_step=step_tokens,
        seq_len=seq_len,
        num_processes=training_args.world_size,
        train_flops_per_token=flops_per_token,
    )
    training_args.max_steps = max_steps
    training_args.output_dir = str(run_dir / CHECKPOINTS_DIR)
    if not _has_accelerator():
        # Pinned memory and non-blocking copies only speed host-to-accelerator copies; without one,
        # torch and the Trainer warn that they are ignored. (After resolved_recipe: the recorded
        # recipe stays as written.)
        training_args.dataloader_pin_memory = False
        training_args.accelerator_config.non_blocking = False
    is_main = training_args.process_index == 0
    made_run_dir = not run_dir.exists()
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_yaml_atomic(run_dir / RECIPE_NAME, recipe)

    trainer = None
    try:
        set_seed(training_args.seed)
        model = build_student(config, training_args)
        record.update(
            init_from=training_args.init_from,
            trainable={"parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                       "of": sum(p.numel() for p in model.parameters()),
                       "mode": "lora" if training_args.lora_rank else "adapter" if training_args.freeze_backbone else "all"},
        )  # fmt: skip
        # The study's kernel choice (FA3 / FA2 / FA4 / sdpa by device and installed packages), kept
        # in the record so that a throughput number can be traced to the kernel that produced it.
        backend = apply_attention_backend(model, model_args.attn_implementation)
        record["attention_backend"] = backend.to_record()
        if is_main:
            print(f"[train] attention: {backend.reason}")
        curriculum = curriculum_of(training_args, config, max_steps)
        varying_r = sampling != "fixed" or curriculum is not None
        compile_forward(model, training_args, sampled=varying_r)
        with training_args.main_process_first(desc="tokenize and pack"):
            train_ds, eval_ds = build_datasets(data_args, tokenizer)
        train_ds = TokenBlocks.wrap(train_ds)  # same rows, read without a per-batch Arrow take
        optimizer, scheduler = build_optimizer_and_scheduler(
            model, training_args, max_steps, tokens_per_step=step_tokens, train_tokens=lr_tokens
        )
        # The peak lr of every param group as built (Trainer's own AdamW: learning_rate), and for
        # muonh how they were obtained (lr_scaling, the HyperP factors, B, T and D_REF).
        used = learning_rates(optimizer) if optimizer is not None else {"adamw": training_args.learning_rate}
        record["learning_rates"] = dict(used, scaling=lr_scaling) if lr_scaling else dict(used)
        if is_main:
            lr_text = ", ".join(f"{k} {v:.4g}" for k, v in used.items())
            print(f"[train] {record['run_id']}: {max_steps:,} steps x {step_tokens:,} tokens; held-out "
                  f"{len(eval_ds):,} blocks x {seq_len:,} = {len(eval_ds) * seq_len:,} tokens; peak lrs: {lr_text}")  # fmt: skip
        compute = LoopedComputeCallback(
            seq_len=seq_len, peak_flops=training_args.peak_flops,
            teacher_flops_per_token=resolved.teacher_flops_per_token, log_recurrences=varying_r,
        )  # fmt: skip
        guard = NonFiniteLossGuard()
        sampler = None
        if varying_r:
            from looped_hf.recurrence import RecurrenceSamplingCallback

            sampler = RecurrenceSamplingCallback(
                seed=training_args.seed, scheme=sampling, curriculum=curriculum
            )
        trainer_kwargs: dict[str, Any] = {}
        if training_args.distill_from is not None:
            from transformers import AutoModelForCausalLM

            from looped_hf.trainer import DistillingTrainer

            if trainer_class is not None and not issubclass(trainer_class, DistillingTrainer):
                raise RecipeError(
                    f"LoopedTrainingArguments.distill_from={training_args.distill_from!r}: needs a DistillingTrainer, "
                    f"not {trainer_class.__name__}"
                )
            trainer_class = trainer_class or DistillingTrainer
            teacher = AutoModelForCausalLM.from_pretrained(training_args.distill_from, dtype=torch.float32)
            trainer_kwargs = dict(teacher=teacher, alpha=training_args.distill_alpha,
                                  temperature=training_args.distill_temperature)  # fmt: skip
            record["distillation"] = {"teacher": training_args.distill_from, "alpha": training_args.distill_alpha,
                                      "temperature": training_args.distill_temperature,
                                      "teacher_flops_per_token": resolved.teacher_flops_per_token}  # fmt: skip
        trainer = (trainer_class or LoopedTrainer)(
            model=model,
            args=training_args,
            data_collator=collator(tokenizer, data_args),
            train_dataset=train_ds,
            eval_dataset=eval_ds,
            processing_class=tokenizer,
            callbacks=[
                *([sampler] if sampler else []),
                compute,
                guard,
                ProgressFileCallback(run_dir),
                *(callbacks or []),
            ],
            optimizers=(optimizer, scheduler),
            **trainer_kwargs,
        )
        resume = training_args.resume_from_checkpoint or last_checkpoint(training_args.output_dir)
        output = trainer.train(resume_from_checkpoint=resume)
        uncompile_forward(model)
        summary = compute.summary(trainer.state)
        if training_args.lora_rank is not None:
            # The run directory holds a looped model like any run's: the LoRA updates merged in.
            model = trainer.model = model.merge_and_unload()
        loss, eval_tokens = heldout_loss(
            model, eval_ds, training_args.per_device_eval_batch_size, trainer.accelerator
        )
        record.update(
            loss=loss,
            eval_tokens=eval_tokens,
            eval_perplexity=math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf,
            tokens=summary["train_tokens"],
            train_flops=summary["train_flops"],
            trainer_total_flos=summary["trainer_total_flos"],
            n_once=summary["n_once"],
            n_rec=summary["n_rec"],
            train_loss=output.metrics.get("train_loss"),
            train_runtime_s=output.metrics.get("train_runtime"),
            resumed_from=resume,
            recurrence_sampling=sampling,
            # With a curriculum also the r of every step (`per_step`) and the curriculum itself.
            sampled_recurrences=sampler.summary(trainer.state.global_step) if sampler else None,
            # The run's average over training time (evaluation and checkpoint writes left out);
            # mfu only where the device's dense bf16 peak is known (recipe peak_flops or the table).
            tokens_per_second=summary["tokens_per_second"],
            model_flops_per_second=summary["model_flops_per_second"],
            mfu=summary["mfu"],
            peak_flops=summary["peak_flops"],
        )
        if sampler is not None or resolved.teacher_flops_per_token:
            # The mean over the r actually run (not the planning value at mean r), teacher included.
            record["train_flops_per_token"] = summary["train_flops_per_token"]
        lineage = retrofit_lineage(training_args.init_from)
        parent_dir = training_args.distill_from or lineage_parent(training_args.init_from, lineage)
        record.update(retrofit=lineage, parent_loss=None)
        if parent_dir is not None and Path(parent_dir).is_dir():
            # The card's reference line: the dense parent on the same held-out blocks, measured once.
            record["parent_loss"] = parent_heldout_loss(
                parent_dir, eval_ds, training_args.per_device_eval_batch_size, trainer.accelerator,
                getattr(trainer, "teacher", None),
            )  # fmt: skip
        if guard.error is not None:
            record["error"] = guard.error
        elif not math.isfinite(loss):
            record["error"] = f"non-finite held-out loss {loss}"
        else:
            record["status"] = "ok"
        # Trainer turns the cache off for training; the published model should generate with it.
        model.config.use_cache = True
        trainer.save_model(str(run_dir))
        if is_main and lineage is not None:  # the folder names its parent, as the retrofit's did
            write_json_atomic(run_dir / RETROFIT_NAME, lineage)
        if is_main:  # safetensors writes 0600; the run's weights are for whoever may read the run
            for weights in run_dir.glob("model*.safetensors"):
                weights.chmod(0o666 & ~current_umask())
    except Exception as err:  # noqa: BLE001 - a failed run is data for the sweep, not a crash
        if isinstance(err, RecipeError):
            # A recipe error found only once the model is built (a frozen backbone without an
            # adapter): the refused run leaves nothing behind, as one refused by resolve_run.
            if is_main and made_run_dir:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        record["error"] = f"{type(err).__name__}: {err}"
        record["traceback"] = traceback.format_exc(limit=20)
    finally:
        if trainer is not None:
            trainer.accelerator.wait_for_everyone()
    record["wall_time_s"] = round(time.time() - started, 3)
    if is_main:
        write_json_atomic(run_dir / RECORD_NAME, record)
        if training_args.results_file:
            append_jsonl(training_args.results_file, record)
    return record


def _usage() -> str:
    return (
        "usage: looped-hf train RECIPE.yaml [--field value ...] [--check]\n"
        "       accelerate launch -m looped_hf.train RECIPE.yaml [--field value ...]\n\n"
        "Train one looped model. The recipe is a flat YAML mapping of model, data and training fields;\n"
        "flags override it. --check validates the recipe completely (values, config, data source name,\n"
        "tokenizer, run length, optimizer) and prints what it resolves to, training nothing. Fields:\n"
    )


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns 0 (ok), 1 (the run failed) or 2 (bad recipe)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        recipe_parser().print_help()
        return 0 if argv else 2
    check = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    if not argv:
        print(
            "looped-hf train: --check needs a recipe (looped-hf train RECIPE.yaml --check)", file=sys.stderr
        )
        return 2
    recipe, overrides = (argv[0], argv[1:]) if not argv[0].startswith("--") else (None, argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        # `accelerate launch --multi_gpu --num_processes N` on a machine without GPUs: train on N
        # CPU processes (gloo) instead of N independent runs. (`accelerate launch --cpu` starts
        # a single process whatever --num_processes says.)
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    try:
        if check:
            parsed, resolved = check_recipe(recipe, overrides)
            where = f"recipe {recipe!r}" if recipe is not None else "recipe"
            print(
                describe_check(
                    where + (f" with {' '.join(overrides)}" if overrides and recipe else ""), parsed, resolved
                )
            )
            return 0
        model_args, data_args, training_args = parse_recipe(recipe, overrides)
        record = train(model_args, data_args, training_args)
    except (RecipeError, FileNotFoundError) as err:
        print(f"looped-hf train: {err}", file=sys.stderr)
        return 2
    if record["status"] != "ok":
        print(f"looped-hf train: run {record['run_id']} failed: {record['error']}", file=sys.stderr)
        return 1
    if training_args.process_index == 0:
        keys = (
            "run_id",
            "loss",
            "tokens",
            "train_flops",
            "n_once",
            "n_rec",
            "num_recurrences",
            "wall_time_s",
        )
        print(json.dumps({k: record[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
