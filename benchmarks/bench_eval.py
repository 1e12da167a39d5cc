"""Downstream evaluation speed: items per second at r = 4 on the built-in bundle, batched against one
item at a time (the study's loop: one forward per item, its options as one batch).

    python benchmarks/bench_eval.py                              # a fresh d128 model, 2 threads
    python benchmarks/bench_eval.py --checkpoint runs/tiny --per-task 64 --repeats 5

Both sides score the same tokenized sequences (prompts are rendered and tokenized once, then reused
at every r: the one-off cost is printed apart) and must give the same losses. The sides take turns
(batched, per item, batched, ...) ``--repeats`` times; the table shows the median items/s of each
and, as the spread, the min-max of the per-repeat speedups.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import torch

from looped_hf.evaluation import load_bundle, prepare_task, score_sequences, write_builtin_bundle
from looped_hf.evaluation.scoring import DEFAULT_BATCH_TOKENS, bos_id


def _model(args: argparse.Namespace):
    from looped_hf import LoopedConfig, LoopedForCausalLM
    from looped_hf.data import load_tokenizer

    if args.checkpoint:
        from looped_hf.evaluation import load_checkpoint

        model, tokenizer, _ = load_checkpoint(args.checkpoint)
        return model, tokenizer
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    config = LoopedConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 64, num_prelude_layers=2, num_recurrent_layers=2,
        num_coda_layers=2, num_recurrences=4, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return LoopedForCausalLM(config).eval(), tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint", default=None, help="a run directory / published folder (default: a fresh model)"
    )
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--per-task", type=int, default=8, help="items per built-in task")
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS, help="padded tokens per batched forward"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = _model(args)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = load_bundle(write_builtin_bundle(tmp, n_examples=max(args.per_task, 6)))
        start = time.perf_counter()
        prepared = [
            prepare_task(task, tokenizer, args.per_task, model.config.max_position_embeddings)
            for task in bundle.tasks
        ]
        tokenize_s = time.perf_counter() - start
    items = sum(t.num_items for t in prepared)
    sequences = sum(len(t.sequences) for t in prepared)
    tokens = sum(len(s.ids) for t in prepared for s in t.sequences)
    pad = bos_id(tokenizer)

    def batched() -> list[float]:
        return [
            x
            for t in prepared
            for x in score_sequences(
                model, t.sequences, args.r, batch_tokens=args.batch_tokens, pad_id=pad
            ).loss_sum
        ]

    def per_item() -> list[float]:
        out = []
        for t in prepared:
            by_item: dict[int, list] = {}
            for s in t.sequences:
                by_item.setdefault(s.item, []).append(s)
            for seqs in by_item.values():  # one forward per item, as the study's evaluate_example
                out += score_sequences(model, seqs, args.r, pad_id=pad).loss_sum
        return out

    # Same numbers both ways (sequence order is the same: tasks, then items in order).
    a, b = batched(), per_item()
    worst = max(abs(x - y) / max(abs(y), 1e-9) for x, y in zip(a, b))
    assert worst < 1e-4, f"batched and per-item losses differ (relative {worst:.2e})"
    times: dict[str, list[float]] = {"batched": [], "per item": []}
    for _ in range(args.repeats):
        for name, fn in (("batched", batched), ("per item", per_item)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ratios = [p_ / b_ for b_, p_ in zip(times["batched"], times["per item"])]
    cmd = "python " + " ".join(shlex.quote(x) for x in sys.argv)
    print(f"command: {cmd}")
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, torch "
        f"{torch.__version__} with {torch.get_num_threads()} threads; model d={model.config.hidden_size} "
        f"{model.config.num_prelude_layers}+{model.config.num_recurrent_layers}x{args.r}+{model.config.num_coda_layers}"
    )
    print(
        f"built-in bundle: {len(prepared)} tasks, {items} items, {sequences} sequences, {tokens} tokens; "
        f"rendered + tokenized once in {tokenize_s:.2f} s (reused at every r); max |rel diff| {worst:.1e}"
    )
    print()
    print(f"| r = {args.r} | median s | items/s | speedup (min-max over {args.repeats} repeats) |")
    print("|---|---:|---:|---|")
    for name in ("per item", "batched"):
        med = statistics.median(times[name])
        speed = (
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            if name == "batched"
            else "1x"
        )
        print(f"| {name} | {med:.2f} | {items / med:.1f} | {speed} |")


if __name__ == "__main__":
    main()
