"""Raw documents from a data source: the embedded corpus, local files (or a directory) or a Hub dataset.

``_resolve_source`` turns ``DataArguments.dataset`` into ``datasets.load_dataset`` arguments plus
the identity that keys the cache (embedded: file hash; local: path, size, mtime; Hub: name,
config, revision).
"""

import lzma
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from datasets import Dataset, IterableDataset, load_dataset

from .corpus import EMBEDDED, _sha256_of, embedded_corpus_jsonl, embedded_corpus_path
from .data_arguments import DataArguments

# Builders of `datasets` for local files, by extension (after a compression suffix is removed).
_LOCAL_BUILDERS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".json": "json", ".jsonl": "json", ".jsonlines": "json",
    ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow",
}  # fmt: skip
_COMPRESSION_SUFFIXES = {".gz", ".xz", ".bz2", ".zst", ".lz4"}


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes.pop()
    return _LOCAL_BUILDERS.get(suffixes[-1]) if suffixes else None


def _resolve_source(args: DataArguments) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Return (kind, load_dataset kwargs, identity dict for the cache key)."""
    if args.dataset is None or args.dataset == EMBEDDED:
        sha = _sha256_of(embedded_corpus_path())
        path = embedded_corpus_jsonl(args.cache_root())
        kwargs = {"path": "json", "data_files": str(path)}
        return "embedded", kwargs, {"kind": "embedded", "sha256": sha}
    path = Path(args.dataset).expanduser()
    if path.exists():
        if path.is_dir():  # every data file below it, skipping hidden files and folders (.cache, .git)
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
        else:
            files = [path]
        builders = {_builder_for(p) for p in files} - {None}
        if len(builders) != 1:
            raise ValueError(
                f"DataArguments.dataset={args.dataset!r}: expected files of one known type "
                f"({sorted(set(_LOCAL_BUILDERS))}), found builders {sorted(b for b in builders if b)}"
            )
        builder = builders.pop()
        files = [p for p in files if _builder_for(p) == builder]
        kwargs: dict[str, Any] = {"path": builder, "data_files": [str(p.resolve()) for p in files]}
        if builder == "text":
            kwargs.update(sample_by=args.text_sample_by, keep_linebreaks=True)
        if builder == "csv" and files[0].suffix.lower() == ".tsv":
            kwargs["sep"] = "\t"
        ident = {
            "kind": "local",
            "builder": builder,
            "files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files],
            "sample_by": args.text_sample_by if builder == "text" else None,
        }
        return "local", kwargs, ident
    if args.dataset.startswith(("/", "./", "../", "~")) or _builder_for(path) is not None:
        # Clearly meant as a local path (a Hub id is "org/name"): fail here, not with a Hub error.
        raise ValueError(f"DataArguments.dataset={args.dataset!r}: no such file or directory")
    kwargs = {"path": args.dataset, "name": args.dataset_config, "revision": args.dataset_revision}
    ident = {
        "kind": "hub",
        "name": args.dataset,
        "config": args.dataset_config,
        "revision": args.dataset_revision,
    }
    return "hub", kwargs, ident


def _load_raw(
    args: DataArguments, kind: str, kwargs: dict[str, Any], streaming: bool
) -> tuple[Dataset | IterableDataset, list[str]]:
    # Local and embedded data get their Arrow cache under our cache dir (tests stay out of $HOME);
    # Hub data uses the user's HF cache so already-downloaded datasets are reused.
    cache_dir = str(args.cache_root() / "hf") if kind != "hub" else None
    split = "train" if kind != "hub" else args.dataset_split
    ds = load_dataset(**kwargs, split=split, streaming=streaming, cache_dir=cache_dir)
    columns = ds.column_names
    if columns is None:  # streaming without known features: look at the first row
        first = next(iter(ds), None)
        columns = list(first) if first is not None else []
    if args.text_column not in columns:
        raise ValueError(
            f"DataArguments.text_column={args.text_column!r} is not a column of dataset "
            f"{args.dataset or EMBEDDED!r}; columns are {columns}"
        )
    return ds, columns


def iter_documents(args: DataArguments) -> Iterator[str]:
    """Yield the raw document texts of ``args`` (streamed; for inspection and tokenizer training)."""
    kind, kwargs, _ = _resolve_source(args)
    raw, _ = _load_raw(args, kind, kwargs, streaming=True)
    for row in raw:
        text = row[args.text_column]
        if isinstance(text, str) and text.strip():
            yield text


# A Hub repository id: "name" or "owner/name" (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def describe_source(args: DataArguments) -> str:
    """Check that ``args.dataset`` names a source, without reading it, and say what it is.

    The embedded corpus always exists; a local file or directory must exist and hold files of one
    known type; anything else must be spelled as a Hub dataset id (whether the Hub has it is
    learned when the data is first read). Used by ``looped-hf train --check`` and before every
    run, so a misspelled path fails before the model is built. Raises ``ValueError`` naming
    the field and its value.
    """
    if args.dataset is None or args.dataset == EMBEDDED:
        return "the embedded corpus (public-domain classics, ~4.0M tokens at vocab 4096)"
    path = Path(args.dataset).expanduser()
    local = path.exists() or args.dataset.startswith(("/", "./", "../", "~"))
    if args.prepacked:
        if local:
            if not path.is_dir():
                raise ValueError(
                    f"dataset={args.dataset!r}: prepacked data is a directory of shards; no such directory"
                )
            return f"prepacked shards in {path} (train split {args.dataset_split!r}, held out {args.eval_split!r})"
    elif local or _builder_for(path) is not None:
        _, kwargs, _ = _resolve_source(args)  # raises for a missing path or mixed file types
        files = kwargs["data_files"]
        return f"{len(files)} local {kwargs['path']} file{'s' if len(files) != 1 else ''} from {path}"
    if not _HUB_ID.match(args.dataset):
        raise ValueError(
            f"dataset={args.dataset!r}: neither a local file or directory nor a Hub dataset id (owner/name)"
        )
    parts = [f"config {args.dataset_config!r}" if args.dataset_config else "",
             f"split {args.dataset_split!r}", f"revision {args.dataset_revision!r}" if args.dataset_revision else ""]  # fmt: skip
    kind = "prepacked Hub dataset" if args.prepacked else "Hub dataset"
    return f"{kind} {args.dataset!r} ({', '.join(p for p in parts if p)}; read when training starts)"


@lru_cache(maxsize=4)
def _embedded_bound(sha256: str) -> int:
    del sha256  # the cache key: this exact corpus file
    total = 0
    with lzma.open(embedded_corpus_path(), "rb") as src:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            total += len(chunk) + 2 * chunk.count(b"\n")  # a document a line: its bytes, bos and eos
    return total


def token_upper_bound(args: DataArguments) -> int | None:
    """An upper bound on the tokens the source can give, when it costs no more than reading file
    sizes (or decompressing the embedded corpus): the text's bytes, as no tokenizer here gives more
    than one token per byte, plus two special tokens (bos, eos) a line. None where it is not known
    cheaply (Hub data, prepacked shards, compressed or parquet files).
    The bound is loose; `build_datasets` checks the exact count before training."""
    if args.prepacked:
        return None
    if args.dataset is None or args.dataset == EMBEDDED:
        return _embedded_bound(_sha256_of(embedded_corpus_path()))
    path = Path(args.dataset).expanduser()
    if not path.exists():
        return None
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    if any(p.suffix.lower() in _COMPRESSION_SUFFIXES or _builder_for(p) in ("parquet", "arrow") for p in files):
        return None
    return 3 * sum(p.stat().st_size for p in files)  # bytes, and bos + eos per (>= 1 byte) line
