"""Data pipeline throughput, in tokens per second.

Three numbers, for one data source and tokenizer:

* ``cold``: first ``build_datasets`` call in an empty cache: load the documents, tokenize, split,
  pack, save (what the first run of a sweep pays once);
* ``warm``: the same call again: load the packed blocks from the cache (what every other run pays);
* ``loader`` (and ``loader_hf``): iterate shuffled batches through a ``torch`` DataLoader with
  ``looped_hf.data.collator`` (and with ``DataCollatorForLanguageModeling`` for comparison), i.e.
  the ceiling the input pipeline puts on training throughput.

The training benchmark can put its tokens/s next to these by calling
``measure_pipeline_throughput`` (it returns a dict) and ``format_table``.

    python benchmarks/bench_data.py                         # embedded corpus + embedded BPE
    python benchmarks/bench_data.py --tokenizer bytes --seq-len 512
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling

from looped_hf.data import DataArguments, build_datasets, collator, data_stats, load_tokenizer


def _iterate(
    dataset: Any, collate: Any, batch_size: int, max_batches: int, num_workers: int
) -> tuple[int, float]:
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        collate_fn=collate,
        num_workers=num_workers,
        drop_last=True,
    )
    tokens, started = 0, time.perf_counter()
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        tokens += batch["input_ids"].numel()
    return tokens, time.perf_counter() - started


def measure_pipeline_throughput(
    dataset: str | None = None,
    tokenizer: str | None = None,
    seq_len: int = 256,
    eval_blocks: int = 64,
    batch_size: int = 16,
    max_batches: int = 200,
    num_workers: int = 0,
    cache_dir: str | Path | None = None,
    compare_hf_collator: bool = True,
) -> dict[str, Any]:
    """Time the data pipeline (cold build, warm cache load, DataLoader iteration).

    Args:
        dataset, tokenizer, seq_len, eval_blocks: as in ``DataArguments``.
        batch_size, max_batches, num_workers: DataLoader settings for the iteration measurement.
        cache_dir: cache to build into; default a fresh temporary directory, so ``cold`` is cold.
        compare_hf_collator: also time ``DataCollatorForLanguageModeling(tok, mlm=False)``.

    Returns:
        Dict with ``tokens`` (documents' tokens incl. EOS), ``train_blocks``, ``eval_blocks``,
        ``seq_len``, and for each stage ``<stage>_seconds`` and ``<stage>_tokens_per_s`` for the
        stages ``cold``, ``warm``, ``loader`` (and ``loader_hf``).
    """
    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_data_")
        cache_dir = tmp.name
    try:
        tok = load_tokenizer(tokenizer)
        args = DataArguments(
            dataset=dataset,
            tokenizer=tokenizer,
            seq_len=seq_len,
            eval_blocks=eval_blocks,
            data_cache_dir=str(cache_dir),
        )
        t0 = time.perf_counter()
        build_datasets(args, tok)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        train, held_out = build_datasets(args, tok)
        warm = time.perf_counter() - t0
        stats = data_stats(args, tok)
        packed_tokens = (len(train) + len(held_out)) * seq_len
        result: dict[str, Any] = {
            "dataset": dataset or "embedded",
            "tokenizer": tokenizer or "embedded",
            "vocab": len(tok),
            "seq_len": seq_len,
            "tokens": stats["tokens"],
            "documents": stats["documents"],
            "train_blocks": len(train),
            "eval_blocks": len(held_out),
            "cold_seconds": cold,
            "cold_tokens_per_s": stats["tokens"] / cold,
            "warm_seconds": warm,
            "warm_tokens_per_s": packed_tokens / warm,
        }
        collators = {"loader": collator(tok)}
        if compare_hf_collator:
            collators["loader_hf"] = DataCollatorForLanguageModeling(tok, mlm=False)
        for name, collate in collators.items():
            torch.manual_seed(0)
            tokens, seconds = _iterate(train, collate, batch_size, max_batches, num_workers)
            result[f"{name}_seconds"] = seconds
            result[f"{name}_tokens_per_s"] = tokens / seconds
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_table(result: dict[str, Any]) -> str:
    """A plain-text table of the stages in ``result`` (from ``measure_pipeline_throughput``)."""
    labels = {
        "cold": "cold: load + tokenize + split + pack + save",
        "warm": "warm: load packed blocks from cache",
        "loader": "DataLoader + looped_hf collator",
        "loader_hf": "DataLoader + DataCollatorForLanguageModeling",
    }
    lines = [
        f"data={result['dataset']} tokenizer={result['tokenizer']} (vocab {result['vocab']}) "
        f"seq_len={result['seq_len']}: {result['documents']:,} documents, {result['tokens']:,} tokens, "
        f"{result['train_blocks']:,} train + {result['eval_blocks']} held-out blocks",
        f"{'stage':48s} {'seconds':>9s} {'tokens/s':>14s}",
    ]
    for key, label in labels.items():
        if f"{key}_seconds" in result:
            lines.append(
                f"{label:48s} {result[f'{key}_seconds']:9.3f} {result[f'{key}_tokens_per_s']:14,.0f}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
    opts = parser.parse_args()
    result = measure_pipeline_throughput(
        dataset=opts.dataset,
        tokenizer=opts.tokenizer,
        seq_len=opts.seq_len,
        batch_size=opts.batch_size,
        max_batches=opts.batches,
        num_workers=opts.num_workers,
        cache_dir=opts.cache_dir,
    )
    print(format_table(result))


if __name__ == "__main__":
    main()
