"""Looped model vs transformers' Llama at equal FLOPs per token, measured side by side.

    python benchmarks/bench_model.py                          # CPU fp32 (and CUDA bf16 when a GPU is present)
    python benchmarks/bench_model.py --quick                  # fewer repetitions, no compiled row
    python benchmarks/bench_model.py --threads 1 --cpu-time   # on a shared, busy machine
    python benchmarks/bench_model.py --profile                # top ops of one training step of each model
    python benchmarks/bench_model.py --switches --threads 1 --cpu-time   # what each study switch costs

Rows: training tokens/s (LoopedForCausalLM prelude 2 + block 4 x r=4 + coda 2 vs a 20-layer
LlamaForCausalLM of the same width and MLP; ``use_cache=False`` as Trainer sets it), decode
tokens/s through ``generate()`` (batch 1, 32-token prompt, 64 new tokens) eager with a dynamic
cache and compiled (``torch.compile(fullgraph=True)``) with a static cache, and peak training
activation memory at r = 8 with ``backprop_recurrences=1`` vs full backprop. Ratios are looped /
reference; targets in the last column.

Every timing is the best of N repetitions in which the models take turns (llama, looped, study,
llama, ...), so a load spike on a shared machine hits all of them alike; the ``median`` column
is the ratio of the medians, a measure of the spread. ``--cpu-time`` times process CPU seconds
instead of wall seconds: other processes' load then barely moves the numbers (use it with
``--threads 1``, where CPU time is compute time; with more threads it counts spin-waiting).
Activation memory on CPU is the bytes of tensors autograd saves for backward (exact, and what
the truncation removes); on CUDA it is ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from looped_hf import LoopedConfig, LoopedForCausalLM

WIDTH, HEADS, VOCAB, FFN = 256, 4, 4096, 704


# The layer Llama has (SwiGLU, no extra norms), so the ratio isolates the cost of looping;
# the study's stabilisers (QK-norm, soft-cap, extra norms) are measured as a second row.
LLAMA_BLOCK = dict(qk_norm=False, logit_softcap=None, embedding_norm=False, recurrence_norm=False)


def looped(r: int = 4, study_block: bool = False, **kw) -> LoopedForCausalLM:
    switches = {} if study_block else LLAMA_BLOCK
    cfg = LoopedConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=FFN,
                       hidden_act="silu", num_prelude_layers=2, num_recurrent_layers=4, num_coda_layers=2,
                       num_recurrences=r, max_position_embeddings=1024, **switches, **kw)
    return LoopedForCausalLM(cfg)


def llama(layers: int = 20) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=FFN,
                      num_hidden_layers=layers, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, cpu_time: bool) -> dict[str, list[float]]:
    """Seconds per call of each ``fns`` entry, the entries taking turns ``repeats`` times (after one
    warm-up call each)."""
    clock = time.process_time if cpu_time else time.perf_counter
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return times


def train_step(model, batch: int, seq: int, device, dtype) -> Callable[[], None]:
    model = model.to(device=device, dtype=dtype).train()
    model.config.use_cache = False  # as Trainer sets it: no KV cache is built while training
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)

    return step


def decode(model, device, dtype, new_tokens: int = 64, compiled: bool = False, **model_kwargs) -> Callable[[], None]:
    """Greedy ``generate()`` of ``new_tokens`` from a 32-token prompt; ``compiled``: a static cache
    and the forward compiled with ``fullgraph=True`` (transformers compiles the decoding steps)."""
    model = model.to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, VOCAB, (1, 32), device=device)
    kwargs = {}
    if compiled:
        config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else None)
        config._compile_all_devices = device.type != "cuda"  # transformers compiles on CPU only when told
        kwargs = dict(cache_implementation="static", compile_config=config)

    @torch.no_grad()
    def gen() -> None:
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       **kwargs, **model_kwargs)
        _sync(device)

    return gen


def activation_bytes(model, batch: int, seq: int, device, dtype) -> int:
    model = model.to(device=device, dtype=dtype).train()
    model.config.use_cache = False
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cuda.max_memory_allocated() - base
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def _rows(name: str, times: dict[str, list[float]], work: float, pairs: list[tuple[str, str, str]]) -> list[tuple]:
    """Throughput rows (``work`` units per call) for (label, looped key, reference key) pairs."""
    rows = []
    for label, a, b in pairs:
        best_a, best_b = work / min(times[a]), work / min(times[b])
        median = statistics.median(times[b]) / statistics.median(times[a])
        rows.append((label or name, best_a, best_b, best_a / best_b, median))
    return rows


def run(device: torch.device, dtype: torch.dtype, repeats: int, cpu_time: bool, compiled: bool) -> list[tuple]:
    torch.manual_seed(0)
    rows = []
    with torch.device("meta"):
        f_loop = looped(4).training_flops_per_token(256)
    ll = llama(20)
    f_llama = 6 * sum(p.numel() for n, p in ll.named_parameters() if "embed" not in n) + 12 * WIDTH * 256 * 20
    rows.append(("train FLOPs/token (analytic)", f_loop, f_llama, f_loop / f_llama, None, "~1.0"))
    models = {"llama": ll, "looped": looped(4), "study": looped(4, study_block=True)}

    steps = {name: train_step(m, 8, 256, device, dtype) for name, m in models.items()}
    times = interleaved(steps, repeats, cpu_time)
    for row, target in zip(_rows("", times, 8 * 256, [("train tokens/s (b8 x 256)", "looped", "llama"),
                                                      ("  same, study block (qk-norm, cap, norms)", "study", "llama")]),
                           (">= 1.0", "info")):  # fmt: skip
        rows.append((*row, target))
    del steps

    gens = {name: decode(m, device, dtype) for name, m in models.items()}
    gens["budget"] = decode(models["study"], device, dtype, kv_budget=1)  # one recurrence's KV slots kept
    times = interleaved(gens, repeats, cpu_time)
    for row, target in zip(_rows("", times, 64, [("decode tokens/s eager (b1, 32+64)", "looped", "llama"),
                                                 ("  same, study block (qk-norm, cap, norms)", "study", "llama")]),
                           (">= 1.0", "info")):  # fmt: skip
        rows.append((*row, target))
    row = _rows("", times, 64, [("  study block, kv_budget=1 / plain", "budget", "study")])[0]
    rows.append((*row, ">= 1.0"))
    if compiled:
        gens = {name: decode(models[name], device, dtype, compiled=True) for name in ("llama", "looped")}
        times = interleaved(gens, repeats, cpu_time)  # the warm-up call compiles
        row = _rows("", times, 64, [("decode tokens/s compiled, static cache", "looped", "llama")])[0]
        rows.append((*row, ">= 1.0"))

    m_trunc = activation_bytes(looped(8, backprop_recurrences=1), 4, 256, device, dtype)
    m_full = activation_bytes(looped(8), 4, 256, device, dtype)
    rows.append(("train activations MB, r=8 k=1 / full", m_trunc / 2**20, m_full / 2**20, m_trunc / m_full, None,
                 "<= 0.5"))
    return rows


#: The study block's switches over Llama's, each turned off alone (``--switches``).
STUDY_SWITCHES = {
    "qk_norm (after RoPE)": {"qk_norm": "none"},
    "logit_softcap 15": {"logit_softcap": None},
    "recurrence_norm": {"recurrence_norm": False},
    "embedding_norm": {"embedding_norm": False},
}


def switch_costs(device: torch.device, dtype: torch.dtype, repeats: int, cpu_time: bool) -> list[tuple]:
    """Training step time of the study block with each switch turned off alone, against the whole
    study block and the Llama block, interleaved: the share of the study block's step each switch
    costs (where eager loop4 loses to an eager Llama of its shape)."""
    torch.manual_seed(0)
    builds = {"study block": {}, **STUDY_SWITCHES}
    steps = {name: train_step(looped(4, study_block=True, **off), 8, 256, device, dtype) for name, off in builds.items()}
    steps["llama block"] = train_step(looped(4), 8, 256, device, dtype)
    times = interleaved(steps, repeats, cpu_time)
    full = min(times["study block"])
    rows = []
    for name, t in times.items():
        if name == "study block":
            continue
        label = name if name == "llama block" else f"  without {name}"
        rows.append((label, min(t) * 1e3, full * 1e3, 1 - min(t) / full,
                     1 - statistics.median(t) / statistics.median(times["study block"])))  # fmt: skip
    return rows


def profile(device: torch.device, dtype: torch.dtype, top: int) -> None:
    """Print the ``top`` ops by self time of one training step (after two warm-up steps) of each model."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    torch.manual_seed(0)
    for name, model in (("llama", llama(20)), ("looped", looped(4)), ("study", looped(4, study_block=True))):
        step = train_step(model, 8, 256, device, dtype)
        step()
        step()
        with torch_profile(activities=activities) as prof:
            step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        print(f"\n{name}: one training step, b8 x 256, self CPU total {total:.0f} ms")
        print(events.table(sort_by=sort, row_limit=top, max_name_column_width=48))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 repetitions, no compiled row")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (default 7, quick 3)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="time process CPU seconds, not wall seconds (CPU)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled static-cache decode row")
    parser.add_argument("--profile", action="store_true", help="print the top ops of one training step instead")
    parser.add_argument("--top", type=int, default=15, help="rows per model with --profile")
    parser.add_argument("--switches", action="store_true",
                        help="what each study-block switch costs in a training step instead")  # fmt: skip
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    targets = [(torch.device("cpu"), torch.float32)]
    if torch.cuda.is_available():
        targets.append((torch.device("cuda"), torch.bfloat16))
    timing = "" if args.profile else f", best of {repeats} interleaved, {'CPU' if args.cpu_time else 'wall'} time"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, width {WIDTH}, vocab {VOCAB}{timing}")
    for device, dtype in targets:
        print(f"\n{device.type} {str(dtype).replace('torch.', '')}")
        if args.profile:
            profile(device, dtype, args.top)
            continue
        if args.switches:
            cpu_time = args.cpu_time and device.type == "cpu"
            print(f"{'training step (b8 x 256)':<44}{'ms':>12}{'study ms':>12}{'saves':>8}{'median':>8}")
            for name, ms, full, share, median in switch_costs(device, dtype, repeats, cpu_time):
                print(f"{name:<44}{ms:>12.1f}{full:>12.1f}{share:>8.1%}{median:>8.1%}")
            continue
        cpu_time = args.cpu_time and device.type == "cpu"
        rows = run(device, dtype, repeats, cpu_time, compiled=not (args.quick or args.no_compile))
        print(f"{'metric':<44}{'looped':>12}{'reference':>12}{'ratio':>8}{'median':>8}  target")
        for name, a, b, ratio, median, target in rows:
            median_text = f"{median:>8.3f}" if median is not None else f"{'':>8}"
            print(f"{name:<44}{a:>12.4g}{b:>12.4g}{ratio:>8.3f}{median_text}  {target}")


if __name__ == "__main__":
    main()
