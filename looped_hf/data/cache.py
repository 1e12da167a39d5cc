"""The tokenized-data cache: the key of a build, atomic publishing, and cleanup of killed builds.

A build's key hashes everything that determines its blocks (``_cache_key``); changing what the
key hashes, or ``DATA_PIPELINE_VERSION``, rebuilds every existing cache.
"""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from .data_arguments import DataArguments
from .tokenizer import tokenizer_fingerprint

#: Bump when tokenization, splitting or packing semantics change: it is part of every cache key.
DATA_PIPELINE_VERSION = "1"


def _cache_key(args: DataArguments, tokenizer: PreTrainedTokenizerBase, identity: dict[str, Any]) -> str:
    spec = {
        "version": DATA_PIPELINE_VERSION,
        "source": identity,
        "split": args.dataset_split,
        "text_column": args.text_column,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seq_len": args.seq_len,
        "eval_blocks": args.eval_blocks,
        "split_seed": args.split_seed,
        "stratify_column": args.stratify_column,
        "streaming": args.streaming,
        "pack_batch_docs": None if args.streaming else args.pack_batch_docs,
        "streaming_eval_fraction": args.streaming_eval_fraction if args.streaming else None,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _remove_stale_builds(root: Path, max_age_s: float = 24 * 3600) -> None:
    """Delete temporary build directories left by runs killed (SIGKILL, OOM) more than a day ago."""
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:  # another run cleaned it first
            pass


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place; if another run won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "meta.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
