"""Iso-depth sweeps: plan (budget x width x r), run resumably, append one record per run.

    looped-hf sweep recipes/iso_depth_tiny.yaml --dry-run     # the plan as a table; writes nothing
    looped-hf sweep recipes/iso_depth_tiny.yaml               # runs it; kill it, rerun, it resumes

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
appended atomically under a lock), `<run_id>/` run directories (see `looped_hf.train`).
Resuming: runs already in results.jsonl are skipped; a finished run whose line is missing is
appended from its run_record.json; an interrupted run continues from its last checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import socket
import subprocess
import sys
import time
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


@dataclass
class SweepPlan:
    sweep: SweepArguments
    base_recipe: dict[str, Any]
    runs: list[PlannedRun]
    tokens_per_step: int
    vocab_size: int
    seq_len: int

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep": dataclasses.asdict(self.sweep),
            "tokens_per_step": self.tokens_per_step,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }

    def table(self) -> str:
        """The plan as a fixed-width table plus totals."""
        head = f"{'run_id':<28} {'budget':>9} {'width':>5} {'r':>2} {'P/K/C':>7} {'n_once':>11} {'n_rec':>11} " \
               f"{'tokens':>11} {'FLOPs':>9} {'steps':>7}"  # fmt: skip
        lines = [head, "-" * len(head)]
        for r in self.runs:
            pkc = f"{r.num_prelude_layers}/{r.num_recurrent_layers}/{r.num_coda_layers}"
            lines.append(
                f"{r.run_id:<28} {r.budget:>9.3g} {r.hidden_size:>5} {r.num_recurrences:>2} {pkc:>7} "
                f"{r.n_once:>11,} {r.n_rec:>11,} {r.tokens:>11,} {r.flops:>9.3g} {r.steps:>7,}"
            )
        by_arch: dict[str, int] = {}
        for r in self.runs:
            by_arch[r.arch] = by_arch.get(r.arch, 0) + 1
        total = sum(r.flops for r in self.runs)
        lines.append("-" * len(head))
        arch_counts = ", ".join(f"{a} {n}" for a, n in by_arch.items())
        lines.append(
            f"{len(self.runs)} runs ({arch_counts}); {total:.3g} training FLOPs in all; "
            f"{self.tokens_per_step:,} tokens per step; seq_len {self.seq_len}; vocab {self.vocab_size}"
        )
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
                            flops=steps * step_tokens * fpt, recipe=run_recipe,
                        )
                    )  # fmt: skip
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise RecipeError(f"{where}: sweep.widths: repeated widths give duplicate run ids")
    return SweepPlan(sweep, data, runs, step_tokens, vocab, seq_len)


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


def _run_inprocess(recipe_path: Path) -> dict[str, Any]:
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train

    return train(*parse_recipe(recipe_path))


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
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    return code, "\n".join(tail)


def run_job(recipe_path: str, num_processes: int = 1, results_file: str | None = None) -> dict[str, Any]:
    """One run as a (submitit) job: train, then append the record to `results_file` itself, so
    the results survive a sweep process that died while the job ran."""
    path = Path(recipe_path)
    if num_processes == 1:
        record = _run_inprocess(path)
    else:
        code, tail = _run_command(train_command(path, num_processes, "accelerate"), path.parent / "train.log")
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


class _Progress:
    """Sweep-level progress: runs recorded / total, failures, FLOP-weighted ETA."""

    def __init__(self, plan: SweepPlan, done: set[str]) -> None:
        self.total = len(plan.runs)
        self.flops = {r.run_id: r.flops for r in plan.runs}
        self.done = set(done)
        self.failed = 0
        self.start = time.time()
        self.session_flops = 0.0
        self.remaining_flops = sum(f for rid, f in self.flops.items() if rid not in self.done)

    def update(self, run_id: str, status: str) -> str:
        self.done.add(run_id)
        self.failed += status != "ok"
        self.session_flops += self.flops[run_id]
        self.remaining_flops -= self.flops[run_id]
        elapsed = time.time() - self.start
        eta = elapsed * self.remaining_flops / self.session_flops if self.session_flops else math.nan
        eta_s = _fmt_time(eta) if math.isfinite(eta) else "?"
        return (f"[sweep] {len(self.done)}/{self.total} runs done ({self.failed} failed this session) | "
                f"{run_id}: {status} | elapsed {_fmt_time(elapsed)} | ETA {eta_s}")  # fmt: skip


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


def run_sweep(
    recipe: str | os.PathLike | dict[str, Any],
    sweep_dir: str | os.PathLike | None = None,
    executor: str | None = None,
    max_runs: int | None = None,
    log: Any = print,
) -> list[dict[str, Any]]:
    """Run every planned run that `results.jsonl` lacks; return the records of all planned runs.

    Safe to kill at any point and rerun: see the module docstring. `max_runs` stops after that
    many runs this session (for tests and smoke checks).
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
    _prepare(plan, sweep_dir, recipe_text)
    results = sweep_dir / RESULTS_NAME
    done = {r.get("run_id") for r in read_jsonl(results)}
    todo = [r for r in plan.runs if r.run_id not in done]
    progress = _Progress(plan, {r.run_id for r in plan.runs if r.run_id in done})
    log(f"[sweep] {sweep_dir}: {len(plan.runs)} planned, {len(plan.runs) - len(todo)} already recorded, "
        f"{len(todo)} to run (executor {plan.sweep.executor})")  # fmt: skip
    if max_runs is not None:
        todo = todo[:max_runs]

    from looped_hf.fileio import write_yaml_atomic

    for run in todo:
        run_dir = sweep_dir / run.run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        existing = _read_record(run_dir)
        if existing is not None and existing.get("status") in ("ok", "failed"):
            record = existing  # finished, but killed before its line was appended
        else:
            recipe_path = run_dir / "recipe.yaml"
            write_yaml_atomic(recipe_path, run.recipe)
            record = _execute(plan, run, run_dir, recipe_path, results)
        append_jsonl(results, record)
        log(progress.update(run.run_id, record.get("status", "failed")))
    by_id = {r.get("run_id"): r for r in read_jsonl(results)}
    return [by_id[r.run_id] for r in plan.runs if r.run_id in by_id]


def _execute(
    plan: SweepPlan, run: PlannedRun, run_dir: Path, recipe_path: Path, results: Path
) -> dict[str, Any]:
    kind = plan.sweep.executor
    if kind == "local":
        try:
            return _run_inprocess(recipe_path)
        except RecipeError:
            raise
        except Exception as err:  # noqa: BLE001 - one failed run must not stop the sweep
            return _failed_record(run, run_dir, f"{type(err).__name__}: {err}")
    if kind in ("subprocess", "accelerate"):
        n = 1 if kind == "subprocess" else plan.sweep.num_processes
        code, tail = _run_command(train_command(recipe_path, n, kind), run_dir / "train.log")
        record = _read_record(run_dir)
        if record is None:
            record = _failed_record(run, run_dir, f"exit code {code} and no run record; log tail:\n{tail}")
        return record
    if kind == "submitit":
        return _submit(plan, run, run_dir, recipe_path, results)
    raise RecipeError(f"sweep.executor={kind!r}: must be one of {EXECUTORS}")


def _submit(
    plan: SweepPlan, run: PlannedRun, run_dir: Path, recipe_path: Path, results: Path
) -> dict[str, Any]:
    """Submit one run through submitit and wait for it (SLURM, or `cluster: local` for tests)."""
    import submitit

    params = dict(plan.sweep.submitit)
    cluster = params.pop("cluster", None)
    executor = submitit.AutoExecutor(folder=str(run_dir.parent / "submitit"), cluster=cluster)
    params.setdefault("name", run.run_id)
    executor.update_parameters(**params)
    job = executor.submit(run_job, str(recipe_path), plan.sweep.num_processes, str(results))
    (run_dir / "job_id").write_text(str(job.job_id))
    try:
        return job.result()
    except Exception as err:  # noqa: BLE001 - the job failed: record it, go on
        record = _read_record(run_dir)
        return record or _failed_record(run, run_dir, f"submitit job {job.job_id} failed: {err}")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`looped-hf sweep RECIPE [--dry-run] [--output DIR] [--executor X] [--max-runs N]`."""
    parser = argparse.ArgumentParser(prog="looped-hf sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="sweep recipe (YAML with a sweep: section)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan as a table; write nothing")
    parser.add_argument(
        "--output", default=None, help="sweep directory (default: sweep.output_dir or runs/<stem>)"
    )
    parser.add_argument("--executor", default=None, choices=EXECUTORS, help="override sweep.executor")
    parser.add_argument("--max-runs", type=int, default=None, help="run at most N runs this session")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            plan = make_plan(args.recipe)
            print(plan.table())
            return 0
        records = run_sweep(args.recipe, args.output, executor=args.executor, max_runs=args.max_runs)
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
    "main",
    "make_plan",
    "read_jsonl",
    "run_job",
    "run_sweep",
    "train_command",
]


if __name__ == "__main__":
    sys.exit(main())
