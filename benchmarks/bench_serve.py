"""Serving throughput and KV capacity: vLLM against batched ``generate()``, looped against Llama.

    python benchmarks/bench_serve.py                        # the docs' table (a few minutes on 2 CPU cores)
    python benchmarks/bench_serve.py --hidden 512 --repeats 5 --concurrency 1 8 32 64
    python benchmarks/bench_serve.py --dtype bfloat16 --skip-kv    # vLLM's default dtype

Three measurements, in one run, in the serving environment (``make serve-setup``):

1. tokens/s at 1, 8 and 32 concurrent requests (64 new tokens each, greedy, no early stop): vLLM's
   offline engine (every request submitted at once, so they share its continuous batch) against
   ``generate()`` on the same requests as one batch, on the same looped checkpoint;
2. the same vLLM on a Llama of the same width, heads, MLP and effective depth (P + r*K + C layers):
   the loop should cost what its depth costs (``--qwen3``: also a Qwen3 of that shape, a Llama with a
   per-head QK-norm, the nearest stock model to the looped layers);
3. vLLM's KV-cache capacity, tokens per GiB of ``VLLM_CPU_KVCACHE_SPACE``, at r = 1, 4 and 8 with
   one cache per layer application and with a ``kv_budget``, next to what P + k*K + C caches of
   this shape should hold.

The sides of 1 and 2 are interleaved within each repeat (vLLM looped, ``generate()``, vLLM Llama),
so drifting load on a shared machine hits all of them; the table gives the median over repeats and
the spread (min .. max). Models are random (throughput does not depend on the weights), in
``--dtype`` (float32 by default; every side, ``generate()`` included, runs in it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KV_SPACE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE for every engine here; capacities are per this GiB
KV_CASES = ((1, None), (4, None), (4, 2), (8, None), (8, 2))  # (r, kv_budget)
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # --dtype choices and their bytes per KV number


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="width d (head_dim 64)")
    p.add_argument("--layers", type=int, nargs=3, default=(1, 2, 1), metavar=("P", "K", "C"),
                   help="prelude, block and coda layers")  # fmt: skip
    p.add_argument("--r", type=int, default=4, help="recurrences of the throughput model")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=(1, 8, 32))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-layers", action="store_true",
                   help="looped layers without QK-norm, logit soft-cap and embedding norm, as Llama's: then only the "
                        "loop (injection, recurrence norm) differs from the Llama")  # fmt: skip
    p.add_argument("--qwen3", action="store_true",
                   help="also time vLLM's Qwen3 of the same width and effective depth: a Llama with a per-head QK-norm, "
                        "the nearest stock model to the looped one's layers")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="the models' dtype on every side (vLLM's own default is bfloat16)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="let vLLM torch.compile the models (default: eager)")
    p.add_argument("--native-norm", action="store_true",
                   help="both models' RMSNorms on vLLM's PyTorch implementation (default: the CPU build's kernels, "
                        "looped_hf.serving.cpu_norm)")  # fmt: skip
    p.add_argument("--skip-kv", action="store_true", help="skip the KV-capacity table (five engine starts)")
    p.add_argument("--skip-generate", action="store_true", help="time vLLM only (looped and Llama), not generate()")
    p.add_argument("--generate-python", default=None, metavar="PYTHON",
                   help="interpreter for the generate() side (default: this one)")  # fmt: skip
    p.add_argument("--generate-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the numbers as JSON")
    p.add_argument("--depth-mix", action="store_true",
                   help="per-request depth instead: requests at r = --shallow and --r served together against "
                        "all at --r, the two groups one after the other, and the stock vLLM worker (see depth_mix)")  # fmt: skip
    p.add_argument("--shallow", type=int, default=2, help="the shallow requests' r in --depth-mix")
    p.add_argument("--single-depth", action="store_true",
                   help="single-depth throughput instead: every request at the served r on a default server (more "
                        "than one depth allowed), vLLM's stock worker (no depth tensors) and a default server run "
                        "eager (see single_depth_sides)")  # fmt: skip
    return p


def save_models(root: Path, args: argparse.Namespace) -> tuple[Path, Path, Any]:
    """A random looped checkpoint and the Llama of its width and effective depth (with ``--qwen3`` also the
    Qwen3 of that shape, in ``root / "qwen3"``); returns the looped and Llama folders and the looped
    config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from looped_hf import LoopedConfig, LoopedForCausalLM

    prelude, block, coda = args.layers
    heads = args.hidden // 64
    looped = LoopedConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_attention_heads=heads, hidden_act="silu",
        num_prelude_layers=prelude, num_recurrent_layers=block, num_coda_layers=coda, num_recurrences=args.r,
        max_position_embeddings=1024,
        **({"qk_norm": None, "logit_softcap": None, "embedding_norm": False} if args.llama_layers else {}),
    )  # fmt: skip
    shape = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=64, intermediate_size=looped.intermediate_size, num_hidden_layers=looped.effective_num_layers,
        hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=looped.rms_norm_eps,
        tie_word_embeddings=looped.tie_word_embeddings,
    )  # fmt: skip
    llama = LlamaConfig(**shape)
    torch.manual_seed(0)
    LoopedForCausalLM(looped).save_pretrained(root / "looped")
    LlamaForCausalLM(llama).save_pretrained(root / "llama")
    if args.qwen3:  # the Llama's shape with Qwen3's per-head q and k norms (learnable, before RoPE)
        from transformers import Qwen3Config, Qwen3ForCausalLM

        Qwen3ForCausalLM(Qwen3Config(**shape)).save_pretrained(root / "qwen3")
    return root / "looped", root / "llama", looped


def norm_priority(args: argparse.Namespace) -> dict[str, list[str]]:
    """vLLM's ``ir_op_priority`` for every engine here, looped and Llama alike: the CPU build's RMSNorm
    kernels (``looped_hf.serving.cpu_norm``; what ``engine_args`` gives a looped engine on CPU), or
    with ``--native-norm`` vLLM's PyTorch implementation."""
    from looped_hf.serving import CPU_NORM_OPS
    from looped_hf.serving.engine import cpu_norm_priority

    return {op: ["native"] for op in CPU_NORM_OPS} if args.native_norm else cpu_norm_priority()


def vllm_engine(folder: Path, args: argparse.Namespace, looped: bool = True, hf_overrides: dict | None = None,
                **kwargs: Any) -> Any:  # fmt: skip
    """vLLM's offline engine on ``folder``: a looped one with ``engine_args(folder, **hf_overrides)``,
    a Llama without; both with ``norm_priority``, then ``kwargs``."""
    from vllm import LLM

    from looped_hf.serving import engine_args

    settings = dict(dtype=args.dtype, skip_tokenizer_init=True, seed=0, enforce_eager=not args.compile,
                    max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=max(args.concurrency))  # fmt: skip
    looped_settings = engine_args(folder, **(hf_overrides or {})) if looped else {}
    return LLM(model=str(folder), **{**settings, **looped_settings, "ir_op_priority": norm_priority(args), **kwargs})


def close(engine: Any) -> None:
    """Stop an engine's core process now (not at garbage collection), so the next one has the cores."""
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def generate_python(requested: str | None) -> str:
    """The interpreter for the ``generate()`` side: ``--generate-python``, else this one (looped_hf
    runs on the transformers vLLM pins, so the serving environment runs both sides)."""
    return requested or sys.executable


class GenerateWorker:
    """``generate()`` on the looped checkpoint in a persistent process (possibly another environment):
    one batched call per request, timed there, so its rate excludes the pipe."""

    def __init__(self, python: str, folder: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([python, __file__, "--generate-worker", str(folder), "--dtype", dtype],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self._send({"prompts": prompts, "new_tokens": new_tokens})

    def _send(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the generate() worker exited ({self.proc.wait()})")
        return json.loads(line)

    def tokens_per_s(self, n: int) -> float:
        return float(self._send({"n": n})["tokens_per_s"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def generate_worker(folder: str, dtype: str) -> int:
    """The worker's loop: the first line sets prompts and length, each next ``{"n": N}`` runs the first N
    prompts as one batch and answers ``{"tokens_per_s": ...}``."""
    import torch

    from looped_hf import LoopedForCausalLM

    model = LoopedForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    setup = json.loads(sys.stdin.readline())
    prompts, new_tokens = torch.tensor(setup["prompts"]), int(setup["new_tokens"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        batch = prompts[: json.loads(line)["n"]]
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False, pad_token_id=0,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)  # fmt: skip
        rate = (out.shape[1] - batch.shape[1]) * batch.shape[0] / (time.perf_counter() - start)
        print(json.dumps({"tokens_per_s": rate}), flush=True)
    return 0


def norm_path(model: Any) -> str:
    """How a served model's RMSNorms run: their classes and, for vLLM's ``RMSNorm``, the CustomOp
    forward it dispatched to and the vLLM IR implementations of ``rms_norm`` in priority order."""
    from vllm import ir

    norms = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1].endswith("norm")]
    classes = sorted({type(m).__name__ for m in norms})
    forwards = sorted({getattr(m, "_forward_method", m.forward).__name__ for m in norms})
    return f"{'/'.join(classes)} via {'/'.join(forwards)}, rms_norm impls {ir.ops.rms_norm.get_priority()}"


Rates = dict[str, dict[int, list[float]]]  # {side: {concurrency: [tokens per second, one per repeat]}}


def throughput(args: argparse.Namespace, looped_dir: Path, llama_dir: Path) -> tuple[Rates, Rates, str]:
    """(tokens/s of vLLM looped, generate() looped, vLLM Llama and with ``--qwen3`` vLLM Qwen3; tokens
    per CPU-second of the vLLM sides; how the vLLM models ran their RMSNorms). They must all run them
    the same way (``norm_path``), so the ratio compares the models, not two norm kernels. CPU-seconds are this
    process's (``time.process_time``, every thread), which holds vLLM's engine core unless
    VLLM_ENABLE_V1_MULTIPROCESSING=1: on a machine other jobs share they count the work done, not
    the time waited for a core, so their ratio is the steadier one there."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (max(args.concurrency), args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    engines = {"vllm_looped": vllm_engine(looped_dir, args), "vllm_llama": vllm_engine(llama_dir, args, looped=False)}
    if args.qwen3:
        engines["vllm_qwen3"] = vllm_engine(llama_dir.parent / "qwen3", args, looped=False)
    paths = {name: engine.apply_model(norm_path)[0] for name, engine in engines.items()}
    if len(set(paths.values())) != 1:
        raise SystemExit(f"bench_serve: the models run their RMSNorms differently: {paths}")
    worker = None
    if not args.skip_generate:
        worker = GenerateWorker(generate_python(args.generate_python), looped_dir, prompts, args.new_tokens, args.dtype)

    cpu: Rates = {name: {n: [] for n in args.concurrency} for name in engines}

    def run_vllm(name: str, n: int) -> float:
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = engines[name].generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:n]], params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        cpu[name][n].append(tokens / (time.process_time() - cpu_start))
        return tokens / (time.perf_counter() - start)

    sides: dict[str, Callable[[int], float]] = {"vllm_looped": lambda n: run_vllm("vllm_looped", n)}
    if worker is not None:
        sides["generate_looped"] = worker.tokens_per_s
    sides["vllm_llama"] = lambda n: run_vllm("vllm_llama", n)
    if args.qwen3:
        sides["vllm_qwen3"] = lambda n: run_vllm("vllm_qwen3", n)
    for fn in sides.values():  # warm-up: first calls allocate and (with --compile) compile
        fn(min(args.concurrency))
    for name in cpu:
        cpu[name][min(args.concurrency)].clear()
    results: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.concurrency} for name in sides}
    for rep in range(args.repeats):
        for n in args.concurrency:
            for name, fn in sides.items():
                results[name][n].append(fn(n))
        print(f"[bench_serve] repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    if worker is not None:
        worker.close()
    for engine in engines.values():
        close(engine)
    return results, cpu, paths["vllm_llama"]


def kv_capacity(args: argparse.Namespace, looped_dir: Path, config: Any) -> list[dict[str, Any]]:
    """vLLM's KV-cache tokens per GiB for each (r, kv_budget) of ``KV_CASES``, and the expected value
    for P + k*K + C caches of 2 * kv_heads * head_dim numbers (of ``--dtype``) per token each."""
    rows = []
    for r, budget in KV_CASES:
        overrides = {"num_recurrences": r, "kv_budget": budget}
        engine = vllm_engine(looped_dir, args, hf_overrides=overrides, load_format="dummy")
        cache = engine.llm_engine.vllm_config.cache_config
        tokens = cache.num_gpu_blocks * cache.block_size
        close(engine)
        slots = config.num_kv_slots(r, budget)
        per_token = slots * 2 * config.num_key_value_heads * config.head_dim * DTYPES[args.dtype]
        rows.append({"r": r, "kv_budget": budget, "slots": slots, "tokens_per_gib": tokens / KV_SPACE_GIB,
                     "expected_tokens_per_gib": 2**30 / per_token})  # fmt: skip
    return rows


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f} .. {max(values):,.0f})"


def qwen3_columns(rates: Rates) -> tuple[str, str, Callable[[int], str]]:
    """With ``--qwen3``: the Qwen3 side's header cells, their separator and each row's cells (its rate and
    looped / Qwen3, of medians); otherwise empty."""
    if "vllm_qwen3" not in rates:
        return "", "", lambda n: ""

    def cells(n: int) -> str:
        ratio = statistics.median(rates["vllm_looped"][n]) / statistics.median(rates["vllm_qwen3"][n])
        return f" {spread(rates['vllm_qwen3'][n])} | {ratio:.2f} |"

    return " vLLM, equal-depth Qwen3 | looped / Qwen3 |", "---|---|", cells


def throughput_table(results: dict[str, dict[int, list[float]]]) -> str:
    """Markdown: tokens/s per side and concurrency, and the two ratios of the targets (of medians)."""
    head, rule, qwen3 = qwen3_columns(results)
    lines = [
        "| concurrent requests | vLLM, looped | generate(), looped | vLLM, equal-depth Llama | vLLM / generate() | "
        f"looped / Llama |{head}",
        f"|---|---|---|---|---|---|{rule}",
    ]
    timed_generate = "generate_looped" in results  # not with --skip-generate
    for n in results["vllm_looped"]:
        med = {name: statistics.median(results[name][n]) for name in results}
        generate = spread(results["generate_looped"][n]) if timed_generate else "-"
        vs_generate = f"{med['vllm_looped'] / med['generate_looped']:.2f}x" if timed_generate else "-"
        lines.append(
            f"| {n} | {spread(results['vllm_looped'][n])} | {generate} | {spread(results['vllm_llama'][n])} | "
            f"{vs_generate} | {med['vllm_looped'] / med['vllm_llama']:.2f} |{qwen3(n)}"
        )
    return "\n".join(lines)


def cpu_table(cpu: Rates) -> str:
    """Markdown: tokens per CPU-second of the two vLLM sides per concurrency, and their ratio (of
    medians)."""
    head, rule, qwen3 = qwen3_columns(cpu)
    lines = [f"| concurrent requests | vLLM, looped | vLLM, equal-depth Llama | looped / Llama |{head}",
             f"|---|---|---|---|{rule}"]  # fmt: skip
    for n in cpu["vllm_looped"]:
        ratio = statistics.median(cpu["vllm_looped"][n]) / statistics.median(cpu["vllm_llama"][n])
        lines.append(
            f"| {n} | {spread(cpu['vllm_looped'][n])} | {spread(cpu['vllm_llama'][n])} | {ratio:.2f} |{qwen3(n)}"
        )
    return "\n".join(lines)


def kv_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| r | kv_budget | KV caches (P + k*K + C) | tokens / GiB (vLLM) | tokens / GiB (expected) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['r']} | {row['kv_budget'] or '-'} | {row['slots']} | {row['tokens_per_gib']:,.0f} | "
                     f"{row['expected_tokens_per_gib']:,.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.generate_worker:
        return generate_worker(args.generate_worker, args.dtype)
    if args.hidden % 64 or args.r < 1 or args.repeats < 1 or min(args.concurrency) < 1:
        print(f"bench_serve: --hidden {args.hidden} must be a multiple of 64 (head_dim 64), --r {args.r}, "
              f"--repeats {args.repeats} and --concurrency {args.concurrency} >= 1", file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        root = Path(tmp)
        if args.depth_mix or args.single_depth:
            return depth_mix_main(args, argv, root)
        # vLLM's compile cache and IPC sockets in the temp folder, a fixed CPU KV-cache size.
        for name in ("cache", "rpc"):
            (root / name).mkdir()
        os.environ.update({"VLLM_CACHE_ROOT": str(root / "cache"), "VLLM_RPC_BASE_PATH": str(root / "rpc"),
                           "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
        # The engine core in this process: an engine in its own process keeps polling while the
        # generate() side runs, which on 2 cores took 40% of generate()'s rate (2,598 -> 1,507
        # tokens/s at 32 requests) and so flattered vLLM. Set it to 1 to measure vLLM's own split.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import torch
        import vllm

        looped_dir, llama_dir, config = save_models(root, args)
        load = [os.getloadavg()[0]]  # the machine's 1-minute load around the timed sides (a shared machine)
        results, cpu, norms = throughput(args, looped_dir, llama_dir)
        load.append(os.getloadavg()[0])
        rows = [] if args.skip_kv else kv_capacity(args, looped_dir, config)
    prelude, block, coda = args.layers
    print(f"command: python benchmarks/bench_serve.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), vllm {vllm.__version__}; {args.dtype}, "
          f"{'compiled' if args.compile else 'eager'}, engine core "
          f"{'in this process' if os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] == '0' else 'in its own process'}")  # fmt: skip
    print(f"RMSNorms, looped and Llama alike: {norms}")
    print(f"load (1-minute average) before / after the timed runs: {load[0]:.2f} / {load[1]:.2f}")
    extras = "none (--llama-layers)" if args.llama_layers else "QK-norm, logit soft-cap, embedding norm"
    print(f"model: hidden {args.hidden}, P={prelude} K={block} C={coda}, r={args.r} (effective depth "
          f"{config.effective_num_layers}; the Llama has {config.effective_num_layers} layers), looped extras: {extras}, "
          f"vocab {args.vocab}, "
          f"prompts {args.prompt_len} tokens, {args.new_tokens} new tokens; tokens/s, median (min .. max) of "
          f"{args.repeats} repeats\n")  # fmt: skip
    print(throughput_table(results))
    print("\nvLLM tokens per CPU-second of this process (engine core included when in this process):\n")
    print(cpu_table(cpu))
    if rows:
        print(f"\nKV cache (VLLM_CPU_KVCACHE_SPACE={KV_SPACE_GIB} GiB):\n")
        print(kv_table(rows))
    if args.json:
        report = {"args": vars(args), "throughput": results, "cpu_throughput": cpu, "norms": norms, "load": load,
                  "kv": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


# --- per-request depth (--depth-mix) ------------------------------------------------------------------
# One engine serves requests at r = --shallow and r = --r (its --max-num-recurrences) in one batch. Sides,
# interleaved in every repeat, at each concurrency n (half the requests shallow, half deep; n = 1: one
# deep request):
#   mixed     n requests, half at --shallow and half at --r, submitted together (one batch);
#   all_deep  the same n requests, all at --r;
#   separate  the shallow half alone, then the deep half alone (what two servers, one per depth, serving
#             the groups one after the other cost: each group runs the batch's uniform path, the loop a
#             fixed-r server runs);
#   stock     all at --r through vLLM's own CPU worker (no per-request depth kwargs: the model runs
#             every token at the engine's r, today's single-depth path), on a second engine.
# The loop's share of a step: the time in the loop (``_VllmRecurrentBlock.run``) over the forward's, in
# the all_deep runs (the engine core runs in this process).


def timed_generate(llm: Any, prompts: list[list[int]], depths: list[dict], new_tokens: int) -> float:
    """Seconds for ``llm`` to serve the first ``len(depths)`` prompts, each at its depth (``extra_args``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, extra_args=d or None) for d in depths]
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[: len(depths)]], params, use_tqdm=False)
    return time.perf_counter() - start


def single_depth_sides(args: argparse.Namespace, folder: Path) -> tuple[Rates, Rates]:
    """``--single-depth``: ({side: {n: [seconds per repeat]}}, the same in CPU-seconds of this process, which
    holds the engine cores: the work done, steadier than wall time on a shared machine), n requests all
    at the served r (no depth field), the sides interleaved in every repeat:

    - default: a default server (its ceiling the served r: requests may ask r = 1 .. r, so it runs the
      looped worker with prefix caching off), compiled with ``--compile``;
    - stock: vLLM's stock CPU worker on the same model and settings: no depth tensors ever, the forward a
      single-depth server runs;
    - default_eager: the default server eager, as every server of more than one depth ran before a step at
      the default depth ran the compiled graph (with ``--compile``; without it, the same as default).
    """
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (max(args.concurrency), args.prompt_len), generator=g).tolist()
    engines = {
        "default": vllm_engine(folder, args),
        "stock": vllm_engine(folder, args, worker_cls=stock_worker()),
        "default_eager": vllm_engine(folder, args, enforce_eager=True),
    }
    for llm in engines.values():  # warm-up (and, compiled, the compile of each size seen)
        for n in args.concurrency:
            timed_generate(llm, prompts, [{}] * n, args.new_tokens)
    results: Rates = {name: {n: [] for n in args.concurrency} for name in engines}
    cpu: Rates = {name: {n: [] for n in args.concurrency} for name in engines}
    for rep in range(args.repeats):
        for n in args.concurrency:
            for name, llm in engines.items():
                cpu_start = time.process_time()
                results[name][n].append(timed_generate(llm, prompts, [{}] * n, args.new_tokens))
                cpu[name][n].append(time.process_time() - cpu_start)
        print(f"[bench_serve] repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    for llm in engines.values():
        close(llm)
    return results, cpu


def single_depth_table(results: Rates, new_tokens: int, compiled: bool, unit: str = "tokens/s") -> str:
    """Markdown: tokens per second (``unit``: of wall time or CPU time) per side (median, min .. max) and
    the ratios of medians."""
    how = "compiled" if compiled else "eager"
    lines = [
        f"| requests | default server, {how} ({unit}) | stock worker, {how} ({unit}) | default server, eager "
        f"({unit}) | default / stock | default eager / default |",
        "|---|---|---|---|---|---|",
    ]
    for n in results["default"]:
        rates = {name: [n * new_tokens / t for t in results[name][n]] for name in results}
        med = {name: statistics.median(rates[name]) for name in rates}
        lines.append(
            f"| {n} | {spread(rates['default'])} | {spread(rates['stock'])} | {spread(rates['default_eager'])} | "
            f"{med['default'] / med['stock']:.2f} | {med['default_eager'] / med['default']:.2f} |"
        )
    return "\n".join(lines)


def stock_worker() -> str:
    """The ``worker_cls`` of the stock side: vLLM's own CPU model runner (no per-request depth kwargs)
    in a subclass of the looped worker, which the model takes (``engine.engine_setting_problems``);
    safe here only because every request of that side runs the engine's r."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from looped_hf.serving.worker import LoopedCPUWorker

    class StockRunnerWorker(LoopedCPUWorker):
        def init_device(self) -> None:
            CPUWorker.init_device(self)

    StockRunnerWorker.__module__ = __name__
    globals()["StockRunnerWorker"] = StockRunnerWorker  # vLLM loads the worker by name
    return f"{__name__}.StockRunnerWorker"


def depth_mix_sides(args: argparse.Namespace, folder: Path) -> tuple[dict[str, dict[int, list[float]]], float]:
    """({side: {n: [seconds per repeat]}}, the loop's share of the forward in all_deep)."""
    import torch

    from looped_hf.serving import vllm_model

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, args.vocab, (max(args.concurrency), args.prompt_len), generator=g).tolist()
    deep = {"num_recurrences": args.r}
    shallow = {"num_recurrences": args.shallow}
    engine = vllm_engine(folder, args, hf_overrides={"max_num_recurrences": args.r})
    stock = vllm_engine(folder, args, hf_overrides={"max_num_recurrences": args.r}, worker_cls=stock_worker())

    def run(llm: Any, depths: list[dict]) -> float:
        return timed_generate(llm, prompts, depths, args.new_tokens)

    def halves(n: int) -> tuple[list[dict], list[dict]]:
        return [shallow] * (n // 2), [deep] * (n - n // 2)

    def separate(n: int) -> float:
        low, high = halves(n)
        return (run(engine, low) if low else 0.0) + run(engine, high)

    sides: dict[str, Callable[[int], float]] = {
        "mixed": lambda n: run(engine, [d for pair in zip(*halves(n)) for d in pair] + halves(n)[1][n // 2 :]),
        "all_deep": lambda n: run(engine, [deep] * n),
        "separate": separate,
        "stock": lambda n: run(stock, [deep] * n),
    }
    for fn in sides.values():  # warm-up
        fn(min(args.concurrency))
    loop_time, forward_time = [0.0], [0.0]
    block_run, model_forward = vllm_model._VllmRecurrentBlock.run, vllm_model.LoopedVllmModel.forward

    def timed(fn: Callable, total: list[float]) -> Callable:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                total[0] += time.perf_counter() - start

        return wrapper

    results: dict[str, dict[int, list[float]]] = {name: {n: [] for n in args.concurrency} for name in sides}
    for rep in range(args.repeats):
        for n in args.concurrency:
            for name, fn in sides.items():
                if name == "all_deep":  # only here: the timers' own cost stays out of the other sides
                    vllm_model._VllmRecurrentBlock.run = timed(block_run, loop_time)
                    vllm_model.LoopedVllmModel.forward = timed(model_forward, forward_time)
                try:
                    results[name][n].append(fn(n))
                finally:
                    vllm_model._VllmRecurrentBlock.run, vllm_model.LoopedVllmModel.forward = block_run, model_forward
        print(f"[bench_serve] repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    close(engine)
    close(stock)
    return results, loop_time[0] / max(forward_time[0], 1e-9)


def depth_mix_table(results: dict[str, dict[int, list[float]]], shallow: int, deep: int) -> str:
    """Markdown: seconds per side and concurrency (median, min .. max) and the target ratios (of medians)."""
    lines = [
        f"| requests | mixed r={shallow} + r={deep} (s) | all r={deep} (s) | two groups one after the other (s) | "
        f"all r={deep}, stock worker (s) | mixed / all r={deep} | mixed / two groups | stock / looped worker |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(values: Sequence[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f} .. {max(values):.2f})"

    for n in results["mixed"]:
        med = {name: statistics.median(results[name][n]) for name in results}
        lines.append(
            f"| {n} | {cell(results['mixed'][n])} | {cell(results['all_deep'][n])} | {cell(results['separate'][n])} | "
            f"{cell(results['stock'][n])} | {med['mixed'] / med['all_deep']:.2f} | {med['mixed'] / med['separate']:.2f} | "
            f"{med['stock'] / med['all_deep']:.2f} |"
        )
    return "\n".join(lines)


def depth_mix_main(args: argparse.Namespace, argv: list[str] | None, root: Path) -> int:
    """``--depth-mix``: save the model (trained at --r), time the sides, print the table."""
    if args.depth_mix and not 1 <= args.shallow <= args.r:
        print(f"bench_serve: --shallow {args.shallow} must be from 1 to --r {args.r}", file=sys.stderr)
        return 2
    for name in ("cache", "rpc"):
        (root / name).mkdir()
    os.environ.update({"VLLM_CACHE_ROOT": str(root / "cache"), "VLLM_RPC_BASE_PATH": str(root / "rpc"),
                       "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "TOKENIZERS_PARALLELISM": "false",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # fmt: skip
    if args.single_depth:
        # Three engines in one process, each with its OpenMP threads: spinning waiters starve each other on a
        # busy machine (measured: 3 to 50 tokens/s instead of hundreds), so waiting threads sleep.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import vllm

    looped_dir, _, config = save_models(root, args)
    prelude, block, coda = args.layers
    if args.single_depth:
        results, cpu = single_depth_sides(args, looped_dir)
        print(f"command: python benchmarks/bench_serve.py {' '.join(argv if argv is not None else sys.argv[1:])}")
        print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
              f"{torch.__version__} ({torch.get_num_threads()} threads), vllm {vllm.__version__}; {args.dtype}, "
              f"engine core in this process")  # fmt: skip
        print(f"model: hidden {args.hidden}, P={prelude} K={block} C={coda}, r={args.r}; every request at r={args.r} "
              f"(no depth field); prompts {args.prompt_len} tokens, {args.new_tokens} new tokens; tokens/s, median "
              f"(min .. max) of {args.repeats} repeats\n")  # fmt: skip
        print(single_depth_table(results, args.new_tokens, args.compile))
        print("\nPer CPU-second of this process (the engine cores run in it):\n")
        print(single_depth_table(cpu, args.new_tokens, args.compile, unit="tokens/CPU-s"))
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "single_depth": results, "cpu": cpu}))
        return 0
    results, loop_share = depth_mix_sides(args, looped_dir)
    print(f"command: python benchmarks/bench_serve.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"device: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), vllm {vllm.__version__}; {args.dtype}, "
          f"{'compiled' if args.compile else 'eager'}, engine core in this process")  # fmt: skip
    print(f"model: hidden {args.hidden}, P={prelude} K={block} C={coda}, served up to r={args.r}; prompts "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens; seconds, median (min .. max) of {args.repeats} "
          f"repeats; the loop is {loop_share:.0%} of the forward at r={args.r}; ideal mixed / all r={args.r}: "
          f"{(args.shallow + args.r) / (2 * args.r):.2f} of the loop\n")  # fmt: skip
    print(depth_mix_table(results, args.shallow, args.r))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "depth_mix": results, "loop_share": loop_share}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
