"""The fixed held-out split: documents ordered by their seeded hash, held out until
``eval_blocks`` blocks are filled (non-streaming), or held out by hash threshold (streaming)."""

import hashlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset, Features, IterableDataset, List, Value
from transformers import PreTrainedTokenizerBase

from .corpus import EMBEDDED
from .data_arguments import DataArguments
from .packing import _HASH_SPACE, _block_features, _pack_batch, _tokenize_batch
from .sources import _load_raw


def _heldout_order(hashes: np.ndarray, groups: list[str] | None) -> np.ndarray:
    """Document indices in held-out priority: by hash, alternating between groups if given.

    Each document's rank within its group (by hash) is the primary key, so the first documents
    taken are the first of every group, then the second of every group, and so on.
    """
    if groups is None:
        return np.argsort(hashes, kind="stable")
    _, group_ids = np.unique(np.asarray(groups), return_inverse=True)
    by_group = np.lexsort((hashes, group_ids))
    rank = np.empty(len(hashes), dtype=np.int64)
    for g in range(group_ids.max() + 1):
        members = by_group[group_ids[by_group] == g]
        rank[members] = np.arange(len(members))
    return np.lexsort((hashes, rank))


def _build_map_style(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, kind: str, kwargs: dict[str, Any], work: Path
) -> tuple[Dataset, Dataset, dict[str, Any]]:
    raw, columns = _load_raw(args, kind, kwargs, streaming=False)
    group = args.stratify_column if args.stratify_column and args.stratify_column in columns else None
    tokenized = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=256,
        fn_kwargs={"tokenizer": tokenizer, "text_column": args.text_column, "group_column": group,
                   "seed": args.split_seed},
        remove_columns=columns,
        num_proc=args.num_proc,
        cache_file_name=str(work / "tokenized.arrow"),
        new_fingerprint=hashlib.sha256(str(work).encode()).hexdigest()[:16],
        desc="Tokenizing documents",
    )  # fmt: skip
    lengths = np.asarray(tokenized["n_tokens"], dtype=np.int64)
    hashes = np.asarray(tokenized["doc_hash"], dtype=np.int64)
    order = _heldout_order(hashes, tokenized["group"] if group else None)
    need = args.eval_blocks * args.seq_len
    cum = np.cumsum(lengths[order])
    total = int(cum[-1]) if len(cum) else 0
    if total < need + args.seq_len:
        raise ValueError(
            f"corpus too small for the held-out split: DataArguments.eval_blocks={args.eval_blocks} x "
            f"seq_len={args.seq_len} needs {need:,} held-out tokens plus at least one training block, but "
            f"dataset {args.dataset or EMBEDDED!r} has {total:,} tokens in {len(lengths)} documents"
        )
    n_eval_docs = int(np.searchsorted(cum, need)) + 1
    eval_idx = order[:n_eval_docs]
    train_idx = np.sort(order[n_eval_docs:])

    pack = {"batched": True, "remove_columns": tokenized.column_names, "features": _block_features(args.seq_len),
            "fn_kwargs": {"seq_len": args.seq_len}}  # fmt: skip
    # The held-out documents are packed in one batch, so no tokens are dropped between them.
    held_out = tokenized.select(eval_idx).map(
        _pack_batch,
        batch_size=None,
        cache_file_name=str(work / "eval.arrow"),
        desc="Packing held-out",
        **pack,
    )
    held_out = held_out.select(range(args.eval_blocks))
    train = tokenized.select(train_idx).map(
        _pack_batch, batch_size=args.pack_batch_docs, cache_file_name=str(work / "train.arrow"),
        desc="Packing train", **pack,
    )  # fmt: skip
    if len(train) == 0:
        raise ValueError(
            f"corpus too small: no training block of seq_len={args.seq_len} left after the held-out split "
            f"(DataArguments.eval_blocks={args.eval_blocks})"
        )
    stats = {
        "documents": len(lengths),
        "tokens": total,
        "train_documents": len(train_idx),
        "eval_documents": n_eval_docs,
        "train_blocks": len(train),
        "eval_blocks": len(held_out),
    }
    return train, held_out, stats


def _stream_blocks(tokenized: IterableDataset, seq_len: int, batch_docs: int) -> IterableDataset:
    return tokenized.map(
        _pack_batch, batched=True, batch_size=batch_docs, remove_columns=tokenized.column_names,
        features=_block_features(seq_len), fn_kwargs={"seq_len": seq_len},
    )  # fmt: skip


def _is_held_out(example: Mapping[str, Any], threshold: float, want: bool) -> bool:
    return (example["doc_hash"] < threshold) == want


def _streaming_parts(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, kind: str, kwargs: dict[str, Any]
) -> tuple[IterableDataset, IterableDataset]:
    raw, columns = _load_raw(args, kind, kwargs, streaming=True)
    tokenized = raw.map(
        _tokenize_batch,
        batched=True,
        batch_size=64,
        fn_kwargs={"tokenizer": tokenizer, "text_column": args.text_column, "group_column": None,
                   "seed": args.split_seed},
        remove_columns=columns,
        features=Features({"input_ids": List(Value("int64")), "doc_hash": Value("int64"), "n_tokens": Value("int64")}),
    )  # fmt: skip
    # Module-level predicates (not lambdas) so the stream pickles into DataLoader workers on spawn.
    threshold = args.streaming_eval_fraction * _HASH_SPACE
    held = tokenized.filter(partial(_is_held_out, threshold=threshold, want=True))
    train = tokenized.filter(partial(_is_held_out, threshold=threshold, want=False))
    return _stream_blocks(train, args.seq_len, 64), _stream_blocks(held, args.seq_len, 64)
