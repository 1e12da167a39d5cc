"""The study's prepacked data: pack any text source into it (``looped-hf prepare-data``), read it back.

Format (what the seed study's ``scripts/prepack.py`` writes and ``nanochat/dataloader.py`` reads):
``{split}-NNNNN.parquet`` shards with one column ``tokens`` (list of uint16; uint32 for vocabularies
over 65,536), every row exactly ``row_capacity = seq_len + 1`` tokens, and ``meta_{split}.json``
(``row_capacity``, ``seq_len``, ``vocab_size``, ``bos_token_id``, row/token/document counts, ...).
A row trains as inputs ``row[:-1]``, targets ``row[1:]``. KristianS7/prepacked-fineweb-edu-llama2-32K-T2048
on the Hub is the study's own dataset in this format.

Packing (``pack_rows``): every document is ``[BOS] + tokens``; a buffer is topped up to
``buffer_size`` documents before each row; a row takes, while it has room, the longest buffered
document that fits whole (the earliest-buffered among equal lengths); when none fits it takes the
shortest document (again the earliest), cropped to the room left, and the rest of that document is
dropped. So every row starts with a BOS, no document is split across rows, and nothing is padded. When
the buffer runs dry before a row is full, packing of the split ends (that partial row is dropped).
Rows are cut into shards of ``rows_per_shard``, and each shard's rows are shuffled (the study's
``random.shuffle``; here a ``random.Random(seed)`` per split, drawn from shard to shard in order, so
seed 0 reproduces the fixture in ``tests/fixtures/study_prepacked`` byte for byte in content).

Parallelism and determinism: the study's rule runs one buffer over one document stream per split,
so the rows depend on the whole stream's order. ``prepare_data(num_proc=N)`` therefore parallelises
only the tokenization (N worker processes tokenize batches of documents; results come back in input
order) and packs in the main process. The output is identical for every N (tested); packing itself
(~millions of tokens/s) is the sequential part (``benchmarks/bench_prepack.py`` measures both).

Resume and atomicity: each shard is written to a temporary name and renamed into place; after it the
packer's state (documents consumed, the buffer, the shuffle generator) is saved atomically. A rerun
skips finished splits (``meta_{split}.json`` is written last) and continues a split from its last
saved shard, reproducing exactly what an uninterrupted run writes. A rerun with different settings
into the same directory is an error (the settings are recorded in ``.prepack/``).

Reading lives in ``looped_hf.prepacked`` (the data module uses it, and this module uses the data
module's sources and tokenizers, so the reader stays apart): (``load_prepacked``, used by
``looped_hf.data.build_datasets`` when ``DataArguments.prepacked``):
the shards of a local directory or a Hub dataset repo through ``datasets.load_dataset("parquet")``,
in file order, rows as ``input_ids`` of ``seq_len + 1`` tokens; the held-out set is the first
``eval_blocks`` rows of ``eval_split`` (the study's final eval: the first 34,560 val rows).
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from looped_hf.fileio import write_json_atomic
from looped_hf.prepacked import (  # the format and the reader (re-exported: one import for users)
    TOKENS_COLUMN,
    PrepackedRowCollator,
    check_meta,
    load_prepacked,
    meta_name,
    prepacked_root,
    shard_name,
    split_files,
)

__all__ = ["PrepackedRowCollator", "check_meta", "load_prepacked", "prepacked_root", "split_files"]

STATE_DIR = ".prepack"
#: What the study's meta files call the data source when we know none better.
STUDY_SOURCE = "karpathy/fineweb-edu-100b-shuffle"


# --------------------------------------------------------------------------------------------
# Best-fit packing
# --------------------------------------------------------------------------------------------
class BestFitBuffer:
    """The document buffer of the study's best-fit packing, with O(log n) choices.

    The study scans its buffer list for the longest document that fits (first one wins ties) and,
    failing that, the shortest (first one wins). Documents keep their buffer order, which is
    insertion order, so "first among equal lengths" is first-in-first-out per length: buckets of
    FIFO queues keyed by length, plus the sorted list of lengths present, choose identically.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, deque[np.ndarray]] = {}
        self._lengths: list[int] = []  # sorted distinct lengths with a non-empty bucket
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, doc: np.ndarray) -> None:
        n = len(doc)
        bucket = self._buckets.get(n)
        if bucket is None:
            bucket = self._buckets[n] = deque()
            bisect.insort(self._lengths, n)
        bucket.append(doc)
        self._count += 1

    def _pop(self, n: int) -> np.ndarray:
        bucket = self._buckets[n]
        doc = bucket.popleft()
        if not bucket:
            del self._buckets[n]
            del self._lengths[bisect.bisect_left(self._lengths, n)]
        self._count -= 1
        return doc

    def fill_row(self, row: np.ndarray) -> bool:
        """Fill ``row`` (length = row capacity) from the buffer; False if the buffer ran dry first."""
        capacity, pos = len(row), 0
        while pos < capacity and self._count:
            room = capacity - pos
            i = bisect.bisect_right(self._lengths, room)
            if i:  # the longest document that fits whole
                doc = self._pop(self._lengths[i - 1])
                row[pos : pos + len(doc)] = doc
                pos += len(doc)
            else:  # nothing fits: crop the shortest, drop its tail
                doc = self._pop(self._lengths[0])
                row[pos:] = doc[:room]
                pos = capacity
        return pos == capacity

    def documents(self) -> list[np.ndarray]:
        """The buffered documents, each length's in FIFO order (enough to restore the choices)."""
        return [doc for n in self._lengths for doc in self._buckets[n]]


def pack_rows(
    docs: Iterable[Sequence[int]], row_capacity: int, buffer_size: int = 1000, buffer: BestFitBuffer | None = None
) -> Iterator[np.ndarray]:
    """Yield BOS-aligned best-fit rows of ``row_capacity`` tokens from documents (BOS already prepended).

    The study's rule: top the buffer up to ``buffer_size`` documents before every row; stop at the
    first row the buffer cannot fill. ``buffer`` lets a resumed run continue with its saved buffer.
    Each yielded row is a fresh int64 array.
    """
    if row_capacity < 2:
        raise ValueError(f"row_capacity must be >= 2, got {row_capacity}")
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    buf = buffer if buffer is not None else BestFitBuffer()
    it = iter(docs)
    exhausted = False
    while True:
        while len(buf) < buffer_size and not exhausted:
            doc = next(it, None)
            if doc is None:
                exhausted = True
            else:
                buf.add(np.asarray(doc, dtype=np.int64))
        if not len(buf):
            return
        row = np.empty(row_capacity, dtype=np.int64)
        if not buf.fill_row(row):
            return
        yield row


# --------------------------------------------------------------------------------------------
# Tokenization (in worker processes)
# --------------------------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_tokenizer(tokenizer_json: str, bos_id: int) -> None:
    """Worker initializer: one tokenizer per process (rebuilt from its JSON, no pickling of Rust objects)."""
    from tokenizers import Tokenizer

    # Parallelism comes from the processes; a Rayon pool per worker would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tok"] = Tokenizer.from_str(tokenizer_json)
    _WORKER["bos"] = bos_id


def _tokenize(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS] + ids`` of every text (the study's ``encode(batch, prepend=bos)``), as (flat ids, lengths).

    Flat int32 arrays cross the process boundary far faster than lists of lists."""
    encodings = _WORKER["tok"].encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encodings), dtype=np.int64, count=len(encodings))
    flat = np.empty(int(lengths.sum()), dtype=np.int32)
    pos = 0
    for enc, n in zip(encodings, lengths):
        flat[pos] = _WORKER["bos"]
        flat[pos + 1 : pos + n] = enc.ids
        pos += n
    return flat, lengths


def _ordered_map(
    fn: Callable[[Any], Any], items: Iterable[Any], pool: Any | None, window: int
) -> Iterator[Any]:
    """``map(fn, items)`` in order, at most ``window`` tasks in flight (``Pool.imap`` would read the
    whole input ahead into memory)."""
    if pool is None:
        yield from map(fn, items)
        return
    pending: deque = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# --------------------------------------------------------------------------------------------
# Sources: what the splits read
# --------------------------------------------------------------------------------------------
@dataclass
class SplitSource:
    """One split's documents: ``load_dataset`` keyword arguments and how many leading documents to skip."""

    load_kwargs: dict[str, Any]
    skip: int = 0
    take: int | None = None

    def texts(self, text_column: str, skip: int = 0) -> Iterator[str]:
        """The split's texts in order, after ``self.skip + skip`` documents (read, not tokenized)."""
        from datasets import load_dataset

        ds = load_dataset(**self.load_kwargs, streaming=True)
        start = self.skip + skip
        stop = None if self.take is None else self.skip + self.take
        for i, row in enumerate(ds):
            if stop is not None and i >= stop:
                return
            if i < start:
                continue
            if text_column not in row:
                raise ValueError(f"--text-column {text_column!r} is not a column of the source; columns {list(row)}")
            text = row[text_column]
            yield text if isinstance(text, str) else ""


def _hub_data_files(repo: str, revision: str | None) -> list[str]:
    """The Hub boundary for file-split sources: a dataset repo's data files, sorted, as hf:// paths."""
    from huggingface_hub import HfApi

    from looped_hf.data import _builder_for

    files = HfApi().list_repo_files(repo, repo_type="dataset", revision=revision)
    at = f"@{revision}" if revision else ""
    # A repo's *.md files are its card and docs, not data (the text builder would take them).
    keep = [f for f in sorted(files) if _builder_for(Path(f)) is not None and not f.lower().endswith(".md")]
    return [f"hf://datasets/{repo}{at}/{f}" for f in keep]


def resolve_splits(
    source: str,
    *,
    val_files: int | None = None,
    val_docs: int | None = None,
    val_split: str | None = None,
    train_split: str = "train",
    config: str | None = None,
    revision: str | None = None,
) -> tuple[dict[str, SplitSource], dict[str, Any]]:
    """The ``train`` and ``val`` documents of ``source`` under exactly one validation rule.

    ``val_files=N``: the last N data files are val, the rest train (the study's rule: its last 2 of
    1,823 FineWeb-Edu shards). ``val_docs=N``: the first N documents are val. ``val_split=NAME``: a
    named split of a Hub dataset. ``source`` is what ``DataArguments.dataset`` takes: a local
    file or directory, a Hub dataset name, or ``embedded``. Returns the splits and an identity of
    the source (recorded with the output so that a rerun cannot mix two sources).
    """
    from looped_hf.data import DataArguments, _builder_for, _resolve_source

    given = {k: v for k, v in {"val_files": val_files, "val_docs": val_docs, "val_split": val_split}.items()
             if v is not None}  # fmt: skip
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of --val-files, --val-docs, --val-split (got {given or 'none'}): how the "
            "validation split is carved out of the source"
        )
    for name in ("val_files", "val_docs"):
        if name in given and int(given[name]) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {given[name]}")
    kind, kwargs, identity = _resolve_source(
        DataArguments(dataset=source, dataset_config=config, dataset_revision=revision)
    )
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if val_split is not None:
        if kind != "hub":
            raise ValueError(f"--val-split {val_split!r}: only a Hub dataset has named splits; source {source!r} is {kind}")
        splits = {"train": SplitSource({**kwargs, "split": train_split}),
                  "val": SplitSource({**kwargs, "split": val_split})}  # fmt: skip
    elif val_docs is not None:
        split = train_split if kind == "hub" else "train"
        splits = {"train": SplitSource({**kwargs, "split": split}, skip=val_docs),
                  "val": SplitSource({**kwargs, "split": split}, take=val_docs)}  # fmt: skip
    else:
        if kind == "hub":
            files = _hub_data_files(source, revision)
            builders = {_builder_for(Path(f)) for f in files}
            if len(builders) != 1:
                raise ValueError(f"source {source!r}: expected data files of one type, found {sorted(builders)}")
            kwargs = {"path": builders.pop(), "data_files": files}
            identity = {**identity, "files": files}
        files = list(kwargs.get("data_files") or [])
        if len(files) <= val_files:
            raise ValueError(
                f"--val-files {val_files}: source {source!r} has {len(files)} data file(s); at least one "
                "must be left for train (use --val-docs for a single file)"
            )
        splits = {"train": SplitSource({**kwargs, "data_files": files[:-val_files], "split": "train"}),
                  "val": SplitSource({**kwargs, "data_files": files[-val_files:], "split": "train"})}  # fmt: skip
    identity = {**identity, "rule": given}
    return splits, identity


# --------------------------------------------------------------------------------------------
# Tokenizer for packing
# --------------------------------------------------------------------------------------------
def packing_tokenizer(spec: str | None) -> tuple[Any, int, int]:
    """``(tokenizers.Tokenizer, bos_id, vocab_size)`` for packing with the tokenizer ``spec`` names.

    The study encodes with the raw ``tokenizer.json`` (``tokenizers.Tokenizer.from_pretrained``),
    not a transformers wrapper, so a Hub tokenizer's file is fetched and used as is, plus the added
    special tokens of ``spec`` (``NAME+TOKEN``, see ``looped_hf.data.load_tokenizer``) added the
    study's way. BOS is the transformers tokenizer's ``bos_token`` (Llama-2: ``<s>``, id 1).
    """
    from tokenizers import Tokenizer

    from looped_hf.data import add_study_special_tokens, load_tokenizer, split_tokenizer_spec
    from looped_hf.data.tokenizer import is_builtin_tokenizer

    wrapped = load_tokenizer(spec)
    name, extra = split_tokenizer_spec(spec)
    raw = None
    if not is_builtin_tokenizer(name) and not os.path.exists(name):
        from huggingface_hub import hf_hub_download  # the Hub boundary: the study's exact file

        raw = Tokenizer.from_file(hf_hub_download(name, "tokenizer.json"))
    elif name is not None and os.path.isdir(name) and (Path(name) / "tokenizer.json").exists():
        raw = Tokenizer.from_file(str(Path(name) / "tokenizer.json"))
    elif name is not None and os.path.isfile(name) and name.endswith(".json"):
        raw = Tokenizer.from_file(name)
    if raw is None:
        raw = Tokenizer.from_str(wrapped.backend_tokenizer.to_str())
    else:
        add_study_special_tokens(raw, extra)
    if wrapped.bos_token_id is None:
        raise ValueError(f"tokenizer {spec!r} has no BOS token; packed rows start with one")
    bos = raw.token_to_id(wrapped.bos_token)
    if bos is None:
        raise ValueError(f"tokenizer {spec!r}: its BOS {wrapped.bos_token!r} is not in its tokenizer.json")
    return raw, int(bos), int(raw.get_vocab_size())


# --------------------------------------------------------------------------------------------
# Writing a split, resumably
# --------------------------------------------------------------------------------------------
@dataclass
class PackSettings:
    """What decides a split's output (recorded; a rerun must match)."""

    row_capacity: int
    buffer_size: int = 1000
    rows_per_shard: int = 15_000
    max_rows: int = -1
    seed: int = 0
    tokenizer_batch_size: int = 128


def _write_shard(path: Path, rows: np.ndarray, dtype: Any) -> None:
    """Write rows as the study's ``tokens`` column via a temporary file renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, cap = rows.shape
    values = pa.array(rows.reshape(-1).astype(dtype, copy=False))
    offsets = pa.array(np.arange(0, (n + 1) * cap, cap, dtype=np.int32))
    table = pa.table({TOKENS_COLUMN: pa.ListArray.from_arrays(offsets, values)})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _state_paths(out: Path, split: str) -> tuple[Path, Path]:
    return out / STATE_DIR / f"{split}-settings.json", out / STATE_DIR / f"{split}-state.npz"


def _save_state(path: Path, state: dict[str, Any], buffer: BestFitBuffer) -> None:
    docs = buffer.documents()
    lengths = np.asarray([len(d) for d in docs], dtype=np.int64)
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    try:
        np.savez(tmp, flat=flat, lengths=lengths, state=np.frombuffer(json.dumps(state).encode(), dtype=np.uint8))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _load_state(path: Path) -> tuple[dict[str, Any], BestFitBuffer]:
    with np.load(path) as z:
        state = json.loads(z["state"].tobytes().decode())
        buffer = BestFitBuffer()
        pos = 0
        for n in z["lengths"]:
            buffer.add(z["flat"][pos : pos + n].copy())
            pos += int(n)
    return state, buffer


def _rng_from(state: list | None, seed: int) -> random.Random:
    rng = random.Random(seed)
    if state is not None:
        version, internal, gauss = state
        rng.setstate((version, tuple(internal), gauss))
    return rng


def pack_split(
    split: str,
    docs_from: Callable[[int], Iterable[Sequence[int]]],
    out: str | os.PathLike,
    settings: PackSettings,
    *,
    meta_extra: dict[str, Any],
    identity: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Pack one split into ``out`` and return its meta; resume from a saved state if there is one.

    ``docs_from(skip)`` yields the split's documents (BOS prepended) after the first ``skip``.
    ``meta_extra`` supplies ``dataset``, ``vocab_size`` and ``bos_token_id`` of the meta file.
    """
    out = Path(out)
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    settings_path, state_path = _state_paths(out, split)
    recorded = {"settings": asdict(settings), "source": identity, "meta": meta_extra}
    meta_path = out / meta_name(split)
    if settings_path.exists():
        before = json.loads(settings_path.read_text())
        for key in ("settings", "source", "meta"):
            if before.get(key) != json.loads(json.dumps(recorded[key], default=str)):
                raise ValueError(
                    f"{out}: already holds split {split!r} prepared with other {key} ({before.get(key)} vs "
                    f"{recorded[key]}); use another --output-dir or delete it"
                )
    else:
        write_json_atomic(settings_path, recorded)
    if meta_path.exists():
        if log:
            log(f"  {split}: done already ({meta_path.name})")
        return json.loads(meta_path.read_text())

    cap, per_shard = settings.row_capacity, settings.rows_per_shard
    dtype = np.uint16 if meta_extra["vocab_size"] <= 1 << 16 else np.uint32
    if state_path.exists():
        state, buffer = _load_state(state_path)
        if log:
            log(f"  {split}: resuming at shard {state['next_shard']} ({state['total_rows']:,} rows written)")
    else:
        state, buffer = {"next_shard": 0, "docs_consumed": 0, "total_rows": 0, "rng": None}, BestFitBuffer()
    rng = _rng_from(state["rng"], settings.seed)
    for stale in out.glob(f".{split}-*.parquet.tmp-*"):
        stale.unlink(missing_ok=True)

    consumed = [state["docs_consumed"]]

    def counted() -> Iterator[Sequence[int]]:
        for doc in docs_from(state["docs_consumed"]):
            consumed[0] += 1
            yield doc

    started = time.perf_counter()
    shard, total_rows = state["next_shard"], state["total_rows"]
    rows = np.empty((per_shard, cap), dtype=np.int64)
    n = 0

    def flush(count: int) -> None:
        nonlocal shard
        order = list(range(count))
        rng.shuffle(order)  # the study's per-shard random.shuffle, same draws
        _write_shard(out / shard_name(split, shard), rows[:count][order], dtype)
        shard += 1
        # After the shard: a kill before this line only rewrites the same shard on resume.
        _save_state(state_path, {"next_shard": shard, "docs_consumed": consumed[0],
                                 "total_rows": total_rows, "rng": rng.getstate()}, buffer)  # fmt: skip
        if log:
            rate = (total_rows - state["total_rows"]) * cap / max(time.perf_counter() - started, 1e-9)
            log(f"  {split}: shard {shard - 1} written, {total_rows:,} rows, {rate:,.0f} tokens/s")

    # docs_consumed counts documents drawn from the stream, including those still in the buffer:
    # the saved buffer is restored, so a resumed stream starts right after them.
    for row in pack_rows(counted(), cap, settings.buffer_size, buffer=buffer):
        rows[n] = row
        n += 1
        total_rows += 1
        if 0 < settings.max_rows <= total_rows:
            break
        if n == per_shard:
            flush(n)
            n = 0
    if n:
        flush(n)
    meta = {
        "dataset": meta_extra["dataset"],
        "vocab_size": meta_extra["vocab_size"],
        "bos_token_id": meta_extra["bos_token_id"],
        "seq_len": cap - 1,
        "row_capacity": cap,
        "total_rows": total_rows,
        "total_tokens": total_rows * cap,
        "total_docs": consumed[0],
        "num_shards": shard,
        "buffer_size": settings.buffer_size,
        "split": split,
    }
    write_json_atomic(meta_path, meta)
    state_path.unlink(missing_ok=True)
    return meta


def _docs_of(
    source: SplitSource, text_column: str, batch_docs: int, pool: Any | None, window: int
) -> Callable[[int], Iterator[np.ndarray]]:
    """``docs_from(skip)`` for ``pack_split``: texts read in order, tokenized by the pool, in order."""

    def docs_from(skip: int) -> Iterator[np.ndarray]:
        def batches() -> Iterator[list[str]]:
            batch: list[str] = []
            for text in source.texts(text_column, skip=skip):
                batch.append(text)
                if len(batch) == batch_docs:
                    yield batch
                    batch = []
            if batch:
                yield batch

        for flat, lengths in _ordered_map(_tokenize, batches(), pool, window):
            yield from np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else ()

    return docs_from


def prepare_data(
    source: str,
    output_dir: str | os.PathLike,
    *,
    tokenizer: str | None = None,
    seq_len: int = 2048,
    buffer_size: int = 1000,
    rows_per_shard: int = 15_000,
    max_rows: int = -1,
    seed: int = 0,
    num_proc: int = 1,
    text_column: str = "text",
    val_files: int | None = None,
    val_docs: int | None = None,
    val_split: str | None = None,
    config: str | None = None,
    revision: str | None = None,
    splits: Sequence[str] = ("train", "val"),
    log: Callable[[str], None] | None = print,
) -> dict[str, dict[str, Any]]:
    """Tokenize and pack ``source`` into the study's prepacked format in ``output_dir``; returns the metas.

    ``num_proc`` processes tokenize; the output does not depend on it (see the module docstring).
    Rerunning resumes; see ``resolve_splits`` for the validation rule (exactly one of ``val_*``).
    """
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    if rows_per_shard < 1:
        raise ValueError(f"--rows-per-shard must be >= 1, got {rows_per_shard}")
    if num_proc < 1:
        raise ValueError(f"--num-proc must be >= 1, got {num_proc}")
    unknown = set(splits) - {"train", "val"}
    if unknown:
        raise ValueError(f"--splits: unknown split(s) {sorted(unknown)}; choose from train, val")
    sources, identity = resolve_splits(source, val_files=val_files, val_docs=val_docs, val_split=val_split,
                                       config=config, revision=revision)  # fmt: skip
    raw, bos, vocab = packing_tokenizer(tokenizer)
    settings = PackSettings(row_capacity=seq_len + 1, buffer_size=buffer_size, rows_per_shard=rows_per_shard,
                            max_rows=max_rows, seed=seed)  # fmt: skip
    meta_extra = {"dataset": source, "vocab_size": vocab, "bos_token_id": bos}
    identity = {**identity, "tokenizer": tokenizer, "text_column": text_column}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = raw.to_str()
    pool = None
    if num_proc > 1:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(num_proc, initializer=_init_tokenizer, initargs=(tok_json, bos))
    else:
        _init_tokenizer(tok_json, bos)
    metas = {}
    try:
        for split in splits:
            if log:
                log(f"=== {split} ===")
            docs_from = _docs_of(sources[split], text_column, 8 * settings.tokenizer_batch_size, pool, 2 * num_proc)
            metas[split] = pack_split(split, docs_from, out, settings, meta_extra=meta_extra,
                                      identity=identity, log=log)  # fmt: skip
            if log:
                m = metas[split]
                log(f"  {split}: {m['total_rows']:,} rows, {m['total_docs']:,} documents, {m['num_shards']} shard(s)")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return metas


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf prepare-data",
        description="Pack a text source into the study's prepacked format (BOS-aligned best-fit rows of "
        "seq_len + 1 tokens in {split}-NNNNN.parquet + meta_{split}.json). Rerun to resume.",
    )
    p.add_argument("source", help="local file/directory, Hub dataset name, or 'embedded' (DataArguments.dataset)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tokenizer", default=None,
                   help="as DataArguments.tokenizer: 'embedded' (default), 'bytes', a path or a Hub id, e.g. "
                   "'NousResearch/Llama-2-7b-hf+<|assistant_end|>' (the study's)")
    p.add_argument("--seq-len", type=int, default=2048, help="T; rows hold T + 1 tokens (default 2048)")
    p.add_argument("--buffer-size", type=int, default=1000, help="documents in the best-fit buffer (default 1000)")
    p.add_argument("--rows-per-shard", type=int, default=15_000)
    p.add_argument("--max-rows", type=int, default=-1, help="rows per split, -1 = all")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-shard row shuffle")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizing processes (output does not depend on it)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--config", default=None, help="Hub dataset configuration")
    p.add_argument("--revision", default=None, help="Hub dataset revision")
    p.add_argument("--splits", nargs="+", default=["train", "val"], choices=["train", "val"])
    val = p.add_mutually_exclusive_group(required=True)
    val.add_argument("--val-files", type=int, help="the last N data files are val (the study: 2)")
    val.add_argument("--val-docs", type=int, help="the first N documents are val")
    val.add_argument("--val-split", help="a named split of a Hub dataset is val")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``looped-hf prepare-data``: see ``--help``."""
    args = _parser().parse_args(argv)
    from looped_hf.fileio import check_output_path

    try:
        check_output_path(args.output_dir, "--output-dir", directory=True)
        prepare_data(
            args.source, args.output_dir, tokenizer=args.tokenizer, seq_len=args.seq_len,
            buffer_size=args.buffer_size, rows_per_shard=args.rows_per_shard, max_rows=args.max_rows,
            seed=args.seed, num_proc=args.num_proc, text_column=args.text_column, val_files=args.val_files,
            val_docs=args.val_docs, val_split=args.val_split, config=args.config, revision=args.revision,
            splits=args.splits,
        )  # fmt: skip
    except ValueError as err:
        print(f"looped-hf prepare-data: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
