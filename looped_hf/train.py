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

import json
import math
import os
import platform
import shutil
import sys
import time
import traceback
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
)
from looped_hf.attention_backends import apply_attention_backend
from looped_hf.fileio import (
    RECORD_NAME,
    append_jsonl,
    current_umask,
    sha256_file,
    write_json_atomic,
    write_yaml_atomic,
)
from looped_hf.run_callbacks import (  # noqa: F401
    PROGRESS_NAME,
    NonFiniteLossGuard,
    ProgressFileCallback,
    compile_forward,
    uncompile_forward,
)
from looped_hf.run_resolve import (  # noqa: F401
    ResolvedRun,
    _describe_retrofit,
    _millions,
    arch_name,
    build_student,
    check_curriculum,
    check_recipe,
    curriculum_of,
    describe_check,
    resolve_max_steps,
    resolve_run,
    start_config,
    trainable_adapter,
    what_trains,
)
from looped_hf.teacher import (  # noqa: F401
    BIDIRECTIONAL_TYPES,
    check_teacher,
    teacher_flops,
)

RECIPE_NAME = "recipe.yaml"
#: The lineage `looped-hf retrofit` writes (parent, its sha256, layer map, method); a run that
#: starts from such a folder keeps it in its record and its own folder.
RETROFIT_NAME = "retrofit.json"
CHECKPOINTS_DIR = "checkpoints"

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
