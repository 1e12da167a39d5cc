"""The one prepared GPU check: attention backends, training throughput and MFU, decoding, a micro sweep.

    python benchmarks/gpu_check.py --out gpu_check/          # one H100/H200, <= 8 minutes
    python benchmarks/gpu_check.py --out gpu_check/ --study-src ~/looped-lm-scaling   # + vs the study, <= 9 min
    python benchmarks/gpu_check.py --out /tmp/gc --tiny      # CPU, seconds: every code path, toy sizes

Sections (each in its own try/except: an error is recorded in the JSON and the next section runs):

* ``environment``: versions, device, its dense bf16 peak (``looped_hf.hardware``), flash-attn, and
  the attention backend a training run picks here (``looped_hf.attention_backends``).
* ``logits``: the study's loop4 (prelude 2, block 4 x r = 4, coda 2, width 640, head dim 128) in
  bf16 with attention eager / sdpa / sdpa forced onto torch's flash kernel (CUDA) / flash_attention_2
  and 3 (when the package is installed), each against the same weights in fp32 eager. Tolerance:
  a backend agrees when its relative L2 error is at most ``2 x`` bf16 eager's own ``+ 0.01`` (bf16
  keeps 8 bits of mantissa; a backend may round differently, not be further off).
* ``train_eager`` / ``train_compiled``: training tokens/s, MFU and peak memory of a hand-written
  step (bf16 autocast, fused AdamW, ``use_cache=False``), loop4 vs transformers' LlamaForCausalLM of
  the same width and effective depth (20 layers, SwiGLU at Llama's 8d/3 rounded up to 256), each
  eager and under ``torch.compile``. MFU = FLOPs/token x tokens/s / peak, the FLOPs from the
  model's own ``training_flops_per_token`` (Llama's: a plain LoopedConfig of its exact shape,
  whose parameter count is checked equal to Llama's). Each model runs on the backend
  ``apply_attention_backend`` picks (FA3 on Hopper where installed, else SDPA, which gets no mask
  for these unpadded rows); each row lists the top kernels of one profiled step.
* ``vs_study`` (with ``--study-src``): ``bench_vs_study.py``'s three sides interleaved at width 640,
  seq 2048, the study's device batch 32: the study's compiled GPT with its compiled MuonAdamW
  kernels, ``looped-hf train``'s Trainer step (``torch_compile``, bf16, the GPU recipe's settings)
  and a bare loop of the same model; tokens/s, MFU, phases, top kernels per side. Target: looped_hf
  / study >= 1.0. For 384 and 1024 too: ``bench_vs_study.py --device cuda --widths 384 640 1024``.
* ``decode``: greedy ``generate()`` tokens/s at r = 4 (batch 1): plain, ``kv_budget=1``, adaptive
  exit (``kl``), and self-drafting (``draft_num_recurrences=1``; every token it emits is checked
  greedy at r within 2 ulps of the logits, and identical to plain greedy in fp32: in bf16 the
  multi-token verification rounds unlike one-token decoding, so a near-tie may flip). Random
  weights: mean recurrences and acceptance show the mechanics, not a trained model's savings.
* ``decode_compiled``: the same greedy decoding through transformers' compiled path (static cache,
  ``fullgraph``, CUDA graphs), loop4 plain and at ``kv_budget=1`` against Llama-20 compiled alike.
  Target: loop4 / Llama >= 1.0.
* ``micro_sweep``: 8 runs (2 budgets x 2 widths x r in {1, 4}) of ``recipes/iso_depth_gpu.yaml``
  at budgets 1/4 and 1/2 of its smallest, through the sweep runner, then ``fit_scaling_law`` on
  them; the measured seconds per step predict the wall time of the whole 48-run recipe (its
  comment assumed ~25 ms per step). Eight, not three: the law has 6 free parameters. A fit of 8
  tiny runs checks the pipeline on the GPU; its phi is not a measurement.

A global time guard (``--time-limit``, default 450 s; 540 s with ``--study-src``) gives every section what is left and
skips the remaining ones when it is spent (``SIGALRM``, so a long compile is interrupted too).
The JSON (``gpu_check.json``) and a markdown table (``gpu_check.md``) are rewritten atomically
after every section, so a killed check leaves what it measured. Nothing is downloaded: random
tokens for the models, the embedded corpus and tokenizer for the sweep.
"""

from __future__ import annotations

import os

# Before transformers is imported: nothing in this check may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import math  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from looped_hf import LoopedConfig, LoopedForCausalLM  # noqa: E402
from looped_hf.attention_backends import (  # noqa: E402
    apply_attention_backend,
    device_capability,
    installed_packages,
    select_attention_backend,
)
from looped_hf.fileio import write_json_atomic, write_text_atomic  # noqa: E402
from looped_hf.hardware import device_peak_flops  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPE = REPO / "recipes" / "iso_depth_gpu.yaml"
JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
# A bf16 backend agrees with the others when rel_l2(backend, fp32) <= SLACK x rel_l2(bf16 eager, fp32) + FLOOR.
LOGITS_SLACK, LOGITS_FLOOR = 2.0, 0.01
# A self-drafted token is greedy "within rounding" when its logit is at most DRAFT_ULPS ulps of the
# position's largest logit below the maximum (the verification forward rounds unlike decoding).
DRAFT_ULPS = 2.0
#: Kernels listed per profiled training step (train_eager / train_compiled / vs_study).
TOP_KERNELS = 8


def _ulp(dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` next to 1.0, i.e. one ulp relative to a value (bf16: 2^-7)."""
    return torch.finfo(dtype).eps


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the GPU check and its ``--tiny`` CPU rehearsal."""

    width: int
    head_dim: int
    vocab: int
    seq_len: int
    batch: int
    warmup_steps: int
    timed_steps: int
    logits_batch: int
    decode_prompt: int
    decode_new: int
    decode_repeats: int
    sweep_jobs: int | None  # None: the sweep runner's default (cores // torch_num_threads)
    study_batch: int  # the study comparison's batch (the study's device batch on a GPU)
    study_steps: int


FULL = Sizes(width=640, head_dim=128, vocab=32000, seq_len=2048, batch=8, warmup_steps=3, timed_steps=10,
             logits_batch=2, decode_prompt=128, decode_new=64, decode_repeats=3, sweep_jobs=None,
             study_batch=32, study_steps=10)  # fmt: skip
TINY = Sizes(width=64, head_dim=16, vocab=512, seq_len=64, batch=2, warmup_steps=1, timed_steps=2,
             logits_batch=2, decode_prompt=8, decode_new=8, decode_repeats=1, sweep_jobs=1,
             study_batch=2, study_steps=2)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def loop4_config(s: Sizes) -> LoopedConfig:
    """The study's loop4 (scaling_laws.sh: prelude 2, block 4 x r = 4, coda 2; nanochat's block)."""
    return LoopedConfig(
        vocab_size=s.vocab, hidden_size=s.width, num_attention_heads=s.width // s.head_dim, head_dim=s.head_dim,
        num_prelude_layers=2, num_recurrent_layers=4, num_coda_layers=2, num_recurrences=4,
        input_injection="linear", hidden_act="relu2", qk_norm="after_rope", init_scheme="study",
        logit_softcap=15.0, embedding_norm=True, recurrence_norm=True, tie_word_embeddings=False,
        max_position_embeddings=max(2048, s.seq_len), use_cache=False,
    )  # fmt: skip


def llama_ffn(width: int) -> int:
    """Llama's MLP width rule: 8d/3 (SwiGLU's 3 matrices ~ the 2 of a 4d MLP), rounded up to 256."""
    return 256 * math.ceil(8 * width / 3 / 256)


def llama_config(s: Sizes, layers: int = 20) -> LlamaConfig:
    """transformers' Llama at loop4's width and effective depth (2 + 4 x 4 + 2 = 20 layers)."""
    return LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.width, num_attention_heads=s.width // s.head_dim, head_dim=s.head_dim,
        intermediate_size=llama_ffn(s.width), num_hidden_layers=layers, max_position_embeddings=max(2048, s.seq_len),
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip


def llama_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Llama's training FLOPs/token from the looped model's own accounting: a plain LoopedConfig (r = 1,
    no loop, Llama's block) of the same shape; raises if its parameter count is not Llama's."""
    plain = LoopedConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim, intermediate_size=config.intermediate_size, hidden_act="silu",
        num_prelude_layers=0, num_recurrent_layers=config.num_hidden_layers, num_coda_layers=0, num_recurrences=1,
        input_injection="none", qk_norm="none", logit_softcap=None, embedding_norm=False, recurrence_norm=False,
        tie_word_embeddings=False, max_position_embeddings=config.max_position_embeddings,
    )  # fmt: skip
    with torch.device("meta"):
        twin, llama = LoopedForCausalLM(plain), LlamaForCausalLM(config)
    n_twin, n_llama = (sum(p.numel() for p in m.parameters()) for m in (twin, llama))
    if n_twin != n_llama:
        raise RuntimeError(f"the plain looped twin has {n_twin:,} parameters, Llama {n_llama:,}: FLOPs would differ")
    return twin.training_flops_per_token(seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device):
    # bf16 autocast over fp32 weights on CUDA, as the study trains; fp32 on CPU (bf16 is slow there).
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Time guard
# ------------------------------------------------------------------------------------------------
class SectionTimeout(Exception):
    """A section ran into the global time limit."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``SectionTimeout`` in the main thread after ``seconds`` (SIGALRM; no-op where absent)."""
    if not hasattr(signal, "SIGALRM") or seconds <= 0:
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"stopped by the time guard after {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Check:
    """Runs the sections under one time limit, recording results or errors, saving after each."""

    def __init__(self, out: Path, time_limit: float, tiny: bool) -> None:
        self.out = out
        self.limit = time_limit
        self.started = time.perf_counter()
        self.result: dict[str, Any] = {"tiny": tiny, "time_limit_s": time_limit, "sections": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def section(self, name: str, fn: Callable[[dict[str, Any]], None], min_s: float) -> None:
        """Run ``fn(rec)`` (it fills ``rec`` as it goes, so a failure keeps the rows before it), unless
        fewer than ``min_s`` seconds of the limit are left."""
        rec: dict[str, Any] = {}
        left = self.limit - self.elapsed()
        self.result["sections"][name] = rec
        if left < min_s:
            rec.update(status="skipped", reason=f"time guard: {left:.0f} s left of {self.limit:.0f}, needs ~{min_s:.0f}")
            _say(f"[{name}] skipped: {rec['reason']}")
            self.save()
            return
        _say(f"[{name}] start ({self.elapsed():.0f} s elapsed, {left:.0f} s left)")
        t0 = time.perf_counter()
        try:
            with deadline(left):
                fn(rec)
            rec["status"] = "ok"
        except Exception as err:  # noqa: BLE001 - one broken section must not cost the others
            rec.update(status="error", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=8))
            _say(f"[{name}] {rec['error']}")
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        _say(f"[{name}] {rec['status']} in {rec['seconds']:.1f} s")
        self.save()

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 2)
        write_json_atomic(self.out / JSON_NAME, self.result)
        write_text_atomic(self.out / MD_NAME, markdown(self.result))


def _say(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------
def environment(rec: dict[str, Any], device: torch.device, peak: float | None) -> None:
    import transformers
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    rec.update(
        python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__,
        device=str(device), device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        peak_flops=peak, flash_attn_2=is_flash_attn_2_available(), flash_attn_3=is_flash_attn_3_available(),
        cuda=torch.version.cuda, torch_threads=torch.get_num_threads(),
    )  # fmt: skip
    # What `looped-hf train` would choose here (the study's rule: FA3 on Hopper, FA2 on Ampere/Ada).
    candidates, reason = select_attention_backend(None, device_capability(device), installed_packages())
    rec.update(attention_backend=reason, attention_candidates=" > ".join(candidates))


def attention_backends(device: torch.device) -> list[tuple[str, str, Any]]:
    """(label, attn_implementation, context) of every backend to compare on ``device``."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    backends: list[tuple[str, str, Any]] = [("eager", "eager", contextlib.nullcontext),
                                            ("sdpa", "sdpa", contextlib.nullcontext)]  # fmt: skip
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends.append(("sdpa_flash_kernel", "sdpa", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)))
        if is_flash_attn_2_available():
            backends.append(("flash_attention_2", "flash_attention_2", contextlib.nullcontext))
        if is_flash_attn_3_available():
            backends.append(("flash_attention_3", "flash_attention_3", contextlib.nullcontext))
    return backends


def logits_agreement(rec: dict[str, Any], s: Sizes, device: torch.device) -> None:
    torch.manual_seed(0)
    model = LoopedForCausalLM(loop4_config(s)).to(device).eval()
    ids = torch.randint(0, s.vocab, (s.logits_batch, s.seq_len), device=device)

    def logits(impl: str, ctx: Any, dtype: torch.dtype) -> torch.Tensor:
        model.set_attn_implementation(impl)
        with torch.no_grad(), ctx():
            return model.to(dtype)(input_ids=ids).logits.float()

    ref = logits("eager", contextlib.nullcontext, torch.float32)
    rows = rec.setdefault("rows", [])
    for label, impl, ctx in attention_backends(device):
        try:
            out = logits(impl, ctx, torch.bfloat16)
        except Exception as err:  # noqa: BLE001 - a backend the build lacks is a row, not a failure
            rows.append({"backend": label, "error": f"{type(err).__name__}: {err}"})
            continue
        diff = out - ref
        rows.append({
            "backend": label,
            "rel_l2_vs_fp32": float(diff.norm() / ref.norm()),
            "max_abs_vs_fp32": float(diff.abs().max()),
            "top1_agree_fp32": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
        })  # fmt: skip
        _say(f"  {label}: rel L2 {rows[-1]['rel_l2_vs_fp32']:.2e}, max |d| {rows[-1]['max_abs_vs_fp32']:.2e}")
    base = next(r["rel_l2_vs_fp32"] for r in rows if r["backend"] == "eager" and "error" not in r)
    tol = LOGITS_SLACK * base + LOGITS_FLOOR
    rec["tolerance"] = {"rule": f"rel_l2_vs_fp32 <= {LOGITS_SLACK} x bf16 eager's + {LOGITS_FLOOR}", "value": tol}
    for row in rows:
        if "error" not in row:
            row["agrees"] = row["rel_l2_vs_fp32"] <= tol
    rec["all_agree"] = all(r.get("agrees", False) for r in rows)


def _train_row(name: str, model: torch.nn.Module, flops_per_token: float, s: Sizes, device: torch.device,
               peak: float | None, compile_backend: str | None,
               kernels: bool = True) -> dict[str, Any]:  # fmt: skip
    """Tokens/s, MFU and peak memory of ``timed_steps`` training steps after ``warmup_steps``;
    ``kernels``: and the top kernels of one more, profiled step (reading the profile of a step
    takes ~2 s on a CPU, so a caller that only needs the timing skips it)."""
    torch.manual_seed(0)
    model = model.to(device).train()
    # The backend a training run gets (apply_attention_backend: FA3 / FA2 where installed, else SDPA),
    # the same for both models.
    capability = device_capability(device)
    attention = apply_attention_backend(model, capability=capability).implementation
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    fwd = torch.compile(model, backend=compile_backend) if compile_backend else model
    ids = torch.randint(0, s.vocab, (s.batch, s.seq_len), device=device)
    losses: list[float] = []

    def step() -> None:
        with _autocast(device):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(s.warmup_steps):
        step()
    _sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(s.timed_steps):
        step()
    _sync(device)
    seconds = time.perf_counter() - t0
    tokens_per_s = s.batch * s.seq_len * s.timed_steps / seconds
    top: list[dict[str, Any]] | None = None
    if kernels:  # where the step's time goes: the top kernels of one more step under the profiler (untimed)
        bench = _bench_vs_study()
        prof = bench._profiler(device)
        with prof:
            step()
            _sync(device)
        top = bench.top_kernels(prof, device, TOP_KERNELS)
    last = float(losses[-1])
    if not math.isfinite(last):
        raise FloatingPointError(f"{name}: non-finite training loss {last}")
    return {
        "model": name, "compiled": compile_backend, "attention": attention, "batch": s.batch, "seq_len": s.seq_len,
        "params": sum(p.numel() for p in model.parameters()), "flops_per_token": flops_per_token,
        "tokens_per_s": tokens_per_s, "step_ms": 1e3 * seconds / s.timed_steps, "warmup_s": warmup_s,
        "mfu": flops_per_token * tokens_per_s / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "last_loss": last, "kernels": top,
    }  # fmt: skip


def training(rec: dict[str, Any], s: Sizes, device: torch.device, peak: float | None,
             compile_backend: str | None) -> None:  # fmt: skip
    rows = rec.setdefault("rows", [])
    lcfg = llama_config(s)
    builds = (
        ("loop4", lambda: LoopedForCausalLM(loop4_config(s)),
         lambda: LoopedForCausalLM(loop4_config(s)).training_flops_per_token(s.seq_len)),
        ("llama20", lambda: LlamaForCausalLM(lcfg), lambda: llama_flops_per_token(lcfg, s.seq_len)),
    )  # fmt: skip
    for name, build, flops in builds:
        with torch.device("meta"):
            fpt = flops()
        torch.manual_seed(0)
        rows.append(_train_row(name, build(), fpt, s, device, peak, compile_backend))
        r = rows[-1]
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        _say(f"  {name} {'compiled' if compile_backend else 'eager'}: {r['tokens_per_s']:,.0f} tok/s{mfu}, "
             f"warm-up {r['warmup_s']:.1f} s")  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _trainer_row(s: Sizes, device: torch.device, work: Path, looped: bool) -> dict[str, Any]:
    """The same loop4 model, AdamW, batch and autocast as ``_train_row``, trained by the HF ``Trainer``
    with ``LoopedComputeCallback``; ``looped``: by ``LoopedTrainer`` with the GPU recipes'
    ``logging_nan_inf_filter: false`` (what ``looped-hf train`` runs per step). Tokens/s over the same
    timed steps, clocked from the end of the warm-up to the end of training (a sync at each end)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from looped_hf.callback import LoopedComputeCallback
    from looped_hf.trainer import LoopedTrainer

    torch.manual_seed(0)
    model = LoopedForCausalLM(loop4_config(s)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    g = torch.Generator().manual_seed(0)
    steps = s.warmup_steps + s.timed_steps
    rows = [{"input_ids": torch.randint(0, s.vocab, (s.seq_len,), generator=g)} for _ in range(s.batch * steps)]
    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == s.warmup_steps:
                _sync(device)
                marks["start"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            _sync(device)
            marks["end"] = time.perf_counter()

    args = TrainingArguments(
        str(work / "trainer_overhead"), max_steps=steps, per_device_train_batch_size=s.batch, max_grad_norm=0.0,
        bf16=device.type == "cuda", use_cpu=device.type == "cpu", logging_steps=max(1, s.timed_steps // 2),
        save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        logging_nan_inf_filter=not looped,
    )  # fmt: skip
    collate = lambda feats: {"input_ids": (x := torch.stack([f["input_ids"] for f in feats])), "labels": x}  # noqa: E731
    (LoopedTrainer if looped else Trainer)(model=model, args=args, train_dataset=rows, data_collator=collate, optimizers=(opt, sched),
            callbacks=[LoopedComputeCallback(), Clock()]).train()  # fmt: skip
    seconds = marks["end"] - marks["start"]
    return {"tokens_per_s": s.batch * s.seq_len * s.timed_steps / seconds, "step_ms": 1e3 * seconds / s.timed_steps}


def trainer_overhead(rec: dict[str, Any], s: Sizes, device: torch.device, work: Path, repeats: int = 2) -> None:
    """The Trainer's own cost, on the device: the vanilla Trainer's and LoopedTrainer's
    steps against the bare loop of ``_train_row`` (same model, optimizer, batch, bf16 autocast,
    eager), interleaved ``repeats`` times; ms/step added and its share of the bare step."""
    rows = rec.setdefault("rows", [])
    for i in range(repeats):
        bare = _train_row(
            "loop4", LoopedForCausalLM(loop4_config(s)), 0.0, s, device, None, None, kernels=False
        )
        vanilla = _trainer_row(s, device, work, looped=False)
        looped = _trainer_row(s, device, work, looped=True)
        rows.append({"repeat": i, "bare_step_ms": bare["step_ms"], "trainer_step_ms": vanilla["step_ms"],
                     "looped_trainer_step_ms": looped["step_ms"],
                     "overhead_ms": vanilla["step_ms"] - bare["step_ms"],
                     "overhead_share": vanilla["step_ms"] / bare["step_ms"] - 1,
                     "looped_overhead_ms": looped["step_ms"] - bare["step_ms"],
                     "looped_overhead_share": looped["step_ms"] / bare["step_ms"] - 1})  # fmt: skip
        _say(f"  Trainer / LoopedTrainer vs bare: {vanilla['step_ms']:.1f} / {looped['step_ms']:.1f} vs "
             f"{bare['step_ms']:.1f} ms/step")  # fmt: skip
    for key in ("overhead_share", "looped_overhead_share"):
        shares = sorted(r[key] for r in rows)
        rec[f"{key}_median"] = shares[len(shares) // 2]


def _timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, Any]:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up call, and its last output."""
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def decoding_compiled(rec: dict[str, Any], s: Sizes, device: torch.device, backend: str) -> None:
    """Batch-1 greedy through transformers' compiled decoding (static cache, ``fullgraph=True``;
    on CUDA ``mode="reduce-overhead"``: CUDA graphs), loop4 at r = 4 plain and with
    ``kv_budget=1`` against Llama of the same width and effective depth (20 layers), compiled the
    same way. Output identical to eager greedy is checked for loop4."""
    from transformers import CompileConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loop = LoopedForCausalLM(loop4_config(s)).to(device=device, dtype=dtype).eval()
    llama = LlamaForCausalLM(llama_config(s)).to(device=device, dtype=dtype).eval()
    for model in (loop, llama):
        model.config.use_cache = True
    prompt = torch.randint(0, s.vocab, (1, s.decode_prompt), device=device)
    cuda = device.type == "cuda"
    config = CompileConfig(fullgraph=True, backend=backend, mode="reduce-overhead" if cuda else None)
    config._compile_all_devices = not cuda  # transformers compiles on a CPU only when told
    gen = dict(max_new_tokens=s.decode_new, min_new_tokens=s.decode_new, do_sample=False, pad_token_id=0,
               use_cache=True)  # the configs say use_cache=False (training); generation_config follows it
    compiled = dict(cache_implementation="static", compile_config=config)
    rows = rec.setdefault("rows", [])
    settings = (("loop4 r=4", loop, {}), ("loop4 r=4 kv_budget=1", loop, {"kv_budget": 1}), ("llama20", llama, {}))
    from torch._dynamo.utils import counters

    for label, model, extra in settings:
        graphs_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(prompt, **gen, **compiled, **extra)  # the first call compiles
            _sync(device)
            compile_s = time.perf_counter() - t0
            seconds, out = _timed(lambda m=model, e=extra: m.generate(prompt, **gen, **compiled, **e),
                                  s.decode_repeats, device)  # fmt: skip
            row = {"setting": label, "tokens_per_s": (out.shape[1] - prompt.shape[1]) / seconds,
                   "first_call_s": compile_s, "graphs": counters["stats"]["unique_graphs"] - graphs_before}  # fmt: skip
            if model is loop:
                row["same_as_eager"] = bool(torch.equal(out, model.generate(prompt, **gen, **extra)))
                # bf16: compiled kernels round unlike eager ones, so a near-tie may flip (see the
                # decode section); what must hold is that every token is greedy within rounding.
                gaps = model.greedy_gaps(out, prompt.shape[1], **extra)
                top = model(input_ids=out, use_cache=False).logits.float()[:, prompt.shape[1] - 1 : -1]
                row["greedy_within_rounding"] = bool((gaps <= DRAFT_ULPS * _ulp(dtype) * top.abs().amax(-1)).all())
        rows.append(row)
        _say(f"  {label} compiled: {row['tokens_per_s']:.1f} tok/s (first call {compile_s:.1f} s)")
    if not all(r["graphs"] > 0 for r in rows):
        raise AssertionError(f"compiled decoding did not compile: {[(r['setting'], r['graphs']) for r in rows]}")
    if not all(r.get("greedy_within_rounding", True) for r in rows):
        raise AssertionError("a token of compiled greedy decoding is not greedy within rounding")
    if dtype == torch.float32 and not all(r.get("same_as_eager", True) for r in rows):
        raise AssertionError("in fp32 compiled greedy decoding differs from eager greedy decoding")
    llama_tps = rows[-1]["tokens_per_s"]
    for row in rows:
        row["vs_llama"] = row["tokens_per_s"] / llama_tps
    rec["loop4_over_llama"] = rows[0]["vs_llama"]


def decoding(rec: dict[str, Any], s: Sizes, device: torch.device) -> None:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LoopedForCausalLM(loop4_config(s)).to(device=device, dtype=dtype).eval()
    model.config.use_cache = True
    prompt = torch.randint(0, s.vocab, (1, s.decode_prompt), device=device)
    gen = dict(max_new_tokens=s.decode_new, min_new_tokens=s.decode_new, do_sample=False, pad_token_id=0,
               num_recurrences=4, return_dict_in_generate=True, use_cache=True)  # fmt: skip
    settings = (
        ("plain r=4", {}),
        ("kv_budget=1", {"kv_budget": 1}),
        ("exit kl 1e-3", {"exit_criterion": "kl", "exit_threshold": 1e-3}),
        ("self-draft k=1", {"draft_num_recurrences": 1}),
    )
    rows = rec.setdefault("rows", [])
    plain_seq = None
    for label, extra in settings:
        with torch.no_grad():
            seconds, out = _timed(lambda extra=extra: model.generate(prompt, **gen, **extra), s.decode_repeats, device)
        new = out.sequences.shape[1] - prompt.shape[1]
        row: dict[str, Any] = {"setting": label, "tokens_per_s": new / seconds, "new_tokens": new}
        if plain_seq is None:
            plain_seq = out.sequences
        if getattr(out, "recurrences_used", None) is not None:
            row["mean_recurrences"] = float(out.recurrences_used.float().mean())
        if getattr(out, "num_draft_tokens", None):
            row["acceptance"] = out.num_accepted_draft_tokens / out.num_draft_tokens
            row["identical_to_plain"] = bool(torch.equal(out.sequences, plain_seq))
            # The guarantee in bf16 (LoopedGenerationMixin.generate): every emitted token is greedy
            # within rounding; identical to plain greedy only in fp32 (near-ties may flip in bf16).
            gaps = model.greedy_gaps(out.sequences, prompt.shape[1], num_recurrences=4)
            with torch.no_grad():
                top = model(input_ids=out.sequences, use_cache=False).logits.float()[:, prompt.shape[1] - 1 : -1]
            row["max_greedy_gap"] = float(gaps.max())
            row["greedy_within_rounding"] = bool((gaps <= DRAFT_ULPS * _ulp(dtype) * top.abs().amax(-1)).all())
            same = (out.sequences == plain_seq)[0, prompt.shape[1] :]
            row["agree_until"] = int(same.long().cumprod(0).sum())
        row["speedup_vs_plain"] = row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0
        rows.append(row)
        _say(f"  {label}: {row['tokens_per_s']:.1f} tok/s")
    rec["note"] = ("random weights: mean r and acceptance show the mechanics (a random model's recurrences barely "
                   "move its prediction), not what a trained model saves")
    drafted = [r for r in rows if "identical_to_plain" in r]
    if drafted and not all(r["greedy_within_rounding"] for r in drafted):
        raise AssertionError("a self-drafted token is not greedy at r within rounding")
    if dtype == torch.float32 and drafted and not all(r["identical_to_plain"] for r in drafted):
        raise AssertionError("in fp32 self-drafted greedy output differs from plain greedy")


def _bench_vs_study() -> Any:
    """benchmarks/bench_vs_study.py as a module (the benchmarks folder is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vs_study", Path(__file__).with_name("bench_vs_study.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_vs_study", module)
    spec.loader.exec_module(module)
    return module


def vs_study(rec: dict[str, Any], s: Sizes, device: torch.device, study_src: Path, peak: float | None,
             compiled: bool) -> None:  # fmt: skip
    """bench_vs_study's three sides at this check's width, interleaved step by step: the study's
    nanochat GPT + MuonAdamW (``torch.compile`` and its compiled optimizer kernels on a GPU), the
    ``looped-hf train`` Trainer step (``torch_compile``, bf16, the GPU recipe's settings) and a bare
    loop of the same model; tokens/s, MFU, phases and the top kernels of one profiled step each.
    One compile per side. The study's device batch (32 x 2048 on a GPU)."""
    from types import SimpleNamespace

    from looped_hf.data import load_tokenizer

    bench = _bench_vs_study()
    shape = {"width": s.width, "head_dim": s.head_dim, "seq": s.seq_len, "batch": s.study_batch,
             "vocab": len(load_tokenizer())}  # fmt: skip
    study_mod = bench.import_study(study_src.resolve(), compile_kernels=compiled)
    result = bench.run_session(
        study_mod, shape, SimpleNamespace(threads=torch.get_num_threads()), compiled, s.study_steps, s.warmup_steps,
        device=device, profile_top=TOP_KERNELS,
    )  # fmt: skip
    numbers = bench.report({"compiled" if compiled else "eager": result}, shape, peak=peak)
    session = next(iter(numbers["sessions"].values()))
    # train.py keeps the backend it chose in the run record (AttentionBackend.to_record()).
    rec.update(shape=shape, compiled=compiled, attention=(result.get("attention") or {}).get("implementation"))
    rec["rows"] = [
        {"side": side, "step_ms": session["ms"][side], "tokens_per_s": session["tokens_per_s"][side],
         "mfu": session["mfu"].get(side), "phases_ms": session["phases_ms"].get(side, {})}
        for side in ("study", "study core", "looped_hf", "bare")
    ]  # fmt: skip
    rec["looped_hf_over_study"] = session["looped_hf_over_study_tokens_per_s"]
    rec["trainer_minus_bare_ms"] = session["trainer_overhead_ms"]
    rec["kernels"] = session["kernels"]


def _small_corpus(path: Path, chars: int = 60_000) -> Path:
    """The first ``chars`` characters of the embedded classics as JSONL (``--tiny``'s sweep data)."""
    from looped_hf.data import embedded_corpus_path

    size, lines = 0, []
    with lzma.open(embedded_corpus_path(), "rt", encoding="utf-8") as src:
        for line in src:
            text = json.loads(line)["text"][:3000]
            lines.append(json.dumps({"text": text}))
            size += len(text)
            if size > chars:
                break
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path


def micro_sweep_recipe(tiny: bool, work: Path) -> dict[str, Any]:
    """``recipes/iso_depth_gpu.yaml`` at 1/4 and 1/2 of its smallest budget, widths 32 and 48,
    r in {1, 4}: 8 runs (``--tiny``: depth 4, width 16 / 24, bytes on a 60 KB corpus, 8 runs too)."""
    recipe = yaml.safe_load(GPU_RECIPE.read_text())
    sweep = recipe["sweep"]
    smallest = min(sweep["budgets"])
    sweep.update(budgets=[smallest / 4, smallest / 2], widths=[32, 48], recurrences=[1, 4], executor="local",
                 checkpoints_per_run=0, output_dir=str(work / "sweep"))  # fmt: skip
    recipe["data_cache_dir"] = str(work / "data_cache")
    if tiny:
        sweep.update(effective_depth=6, prelude=1, coda=1, head_dim=8, widths=[16, 24], budgets=[4e8, 8e8])
        recipe.update(dataset=str(_small_corpus(work / "corpus.jsonl")), tokenizer="bytes", seq_len=32,
                      eval_blocks=16, per_device_train_batch_size=8, per_device_eval_batch_size=16, bf16=False,
                      tf32=False, torch_num_threads=1, logging_steps=10)  # fmt: skip
    elif not torch.cuda.is_available():
        recipe.update(bf16=False, tf32=False)
    return recipe


def micro_sweep(rec: dict[str, Any], tiny: bool, jobs: int | None, work: Path, out: Path) -> None:
    from looped_hf.arguments import parse_recipe
    from looped_hf.data import build_datasets, load_tokenizer
    from looped_hf.scaling import fit_scaling_law
    from looped_hf.sweep import default_jobs, make_plan, run_sweep

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the earlier sections' cached blocks, before 4 worker processes share the GPU
    recipe = micro_sweep_recipe(tiny, work)
    # Tokenize once here, so parallel runs find the cache instead of each building it.
    flat = {k: v for k, v in recipe.items() if k != "sweep"}
    _, data_args, _ = parse_recipe({**flat, "max_steps": 1, "output_dir": str(work / "probe")})
    t0 = time.perf_counter()
    build_datasets(data_args, load_tokenizer(data_args.tokenizer))
    rec["tokenize_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = run_sweep(recipe, recipe["sweep"]["output_dir"], jobs=jobs, log=_say)
    rec["wall_s"] = time.perf_counter() - t0
    rec["jobs"] = jobs
    runs = rec.setdefault("runs", [])
    for r in records:
        steps = r.get("max_steps") or 0
        runs.append({"run_id": r["run_id"], "status": r["status"], "loss": r.get("loss"), "steps": steps,
                     "train_runtime_s": r.get("train_runtime_s"),
                     "s_per_step": r["train_runtime_s"] / steps if r.get("train_runtime_s") and steps else None,
                     "error": r.get("error")})  # fmt: skip
    results = Path(recipe["sweep"]["output_dir"]) / "results.jsonl"
    write_text_atomic(out / "micro_sweep_results.jsonl", results.read_text())
    failed = [r["run_id"] for r in runs if r["status"] != "ok"]
    if failed:
        raise RuntimeError(f"micro sweep runs failed: {failed}")
    per_step = statistics.median(r["s_per_step"] for r in runs if r["s_per_step"])
    rec["median_s_per_step"] = per_step
    if not tiny:  # what the whole iso_depth_gpu recipe would take at this pace, runs in parallel
        plan = make_plan(GPU_RECIPE, work / "plan_only")
        n_jobs = jobs or default_jobs(plan)
        steps = sum(r.steps for r in plan.runs)
        rec["iso_depth_gpu_prediction"] = {"runs": len(plan.runs), "steps": steps, "jobs": n_jobs,
                                           "train_s_if_jobs_overlap_fully": steps * per_step / n_jobs,
                                           "train_s_one_at_a_time": steps * per_step}  # fmt: skip
    with warnings_caught() as caught:
        fit = fit_scaling_law(results, bootstrap=0, seed=0, checks=False)
    fit.to_json(out / "micro_sweep_fit.json")
    rec["fit"] = {"params": {k: float(v) for k, v in fit.params.items() if v is not None},
                  "note": "8 tiny runs: checks the pipeline; phi here is not a measurement",
                  "warnings": caught}  # fmt: skip


@contextlib.contextmanager
def warnings_caught() -> Iterator[list[str]]:
    """Collect the messages of warnings raised inside (a fit on 8 runs warns; the JSON keeps them)."""
    import warnings

    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages.extend(str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------------
# Markdown
# ------------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def markdown(result: dict[str, Any]) -> str:
    """The JSON as tables, one per section; a section that failed or was skipped says so."""
    sections = result["sections"]
    lines = [f"# GPU check{' (--tiny rehearsal)' if result.get('tiny') else ''}", "",
             f"Elapsed {result.get('elapsed_s', 0):.0f} s of a {result['time_limit_s']:.0f} s limit.", ""]  # fmt: skip
    for name, sec in sections.items():
        lines += [f"## {name}: {sec.get('status', 'running')}", ""]
        if sec.get("status") in ("error", "skipped"):
            lines += [f"`{sec.get('error') or sec.get('reason')}`", ""]
        if name == "environment":
            lines += _table(["key", "value"], [[k, v] for k, v in sec.items() if k not in ("status", "seconds")])
        elif name == "logits" and sec.get("rows"):
            if "tolerance" in sec:
                lines += [f"Tolerance: {sec['tolerance']['rule']} = {sec['tolerance']['value']:.3g}.", ""]
            lines += _table(["backend (bf16)", "rel L2 vs fp32 eager", "max abs", "top-1 = fp32", "agrees"],
                            [[r["backend"], r.get("rel_l2_vs_fp32"), r.get("max_abs_vs_fp32"), r.get("top1_agree_fp32"),
                              r.get("agrees", r.get("error"))] for r in sec["rows"]])  # fmt: skip
        elif name in ("train_eager", "train_compiled") and sec.get("rows"):
            lines += _table(["model", "torch.compile", "attention", "tokens/s", "step ms", "MFU", "peak GiB", "warm-up s",
                             "FLOPs/token"],
                            [[r["model"], r["compiled"] or "off", r.get("attention"), r["tokens_per_s"], r["step_ms"],
                              None if r["mfu"] is None else f"{r['mfu']:.1%}", r["peak_memory_gib"], r["warmup_s"],
                              r["flops_per_token"]] for r in sec["rows"]])  # fmt: skip
            for r in sec["rows"]:
                if r.get("kernels"):
                    lines += [f"Top of one profiled {r['model']} step:", ""]
                    lines += _table(["ms", "share", "kernel"],
                                    [[k["ms"], f"{k['share']:.1%}", f"`{k['name']}`"] for k in r["kernels"]])
        elif name == "trainer_overhead" and sec.get("rows"):
            lines += ["transformers.Trainer and LoopedTrainer (+ LoopedComputeCallback; LoopedTrainer without the "
                      "per-step NaN check, as the GPU recipes) vs a bare loop, same model, AdamW, batch, bf16, eager.", ""]
            lines += _table(["repeat", "bare ms/step", "Trainer ms/step", "LoopedTrainer ms/step", "Trainer added",
                             "LoopedTrainer added"],
                            [[r["repeat"], r["bare_step_ms"], r["trainer_step_ms"], r["looped_trainer_step_ms"],
                              f"{r['overhead_ms']:.2f} ms ({r['overhead_share']:.1%})",
                              f"{r['looped_overhead_ms']:.2f} ms ({r['looped_overhead_share']:.1%})"]
                             for r in sec["rows"]])  # fmt: skip
        elif name == "vs_study" and sec.get("rows"):
            shape = sec["shape"]
            lines += [f"Width {shape['width']}, head dim {shape['head_dim']}, {shape['batch']} x {shape['seq']} tokens, "
                      f"vocab {shape['vocab']}, {'compiled' if sec['compiled'] else 'eager'}; attention "
                      f"{sec.get('attention') or 'sdpa'}. **looped_hf / study tokens/s: "
                      f"{sec['looped_hf_over_study']:.3f}** (target >= 1.0); Trainer - bare "
                      f"{sec['trainer_minus_bare_ms']:.2f} ms/step.", ""]  # fmt: skip
            lines += _table(["side", "ms/step", "tokens/s", "MFU", "phases ms"],
                            [[r["side"], r["step_ms"], r["tokens_per_s"], None if r["mfu"] is None else f"{r['mfu']:.1%}",
                              " ".join(f"{k} {v:.1f}" for k, v in r["phases_ms"].items())] for r in sec["rows"]])  # fmt: skip
            for side, kernels in sec.get("kernels", {}).items():
                lines += [f"Top of one profiled {side} step:", ""]
                lines += _table(["ms", "share", "kernel"], [[k["ms"], f"{k['share']:.1%}", f"`{k['name']}`"] for k in kernels])
        elif name == "decode_compiled" and sec.get("rows"):
            lines += [f"Batch 1, greedy, static cache, compiled. **loop4 / Llama: {sec.get('loop4_over_llama', 0):.3f}** "
                      "(target >= 1.0).", ""]  # fmt: skip
            lines += _table(["setting", "tokens/s", "x llama20", "first call s", "= eager greedy", "greedy within rounding"],
                            [[r["setting"], r["tokens_per_s"], r["vs_llama"], r["first_call_s"], r.get("same_as_eager"),
                              r.get("greedy_within_rounding")] for r in sec["rows"]])  # fmt: skip
        elif name == "decode" and sec.get("rows"):
            lines += [f"Batch 1, greedy; {sec.get('note', '')}.", ""]
            lines += _table(["setting", "tokens/s", "x plain", "mean r", "acceptance", "= plain greedy",
                             "same tokens", "greedy within rounding"],
                            [[r["setting"], r["tokens_per_s"], r["speedup_vs_plain"], r.get("mean_recurrences"),
                              r.get("acceptance"), r.get("identical_to_plain"), r.get("agree_until"),
                              r.get("greedy_within_rounding")] for r in sec["rows"]])  # fmt: skip
        elif name == "micro_sweep" and sec.get("runs"):
            lines += _table(["run", "status", "loss", "steps", "s/step"],
                            [[r["run_id"], r["status"], r["loss"], r["steps"], r["s_per_step"]] for r in sec["runs"]])
            if "iso_depth_gpu_prediction" in sec:
                p = sec["iso_depth_gpu_prediction"]
                lines += [f"recipes/iso_depth_gpu.yaml ({p['runs']} runs, {p['steps']:,} steps) at this pace: "
                          f"{p['train_s_one_at_a_time']:.0f} s of training one at a time, "
                          f"{p['train_s_if_jobs_overlap_fully']:.0f} s if {p['jobs']} jobs overlap fully.", ""]  # fmt: skip
            if "fit" in sec:
                params = ", ".join(f"{k} {v:.3g}" for k, v in sec["fit"]["params"].items())
                lines += [f"Fit ({sec['fit']['note']}): {params}.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run every section; exit 0 when all ran ok (1 when one failed, was skipped or disagreed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / gpu_check.md")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU: the whole code path in seconds")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for everything (default 450; tiny 300)")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --tiny)")
    parser.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: hardware table)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; tiny: eager)")
    parser.add_argument("--only", action="append", default=None,
                        choices=["logits", "vs_study", "train_eager", "trainer_overhead", "decode", "micro_sweep",
                                 "train_compiled", "decode_compiled"])  # fmt: skip
    parser.add_argument("--study-src", type=Path, default=None,
                        help="a checkout of kschwethelm/looped-lm-scaling: adds the vs_study section")
    args = parser.parse_args(argv)
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"--time-limit={args.time_limit}: must be > 0")
    if args.peak_flops is not None and not args.peak_flops > 0:
        parser.error(f"--peak-flops={args.peak_flops}: must be > 0")
    sizes = TINY if args.tiny else FULL
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the study's compute_init; bf16 autocast does the rest
        torch.backends.cudnn.allow_tf32 = True
    peak = args.peak_flops or device_peak_flops(device)
    backend = args.compile_backend or ("eager" if args.tiny else "inductor")
    if args.study_src is not None and not (args.study_src / "nanochat" / "gpt.py").is_file():
        parser.error(f"--study-src {args.study_src}: no nanochat/gpt.py there")
    # The study comparison adds three compiles (~1 min each on an H200): the limit grows to 9 min.
    default_limit = 300.0 if args.tiny else (540.0 if args.study_src is not None else 450.0)
    check = Check(args.out, args.time_limit or default_limit, args.tiny)
    check.result.update(sizes=asdict(sizes), compile_backend=backend)
    only = set(args.only or ["logits", "vs_study", "train_eager", "trainer_overhead", "decode", "micro_sweep",
                             "train_compiled", "decode_compiled"])  # fmt: skip
    if args.study_src is None:
        only.discard("vs_study")
    _say(f"gpu_check: device {device}, peak {peak or 'unknown'} FLOP/s, out {args.out}, limit {check.limit:.0f} s")
    check.section("environment", lambda rec: environment(rec, device, peak), 0)
    # Cheapest and most telling first; the compiles (minutes) last, where the guard can cut them.
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        plan: list[tuple[str, Callable[[dict[str, Any]], None], float]] = [
            ("logits", lambda rec: logits_agreement(rec, sizes, device), 5),
            # The headline (the target: looped_hf's Trainer step >= 1.0x the study's), early.
            ("vs_study", lambda rec: vs_study(rec, sizes, device, args.study_src, peak, not args.tiny), 60),
            ("train_eager", lambda rec: training(rec, sizes, device, peak, None), 10),
            ("trainer_overhead", lambda rec: trainer_overhead(rec, sizes, device, Path(work)), 10),
            ("decode", lambda rec: decoding(rec, sizes, device), 10),
            ("micro_sweep", lambda rec: micro_sweep(rec, args.tiny, sizes.sweep_jobs, Path(work), args.out), 30),
            ("train_compiled", lambda rec: training(rec, sizes, device, peak, backend), 30),
            ("decode_compiled", lambda rec: decoding_compiled(rec, sizes, device, backend), 30),
        ]
        for name, fn, min_s in plan:
            if name in only:
                check.section(name, fn, min_s)
    check.save()
    sections = check.result["sections"].values()
    ok = all(sec["status"] == "ok" for sec in sections) and check.result["sections"].get("logits", {}).get(
        "all_agree", True
    )
    _say(f"gpu_check: {'all sections ok' if ok else 'NOT all ok'}; {args.out / JSON_NAME}, {args.out / MD_NAME}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
