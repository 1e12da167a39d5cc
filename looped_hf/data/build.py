"""``build_datasets``: tokenize, split and pack a source (or load it from the cache)."""

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from datasets import Dataset, IterableDataset, load_from_disk
from transformers import PreTrainedTokenizerBase

from looped_hf.fileio import current_umask

from .cache import DATA_PIPELINE_VERSION, _cache_key, _publish, _remove_stale_builds
from .data_arguments import DataArguments
from .heldout import _build_map_style, _streaming_parts
from .packing import _block_features
from .sources import _resolve_source

logger = logging.getLogger(__name__)


def _with_torch(ds: Dataset | IterableDataset) -> Dataset | IterableDataset:
    return ds.with_format("torch")


def build_datasets(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase
) -> tuple[Dataset | IterableDataset, Dataset]:
    """Tokenize, split and pack the data of ``args`` (or load it from the cache).

    Returns:
        ``(train, held_out)``. Both have the single column ``input_ids``, each row exactly
        ``args.seq_len`` tokens, formatted as torch int64 tensors. ``train`` is a map-style
        ``Dataset`` (an ``IterableDataset`` when ``args.streaming``); ``held_out`` is always a
        ``Dataset`` of exactly ``args.eval_blocks`` rows, disjoint by document from ``train``.

    Raises:
        ValueError: unknown ``text_column``, or too little text for ``eval_blocks`` held-out blocks
            plus one training block.
    """
    args.validate()
    if args.prepacked:
        from looped_hf.prepacked import load_prepacked

        return load_prepacked(args, tokenizer, cache_dir=str(args.cache_root() / "hf"))
    kind, kwargs, identity = _resolve_source(args)
    key = _cache_key(args, tokenizer, identity)
    root = args.cache_root() / "tokenized"
    final = root / key
    if (final / "meta.json").exists():
        logger.info("Loading tokenized data from cache %s", final)
        held_out = load_from_disk(str(final / "eval"))
        if args.streaming:
            train, _ = _streaming_parts(args, tokenizer, kind, kwargs)
            return _shuffled(train, args), _with_torch(held_out)
        return _with_torch(load_from_disk(str(final / "train"))), _with_torch(held_out)

    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{key}-"))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would stay once the build is renamed into the cache
    started = time.perf_counter()
    try:
        work = tmp / "work"
        work.mkdir()
        if args.streaming:
            train, held_stream = _streaming_parts(args, tokenizer, kind, kwargs)
            rows = [row for row, _ in zip(held_stream, range(args.eval_blocks))]
            if len(rows) < args.eval_blocks:
                raise ValueError(
                    f"corpus too small for the held-out split: only {len(rows)} of DataArguments.eval_blocks="
                    f"{args.eval_blocks} blocks of seq_len={args.seq_len} from the "
                    f"streaming_eval_fraction={args.streaming_eval_fraction} of documents held out"
                )
            held_out = Dataset.from_list(rows, features=_block_features(args.seq_len))
            stats: dict[str, Any] = {"eval_blocks": len(held_out)}
        else:
            train, held_out, stats = _build_map_style(args, tokenizer, kind, kwargs, work)
            train.save_to_disk(str(tmp / "train"))
        held_out.save_to_disk(str(tmp / "eval"))
        shutil.rmtree(work, ignore_errors=True)
        meta = {"key": key, "args": asdict(args), "source": identity, "stats": stats,
                "tokenizer": getattr(tokenizer, "name_or_path", None), "version": DATA_PIPELINE_VERSION,
                "build_seconds": round(time.perf_counter() - started, 3)}  # fmt: skip
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Built tokenized data %s: %s", final, json.dumps(stats))
    held_out = load_from_disk(str(final / "eval"))
    if args.streaming:
        return _shuffled(train, args), _with_torch(held_out)
    return _with_torch(load_from_disk(str(final / "train"))), _with_torch(held_out)


def _shuffled(train: IterableDataset, args: DataArguments) -> IterableDataset:
    # A stream comes in document order, so neighbouring blocks share a document; a shuffle buffer
    # decorrelates the blocks of a batch. Seeded by split_seed so runs are reproducible.
    if args.shuffle_buffer > 0:
        train = train.shuffle(seed=args.split_seed, buffer_size=args.shuffle_buffer)
    return _with_torch(train)


def data_stats(args: DataArguments, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Counts recorded when the cached data was built (documents, tokens, blocks); builds if needed."""
    build_datasets(args, tokenizer)
    kind, kwargs, identity = _resolve_source(args)
    meta = args.cache_root() / "tokenized" / _cache_key(args, tokenizer, identity) / "meta.json"
    return json.loads(meta.read_text())["stats"]


def heldout_from_recipe(recipe: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The held-out blocks of a finished run, rebuilt from its recorded recipe (the run record's
    ``recipe``): same source, ``seq_len``, ``eval_blocks`` and split seed, so the same blocks its
    ``loss`` was measured on. Recipe keys that are not data fields are ignored."""
    names = {f.name for f in fields(DataArguments) if f.init}
    _, heldout = build_datasets(DataArguments(**{k: v for k, v in recipe.items() if k in names}), tokenizer)
    return heldout
