"""Throughput of ``looped-hf prepare-data`` (the study's best-fit packing), per process and with N processes.

Rows of the table:

* ``tokenize only``: the tokenizer's ``encode_batch`` in one process (no Rayon threads), documents
  and tokens per second: the part that ``--num-proc`` parallelises;
* ``pack only``: the best-fit packer over already tokenized documents (``pack_rows``): the part that
  stays sequential (one buffer over one stream, as the study's rule needs), i.e. the ceiling of
  ``prepare-data`` however many processes tokenize;
* ``prepare-data, N proc``: the whole command (read, tokenize, pack, shuffle, write parquet) on the
  source's train split, with N tokenizing processes; per process = total / N. The outputs of every N
  are checked to be identical.

Input tokens are document tokens with their BOS; output tokens are packed rows x (seq_len + 1).
``CPU s`` is the CPU time of the main process and its tokenizing workers, so ``tokens/CPU s`` is the
per-process rate on an idle core even when the machine is shared (wall-clock rates are not).

    python benchmarks/bench_prepack.py                           # embedded corpus + embedded BPE, N = 1, 2
    python benchmarks/bench_prepack.py --source DIR --tokenizer NAME --val-files 1 --procs 1 2 4
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per process: honest per-process rates

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from looped_hf import prepack  # noqa: E402
from looped_hf.data import embedded_corpus_jsonl  # noqa: E402


def _texts(source: str, val_files: int | None, val_docs: int | None) -> list[str]:
    splits, _ = prepack.resolve_splits(source, val_files=val_files, val_docs=val_docs)
    return list(splits["train"].texts("text"))


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the tokenizing workers)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def _row(name: str, docs: int, tokens_in: int, tokens_out: int | None, seconds: float, procs: int,
         cpu: float) -> list[str]:  # fmt: skip
    per = procs * seconds
    out = f"{tokens_out / seconds:,.0f}" if tokens_out else "-"
    return [name, f"{docs:,}", f"{tokens_in:,}", f"{seconds:.2f}", f"{docs / seconds:,.0f}", f"{tokens_in / seconds:,.0f}",
            f"{docs / per:,.0f}", f"{tokens_in / per:,.0f}", out, f"{cpu:.2f}", f"{tokens_in / cpu:,.0f}"]  # fmt: skip


def _table(rows: list[list[str]]) -> str:
    head = ["run", "docs", "tokens in", "s", "docs/s", "tokens/s", "docs/s/proc", "tokens/s/proc", "packed tok/s",
            "CPU s", "tokens/CPU s"]  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default=None, help="DataArguments.dataset (default: the embedded corpus)")
    p.add_argument("--tokenizer", default=None, help="DataArguments.tokenizer (default: the embedded BPE)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--val-files", type=int, default=None)
    p.add_argument("--val-docs", type=int, default=None, help="default 10 when no --val-files")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    a = p.parse_args(argv)
    source = a.source or str(embedded_corpus_jsonl())
    val_docs = a.val_docs if a.val_docs is not None or a.val_files is not None else 10

    raw, bos, vocab = prepack.packing_tokenizer(a.tokenizer)
    prepack._init_tokenizer(raw.to_str(), bos)
    texts = _texts(source, a.val_files, val_docs)
    t0, c0 = time.perf_counter(), _cpu_seconds()
    docs = []
    for i in range(0, len(texts), 1024):
        flat, lengths = prepack._tokenize(texts[i : i + 1024])
        docs += np.split(flat, np.cumsum(lengths)[:-1])
    tok_s = time.perf_counter() - t0
    n_in = int(sum(len(d) for d in docs))
    rows = [_row("tokenize only", len(docs), n_in, None, tok_s, 1, _cpu_seconds() - c0)]
    t0, c0 = time.perf_counter(), _cpu_seconds()
    packed = sum(1 for _ in prepack.pack_rows(docs, a.seq_len + 1, 1000))
    rows.append(_row("pack only", len(docs), n_in, packed * (a.seq_len + 1), time.perf_counter() - t0, 1,
                     _cpu_seconds() - c0))  # fmt: skip

    outputs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.procs:
            out = Path(tmp) / f"n{n}"
            t0, c0 = time.perf_counter(), _cpu_seconds()
            metas = prepack.prepare_data(source, out, tokenizer=a.tokenizer, seq_len=a.seq_len, num_proc=n,
                                         val_files=a.val_files, val_docs=val_docs, splits=["train"],
                                         rows_per_shard=500, log=None)  # fmt: skip
            secs = time.perf_counter() - t0
            m = metas["train"]
            rows.append(_row(f"prepare-data, {n} proc", m["total_docs"], n_in, m["total_tokens"], secs, n,
                             _cpu_seconds() - c0))  # fmt: skip
            outputs.append([pq.read_table(f) for f in prepack.split_files(out, "train")])
    same = all(len(o) == len(outputs[0]) and all(x.equals(y) for x, y in zip(o, outputs[0])) for o in outputs)
    print(f"source {source} ({len(docs):,} train documents), tokenizer {a.tokenizer or 'embedded'} (vocab {vocab}), "
          f"rows of {a.seq_len + 1} tokens, {os.cpu_count()} CPUs")  # fmt: skip
    print(_table(rows))
    print(f"outputs identical across --num-proc {a.procs}: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
