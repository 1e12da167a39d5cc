"""Documents -> token ids (EOS appended, a split hash per document) -> blocks of exactly ``seq_len``.

Functions at module level (not closures) so that ``datasets`` can hash and pickle them for
``.map`` with ``num_proc`` and for streams read by DataLoader workers.
"""

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from datasets import Features, List, Value
from transformers import PreTrainedTokenizerBase

_HASH_SPACE = float(2**63)


def _doc_hash(text: str, seed: int) -> int:
    # 63 bits so the value fits Arrow's int64 (uint64 is not inferred from Python ints).
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{text}".encode()).digest()[:8], "big") >> 1


def _tokenize_batch(
    batch: Mapping[str, Sequence[Any]],
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    group_column: str | None,
    seed: int,
) -> dict[str, list[Any]]:
    """Tokenize documents, append EOS; drop empty ones; add the split hash (and group)."""
    texts = list(batch[text_column])
    keep = [i for i, t in enumerate(texts) if isinstance(t, str) and t.strip()]
    texts = [texts[i] for i in keep]
    ids = (
        tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        if texts
        else []
    )
    eos = tokenizer.eos_token_id
    out: dict[str, list[Any]] = {
        "input_ids": [x + [eos] for x in ids],
        "doc_hash": [_doc_hash(t, seed) for t in texts],
        "n_tokens": [len(x) + 1 for x in ids],
    }
    if group_column is not None:
        out["group"] = [str(batch[group_column][i]) for i in keep]
    return out


def _pack_batch(batch: Mapping[str, Sequence[Sequence[int]]], seq_len: int) -> dict[str, list[list[int]]]:
    """Concatenate documents and cut into seq_len blocks; drop the remainder of the batch."""
    flat = np.fromiter((t for doc in batch["input_ids"] for t in doc), dtype=np.int64)
    n = len(flat) // seq_len
    return {"input_ids": flat[: n * seq_len].reshape(n, seq_len).tolist()}


def _block_features(seq_len: int) -> Features:
    return Features({"input_ids": List(Value("int32"), length=seq_len)})
