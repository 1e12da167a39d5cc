"""looped_hf's `Trainer` step against the study's own training step, and the `Trainer`'s own cost.

    python benchmarks/bench_vs_study.py --study-src DIR                          # default shape: ~9 min on 1 thread
    python benchmarks/bench_vs_study.py --study-src DIR --width 128 --head-dim 64  # ~3 min (+ the Trainer-cost table)
    python benchmarks/bench_vs_study.py --study-src DIR --steps 30 --compile     # + compiled sides (slow on CPU)
    python benchmarks/bench_vs_study.py --study-src DIR --device cuda --json vs.json              # H100/H200, width 640
    python benchmarks/bench_vs_study.py --study-src DIR --device cuda --widths 384 640 1024       # + 384, 1024

On a GPU (``--device cuda``) the shape is the study's: width 640 (``--widths``), head dim 128,
seq 2048, its device batch 32, bf16 autocast on every side; one compiled session (one compile per
side and width): the study's ``torch.compile(model)`` with its compiled MuonAdamW kernels, looped_hf
with ``torch_compile: true`` and the GPU recipe's settings (``GPU_SETTINGS``), bare with
``torch.compile(model)``. Every phase ends with a CUDA synchronise. Each side reports tokens/s and MFU
(looped_hf's FLOPs/token for all three: the same model; the peak from ``looped_hf.hardware`` or
``--peak-flops``), and one more, untimed step of each side runs under the profiler: its top kernels
by device time (``--profile-top``, default 12 on CUDA) say where a side loses.

(On a CPU without bf16 matrix units the step is mostly the study's bf16 Polar-Express in MuonH,
on both sides: ~22 s of a ~24 s step at width 256, ~1.8 of ~2.7 s at width 128.)

DIR is a checkout of kschwethelm/looped-lm-scaling (the study's nanochat fork); its `nanochat.gpt`
and `nanochat.optim` are imported from there at run time, nothing of it is in this repository.
Without `--study-src` the script says what it needs and exits 0.

One process trains three copies of the study's loop4 model (prelude 2, block 4 x r = 4, coda 2,
linear injection W [e; h] = [I | 0], QK-norm after RoPE, relu2, soft-cap 15, the study's init),
scaled to a CPU (default width 256, head dim 128, seq 256, batch 4, the embedded BPE's vocabulary), with the study's
optimizer on every side (MuonH for the layer and injection matrices, AdamW groups for the rest):

- study:   scripts/base_train.py's per-step body with the study's GPT and MuonAdamW: forward
           (`model(x, y)`), backward, next batch, `compute_gradient_stats` (its default
           `--track-gradients basic`), lr multiplier into every group, `optimizer.step()`,
           `zero_grad`, `loss.item()`. "study core" is the same step without the statistics.
- looped_hf: one optimizer step of `looped_hf.train.train` (`LoopedTrainer` with `optimizer: muonh`,
           `LoopedComputeCallback`, the run's other callbacks, its dataloader), timed between
           consecutive `on_step_end` events, so everything the Trainer does per step is inside.
- bare:    the same `LoopedForCausalLM`, optimizer (`build_optimizer_and_scheduler`) and batch shape
           in a hand-written loop: forward with labels, backward, `optimizer.step()`,
           `scheduler.step()`, `zero_grad`. trainer - bare is the Trainer's own cost.

The study and bare steps run inside the Trainer's `on_step_end` (excluded from the Trainer's
time), alternating their order every step, so the three sides interleave step by step and a
shared machine's load drift hits all of them alike. Cells are medians over the timed steps with
the [min, max] spread; ratios are medians of the per-step ratios. Tokens/s = batch x seq / step
time (the same forward shape on every side: the study feeds x = row[:-1] of 257-token rows, looped_hf
256-token blocks with the shift inside the loss).

Eager on both sides by default: `nanochat/optim.py` decorates its fused AdamW and MuonH steps
with `torch.compile`; the script replaces `torch.compile` by the identity while it imports
nanochat (as the study-checkpoint fixtures were made, tests/fixtures/study_checkpoints/PROVENANCE.md),
so the study's steps run eagerly, like ours. `--compile` adds a second, compiled session:
the study's loop as base_train runs it (`torch.compile(model)`; its compiled optimizer kernels only
with `--study-compiled-kernels`: on CPU, torch 2.13's inductor fails on its fused MuonH step with
"KeyError: 'buf28'", so by default its optimizer stays eager, like ours), looped_hf with
`torch_compile: true`, bare with `torch.compile(model)`; compiled / eager is per side.

It also prints the Trainer's per-step cost by part (timers around `_get_grad_norm`,
`_track_num_input_tokens`, `floating_point_ops`, the callback events, the batch fetch), and its
whole cost where it is not lost in the noise of a ~3 s CPU step: a second table trains a model
small enough for steps of ~20 ms (`--overhead-steps` per session) with `LoopedTrainer` and with the
vanilla `transformers.Trainer` (alternating sessions), each against its own bare loop step by
step. Both are put against a step of the study's smallest paper run (recipes/iso_depth_paper.yaml,
262,144 tokens per step) on 8 H100s at 40% of the dense bf16 peak: an upper bound, since on a GPU
the host queues kernels ahead and only waits at syncs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
STUDY_URL = "https://github.com/kschwethelm/looped-lm-scaling (commit ad7d8f3)"
PAPER_RECIPE = REPO / "recipes" / "iso_depth_paper.yaml"
#: The share of bf16 peak the projection assumes for the study's GPUs, and their count.
PROJECTED_MFU, PROJECTED_GPUS = 0.40, 8
#: What `recipes/iso_depth_gpu.yaml` sets for a GPU run, given to the looped_hf side on CUDA.
GPU_SETTINGS: dict[str, Any] = {
    "bf16": True, "tf32": True, "logging_nan_inf_filter": False, "accelerator_config": {"non_blocking": True},
    "dataloader_num_workers": 0,
}  # fmt: skip
#: The study's shape on a GPU (the issue's measurement): width 640, head dim 128, seq 2048, its
#: device batch 32. --widths adds 384 and 1024 at the same head dim, seq and batch.
GPU_SHAPE = {"width": 640, "head_dim": 128, "seq": 2048, "batch": 32}


# ---------------------------------------------------------------------------------------------
# The study's side
# ---------------------------------------------------------------------------------------------
def import_study(src: Path, compile_kernels: bool) -> tuple[Any, Any]:
    """`(nanochat.gpt, nanochat.common)` imported from `src`; eager kernels unless `compile_kernels`.

    nanochat/optim.py applies `torch.compile` as a decorator at import, so eager means replacing
    it by the identity during the import (nothing of the study's files changes).
    """
    if not (src / "nanochat" / "gpt.py").is_file():
        raise SystemExit(f"--study-src {src}: no nanochat/gpt.py there (a checkout of {STUDY_URL})")
    sys.path.insert(0, str(src))
    for name in [m for m in sys.modules if m == "nanochat" or m.startswith("nanochat.")]:
        del sys.modules[name]  # a second session may switch compile on or off
    real = torch.compile

    def identity(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    if not compile_kernels:
        torch.compile = identity
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its "Flash Attention backend" banner
            gpt = importlib.import_module("nanochat.gpt")
            common = importlib.import_module("nanochat.common")
    finally:
        torch.compile = real
    return gpt, common


class StudyStep:
    """scripts/base_train.py's training step (grad accumulation 1) with the study's GPT and optimizer."""

    def __init__(self, gpt: Any, common: Any, shape: dict[str, int], lrs: dict[str, float], compiled: bool,
                 device: torch.device) -> None:  # fmt: skip
        self.device = device
        cfg = gpt.GPTConfig(
            sequence_len=shape["seq"], vocab_size=shape["vocab"], n_head=shape["width"] // shape["head_dim"],
            n_kv_head=shape["width"] // shape["head_dim"], n_embd=shape["width"], n_prelude=2, n_recur_block=4,
            n_coda=2, num_recur=4, bptt_k=4, input_injection="inject_init_prelude",
        )  # fmt: skip
        torch.manual_seed(0)
        with torch.device("meta"):
            model = gpt.GPT(cfg)
        model.to_empty(device=device)
        model.init_weights()
        with contextlib.redirect_stdout(sys.stderr):
            # base_train multiplies these by its HyperP factors; the values only set the update sizes.
            self.optimizer = model.setup_optimizer(
                unembedding_lr=lrs["lm_head"], embedding_lr=lrs["embedding"], matrix_lr=lrs["matrix"], d_ref=640
            )
        self.orig_model = model
        self.model = torch.compile(model) if compiled else model
        self.stats = common.compute_gradient_stats
        self.batches = _random_batches(shape, rows=shape["seq"] + 1, split=True, device=device)
        self.x, self.y = next(self.batches)
        self.step_index = 0

    def __call__(self, phases: dict[str, float]) -> None:
        sync = functools.partial(_sync, self.device)  # phases on a GPU: each ends when its kernels do
        t0 = time.perf_counter()
        with _autocast(self.device):  # base_train's autocast_ctx (bf16 on CUDA)
            loss = self.model(self.x, self.y, num_recur=4)
        train_loss = loss.detach()
        sync()
        t1 = time.perf_counter()
        loss.backward()
        self.x, self.y = next(self.batches)  # base_train prefetches the next batch here
        sync()
        t2 = time.perf_counter()
        self.stats(self.orig_model, "basic")  # base_train's default --track-gradients basic
        sync()
        t3 = time.perf_counter()
        lrm = 1.0 - 0.9 * min(1.0, self.step_index / 1000)  # warmdown 1.0 to final 0.1 (1000-step run)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        train_loss.item()
        t4 = time.perf_counter()
        self.step_index += 1
        for name, dt in (("fwd", t1 - t0), ("bwd", t2 - t1), ("stats", t3 - t2), ("opt", t4 - t3)):
            phases[name] = dt


def _random_batches(shape: dict[str, int], rows: int, split: bool, device: torch.device) -> Iterator[Any]:
    """Endless batches of uniform random tokens (timing does not depend on their values), on ``device``."""
    gen = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, shape["vocab"], (shape["batch"], rows), generator=gen).to(device, non_blocking=True)
        yield (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()) if split else ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device) -> Any:
    """bf16 autocast over fp32 weights on CUDA, as both trainings run there; nothing on a CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# looped_hf's bare loop and the interleaving callback
# ---------------------------------------------------------------------------------------------
class BareStep:
    """The Trainer's model, optimizer and schedule in a hand-written loop (no Trainer around it)."""

    def __init__(self, model: torch.nn.Module, training_args: Any, shape: dict[str, int], compiled: bool,
                 device: torch.device) -> None:  # fmt: skip
        from looped_hf.arguments import tokens_per_step
        from looped_hf.optim import build_optimizer_and_scheduler

        self.model = copy.deepcopy(model)
        # `torch_compile: true` sets the Trainer's model's `forward` to a compiled bound method of
        # that model; a deep copy would keep calling it (the original's weights): drop it.
        self.model.__dict__.pop("forward", None)
        self.model.to(device).train()
        self.device = device
        step_tokens = tokens_per_step(training_args, shape["seq"])
        self.optimizer, self.scheduler = build_optimizer_and_scheduler(
            self.model, training_args, training_args.max_steps, tokens_per_step=step_tokens,
            train_tokens=training_args.max_steps * step_tokens,
        )  # fmt: skip
        self.forward = torch.compile(self.model) if compiled else self.model
        self.batches = _random_batches(shape, rows=shape["seq"], split=False, device=device)
        self.ids = next(self.batches)

    def __call__(self, phases: dict[str, float]) -> None:
        sync = functools.partial(_sync, self.device)
        t0 = time.perf_counter()
        with _autocast(self.device):
            loss = self.forward(input_ids=self.ids, labels=self.ids).loss
        sync()
        t1 = time.perf_counter()
        loss.backward()
        self.ids = next(self.batches)
        sync()
        t2 = time.perf_counter()
        self.optimizer.step()
        self.scheduler.step()
        self.model.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        for name, dt in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2)):
            phases[name] = dt


def _interleave_callback(session: Session) -> Any:
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        """Times the Trainer between consecutive `on_step_end`s and runs the other sides in between."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            session.start(model, args)

        def on_step_end(self, args, state, control, **kwargs):
            session.trainer_step_done(state.global_step, state.max_steps)

    return Interleave()


class PartTimers:
    """Wall time per step inside named Trainer methods (class-level wrappers on the Trainer class the
    run uses, so an override such as LoopedTrainer's is what is timed; removed by `close`)."""

    PARTS = {
        "grad norm (_get_grad_norm)": ("Trainer", "_get_grad_norm"),
        "token count (_track_num_input_tokens)": ("Trainer", "_track_num_input_tokens"),
        "Trainer FLOPs (floating_point_ops)": ("Trainer", "floating_point_ops"),
        "batch fetch (get_batch_samples)": ("Trainer", "get_batch_samples"),
        "log/save/eval (_maybe_log_save_evaluate)": ("Trainer", "_maybe_log_save_evaluate"),
        "callback events (CallbackHandler.call_event)": ("CallbackHandler", "call_event"),
    }
    #: The model's and optimizer's own work inside a Trainer step: a step less these is the
    #: Trainer's own host time, free of the compute's step-to-step noise.
    COMPUTE = {
        "model forward": ("Model", "forward"),
        "backward (Accelerator.backward)": ("Accelerator", "backward"),
        "optimizer step (AcceleratedOptimizer.step)": ("AcceleratedOptimizer", "step"),
        "zero_grad": ("Module", "zero_grad"),
    }

    def __init__(self, trainer_class: type) -> None:
        from accelerate import Accelerator
        from accelerate.optimizer import AcceleratedOptimizer
        from transformers.trainer_callback import CallbackHandler

        from looped_hf import LoopedForCausalLM

        self.totals: dict[str, float] = defaultdict(float)
        self.excluded = 0.0  # time of the benchmark's own sides, run inside on_step_end
        self.active = False  # off while the benchmark's own sides run (their forwards are not the Trainer's)
        owners = {"Trainer": trainer_class, "CallbackHandler": CallbackHandler, "Model": LoopedForCausalLM,
                  "Accelerator": Accelerator, "AcceleratedOptimizer": AcceleratedOptimizer,
                  "Module": torch.nn.Module}  # fmt: skip
        self._saved: list[tuple[type, str, Any]] = []  # (owner, attr, what its __dict__ had: None = nothing)
        for label, (owner_name, attr) in {**self.PARTS, **self.COMPUTE}.items():
            owner = owners[owner_name]
            self._saved.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, self._wrap(label, getattr(owner, attr)))

    def _wrap(self, label: str, fn: Callable) -> Callable:
        timers = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not timers.active:
                return fn(*args, **kwargs)
            excluded = timers.excluded
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.totals[label] += time.perf_counter() - t0 - (timers.excluded - excluded)

        return timed

    def close(self) -> None:
        for owner, attr, original in self._saved:
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


class Session:
    """One interleaved measurement: looped_hf's Trainer run, with the study and bare steps in between."""

    def __init__(self, study: StudyStep | None, shape: dict[str, int], warmup: int, steps: int, compiled: bool,
                 device: torch.device, profile_top: int = 0) -> None:  # fmt: skip
        self.study, self.shape, self.warmup, self.compiled = study, shape, warmup, compiled
        self.last_timed = warmup + steps  # with profile_top, one more (untimed) step is profiled
        self.device, self.profile_top = device, profile_top
        self.profiler: Any = None
        self.kernels: dict[str, list[dict[str, Any]]] = {}
        self.bare: BareStep | None = None
        self.times: dict[str, list[float]] = defaultdict(list)
        self.phases: dict[str, dict[str, list[float]]] = {"study": defaultdict(list), "bare": defaultdict(list)}
        self.mark: float | None = None
        self.timers: PartTimers | None = None
        self.part_steps: list[dict[str, float]] = []  # per timed step: seconds in each part
        self.parts_seen: dict[str, float] = {}

    def start(self, model: torch.nn.Module, training_args: Any) -> None:
        self.bare = BareStep(model, training_args, self.shape, self.compiled, self.device)

    def trainer_step_done(self, step: int, max_steps: int) -> None:
        _sync(self.device)  # the Trainer's step ends when its kernels do
        now = time.perf_counter()
        if self.profiler is not None:  # the Trainer step that just ended ran under the profiler
            self.profiler.stop()
            self.kernels["looped_hf"] = top_kernels(self.profiler, self.device, self.profile_top)
            self.profiler = None
        timed_step = self.timers is not None and self.timers.active
        if self.timers is not None:
            self.timers.active = False
        timing = self.warmup < step <= self.last_timed
        profiling = step > self.last_timed
        if self.mark is not None and timing:
            self.times["looped_hf"].append(now - self.mark)
        sides = [("study", self.study), ("bare", self.bare)] if self.study is not None else [("bare", self.bare)]
        for name, side in sides if step % 2 else sides[::-1]:
            phases: dict[str, float] = {}
            if profiling:
                self.kernels[name] = profiled(side, phases, self.device, self.profile_top)
                continue
            t0 = time.perf_counter()
            side(phases)
            dt = time.perf_counter() - t0
            if timing:
                self.times[name].append(dt)
                if name == "study":
                    self.times["study core"].append(dt - phases["stats"])
                for phase, value in phases.items():
                    self.phases[name][phase].append(value)
        if self.timers is not None:
            if timed_step:  # the step that just ended was timed: its share of each part
                snap = dict(self.timers.totals)
                labels = [*PartTimers.PARTS, *PartTimers.COMPUTE]
                self.part_steps.append({k: snap.get(k, 0.0) - self.parts_seen.get(k, 0.0) for k in labels})
                self.parts_seen = snap
            # The part timers count from the first timed Trainer step on; our sides are not theirs.
            self.timers.active = self.warmup <= step < self.last_timed
            self.timers.excluded += time.perf_counter() - now
        if self.profile_top and step == self.last_timed:  # profile the Trainer's next (last) step
            self.profiler = _profiler(self.device)
            self.profiler.start()
        self.mark = time.perf_counter()


def _profiler(device: torch.device) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def top_kernels(prof: Any, device: torch.device, top: int) -> list[dict[str, Any]]:
    """The ``top`` entries of one profiled step by self time: GPU kernels on CUDA (device time),
    aten ops on a CPU; ms in the step and share of the step's total."""
    events = prof.key_averages()
    if device.type == "cuda":
        timed = [(e.key, e.self_device_time_total) for e in events if e.self_device_time_total > 0]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]
    total = sum(us for _, us in timed) or 1.0
    timed.sort(key=lambda kv: -kv[1])
    return [{"name": name[:90], "ms": us / 1e3, "share": us / total} for name, us in timed[:top]]


def profiled(side: Callable[[dict[str, float]], None], phases: dict[str, float], device: torch.device,
             top: int) -> list[dict[str, Any]]:  # fmt: skip
    """One call of ``side`` under the profiler: its top kernels."""
    prof = _profiler(device)
    with prof:
        side(phases)
        _sync(device)
    return top_kernels(prof, device, top)


# ---------------------------------------------------------------------------------------------
# Running a session
# ---------------------------------------------------------------------------------------------
def recipe(shape: dict[str, int], steps: int, threads: int, out: str, compiled: bool, **overrides: Any) -> dict[str, Any]:
    """The looped_hf run: the study's loop4 model and optimizer at the benchmark's shape, logging
    every 50 steps as the paper recipes do; `overrides` replace fields."""
    return {
        "hidden_size": shape["width"], "head_dim": shape["head_dim"], "num_prelude_layers": 2,
        "num_recurrent_layers": 4, "num_coda_layers": 2, "num_recurrences": 4, "input_injection": "linear",
        "init_scheme": "study", "seq_len": shape["seq"], "eval_blocks": 2,
        "per_device_train_batch_size": shape["batch"], "per_device_eval_batch_size": shape["batch"],
        "optimizer": "muonh", "max_grad_norm": 0.0, "max_steps": steps, "logging_steps": 50,
        "save_strategy": "no", "report_to": "none", "torch_num_threads": threads, "output_dir": out,
        "torch_compile": compiled, "seed": 0, "disable_tqdm": True, **overrides,
    }  # fmt: skip


def run_session(
    study_mod: tuple[Any, Any] | None,
    shape: dict[str, int],
    args: argparse.Namespace,
    compiled: bool,
    steps: int,
    warmup: int,
    trainer_class: type | None = None,
    overrides: dict[str, Any] | None = None,
    device: torch.device | None = None,
    profile_top: int = 0,
) -> dict:
    """Train looped_hf for warmup + steps Trainer steps with the other sides interleaved (the study's
    when `study_mod` = (nanochat.gpt, nanochat.common) is given; always the bare loop); the timings.
    `trainer_class`: what `train()` runs (default its LoopedTrainer)."""
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train
    from looped_hf.trainer import LoopedTrainer

    device = device or torch.device("cpu")
    study = StudyStep(*study_mod, shape, STUDY_LRS, compiled, device) if study_mod is not None else None
    session = Session(study, shape, warmup, steps, compiled, device, profile_top)
    session.timers = PartTimers(trainer_class or LoopedTrainer)
    total_steps = warmup + steps + (1 if profile_top else 0)
    if device.type == "cuda":
        overrides = {**GPU_SETTINGS, **(overrides or {})}
    with tempfile.TemporaryDirectory() as tmp:
        fields = recipe(shape, total_steps, args.threads, str(Path(tmp) / "run"), compiled, **(overrides or {}))
        model_args, data_args, training_args = parse_recipe(fields)
        try:
            record = train(model_args, data_args, training_args, callbacks=[_interleave_callback(session)],
                           trainer_class=trainer_class)  # fmt: skip
        finally:
            session.timers.close()
    if record["status"] != "ok":
        raise SystemExit(f"looped_hf run failed: {record['error']}\n{record.get('traceback', '')}")
    steps = session.part_steps
    parts = {k: statistics.mean(step[k] for step in steps) for k in PartTimers.PARTS if steps}
    medians = {k: statistics.median(step[k] for step in steps) for k in PartTimers.PARTS if steps}
    # The Trainer's own host time per step: the step less the model's and optimizer's work in it.
    # (Compiled, the forward is an instance attribute the class-level timer does not see: not measured.)
    own = [] if compiled else [t - sum(p[k] for k in PartTimers.COMPUTE)
                               for t, p in zip(session.times["looped_hf"], session.part_steps)]  # fmt: skip
    return {"times": dict(session.times), "phases": {k: dict(v) for k, v in session.phases.items()}, "parts": parts,
            "parts_median": medians, "own": own, "fpt": record["train_flops_per_token"],
            "kernels": session.kernels, "attention": record.get("attention_backend")}  # fmt: skip


def overhead_sessions(args: argparse.Namespace) -> dict[str, dict]:
    """The Trainer's whole per-step cost, measured where it is not lost in the noise: a model small
    enough for a step of milliseconds (width 32, one layer per stack, r = 2, AdamW: on a CPU the
    bf16 Polar-Express of MuonH alone takes ~60 ms per matrix stack), Trainer against the bare loop
    (same model, optimizer, batches) step by step, for LoopedTrainer and the vanilla
    transformers.Trainer, in alternating sessions."""
    from transformers import Trainer

    from looped_hf.data import load_tokenizer
    from looped_hf.trainer import LoopedTrainer

    shape = {"width": 32, "head_dim": 16, "seq": 32, "batch": 2, "vocab": len(load_tokenizer())}
    small = {"num_prelude_layers": 1, "num_recurrent_layers": 1, "num_coda_layers": 1, "num_recurrences": 2,
             "optimizer": "adamw"}  # fmt: skip
    merged: dict[str, dict] = {}
    for _ in range(args.overhead_rounds):
        for name, cls in (("LoopedTrainer", LoopedTrainer), ("transformers.Trainer", Trainer)):
            res = run_session(None, shape, args, False, args.overhead_steps, 5, trainer_class=cls, overrides=small)
            into = merged.setdefault(name, {"times": defaultdict(list), "parts": defaultdict(list),
                                            "parts_median": defaultdict(list), "own": []})  # fmt: skip
            into["own"].extend(res["own"])
            for side, values in res["times"].items():
                into["times"][side].extend(values)
            for part, value in res["parts"].items():
                into["parts"][part].append(value)
            for part, value in res["parts_median"].items():
                into["parts_median"][part].append(value)
    return {"shape": shape, "classes": merged}


#: The study's reference lrs (scripts/base_train.py defaults), used on both sides.
STUDY_LRS = {"matrix": 0.014, "embedding": 0.3, "lm_head": 0.004}


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def median_spread(values: list[float], scale: float = 1.0) -> str:
    """'median [min, max]' of `values` x `scale`."""
    if not values:
        return "-"
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.4g} [{v[0]:.4g}, {v[-1]:.4g}]"


def paired_ratio(a: list[float], b: list[float]) -> list[float]:
    """Per-step a_i / b_i (the steps ran back to back, so each pair saw the same machine load)."""
    return [x / y for x, y in zip(a, b) if y > 0]


def smallest_paper_step_s() -> tuple[float, str]:
    """Seconds per optimizer step of the study's smallest paper run on 8 H100s at 40% of bf16 peak."""
    from looped_hf.hardware import peak_flops_for_name
    from looped_hf.sweep.plan import make_plan

    plan = make_plan(PAPER_RECIPE)
    run = min(plan.runs, key=lambda r: r.flops_per_token)
    step_flops = run.flops_per_token * plan.tokens_per_step
    peak = peak_flops_for_name("NVIDIA H100 80GB HBM3")
    seconds = step_flops / (PROJECTED_GPUS * peak * PROJECTED_MFU)
    return seconds, f"{run.run_id}: {step_flops:.3g} FLOPs/step ({plan.tokens_per_step:,} tokens)"


def report(results: dict[str, dict], shape: dict[str, int], overhead: dict | None = None,
           peak: float | None = None) -> dict[str, Any]:  # fmt: skip
    """Print the table; return its numbers (also written with --json). ``peak``: the device's dense
    bf16 FLOP/s, for MFU (every side trains the same model: its FLOPs/token are looped_hf's count)."""
    tokens = shape["batch"] * shape["seq"]
    out: dict[str, Any] = {"shape": shape, "sessions": {}}
    for label, res in results.items():
        t = res["times"]
        print(f"\n== {label}: {len(t['looped_hf'])} timed steps, {tokens:,} tokens/step; median [min, max] ==")
        print(f"{'side':<12} {'ms/step':>28} {'tokens/s':>28} {'MFU':>7}")
        mfu = {}
        for side in ("study", "study core", "looped_hf", "bare"):
            if peak and t.get(side):
                mfu[side] = res["fpt"] * tokens / statistics.median(t[side]) / peak
            mfu_text = f"{mfu[side]:.1%}" if side in mfu else "-"
            print(f"{side:<12} {median_spread(t[side], 1e3):>28} {median_spread([1 / x for x in t[side]], tokens):>28} "
                  f"{mfu_text:>7}")  # fmt: skip
        vs_study = paired_ratio(t["study"], t["looped_hf"])  # tokens/s ratio = time ratio inverted
        vs_core = paired_ratio(t["study core"], t["looped_hf"])
        bare_vs_core = paired_ratio(t["study core"], t["bare"])
        gap = [(a - b) * 1e3 for a, b in zip(t["looped_hf"], t["bare"])]
        print(f"looped_hf / study  tokens/s: {median_spread(vs_study)}")
        print(f"looped_hf / study core     : {median_spread(vs_core)}")
        print(f"bare / study core          : {median_spread(bare_vs_core)}")
        print(f"Trainer - bare (ms/step)   : {median_spread(gap)}")
        print(f"Trainer's own host time    : {median_spread(res['own'], 1e3)} ms/step (its step less the "
              "model's forward, backward, optimizer step and zero_grad in it)")  # fmt: skip
        for side in ("study", "bare"):
            phases = "  ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in res["phases"][side].items())
            print(f"  {side} phases (median ms): {phases}")
        for side, kernels in res.get("kernels", {}).items():
            print(f"  top of one profiled {side} step (self time):")
            for k in kernels:
                print(f"    {k['ms']:9.2f} ms {k['share']:6.1%}  {k['name']}")
        print("  Trainer parts, ms/step mean (median; a mean above the median is a few slow steps): "
              + "; ".join(f"{k} {v * 1e3:.2f} ({res['parts_median'].get(k, math.nan) * 1e3:.2f})"
                          for k, v in sorted(res["parts"].items(), key=lambda kv: -kv[1])))  # fmt: skip
        out["sessions"][label] = {
            "ms": {side: statistics.median(t[side]) * 1e3 for side in ("study", "study core", "looped_hf", "bare")},
            "looped_hf_over_study_tokens_per_s": statistics.median(vs_study),
            "looped_hf_over_study_core_tokens_per_s": statistics.median(vs_core),
            "trainer_overhead_ms": statistics.median(gap),
            "trainer_overhead_ms_range": [min(gap), max(gap)],
            "trainer_own_host_ms": statistics.median(res["own"]) * 1e3 if res["own"] else math.nan,
            "trainer_parts_ms": {k: v * 1e3 for k, v in res["parts"].items()},
            "trainer_parts_median_ms": {k: v * 1e3 for k, v in res["parts_median"].items()},
            "tokens_per_s": {side: tokens / statistics.median(t[side]) for side in t if t[side]},
            "mfu": mfu,
            "phases_ms": {side: {k: statistics.median(v) * 1e3 for k, v in res["phases"][side].items()}
                          for side in res["phases"]},
            "kernels": res.get("kernels", {}),
            "flops_per_token": res["fpt"],
        }  # fmt: skip
    if overhead is not None:
        out["overhead"] = report_overhead(overhead, smallest_paper_step_s()[0] * 1e3)
    if "eager" not in out["sessions"]:
        return out  # the host-time projection below is about the eager session
    step_s, what = smallest_paper_step_s()
    eager = out["sessions"]["eager"]
    step_ms = step_s * 1e3
    parts_ms = sum(eager["trainer_parts_ms"].values())
    parts_median_ms = sum(eager["trainer_parts_median_ms"].values())
    print(f"\nThe study's smallest paper run ({what}) on {PROJECTED_GPUS} H100s at {PROJECTED_MFU:.0%} of bf16 peak: "
          f"{step_ms:.1f} ms/step. Host time of the Trainer measured here (CPU), as a share of it (an upper "
          "bound: on a GPU the host runs ahead of the kernels except at syncs):")  # fmt: skip
    print(f"  timed Trainer parts at this shape (LoopedTrainer): mean {parts_ms:.2f} ms/step = {parts_ms / step_ms:.1%}, "
          f"sum of medians {parts_median_ms:.2f} ms/step = {parts_median_ms / step_ms:.1%}")  # fmt: skip
    own_ms = eager["trainer_own_host_ms"]
    print(f"  the Trainer's own host time at this shape (LoopedTrainer): {own_ms:.2f} ms/step = {own_ms / step_ms:.1%}")
    out["trainer_own_host_share_of_paper_step"] = own_ms / step_ms
    out["paper_smallest_step_ms"] = step_ms
    out["trainer_parts_share_of_paper_step"] = parts_ms / step_ms
    if "compiled" in out["sessions"]:
        for side in ("study", "looped_hf", "bare"):
            ratio = eager["ms"][side] / out["sessions"]["compiled"]["ms"][side]
            print(f"compiled / eager tokens/s, {side}: {ratio:.3g}")
            out[f"compiled_over_eager_{side}"] = ratio
    return out


def report_overhead(overhead: dict, step_ms: float) -> dict[str, Any]:
    """The Trainer-class table of `overhead_sessions`; its numbers."""
    classes = overhead["classes"]
    names = list(classes)
    shape = overhead["shape"]
    n = {name: len(c["times"]["looped_hf"]) for name, c in classes.items()}
    print(f"\n== The Trainer's own cost (width {shape['width']}, 1+1x2+1 layers, seq {shape['seq']}, batch {shape['batch']}, AdamW; "
          f"{', '.join(f'{k} {v} steps' for k, v in n.items())}, alternating sessions) ==")  # fmt: skip
    print(f"{'ms/step':<62}" + "".join(f"{name:>26}" for name in names))
    out: dict[str, Any] = {"shape": shape, "classes": {}}
    own_label = "Trainer's own host time, median [min, max]"
    rows = {own_label: {}, "Trainer - bare, median [min, max]": {}}
    for name, c in classes.items():
        diff = [(a - b) * 1e3 for a, b in zip(c["times"]["looped_hf"], c["times"]["bare"])]
        rows[own_label][name] = median_spread(c["own"], 1e3)
        rows["Trainer - bare, median [min, max]"][name] = median_spread(diff)
        out["classes"][name] = {"own_host_ms": statistics.median(c["own"]) * 1e3,
                                "own_host_ms_range": [min(c["own"]) * 1e3, max(c["own"]) * 1e3],
                                "trainer_minus_bare_ms": statistics.median(diff),
                                "trainer_minus_bare_ms_range": [min(diff), max(diff)],
                                "bare_ms": statistics.median(c["times"]["bare"]) * 1e3,
                                "parts_ms": {k: statistics.mean(v) * 1e3 for k, v in c["parts"].items()},
                                "parts_median_ms": {k: statistics.median(v) * 1e3
                                                    for k, v in c["parts_median"].items()}}  # fmt: skip
    for part in PartTimers.PARTS:
        rows[f"  {part}, mean (median)"] = {
            name: f"{statistics.mean(c['parts'][part]) * 1e3:.3f} ({statistics.median(c['parts_median'][part]) * 1e3:.3f})"
            for name, c in classes.items()
        }
    rows["  bare step (model + optimizer), median"] = {
        name: f"{out['classes'][name]['bare_ms']:.4g}" for name in names
    }
    for label, cells in rows.items():
        print(f"{label:<62}" + "".join(f"{cells[name]:>26}" for name in names))
    print("  (own host time: the Trainer step less the model's forward, backward, optimizer step and zero_grad in it;\n"
          "   Trainer - bare: the same, but through the noise of two separate compute steps)")  # fmt: skip
    for name in names:
        ms = out["classes"][name]["own_host_ms"]
        out["classes"][name]["share_of_paper_step"] = ms / step_ms
        print(f"  {name}: {ms:.2f} ms/step of its own = {ms / step_ms:.1%} of the paper step")
    return out


def _write_json(path: Path | None, numbers: dict[str, Any]) -> None:
    if path is not None:
        from looped_hf.fileio import write_json_atomic

        write_json_atomic(path, numbers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--study-src", type=Path, help=f"a checkout of {STUDY_URL}")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the study's GPU shape, compiled sides")
    parser.add_argument("--width", type=int, default=None, help="default 256 (cuda: 640)")
    parser.add_argument("--widths", type=int, nargs="+", default=None,
                        help="several widths, one session each (e.g. 384 640 1024)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128")
    parser.add_argument("--seq", type=int, default=None, help="default 256 (cuda: 2048)")
    parser.add_argument("--batch", type=int, default=None, help="default 4 (cuda: 32, the study's device batch)")
    parser.add_argument("--eager", action="store_true", help="cuda: also the eager session (default: compiled only)")
    parser.add_argument("--profile-top", type=int, default=None,
                        help="profile one more step per side and print its top N kernels (default: cuda 12, cpu 0)")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: hardware table)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument("--compile", action="store_true", help="also a compiled session (minutes on a CPU)")
    parser.add_argument("--study-compiled-kernels", action="store_true",
                        help="compiled session: also compile the study's optimizer kernels (GPU; inductor fails on CPU)")
    parser.add_argument("--overhead-steps", type=int, default=None,
                        help="timed steps per Trainer-cost session (tiny width, CPU; 0: skip that table; "
                             "default 300, cuda 0)")  # fmt: skip
    parser.add_argument("--overhead-rounds", type=int, default=2, help="Trainer-cost sessions per Trainer class")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the Trainer-cost table (LoopedTrainer vs transformers.Trainer); needs no study code")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args(argv)
    command = " ".join(["python benchmarks/bench_vs_study.py", *(argv if argv is not None else sys.argv[1:])])
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.overhead_steps is None:
        args.overhead_steps = 0 if cuda else 300
    torch.set_num_threads(args.threads)
    if args.overhead_only:
        step_ms = smallest_paper_step_s()[0] * 1e3
        numbers = {"overhead": report_overhead(overhead_sessions(args), step_ms), "paper_smallest_step_ms": step_ms,
                   "command": command}  # fmt: skip
        _write_json(args.json, numbers)
        return 0 if all(math.isfinite(c["own_host_ms"]) for c in numbers["overhead"]["classes"].values()) else 1
    if args.study_src is None:
        print(f"bench_vs_study needs the study's code to compare against: a checkout of {STUDY_URL},\n"
              "given as --study-src DIR (its nanochat package is imported from there at run time);\n"
              "--overhead-only runs the Trainer-cost table alone, without it.")  # fmt: skip
        return 0
    from looped_hf.data import load_tokenizer
    from looped_hf.hardware import device_peak_flops

    vocab = len(load_tokenizer())  # the Trainer trains on the embedded corpus; every side gets its vocabulary
    defaults = GPU_SHAPE if cuda else {"width": 256, "head_dim": 128, "seq": 256, "batch": 4}
    given = {"width": args.width, "head_dim": args.head_dim, "seq": args.seq, "batch": args.batch}
    base = {key: defaults[key] if value is None else value for key, value in given.items()}
    widths = args.widths or [base["width"]]
    # On a GPU the comparison is the study's production setting: compiled model and optimizer
    # kernels on its side, torch_compile on ours; one compile per side and width.
    if cuda:
        sessions = [False, True] if args.eager else [True]
        study_kernels = True
    else:
        sessions = [False, True] if args.compile else [False]
        study_kernels = args.study_compiled_kernels
    profile_top = args.profile_top if args.profile_top is not None else (12 if cuda else 0)
    peak = args.peak_flops or device_peak_flops(device)
    print(f"bench_vs_study: {command}\ndevice {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch "
          f"{torch.__version__}, peak {peak or 'unknown'} FLOP/s, widths {widths}")  # fmt: skip
    per_width: dict[str, Any] = {}
    for width in widths:
        shape = {**base, "width": width, "vocab": vocab}
        results = {}
        for compiled in sessions:
            study_mod = import_study(args.study_src.resolve(), compile_kernels=compiled and study_kernels)
            results["compiled" if compiled else "eager"] = run_session(
                study_mod, shape, args, compiled, args.steps, args.warmup, device=device, profile_top=profile_top
            )
            if cuda:
                torch.cuda.empty_cache()
        per_width[str(width)] = report(results, shape, peak=peak)
    overhead = overhead_sessions(args) if args.overhead_steps > 0 else None
    numbers = dict(per_width[str(widths[0])]) if len(widths) == 1 else {"widths": per_width}
    if overhead is not None:
        numbers["overhead"] = report_overhead(overhead, smallest_paper_step_s()[0] * 1e3)
    numbers.update(command=command, device=str(device), peak_flops=peak)
    _write_json(args.json, numbers)
    finite = all(math.isfinite(v["trainer_overhead_ms"]) for w in per_width.values() for v in w["sessions"].values())
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
