"""The embedded corpus and tokenizer shipped in ``looped_hf/assets``, and where data is cached.

The corpus ships xz-compressed; ``embedded_corpus_jsonl`` decompresses it once per cache
directory so that streaming and non-streaming runs share one fast JSON reader.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

EMBEDDED = "embedded"
# The package data folder: looped_hf/assets, beside this subpackage.
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"


def embedded_corpus_path() -> Path:
    """The shipped corpus: xz-compressed JSONL, fields ``id``, ``source``, ``title``, ``text``."""
    return ASSETS_DIR / "corpus.jsonl.xz"


def embedded_tokenizer_path() -> Path:
    """The shipped byte-level BPE ``tokenizer.json`` (vocab 4096, trained on the embedded corpus)."""
    return ASSETS_DIR / "tokenizer.json"


def default_cache_dir() -> Path:
    """``$LOOPED_HF_CACHE/data`` if that variable is set, else ``~/.cache/looped_hf/data``."""
    root = os.environ.get("LOOPED_HF_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "looped_hf") / "data"


@lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    st = path.stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


def embedded_corpus_jsonl(cache_dir: str | os.PathLike | None = None) -> Path:
    """Decompress the embedded corpus once into ``cache_dir`` (atomically) and return the JSONL path.

    ``datasets`` reads xz itself, but a plain file lets streaming and non-streaming runs share
    the same fast JSON reader and keeps the decompression cost to once per cache.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "embedded" / f"corpus-{_sha256_of(embedded_corpus_path())[:16]}.jsonl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "wb") as out, lzma.open(embedded_corpus_path(), "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
