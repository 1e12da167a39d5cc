"""MuonH (the study's optimizer) vs AdamW: one optimizer step, and one whole training step.

    python benchmarks/bench_optim.py               # width 256, CPU, 1 thread, 7 repeats
    python benchmarks/bench_optim.py --repeats 11 --threads 2 --batch 8 --seq 256

The model is the study's block at width 256 (head dim 128, relu2 MLP 4d, QK-norm after RoPE,
the study's init) in the loop4 shape of benchmarks/bench_model.py: prelude 2, block 4 x r = 4,
coda 2, linear injection. Two copies of it, one per optimizer, trained side by side:

- "adamw": `optimizer: adamw` (torch AdamW over every parameter, foreach);
- "muonh": `optimizer: muonh` (`looped_hf.optim`: AdamW groups + MuonH over the 26 layer and
  injection matrices, stacked by shape, Polar-Express in bf16); a third row orthogonalises in
  fp32 to show why bf16 is the default on CPUs with bf16 matmuls too.

Rows are interleaved (A, B, A, B, ...) after a warm-up so drift in a shared machine's load hits
both sides alike; each cell is the median over the repeats with the min-max spread, and the last
column the ratio of medians against AdamW. "opt step" times `optimizer.step()` alone on fixed
gradients; "train step" is forward + backward + step + zero_grad on a (batch x seq) batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import LoopedTrainingArguments
from looped_hf.optim import HYPERP_BATCH_REF, build_optimizer

WIDTH, HEAD_DIM, VOCAB = 256, 128, 4096


def make_model() -> LoopedForCausalLM:
    cfg = LoopedConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=WIDTH // HEAD_DIM, head_dim=HEAD_DIM,
                       num_prelude_layers=2, num_recurrent_layers=4, num_coda_layers=2, num_recurrences=4,
                       max_position_embeddings=1024, init_scheme="study")  # fmt: skip
    torch.manual_seed(0)
    return LoopedForCausalLM(cfg).train()


def make_optimizer(model: LoopedForCausalLM, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        args = LoopedTrainingArguments(output_dir="/tmp/bench_optim", optimizer="adamw", learning_rate=1e-3)
        return build_optimizer(model, args)
    args = LoopedTrainingArguments(output_dir="/tmp/bench_optim", optimizer="muonh")
    optimizer = build_optimizer(model, args, tokens_per_step=HYPERP_BATCH_REF, train_tokens=1e9)
    if kind == "muonh-fp32":
        optimizer.optimizers[1].ortho_dtype = torch.float32
    return optimizer


def interleaved(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each fn, measured round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = ("adamw", "muonh", "muonh-fp32")
    models = {kind: make_model() for kind in kinds}
    optimizers = {kind: make_optimizer(models[kind], kind) for kind in kinds}
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def opt_step(kind: str) -> Callable[[], None]:
        model, optimizer = models[kind], optimizers[kind]
        grads = {p: torch.randn_like(p) * 1e-3 for p in model.parameters()}

        def fn() -> None:
            for p, g in grads.items():
                p.grad = g
            optimizer.step()

        return fn

    def train_step(kind: str) -> Callable[[], None]:
        model, optimizer = models[kind], optimizers[kind]

        def fn() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return fn

    n_matrix = sum(len(g["params"]) for g in optimizers["muonh"].optimizers[1].param_groups)
    print(f"width {WIDTH}, head dim {HEAD_DIM}, P2 + 4 x r4 + C2, vocab {VOCAB}; "
          f"{sum(p.numel() for p in models['adamw'].parameters()):,} params, {n_matrix} MuonH matrices; "
          f"torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats, "
          f"train batch {args.batch} x {args.seq}")  # fmt: skip
    rows = [("opt step", interleaved({k: opt_step(k) for k in kinds}, args.repeats)),
            (f"train step ({args.batch}x{args.seq})", interleaved({k: train_step(k) for k in kinds}, args.repeats))]  # fmt: skip
    print(f"{'what':<22} {'optimizer':<11} {'median ms':>10} {'min-max ms':>17} {'/ adamw':>8}")
    for what, times in rows:
        ref = statistics.median(times["adamw"])
        for kind in kinds:
            med = statistics.median(times[kind])
            spread = f"{1e3 * min(times[kind]):.1f}-{1e3 * max(times[kind]):.1f}"
            print(f"{what:<22} {kind:<11} {1e3 * med:>10.1f} {spread:>17} {med / ref:>8.2f}")


if __name__ == "__main__":
    main()
