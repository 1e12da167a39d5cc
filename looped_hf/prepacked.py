"""The study's prepacked data format and its reader (``looped-hf prepare-data`` writes it, see
``looped_hf.prepack``).

``{split}-NNNNN.parquet`` shards with one column ``tokens``, every row exactly ``seq_len + 1``
tokens, and ``meta_{split}.json``; a row trains as inputs ``row[:-1]``, targets ``row[1:]``.
``load_prepacked`` reads the shards of a local directory or a Hub dataset repo through
``datasets.load_dataset("parquet")``, in file order, rows as ``input_ids`` of ``seq_len + 1``
tokens; the held-out set is the first ``eval_blocks`` rows of ``eval_split`` (the study's final
eval: the first 34,560 val rows). Imports nothing of looped_hf.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENS_COLUMN = "tokens"


def shard_name(split: str, index: int) -> str:
    """``train-00003.parquet``: the study's shard file name."""
    return f"{split}-{index:05d}.parquet"


def meta_name(split: str) -> str:
    return f"meta_{split}.json"


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
def split_files(root: str | os.PathLike, split: str) -> list[Path]:
    """The ``{split}-*.parquet`` shards of a prepacked directory, sorted (the study's file order)."""
    files = sorted(Path(root).glob(f"{split}-*.parquet"))
    if not files:
        raise ValueError(f"prepacked data {str(root)!r}: no {split}-*.parquet shards")
    return files


def check_meta(root: str | os.PathLike, split: str, seq_len: int) -> dict[str, Any] | None:
    """Read ``meta_{split}.json`` (if present) and check it against ``seq_len`` (the study's assert)."""
    path = Path(root) / meta_name(split)
    if not path.exists():
        return None
    meta = json.loads(path.read_text())
    if meta.get("row_capacity") != seq_len + 1:
        raise ValueError(
            f"DataArguments.seq_len={seq_len}: prepacked split {split!r} of {str(root)!r} has row_capacity="
            f"{meta.get('row_capacity')} (rows of seq_len + 1 tokens), so seq_len must be "
            f"{(meta.get('row_capacity') or 0) - 1}"
        )
    return meta


def _hub_snapshot(repo: str, revision: str | None, splits: Sequence[str]) -> Path:
    """The Hub boundary for reading: download the given splits' shards and metas of a dataset repo."""
    from huggingface_hub import snapshot_download

    patterns = [p for s in splits for p in (meta_name(s), f"{s}-*.parquet")]
    return Path(snapshot_download(repo, repo_type="dataset", revision=revision, allow_patterns=patterns))


def prepacked_root(args: Any, splits: Sequence[str]) -> Path:
    """The local directory of ``args.dataset``: itself, or a snapshot of a Hub repo's ``splits``."""
    path = Path(args.dataset).expanduser()
    if path.is_dir():
        return path
    if path.exists() or args.dataset.startswith(("/", "./", "../", "~")):
        raise ValueError(f"DataArguments.dataset={args.dataset!r}: prepacked data is a directory of shards")
    return _hub_snapshot(args.dataset, args.dataset_revision, splits)


def _load_rows(files: list[Path], seq_len: int, where: str, cache_dir: str | None, streaming: bool) -> Any:
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=[str(f) for f in files], split="train", streaming=streaming,
                      cache_dir=cache_dir)  # fmt: skip
    if TOKENS_COLUMN not in (ds.column_names or []):
        raise ValueError(f"prepacked data {where}: no {TOKENS_COLUMN!r} column (columns {ds.column_names})")
    ds = ds.rename_column(TOKENS_COLUMN, "input_ids")
    if not streaming and len(ds):
        import pyarrow.compute as pc

        span = pc.min_max(pc.list_value_length(ds.data.column("input_ids"))).as_py()
        if span["min"] != seq_len + 1 or span["max"] != seq_len + 1:
            raise ValueError(
                f"DataArguments.seq_len={seq_len}: prepacked rows of {where} have {span['min']}..{span['max']} "
                f"tokens, not seq_len + 1 = {seq_len + 1}"
            )
    return ds


def load_prepacked(args: Any, tokenizer: Any = None, cache_dir: str | None = None) -> tuple[Any, Any]:
    """``(train, held_out)`` from prepacked shards (``DataArguments.prepacked``), rows in file order.

    Every row is ``input_ids`` of ``seq_len + 1`` tokens: the model's loss shifts its labels, so a
    row given whole trains/evaluates the study's targets ``row[1:]`` from ``row[:-1]``;
    ``looped_hf.data.collator(tok, args)`` splits it into exactly those inputs and targets for the
    ``Trainer``. The held-out set is the first ``eval_blocks`` rows of ``eval_split``. The train
    split is map-style (``Trainer`` with ``train_sampling_strategy: sequential`` reads it in order;
    ``accelerate`` gives each process its own batches), or streamed in file order with
    ``streaming``. ``cache_dir``: where ``datasets`` keeps its Arrow copy (the data module passes
    its cache).
    """
    splits = [args.dataset_split, args.eval_split]
    root = prepacked_root(args, splits)
    where = f"{args.dataset!r}"
    metas = {s: check_meta(root, s, args.seq_len) for s in splits}
    if tokenizer is not None:
        size = len(tokenizer)
        for s, meta in metas.items():
            if meta is not None and meta.get("vocab_size", 0) > size:
                raise ValueError(
                    f"DataArguments.tokenizer={args.tokenizer!r} has {size} tokens, but prepacked split {s!r} of "
                    f"{where} was made with vocab_size {meta['vocab_size']}: use the tokenizer it was packed with"
                )
    train = _load_rows(split_files(root, args.dataset_split), args.seq_len, where, cache_dir, args.streaming)
    held = _load_rows(split_files(root, args.eval_split), args.seq_len, where, cache_dir, streaming=False)
    if len(held) < args.eval_blocks:
        raise ValueError(
            f"DataArguments.eval_blocks={args.eval_blocks}: split {args.eval_split!r} of {where} has only "
            f"{len(held)} rows"
        )
    held = held.select(range(args.eval_blocks))
    if args.streaming and args.shuffle_buffer > 0:
        train = train.shuffle(seed=args.split_seed, buffer_size=args.shuffle_buffer)
    return train.with_format("torch"), held.with_format("torch")


class PrepackedRowCollator:
    """Rows of ``seq_len + 1`` tokens -> ``input_ids = row[:-1]``, targets ``row[1:]`` (the study's).

    The targets go as ``shift_labels`` (used as given by the model's loss and by the Trainer's
    token count); ``labels`` is ``input_ids`` (the unshifted form, for code that looks for it).
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        rows = torch.stack([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        if rows.shape[-1] != self.seq_len + 1:
            raise ValueError(f"prepacked rows have {rows.shape[-1]} tokens, expected seq_len + 1 = {self.seq_len + 1}")
        inputs = rows[:, :-1].contiguous()
        return {"input_ids": inputs, "labels": inputs.clone(), "shift_labels": rows[:, 1:].contiguous()}
