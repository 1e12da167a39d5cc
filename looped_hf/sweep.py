"""Iso-depth sweeps: plan (budget x width x r), run resumably, append one record per run.

    looped-hf sweep recipes/iso_depth_tiny.yaml --dry-run     # the plan as a table; writes nothing
    looped-hf sweep recipes/iso_depth_tiny.yaml               # runs it; kill it, rerun, it resumes
    looped-hf sweep recipes/iso_depth_tiny.yaml --jobs 2      # two runs at once (default: cores // threads)

A sweep recipe is a training recipe (flat model / data / training fields, applied to every run)
plus a `sweep:` section (`SweepArguments`). For each budget C, width d (in that budget's list)
and r, the planner builds the study's iso-depth model (every r has the same effective depth L):

    r = 1:  prelude 0, block L x 1, coda 0, injection "none"      (a plain decoder; arch "base")
    r > 1:  prelude P, block (L - P - C) / r, coda C, injection  (arch "loop<r>")

and trains it for D = C / training_flops_per_token tokens (the model's own count, obtained on
the meta device), i.e. steps = ceil(D / tokens_per_step): never under budget, over by less than one
step; the run record holds the actual tokens and FLOPs. Variants: "truncated" (backprop through
the last k = ceil(r/2) recurrences) and "hyperconnection" (lanes at loop boundaries); their
r = 1 runs are the plain decoder, so each results file can be fitted on its own.

Sweep directory: `sweep.yaml` (the recipe), `plan.json`, `results.jsonl` (one JSON line per run,
appended atomically under a lock), `<run_id>/` run directories (see `looped_hf.train`; each
also gets `train.log`, the run's whole output, and `progress.json`), `worker-<i>.log`.
Resuming: runs already in results.jsonl are skipped; a finished run whose line is missing is
appended from its run_record.json; an interrupted run continues from its last checkpoint.
`--jobs N` keeps N runs in flight (local executor: N persistent worker processes, each dying
with the sweep); every run trains under an exclusive lock on its directory, so a run is never
trained by two processes at once and every run_id is in results.jsonl exactly once, whatever
was killed when. The console shows one live progress line (one line per finished run when
stdout is not a terminal); `--verbose` also prints the runs' logs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import io
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from looped_hf.arguments import RecipeError, load_yaml, steps_for_tokens

VARIANTS = ("base", "truncated", "hyperconnection")
EXECUTORS = ("local", "subprocess", "accelerate", "submitit")
RESULTS_NAME = "results.jsonl"
PLAN_NAME = "plan.json"
RECIPE_COPY = "sweep.yaml"


# ---------------------------------------------------------------------------------------------
# results.jsonl: atomic appends, tolerant reads
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on `<path>.lock` (a separate file, so the data file can be replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _parse_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Records of complete, valid lines, and the byte length of the valid prefix."""
    records, valid = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break  # a torn last line (killed mid-write): ignored, repaired on the next append
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        valid += len(line)
    return records, valid


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file; a truncated or corrupt tail is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    return _parse_lines(path.read_bytes())[0]


def append_jsonl(path: str | os.PathLike, record: dict[str, Any], unique_key: str | None = "run_id") -> bool:
    """Append `record` as one line: one `write` of the whole line, flush, fsync, under a file lock.

    A torn tail left by a killed writer is cut off first. With `unique_key`, a record whose key
    is already in the file is not appended again (returns False), so every run appears once even
    if two writers (a rerun and a stale job) finish the same run.
    """
    path = Path(path)
    line = (json.dumps(record, default=str, allow_nan=True) + "\n").encode("utf-8")
    with _locked(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with open(fd, "rb", closefd=False) as fh:
                data = fh.read()
            records, valid = _parse_lines(data)
            if unique_key is not None and any(r.get(unique_key) == record.get(unique_key) for r in records):
                return False
            if valid != len(data):
                os.ftruncate(fd, valid)
            os.lseek(fd, 0, os.SEEK_END)
            written = os.write(fd, line)
            if written != len(line):  # practically never for a local file; do not leave half a line
                os.ftruncate(fd, valid)
                raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
    return True


# ---------------------------------------------------------------------------------------------
# The sweep section of a recipe
# ---------------------------------------------------------------------------------------------
@dataclass
class SweepArguments:
    """The `sweep:` section of a sweep recipe (the rest of the file is the per-run recipe)."""

    budgets: list[float] = field(default_factory=list)
    """Training-FLOP budgets C (the model's `training_flops_per_token` x tokens)."""
    widths: list[list[int]] | list[int] = field(default_factory=list)
    """Hidden sizes d: one list per budget (index-aligned with `budgets`), or one list for all."""
    recurrences: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """The r values; each must divide `effective_depth - prelude - coda` (r = 1 always fits)."""
    effective_depth: int = 20
    """Layer applications per token, the same for every r (the study: 20)."""
    prelude: int = 2
    """Prelude layers of the looped models (r > 1); r = 1 has none."""
    coda: int = 2
    """Coda layers of the looped models (r > 1); r = 1 has none."""
    head_dim: int = 128
    """Per-head width; heads = d / head_dim (the study: 128, d = 64 s)."""
    injection: str = "linear"
    """Input injection of the looped models (the study: linear)."""
    variant: str = "base"
    """"base"; "truncated" (backprop through the last ceil(r/2) recurrences); "hyperconnection"."""
    hyperconnection_lanes: int = 2
    """Lanes for the hyperconnection variant (the study: 2)."""
    learning_rate_by_r: dict[int, float] | None = None
    """AdamW / Muon recipes: the `learning_rate` of each r (every r of `recurrences` listed), so
    every architecture trains at its own tuned lr, as the study's HyperP gives looped and plain
    models their own reference (D_REF). None: the recipe's `learning_rate` for all. Not with
    muonh, whose lrs HyperP computes per run."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """One run per seed per cell (the study: one seed); run ids get `-s<seed>` if several."""
    vocab_size: int | None = None
    """Plan with this vocabulary size instead of loading the tokenizer (offline dry runs of Hub
    tokenizers); the runs themselves always use the tokenizer's size."""
    executor: str = "local"
    """local: in this process (fast; exceptions are caught). subprocess: one `python -m
    looped_hf.train` per run (a crash cannot take the sweep down). accelerate: one `accelerate
    launch --num_processes N` per run. submitit: one SLURM (or local) job per run."""
    num_processes: int = 1
    """Processes per run (accelerate / submitit); part of tokens_per_step."""
    checkpoints_per_run: int = 4
    """Trainer checkpoints per run (the last one is kept), so a killed run resumes mid-way."""
    submitit: dict[str, Any] = field(default_factory=dict)
    """Passed to `submitit.AutoExecutor.update_parameters` (e.g. slurm_partition, timeout_min,
    gpus_per_node); `cluster` picks the executor ("local" for tests, default auto-detect)."""
    output_dir: str | None = None
    """The sweep directory (default: runs/<recipe file stem>); `--output` overrides."""

    def validate(self) -> None:
        def bad(name: str, why: str) -> RecipeError:
            return RecipeError(f"sweep.{name}={getattr(self, name)!r}: {why}")

        if not self.budgets or any(not isinstance(b, (int, float)) or b <= 0 for b in self.budgets):
            raise bad("budgets", "must be a non-empty list of positive FLOP counts")
        if not self.widths:
            raise bad("widths", "must list hidden sizes (one list per budget, or one for all)")
        if isinstance(self.widths[0], list) and len(self.widths) != len(self.budgets):
            raise bad("widths", f"has {len(self.widths)} lists for {len(self.budgets)} budgets")
        for w in self.widths_for_all():
            for d in w:
                if not isinstance(d, int) or d < 1 or d % self.head_dim:
                    raise bad("widths", f"width {d!r} is not a positive multiple of head_dim={self.head_dim}")
        if not self.recurrences or any(not isinstance(r, int) or r < 1 for r in self.recurrences):
            raise bad("recurrences", "must be a non-empty list of integers >= 1")
        depth = self.effective_depth - self.prelude - self.coda
        if self.prelude < 0 or self.coda < 0 or (depth < 1 and any(r > 1 for r in self.recurrences)):
            raise bad(
                "effective_depth",
                f"leaves {depth} recurrent layers after prelude {self.prelude} + coda {self.coda}",
            )
        for r in self.recurrences:
            if r > 1 and depth % r:
                raise bad(
                    "recurrences",
                    f"r={r} does not divide the recurrent depth effective_depth - prelude - coda = {depth}",
                )
        if self.variant not in VARIANTS:
            raise bad("variant", f"must be one of {VARIANTS}")
        if self.executor not in EXECUTORS:
            raise bad("executor", f"must be one of {EXECUTORS}")
        if self.num_processes < 1:
            raise bad("num_processes", "must be >= 1")
        if self.executor == "local" and self.num_processes != 1:
            raise bad("num_processes", "the local executor runs one process; use executor: accelerate")
        if self.checkpoints_per_run < 0:
            raise bad("checkpoints_per_run", "must be >= 0")
        if not self.seeds:
            raise bad("seeds", "must list at least one seed")
        if self.learning_rate_by_r is not None:
            lrs = self.learning_rate_by_r
            if not isinstance(lrs, dict) or any(
                not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 for v in lrs.values()
            ):
                raise bad("learning_rate_by_r", "must map each r to a positive learning rate")
            try:
                lrs = {int(k): float(v) for k, v in lrs.items()}
            except (TypeError, ValueError) as err:
                raise bad("learning_rate_by_r", f"keys must be values of r ({err})") from err
            missing = [r for r in self.recurrences if r not in lrs]
            if missing:
                raise bad("learning_rate_by_r", f"has no learning rate for r = {missing}")
            self.learning_rate_by_r = lrs

    def widths_for_all(self) -> list[list[int]]:
        if self.widths and isinstance(self.widths[0], list):
            return [list(w) for w in self.widths]
        return [list(self.widths) for _ in self.budgets]


def parse_sweep_section(data: Any, where: str) -> SweepArguments:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: 'sweep' must be a mapping of sweep fields")
    known = {f.name for f in dataclasses.fields(SweepArguments)}
    for key in data:
        if key not in known:
            raise RecipeError(f"{where}: unknown field 'sweep.{key}' (known: {', '.join(sorted(known))})")
    data = dict(data)
    if "budgets" in data:
        try:
            data["budgets"] = [float(b) for b in data["budgets"]]  # YAML reads 1e12 (no dot) as a string
        except (TypeError, ValueError) as err:
            raise RecipeError(f"{where}: sweep.budgets={data['budgets']!r}: must be numbers ({err})") from err
    args = SweepArguments(**data)
    args.validate()
    return args


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    """One run of the plan (all FLOPs from the model's own `training_flops_per_token`)."""

    run_id: str
    arch: str
    variant: str
    budget_index: int
    budget: float
    hidden_size: int
    num_recurrences: int
    num_prelude_layers: int
    num_recurrent_layers: int
    num_coda_layers: int
    input_injection: str
    backprop_recurrences: int | None
    seed: int
    effective_num_layers: int
    n_once: int
    n_rec: int
    flops_per_token: float
    target_tokens: float
    steps: int
    tokens: int
    flops: float
    recipe: dict[str, Any]
    learning_rates: dict[str, Any] | None = None
    """optimizer muonh: the run's peak lr per group and the HyperP factors (`looped_hf.optim.
    LearningRates.to_dict`); the run's recipe carries the lrs themselves (lr_scaling none).
    With `sweep.learning_rate_by_r`: {"learning_rate": lr, "scaling": "by_r"}."""


@dataclass
class SweepPlan:
    sweep: SweepArguments
    base_recipe: dict[str, Any]
    runs: list[PlannedRun]
    tokens_per_step: int
    vocab_size: int
    seq_len: int
    eval_blocks: int | None = None
    """Held-out blocks of seq_len tokens every run is evaluated on (DataArguments.eval_blocks)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep": dataclasses.asdict(self.sweep),
            "tokens_per_step": self.tokens_per_step,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "eval_blocks": self.eval_blocks,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }

    def summary(self) -> list[str]:
        """The plan's totals (runs per arch, FLOPs, batch, held-out size, lr rule), one per line."""
        lines: list[str] = []
        by_arch: dict[str, int] = {}
        for r in self.runs:
            by_arch[r.arch] = by_arch.get(r.arch, 0) + 1
        total = sum(r.flops for r in self.runs)
        arch_counts = ", ".join(f"{a} {n}" for a, n in by_arch.items())
        lines.append(
            f"{len(self.runs)} runs ({arch_counts}); {total:.3g} training FLOPs in all; "
            f"{self.tokens_per_step:,} tokens per step; seq_len {self.seq_len}; vocab {self.vocab_size}"
        )
        if self.eval_blocks is not None:
            lines.append(
                f"held-out set: {self.eval_blocks:,} blocks x {self.seq_len:,} = "
                f"{self.eval_blocks * self.seq_len:,} tokens per run (data field eval_blocks)"
            )
        scaled = [r.learning_rates for r in self.runs if r.learning_rates and r.learning_rates["scaling"] == "hyperp"]
        if scaled:
            lines.append(
                f"lrs: HyperP per run (looped_hf.optim.hyperp_learning_rates): every lr x (B / 262,144)^0.558 = "
                f"x{scaled[0]['batch_scale']:.4g}; matrix lr x (T / D_REF)^-0.32 with D_REF "
                + ", ".join(sorted({f"{lr['reference_tokens']:,}" for lr in scaled}))
                + "; AdamW lrs x (d / 640)^-0.5"
            )
        if self.sweep.learning_rate_by_r:
            lines.append(
                "lrs: learning_rate by r (sweep.learning_rate_by_r): "
                + ", ".join(f"r = {r}: {lr:g}" for r, lr in sorted(self.sweep.learning_rate_by_r.items()))
            )
        return lines

    def table(self) -> str:
        """The plan as a fixed-width table plus totals; with muonh, each run's peak lrs (matrix,
        embedding, lm_head, norm scales, and hyperconnection gains where a run has them)."""
        lr_cols = [("matrix", "lr_mat"), ("embedding", "lr_emb"), ("lm_head", "lr_head"), ("norm", "lr_norm")]
        if any(r.input_injection == "hyperconnection" for r in self.runs):
            lr_cols.append(("hyperconnection", "lr_hc"))
        if any(r.learning_rates and r.learning_rates["scaling"] == "by_r" for r in self.runs):
            lr_cols = [("learning_rate", "lr")]
        if not any(r.learning_rates for r in self.runs):
            lr_cols = []
        head = f"{'run_id':<30} {'budget':>9} {'width':>5} {'r':>2} {'P/K/C':>7} {'n_once':>11} {'n_rec':>11} " \
               f"{'tokens':>13} {'FLOPs':>9} {'steps':>7}" + "".join(f" {title:>8}" for _, title in lr_cols)  # fmt: skip
        lines = [head, "-" * len(head)]
        for r in self.runs:
            pkc = f"{r.num_prelude_layers}/{r.num_recurrent_layers}/{r.num_coda_layers}"
            lrs = "".join(
                f" {r.learning_rates[key]:>8.3g}" if r.learning_rates and (key != "hyperconnection" or
                r.input_injection == "hyperconnection") else f" {'-':>8}" for key, _ in lr_cols
            )  # fmt: skip
            lines.append(
                f"{r.run_id:<30} {r.budget:>9.3g} {r.hidden_size:>5} {r.num_recurrences:>2} {pkc:>7} "
                f"{r.n_once:>11,} {r.n_rec:>11,} {r.tokens:>13,} {r.flops:>9.3g} {r.steps:>7,}{lrs}"
            )
        lines.append("-" * len(head))
        lines += self.summary()
        return "\n".join(lines)


def _shape(sweep: SweepArguments, r: int) -> tuple[int, int, int, str, int | None]:
    """(prelude, block, coda, injection, backprop_recurrences) of the iso-depth model with r."""
    if r == 1:
        return 0, sweep.effective_depth, 0, "none", None
    block = (sweep.effective_depth - sweep.prelude - sweep.coda) // r
    injection, k = sweep.injection, None
    if sweep.variant == "truncated":
        k = math.ceil(r / 2)
    elif sweep.variant == "hyperconnection":
        injection = "hyperconnection"
    return sweep.prelude, block, sweep.coda, injection, k


def make_plan(
    recipe: str | os.PathLike | dict[str, Any], sweep_dir: str | os.PathLike | None = None
) -> SweepPlan:
    """Turn a sweep recipe into its runs; every error names the recipe field."""
    import torch

    from looped_hf import LoopedForCausalLM
    from looped_hf.arguments import LENGTH_FIELDS, parse_recipe, tokens_per_step
    from looped_hf.optim import hyperp_learning_rates, muonh_parameter_groups
    from looped_hf.train import arch_name

    if isinstance(recipe, dict):
        data, where = dict(recipe), "sweep recipe"
    else:
        data, where = load_yaml(recipe), f"sweep recipe {str(recipe)!r}"
    if "sweep" not in data:
        raise RecipeError(f"{where}: no 'sweep' section (a single run is `looped-hf train`)")
    sweep = parse_sweep_section(data.pop("sweep"), where)
    for name in (*LENGTH_FIELDS, "output_dir", "run_id", "arch", "variant", "results_file"):
        if name in data:
            raise RecipeError(f"{where}: field {name!r} is set by the sweep for each run; remove it")
    model_fields = ("hidden_size", "num_attention_heads", "head_dim", "num_prelude_layers", "num_recurrent_layers",
                    "num_coda_layers", "num_recurrences", "input_injection", "backprop_recurrences")  # fmt: skip
    for name in model_fields:
        if name in data:
            raise RecipeError(
                f"{where}: field {name!r} is set by the sweep (see the sweep: section); remove it"
            )
    # Parsing the shared part checks every field name and value once, before any run starts.
    # Precision flags do not change the plan, and TrainingArguments rejects bf16 on a machine
    # without a GPU: drop them so a GPU recipe can be planned (--dry-run) anywhere.
    model_args, data_args, training_args = parse_recipe(
        {
            k: v
            for k, v in data.items()
            if k not in ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")
        }
    )
    seq_len = data_args.seq_len
    step_tokens = tokens_per_step(training_args, seq_len, world_size=sweep.num_processes)
    if sweep.vocab_size is not None:
        vocab = sweep.vocab_size
    else:
        from looped_hf.data import load_tokenizer

        vocab = len(load_tokenizer(data_args.tokenizer))
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else None

    runs: list[PlannedRun] = []
    for b, (budget, widths) in enumerate(zip(sweep.budgets, sweep.widths_for_all())):
        for width in widths:
            for r in sweep.recurrences:
                for seed in sweep.seeds:
                    prelude, block, coda, injection, k = _shape(sweep, r)
                    run_model = dataclasses.replace(
                        model_args, hidden_size=width, head_dim=sweep.head_dim, num_attention_heads=None,
                        num_prelude_layers=prelude, num_recurrent_layers=block, num_coda_layers=coda,
                        num_recurrences=r, input_injection=injection, backprop_recurrences=k,
                        num_hyperconnection_lanes=sweep.hyperconnection_lanes,
                    )  # fmt: skip
                    config = run_model.to_config(vocab, seq_len)
                    with torch.device("meta"):
                        model = LoopedForCausalLM(config)
                    params = model.num_scaling_params()
                    fpt = model.training_flops_per_token(seq_len)
                    target = budget / fpt
                    steps = steps_for_tokens(target, step_tokens, f"sweep.budgets[{b}]", f"{budget:.4g}")
                    arch = arch_name(config)
                    run_id = f"{arch}-w{width}-b{b}"
                    if sweep.variant != "base":
                        run_id = f"{sweep.variant}-{run_id}"
                    if len(sweep.seeds) > 1:
                        run_id += f"-s{seed}"
                    run_recipe = dict(data)
                    run_recipe.update(
                        {f: getattr(run_model, f) for f in (*model_fields, "num_hyperconnection_lanes")}
                    )
                    run_recipe.update(
                        train_flops_budget=float(budget),
                        run_id=run_id,
                        arch=arch,
                        variant=sweep.variant,
                        seed=seed,
                    )
                    lrs = None
                    if sweep.learning_rate_by_r is not None:
                        if training_args.optimizer == "muonh":
                            raise RecipeError(
                                f"{where}: sweep.learning_rate_by_r is for adamw / muon; muonh's lrs are "
                                "HyperP's per run (remove it, or set lr_scaling: none and give the lrs)"
                            )
                        lr = sweep.learning_rate_by_r[r]
                        run_recipe["learning_rate"] = lr
                        lrs = {"learning_rate": lr, "scaling": "by_r"}
                    if training_args.optimizer == "muonh":
                        # The study's per-run lrs (HyperP: this run's batch, target tokens T =
                        # int(budget / flops_per_token) as base_train.py, width), written into
                        # the run's recipe so it trains at exactly these (lr_scaling none).
                        try:
                            muonh_parameter_groups(model)  # a tied head or a parameter no group takes
                            rates = hyperp_learning_rates(
                                training_args, config, tokens_per_step=step_tokens, train_tokens=int(target)
                            )
                        except ValueError as err:
                            raise RecipeError(f"{where}: run {run_id}: {err}") from err
                        run_recipe.update(rates.recipe_fields())
                        lrs = rates.to_dict()
                    if sweep_dir is not None:
                        run_recipe["output_dir"] = str(sweep_dir / run_id)
                    if sweep.checkpoints_per_run > 0:
                        run_recipe.update(
                            save_strategy="steps",
                            save_steps=max(1, math.ceil(steps / sweep.checkpoints_per_run)),
                            save_total_limit=1,
                        )
                    runs.append(
                        PlannedRun(
                            run_id=run_id, arch=arch, variant=sweep.variant, budget_index=b, budget=float(budget),
                            hidden_size=width, num_recurrences=r, num_prelude_layers=prelude,
                            num_recurrent_layers=block, num_coda_layers=coda, input_injection=injection,
                            backprop_recurrences=k, seed=seed, effective_num_layers=config.effective_num_layers,
                            n_once=int(params["once"]), n_rec=int(params["recurrent"]), flops_per_token=fpt,
                            target_tokens=target, steps=steps, tokens=steps * step_tokens,
                            flops=steps * step_tokens * fpt, recipe=run_recipe, learning_rates=lrs,
                        )
                    )  # fmt: skip
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise RecipeError(f"{where}: sweep.widths: repeated widths give duplicate run ids")
    return SweepPlan(sweep, data, runs, step_tokens, vocab, seq_len, eval_blocks=data_args.eval_blocks)


# ---------------------------------------------------------------------------------------------
# Executors: each takes a run directory holding recipe.yaml and leaves run_record.json there
# ---------------------------------------------------------------------------------------------
def _failed_record(run: PlannedRun, run_dir: Path, error: str) -> dict[str, Any]:
    from looped_hf.train import RECORD_KEYS

    record: dict[str, Any] = dict.fromkeys(RECORD_KEYS)
    record.update(
        run_id=run.run_id, run_dir=str(run_dir), arch=run.arch, variant=run.variant, budget=run.budget,
        hidden_size=run.hidden_size, num_recurrences=run.num_recurrences, n_once=run.n_once, n_rec=run.n_rec,
        effective_num_layers=run.effective_num_layers, backprop_recurrences=run.backprop_recurrences,
        seed=run.seed, status="failed", error=error, recipe=run.recipe,
    )  # fmt: skip
    return record


def _read_record(run_dir: Path) -> dict[str, Any] | None:
    from looped_hf.train import RECORD_NAME

    path = run_dir / RECORD_NAME
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


LOG_NAME = "train.log"
"""Each run's full output (Trainer log lines, warnings, tracebacks), in its run directory."""
LOCK_NAME = ".run.lock"


def _run_inprocess(recipe_path: Path, callbacks: list[Any] | None = None) -> dict[str, Any]:
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train

    return train(*parse_recipe(recipe_path), callbacks=callbacks)


def _log_tail(log_path: Path, lines: int = 15) -> str:
    """The last lines of a run's log (for the error of a run that left no record)."""
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- one process per run at a time ------------------------------------------------------------
def _try_lock(run_dir: Path) -> int | None:
    """Take the run's exclusive lock (`<run_dir>/.run.lock`) without waiting: its fd, or None if
    another process holds it.

    The kernel drops the lock when the last holder dies, SIGKILL included, so the lock means
    "someone is training this run right now". A rerun that finds it held (a worker orphaned by a
    killed sweep, or a second `looped-hf sweep` on the same directory) leaves the run alone and
    comes back to it, so two processes never train, checkpoint or record the same run at once.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the last fd of the open file releases the flock


# --- where a run's output goes -----------------------------------------------------------------
def _console_stream() -> tuple[Any, bool]:
    """The stream the sweep's own lines go to, and whether it is ours to close.

    A run's output is redirected at the file-descriptor level (see `_run_output`), so when
    sys.stdout is fd 1 the console keeps a duplicate of fd 1 that the redirect does not touch.
    Otherwise (a captured stdout, as under pytest) the stdout object itself is unaffected."""
    try:
        if sys.stdout.fileno() == 1:
            stream = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
            return stream, True
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    return sys.stdout, False


class _Tee:
    """Copies everything written to a pipe into the run's log and, line by line and prefixed with
    the run id, to the console (`--verbose`)."""

    def __init__(self, log: Any, console: Any, prefix: str) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.log, self.console, self.prefix = log, console, prefix
        self.thread = threading.Thread(target=self._pump, daemon=True, name="sweep-tee")
        self.thread.start()

    def _pump(self) -> None:
        pending = b""
        while data := os.read(self.read_fd, 65536):
            self.log.write(data)
            self.log.flush()
            pending += data
            *lines, pending = pending.split(b"\n")
            self._show(lines)
        self._show([pending] if pending else [])
        os.close(self.read_fd)

    def _show(self, lines: list[bytes]) -> None:
        for line in lines:
            text = line.decode("utf-8", errors="replace").rstrip("\r")
            with contextlib.suppress(OSError, ValueError):
                self.console.write(f"{self.prefix}{text}\n")
                self.console.flush()

    def close(self) -> None:
        os.close(self.write_fd)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def _run_output(log_path: Path, verbose: bool = False, console: Any = None, prefix: str = ""):
    """Send everything the run prints (Trainer log lines, warnings, C-level output, tracebacks)
    to `log_path`, appended; with `verbose` also to `console`, each line prefixed.

    Both levels are redirected: file descriptors 1 and 2 (C code, logging handlers bound to the
    real stderr, warnings) and the sys.stdout / sys.stderr objects (which are not fds 1 / 2 when
    the caller's output is captured)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    own_console = None
    if verbose and console is None:  # a copy of fd 2 made now: fd 2 itself is about to point at the tee
        own_console = console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    with open(log_path, "ab") as log:
        tee = _Tee(log, console, prefix) if verbose else None
        target = tee.write_fd if tee is not None else log.fileno()
        saved = (os.dup(1), os.dup(2))
        text = io.TextIOWrapper(os.fdopen(os.dup(target), "wb"), encoding="utf-8", errors="replace",
                                line_buffering=True)  # fmt: skip
        try:
            os.dup2(target, 1)
            os.dup2(target, 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            for stream in (text, sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            text.close()
            if tee is not None:
                tee.close()
            if own_console is not None:
                own_console.close()


# --- persistent workers: `--jobs N` with the local executor -----------------------------------
_WORKER_CODE = "import sys; from looped_hf.sweep import _worker_main; sys.exit(_worker_main())"
_INTERRUPTS = (-signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP)


def _die_with_parent() -> None:
    """A worker must not outlive its sweep (a SIGKILLed sweep cannot stop it, and an orphan would
    go on training and checkpointing a run the next sweep resumes): on Linux the kernel kills it
    with its parent (PR_SET_PDEATHSIG); elsewhere a thread notices within 0.2 s. The run resumes
    from its last checkpoint on the next sweep."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _worker_main() -> int:
    """A training process of `--jobs N`: reads one task per stdin line (`{"recipe", "verbose"}`),
    trains that run in process under its run lock with its output in `<run_dir>/train.log`, and
    answers one JSON line on stdout. One process trains many runs, so torch, transformers and the
    tokenized data are loaded once per worker, not once per run (~8 s of CPU each on 2 cores)."""
    _die_with_parent()
    if len(sys.argv) > 1 and sys.argv[1].isdigit():
        import torch

        torch.set_num_threads(int(sys.argv[1]))  # a recipe's torch_num_threads still wins in train()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the worker's log, never into the reply pipe
    for line in sys.stdin:
        task = json.loads(line)
        replies.write(json.dumps(_worker_run(Path(task["recipe"]), bool(task.get("verbose")))) + "\n")
    return 0


def _worker_run(recipe_path: Path, verbose: bool) -> dict[str, Any]:
    run_dir = recipe_path.parent
    lock = _try_lock(run_dir)
    if lock is None:
        return {"busy": True}
    try:
        with _run_output(run_dir / LOG_NAME, verbose, None, f"[{run_dir.name}] "):
            try:
                record = _run_inprocess(recipe_path)
            except RecipeError as err:
                return {"recipe_error": str(err)}
            except Exception as err:  # noqa: BLE001 - the sweep records it and goes on
                traceback.print_exc()
                return {"error": f"{type(err).__name__}: {err}"}
        return {"status": record.get("status")}
    finally:
        _unlock(lock)


class _Worker:
    """The sweep's handle on one worker process."""

    def __init__(self, env: dict[str, str], threads: int, log_path: Path, verbose: bool) -> None:
        self.log = open(log_path, "ab")  # the worker's own output (outside its runs); open as long as it lives
        stderr = None if verbose else self.log
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, env=env)  # fmt: skip
        self.buffer = b""
        self.job: _Job | None = None

    def send(self, task: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(task) + "\n").encode())
        self.proc.stdin.flush()

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read_replies(self) -> tuple[list[dict[str, Any]], bool]:
        """Replies readable now (call when select says so), and whether the worker has exited."""
        data = os.read(self.fileno(), 65536)
        if not data:
            return [], True
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()], False

    def close(self, kill: bool = False) -> None:
        """Stop the worker. An idle one holds no run and has written everything, so it is killed
        rather than waited for (a Python with torch loaded takes seconds to shut down)."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF: the worker finishes its loop and exits
        if (kill or self.job is None) and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (none on a CPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [x.strip() for x in visible.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _worker_env(threads: int, index: int = 0) -> dict[str, str]:
    """Worker `index`'s environment: looped_hf importable from the same source, OpenMP sized to
    its share of the cores (the user's own OMP_NUM_THREADS wins) and, on a machine with several
    GPUs, one GPU per worker round-robin (every run would otherwise land on the first GPU)."""
    import looped_hf

    env = dict(os.environ)
    gpus = _gpu_ids()
    if len(gpus) > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    root = str(Path(looped_hf.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(recipe_path: Path, num_processes: int, launcher: str) -> list[str]:
    """The command line of one run (subprocess / accelerate executors)."""
    if launcher == "subprocess" or (launcher == "submitit" and num_processes == 1):
        return [sys.executable, "-m", "looped_hf.train", str(recipe_path)]
    import torch

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port())]  # fmt: skip
    if num_processes > 1:
        # Also on CPU: `--cpu` would start one process; looped_hf.train switches a multi-process
        # launch without GPUs to CPU (gloo) by itself.
        cmd.append("--multi_gpu")
    elif not torch.cuda.is_available():
        cmd.append("--cpu")
    return [*cmd, "-m", "looped_hf.train", str(recipe_path)]


def _run_command(cmd: list[str], log_path: Path) -> tuple[int, str]:
    """Run `cmd` with output to `log_path`; return (exit code, last lines of the log)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException:
            proc.kill()  # Ctrl-C of the sweep ends the run it started (it resumes on rerun)
            proc.wait()
            raise
    return code, _log_tail(log_path)


def run_job(recipe_path: str, num_processes: int = 1, results_file: str | None = None) -> dict[str, Any]:
    """One run as a (submitit) job: train, then append the record to `results_file` itself, so
    the results survive a sweep process that died while the job ran."""
    path = Path(recipe_path)
    if num_processes == 1:
        with _run_output(path.parent / LOG_NAME):
            record = _run_inprocess(path)
    else:
        code, tail = _run_command(train_command(path, num_processes, "accelerate"), path.parent / LOG_NAME)
        record = _read_record(path.parent) or {"run_id": path.parent.name, "status": "failed",
                                               "error": f"exit code {code}: {tail}"}  # fmt: skip
    if results_file:
        append_jsonl(results_file, record)
    return record


# ---------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------
def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _read_progress(run_dir: Path) -> dict[str, Any] | None:
    from looped_hf.train import PROGRESS_NAME

    try:
        return json.loads((run_dir / PROGRESS_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


class _Console:
    """What a person sees: one live progress line on a terminal, one line per finished run
    otherwise (a log file, CI, `--verbose`).

    Live: `[sweep] ██████░░░░ 47%  17/36 runs, 1 failed | loop2-w48-b1 62% loss 2.31 | 4m12s, ETA 5m40s`,
    redrawn in place at most every `interval` seconds; failed runs also get a permanent line.
    The bar and the ETA weigh runs by their planned FLOPs and count the finished fraction of the
    running ones (their `progress.json`), so the ETA reflects all runs in flight."""

    def __init__(
        self, plan: SweepPlan, records: list[dict[str, Any]], todo: list[PlannedRun], log: Any, verbose: bool
    ) -> None:
        self.stream, self._owned = _console_stream()
        self.emit = log if log not in (None, print) else self._write_line
        self.live = self.emit == self._write_line and not verbose and _isatty(self.stream)
        self.total = len(plan.runs)
        self.flops = {r.run_id: r.flops for r in plan.runs}
        self.all_flops = sum(self.flops.values()) or 1.0
        recorded = {r.get("run_id"): r for r in records if r.get("run_id") in self.flops}
        self.done = set(recorded)
        self.failed = sum(r.get("status") != "ok" for r in recorded.values())
        self.done_flops = sum(self.flops[i] for i in self.done)
        self.todo_flops = sum(r.flops for r in todo)
        self.session_flops = 0.0
        self.running: dict[str, tuple[Path, float | None]] = {}  # run_id -> (run_dir, fraction at start)
        self.waiting = 0
        self.start = time.time()
        self.clock: float | None = None  # when the first run of this session began training
        self._drawn = 0.0
        self._width = 0

    def write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def _write_line(self, text: str) -> None:
        if self.live and self._width:
            self.write("\r\x1b[K")  # clear the live line; it is redrawn below the new one
            self._width = 0
        self.write(text + "\n")

    def started(self, run: PlannedRun, run_dir: Path) -> None:
        self.running[run.run_id] = (run_dir, None)
        self.refresh(force=True)

    def finished(self, run: PlannedRun, record: dict[str, Any]) -> None:
        self._fractions()  # sets the ETA clock from this run's start if it is the first seen
        self.running.pop(run.run_id, None)
        if run.run_id not in self.done:
            self.done.add(run.run_id)
            self.done_flops += run.flops
        self.session_flops += run.flops
        ok = record.get("status") == "ok"
        self.failed += not ok
        if ok:
            loss = record.get("loss")
            wall = record.get("wall_time_s")
            what = f"ok, loss {loss:.4f}" if isinstance(loss, (int, float)) else "ok"
            what += f", {_fmt_time(wall)}" if isinstance(wall, (int, float)) else ""
        else:
            error = str(record.get("error") or "no error message").strip().splitlines()
            where = Path(str(record.get("run_dir") or "")) / LOG_NAME
            what = f"FAILED ({error[0] if error else ''}; log: {where})"
        if self.live and ok:
            self.refresh(force=True)
            return
        self.emit(f"[sweep] {len(self.done)}/{self.total} runs done ({self.failed} failed) | {run.run_id}: {what} | "
                  f"elapsed {_fmt_time(time.time() - self.start)} | ETA {self._eta()}")  # fmt: skip
        self.refresh(force=True)

    def _fractions(self) -> dict[str, float]:
        out = {}
        for run_id, (run_dir, first) in list(self.running.items()):
            progress = _read_progress(run_dir) or {}
            began = progress.get("started")
            if isinstance(began, (int, float)) and began >= self.start and (self.clock is None or began < self.clock):
                self.clock = began
            step, total = progress.get("step"), progress.get("max_steps")
            frac = min(1.0, step / total) if isinstance(step, int) and isinstance(total, int) and total > 0 else 0.0
            if first is None and progress:
                self.running[run_id] = (run_dir, frac)  # a resumed run: its earlier progress is not this session's
            out[run_id] = frac
        return out

    def _eta(self, fractions: dict[str, float] | None = None) -> str:
        fractions = self._fractions() if fractions is None else fractions
        partial = sum(
            max(0.0, frac - (self.running[rid][1] or 0.0)) * self.flops[rid] for rid, frac in fractions.items()
        )
        progressed = self.session_flops + partial
        remaining = self.todo_flops - progressed
        if progressed <= 0:
            return "?"
        # The rate is measured from the first training start: imports and worker start-up happen
        # once, before it, and would inflate an ETA taken early.
        since = time.time() - (self.clock if self.clock is not None else self.start)
        return _fmt_time(max(0.0, since * remaining / progressed))

    def refresh(self, force: bool = False, interval: float = 0.5) -> None:
        if not self.live or (not force and time.monotonic() - self._drawn < interval):
            return
        self._drawn = time.monotonic()
        fractions = self._fractions()
        share = (self.done_flops + sum(f * self.flops[r] for r, f in fractions.items())) / self.all_flops
        filled = int(round(16 * min(1.0, share)))
        head = f"[sweep] {'█' * filled}{'░' * (16 - filled)} {100 * share:3.0f}%  {len(self.done)}/{self.total} runs"
        head += f", {self.failed} failed" if self.failed else ""
        tail = f" | {_fmt_time(time.time() - self.start)}, ETA {self._eta(fractions)}"
        parts = []
        for run_id, (run_dir, _) in self.running.items():
            progress = _read_progress(run_dir) or {}
            part = f"{run_id} {100 * fractions.get(run_id, 0.0):.0f}%"
            if isinstance(progress.get("loss"), (int, float)):
                part += f" loss {progress['loss']:.3f}"
            parts.append(part)
        if self.waiting:
            parts.append(f"{self.waiting} waiting for another process")
        middle = " | " + " · ".join(parts) if parts else ""
        width = max(40, shutil.get_terminal_size((120, 20)).columns - 1)
        room = width - len(head) - len(tail)
        if len(middle) > room:
            middle = middle[: max(0, room - 1)] + "…" if room > 4 else ""
        line = head + middle + tail
        self.write("\r" + line[:width] + "\x1b[K")
        self._width = len(line)

    def close(self) -> None:
        if self.live and self._width:
            self.write("\n")
            self._width = 0
        if self._owned:
            with contextlib.suppress(OSError):
                self.stream.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _refresh_callback(console: _Console) -> Any:
    """A TrainerCallback that redraws the console while an in-process run trains (the runner
    itself is blocked inside `train`). Built here so importing this module needs no transformers."""
    from transformers import TrainerCallback

    class RefreshConsole(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            console.refresh()

    return RefreshConsole()


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_jobs(plan: SweepPlan) -> int:
    """Runs trained at once without `--jobs`: the available cores divided by the cores one run
    uses (the recipe's `torch_num_threads` x `sweep.num_processes`), at least 1.

    A recipe without `torch_num_threads` lets torch use every core in each run, so its default
    is 1. On a GPU machine the same rule applies: a recipe for small models that sets
    `torch_num_threads: 4` on 16 cores shares the GPU among 4 runs (`--jobs 1` to avoid that); with
    several GPUs the local executor's workers take one each, round-robin.
    submitit: 1 (give `--jobs` to keep that many cluster jobs in flight)."""
    if plan.sweep.executor == "submitit":
        return 1
    threads = plan.base_recipe.get("torch_num_threads")
    if not isinstance(threads, int) or threads < 1:
        return 1
    return max(1, available_cores() // (threads * plan.sweep.num_processes))


def _prepare(plan: SweepPlan, sweep_dir: Path, recipe_text: str | None) -> None:
    from looped_hf.fileio import write_json_atomic, write_yaml_atomic

    sweep_dir.mkdir(parents=True, exist_ok=True)
    copy = sweep_dir / RECIPE_COPY
    if copy.exists():
        old = yaml.safe_load(copy.read_text())
        new = yaml.safe_load(recipe_text) if recipe_text is not None else None
        if new is not None and old != new:
            raise RecipeError(
                f"{sweep_dir} holds a different sweep recipe ({copy}); resume with that one or use another --output"
            )
    elif recipe_text is not None:
        copy.write_text(recipe_text)
    else:
        write_yaml_atomic(copy, {"sweep": dataclasses.asdict(plan.sweep), **plan.base_recipe})
    write_json_atomic(sweep_dir / PLAN_NAME, plan.to_json())


@dataclass
class _Job:
    """A run in flight: in a worker, a command, or a submitit job."""

    run: PlannedRun
    run_dir: Path
    proc: subprocess.Popen | None = None
    lock: int | None = None
    job: Any = None
    worker: _Worker | None = None


class _Runner:
    """Keeps up to `jobs` runs in flight and records each finished one exactly once.

    Every run is trained under its run lock (`_try_lock`), by this process (`--jobs 1`, local),
    a persistent worker (`--jobs N`, local), a command (subprocess / accelerate) or a submitit
    job. Records are appended by this process with `append_jsonl`, which skips a run_id already
    in the file; a run that finished without being appended (the sweep was killed in between) is
    appended from its run_record.json on the next start. A run whose lock is held elsewhere waits
    until it is free, then is either appended (it finished there) or resumed here."""

    def __init__(self, plan: SweepPlan, sweep_dir: Path, jobs: int, console: _Console, verbose: bool) -> None:
        self.plan, self.sweep_dir, self.jobs, self.console, self.verbose = plan, sweep_dir, jobs, console, verbose
        self.results = sweep_dir / RESULTS_NAME
        self.kind = plan.sweep.executor
        self.running: list[_Job] = []
        self.waiting: list[PlannedRun] = []
        self.workers: list[_Worker] = []
        threads = plan.base_recipe.get("torch_num_threads")
        self.threads = threads if isinstance(threads, int) else max(1, available_cores() // jobs)

    # --- one run -----------------------------------------------------------------------------
    def _wait_for(self, run: PlannedRun) -> None:
        """`run` is locked by another process: say so, and retry it when its lock is free."""
        self.waiting.append(run)
        try:
            holder = (self.sweep_dir / run.run_id / LOCK_NAME).read_text().strip()
        except OSError:
            holder = "?"
        self.console.emit(f"[sweep] {run.run_id} is being trained by another process (pid {holder}); "
                          "it is recorded or resumed here once that one stops")  # fmt: skip

    def _record(self, run: PlannedRun, record: dict[str, Any]) -> None:
        append_jsonl(self.results, record)
        self.console.finished(run, record)

    def start(self, run: PlannedRun) -> None:
        """Record, train here, or launch `run`; a run locked elsewhere goes to the waiting list."""
        from looped_hf.fileio import write_yaml_atomic

        run_dir = self.sweep_dir / run.run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        existing = _read_record(run_dir)
        if existing is not None and existing.get("status") in ("ok", "failed"):
            self._record(run, existing)  # finished, but killed before its line was appended
            return
        recipe_path = run_dir / "recipe.yaml"
        if self.kind == "submitit":
            write_yaml_atomic(recipe_path, run.recipe)
            self.console.started(run, run_dir)
            self.running.append(_Job(run, run_dir, job=self._submit(run, run_dir, recipe_path)))
            return
        if self.kind == "local" and self.jobs > 1:
            self._start_in_worker(run, run_dir, recipe_path)
            return
        lock = _try_lock(run_dir)
        if lock is None:
            self._wait_for(run)
            return
        try:
            write_yaml_atomic(recipe_path, run.recipe)
            self.console.started(run, run_dir)
            if self.kind == "local":
                self._record(run, self._train_here(run, run_dir, recipe_path))
                return
            n = 1 if self.kind == "subprocess" else self.plan.sweep.num_processes
            with open(run_dir / LOG_NAME, "ab") as log:
                # The child inherits the lock: it stays held while the run trains, even if this
                # process dies first.
                proc = subprocess.Popen(train_command(recipe_path, n, self.kind), stdout=log,
                                        stderr=subprocess.STDOUT, pass_fds=(lock,))  # fmt: skip
            self.running.append(_Job(run, run_dir, proc=proc, lock=lock))
            lock = None
        finally:
            _unlock(lock)

    def _train_here(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> dict[str, Any]:
        prefix = f"[{run.run_id}] "
        with _run_output(run_dir / LOG_NAME, self.verbose, self.console.stream, prefix):
            try:
                return _run_inprocess(recipe_path, [_refresh_callback(self.console)])
            except RecipeError:
                raise
            except Exception as err:  # noqa: BLE001 - one failed run must not stop the sweep
                traceback.print_exc()
                return _failed_record(run, run_dir, f"{type(err).__name__}: {err}")

    def _start_in_worker(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> None:
        from looped_hf.fileio import write_yaml_atomic

        if not _read_lock_free(run_dir):
            self._wait_for(run)
            return
        worker = next((w for w in self.workers if w.job is None and w.proc.poll() is None), None)
        if worker is None:
            log_path = self.sweep_dir / f"worker-{len(self.workers)}.log"
            worker = _Worker(_worker_env(self.threads, len(self.workers)), self.threads, log_path, self.verbose)
            self.workers.append(worker)
        write_yaml_atomic(recipe_path, run.recipe)
        worker.job = _Job(run, run_dir, worker=worker)
        worker.send({"recipe": str(recipe_path), "verbose": self.verbose})
        self.running.append(worker.job)
        self.console.started(run, run_dir)

    def _submit(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> Any:
        """Submit one run through submitit (SLURM, or `cluster: local` for tests)."""
        import submitit

        params = dict(self.plan.sweep.submitit)
        cluster = params.pop("cluster", None)
        executor = submitit.AutoExecutor(folder=str(run_dir.parent / "submitit"), cluster=cluster)
        params.setdefault("name", run.run_id)
        executor.update_parameters(**params)
        job = executor.submit(run_job, str(recipe_path), self.plan.sweep.num_processes, str(self.results))
        (run_dir / "job_id").write_text(str(job.job_id))
        return job

    # --- runs in flight ----------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for runs in flight; record every one that finished."""
        busy = [j.worker for j in self.running if j.worker is not None]
        if busy:
            ready, _, _ = select.select(busy, [], [], timeout)
        else:
            ready = []
            time.sleep(timeout if self.running or self.waiting else 0)
        for worker in ready:
            self._read_worker(worker)  # a reply, or EOF: the worker died
        for worker in list(self.workers):
            # Exited while its reply pipe stays open (a forked DataLoader process still holds it).
            if worker.job is not None and worker.proc.poll() is not None:
                if select.select([worker], [], [], 0)[0]:
                    self._read_worker(worker)
                if worker in self.workers:
                    self._worker_died(worker)
        for job in list(self.running):
            if job.proc is not None and job.proc.poll() is not None:
                self._finish_command(job)
            elif job.job is not None and job.job.done():
                self._finish_submitit(job)
        self.console.refresh()

    def _read_worker(self, worker: _Worker) -> None:
        replies, exited = worker.read_replies()
        for reply in replies:
            job = worker.job
            assert job is not None, reply
            worker.job = None
            self.running.remove(job)
            if reply.get("busy"):
                self.console.running.pop(job.run.run_id, None)
                self._wait_for(job.run)
            elif "recipe_error" in reply:
                raise RecipeError(reply["recipe_error"])
            else:
                record = _read_record(job.run_dir)
                if record is None:
                    error = reply.get("error") or "the worker left no run record"
                    record = _failed_record(job.run, job.run_dir, error)
                self._record(job.run, record)
        if exited:
            self._worker_died(worker)

    def _worker_died(self, worker: _Worker) -> None:
        worker.proc.wait()
        code = worker.proc.returncode
        if worker in self.workers:
            self.workers.remove(worker)
        worker.close()
        job, worker.job = worker.job, None
        if job is None:
            return
        self.running.remove(job)
        self.console.running.pop(job.run.run_id, None)
        if code in _INTERRUPTS:
            self.waiting.append(job.run)  # stopped, not failed: it resumes from its checkpoint
            return
        record = _read_record(job.run_dir)
        if record is None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            record = _failed_record(job.run, job.run_dir, f"the worker training it died ({how}); log tail:\n"
                                    f"{_log_tail(job.run_dir / LOG_NAME)}")  # fmt: skip
        self._record(job.run, record)

    def _finish_command(self, job: _Job) -> None:
        self.running.remove(job)
        _unlock(job.lock)
        assert job.proc is not None
        record = _read_record(job.run_dir)
        if record is None:
            tail = _log_tail(job.run_dir / LOG_NAME)
            record = _failed_record(job.run, job.run_dir, f"exit code {job.proc.returncode} and no run record; "
                                    f"log tail:\n{tail}")  # fmt: skip
        self._record(job.run, record)

    def _finish_submitit(self, job: _Job) -> None:
        self.running.remove(job)
        try:
            record = job.job.result()
        except Exception as err:  # noqa: BLE001 - the job failed: record it, go on
            record = _read_record(job.run_dir) or _failed_record(
                job.run, job.run_dir, f"submitit job {job.job.job_id} failed: {err}"
            )
        self._record(job.run, record)

    def retry_waiting(self) -> list[PlannedRun]:
        """The waiting runs whose lock is free again (their holder finished or died)."""
        free = [r for r in self.waiting if _read_lock_free(self.sweep_dir / r.run_id)]
        self.waiting = [r for r in self.waiting if r not in free]
        return free

    def close(self, kill: bool = False) -> None:
        for worker in self.workers:
            worker.close(kill=kill)
        self.workers = []
        for job in self.running:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.kill()  # Ctrl-C of the sweep ends the runs it started (they resume on rerun)
                job.proc.wait()
            _unlock(job.lock)
        self.running = []


def _read_lock_free(run_dir: Path) -> bool:
    """Whether no process holds the run's lock right now (a check: the lock is not kept)."""
    lock = _try_lock(run_dir)
    _unlock(lock)
    return lock is not None


def run_sweep(
    recipe: str | os.PathLike | dict[str, Any],
    sweep_dir: str | os.PathLike | None = None,
    executor: str | None = None,
    max_runs: int | None = None,
    log: Any = None,
    jobs: int | None = None,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """Run every planned run that `results.jsonl` lacks, `jobs` at a time; return the records of
    all planned runs.

    Safe to kill at any point (SIGKILL included) and rerun: every run is recorded exactly once
    and an interrupted one resumes from its last checkpoint (see `_Runner`). `jobs`: runs in
    flight at once (default `default_jobs`); with the local executor and jobs > 1 they train in
    persistent worker processes, largest runs first (the shortest finish). Each run's output goes
    to `<run_dir>/train.log`; `verbose` also shows it, each line prefixed with its run id. `log`:
    where the sweep's own lines go (default: a live progress line on a terminal, else one line
    per finished run on stdout). `max_runs` stops after starting that many runs this session.
    """
    if isinstance(recipe, dict):
        recipe_text = yaml.safe_dump(recipe, sort_keys=False)
        default_dir = Path("runs") / "sweep"
    else:
        recipe_text = Path(recipe).read_text()
        default_dir = Path("runs") / Path(recipe).stem
    data = yaml.safe_load(recipe_text)
    sweep_dir = Path(sweep_dir or (data.get("sweep") or {}).get("output_dir") or default_dir).resolve()
    plan = make_plan(recipe if isinstance(recipe, dict) else Path(recipe), sweep_dir)
    if executor is not None:
        if executor not in EXECUTORS:
            raise RecipeError(f"--executor={executor!r}: must be one of {EXECUTORS}")
        plan.sweep.executor = executor
    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise RecipeError(f"--jobs={jobs!r}: must be an integer >= 1")
    _prepare(plan, sweep_dir, recipe_text)
    results = sweep_dir / RESULTS_NAME
    records = read_jsonl(results)
    done = {r.get("run_id") for r in records}
    todo = [r for r in plan.runs if r.run_id not in done]
    recorded = len(plan.runs) - len(todo)
    if max_runs is not None:
        todo = todo[:max_runs]
    jobs = min(jobs or default_jobs(plan), max(1, len(todo)))
    if jobs > 1:
        todo.sort(key=lambda r: -r.flops)  # longest first: the last runs in flight are the short ones
    console = _Console(plan, records, todo, log, verbose)
    mode = f"{jobs} at once" + (" in worker processes" if jobs > 1 and plan.sweep.executor == "local" else "")
    console.emit(f"[sweep] {sweep_dir}: {len(plan.runs)} planned, {recorded} already recorded, {len(todo)} to run "
                 f"(executor {plan.sweep.executor}, {mode}; each run's log: <run>/{LOG_NAME})")  # fmt: skip
    runner = _Runner(plan, sweep_dir, jobs, console, verbose)
    pending = list(todo)
    clean = False
    try:
        while pending or runner.running or runner.waiting:
            while pending and len(runner.running) < jobs:
                runner.start(pending.pop(0))
            console.waiting = len(runner.waiting)
            if not pending and runner.waiting and len(runner.running) < jobs:
                pending.extend(runner.retry_waiting())
                if pending:
                    continue
            if runner.running or runner.waiting:
                runner.poll(0.25 if runner.running else 1.0)
        clean = True
    finally:
        runner.close(kill=not clean)
        console.close()
    by_id = {r.get("run_id"): r for r in read_jsonl(results)}
    return [by_id[r.run_id] for r in plan.runs if r.run_id in by_id]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--jobs={text!r}: must be an integer >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    """`looped-hf sweep RECIPE [--dry-run] [--output DIR] [--executor X] [--max-runs N] [--jobs N] [--verbose]`."""
    parser = argparse.ArgumentParser(prog="looped-hf sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="sweep recipe (YAML with a sweep: section)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as a table; write nothing")
    parser.add_argument(
        "--output", default=None, help="sweep directory (default: sweep.output_dir or runs/<stem>)"
    )
    parser.add_argument("--executor", default=None, choices=EXECUTORS, help="override sweep.executor")
    parser.add_argument("--max-runs", type=int, default=None, help="run at most N runs this session")
    parser.add_argument(
        "--jobs", "-j", type=_positive_int, default=None, metavar="N",
        help="runs trained at once (default: available cores // the recipe's torch_num_threads, at least 1; "
             "1 if the recipe does not set torch_num_threads)",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", "-v", action="store_true",
        help="also print every run's log (always written to <run>/train.log), each line prefixed with its run id",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            plan = make_plan(args.recipe)
            print(plan.table())
            print(f"default --jobs here: {default_jobs(plan)} (available cores {available_cores()})")
            return 0
        records = run_sweep(args.recipe, args.output, executor=args.executor, max_runs=args.max_runs,
                            jobs=args.jobs, verbose=args.verbose)  # fmt: skip
    except RecipeError as err:
        print(f"looped-hf sweep: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlooped-hf sweep: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    failed = [r["run_id"] for r in records if r.get("status") != "ok"]
    print(
        f"[sweep] {len(records)} runs recorded, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 0


__all__ = [
    "EXECUTORS",
    "PlannedRun",
    "SweepArguments",
    "SweepPlan",
    "VARIANTS",
    "append_jsonl",
    "available_cores",
    "default_jobs",
    "main",
    "make_plan",
    "read_jsonl",
    "run_job",
    "run_sweep",
    "train_command",
]


if __name__ == "__main__":
    sys.exit(main())
