"""Training data for looped language models: tokenizers, packed blocks, a fixed held-out split.

One pipeline serves every source. A Hub dataset name, a local text/JSON/JSONL/CSV/parquet file
(or a directory of them) and the embedded default corpus all go through ``datasets.load_dataset``;
documents are tokenized with EOS appended, split into train / held-out **by document**, and each
side is packed into blocks of exactly ``seq_len`` tokens (no padding, no attention mask).

Usage (what the trainer does)::

    from looped_hf.data import DataArguments, load_tokenizer, build_datasets, collator
    args = DataArguments(seq_len=256)                 # embedded classics + embedded BPE
    tok = load_tokenizer(args.tokenizer)
    train, held_out = build_datasets(args, tok)       # rows: {"input_ids": LongTensor[seq_len]}
    Trainer(..., train_dataset=train, eval_dataset=held_out, data_collator=collator(tok),
            processing_class=tok)                     # size the model's vocab with len(tok)

Design decisions (and why):

* **Held-out split.** Every document gets a key ``sha256(split_seed, text)``. Non-streaming, the
  held-out side is the shortest prefix of documents in key order (interleaved across the values of
  ``stratify_column`` when the dataset has that column, so the embedded corpus's held-out text mixes
  Shakespeare, Bible and Austen) that packs into ``eval_blocks`` blocks; everything else is
  training. Hence the held-out set depends only on (data source, tokenizer, ``seq_len``,
  ``eval_blocks``, ``split_seed``, ``stratify_column``): losses from runs of a sweep that differ in
  model, steps or training tokens are measured on identical blocks. Held-out blocks are a prefix
  in key order, so a larger ``eval_blocks`` extends a smaller one's held-out blocks.
  Streaming cannot sort the stream, so there a document is held out iff its key falls below
  ``streaming_eval_fraction`` and the held-out set is the first ``eval_blocks`` blocks of those
  documents in stream order (a different, equally fixed, set than the non-streaming one).
  Train and held-out never share a document, and identical texts always land on the same side.
  The tail of the last held-out document beyond ``eval_blocks`` blocks is used by neither side.
* **Multi-epoch.** The embedded corpus is ~4.0M tokens at vocab 4096 (13.3M characters), often
  less than a scaling run's token budget D. ``build_datasets`` returns the whole map-style train set; run the
  ``Trainer`` with ``max_steps`` and it reshuffles and repeats epochs on its own. ``len(train)``
  is the number of distinct blocks (``len(train) * seq_len`` distinct training tokens).
* **Cache.** Tokenized, packed datasets are saved with ``Dataset.save_to_disk`` under
  ``<data_cache_dir>/tokenized/<key>/``; the key hashes the data source identity (embedded: file
  hash; local files: path, size, mtime; Hub: name, config, split, revision), the tokenizer
  (hash of its ``tokenizer.json`` or vocabulary), ``seq_len``, the split settings and
  ``DATA_PIPELINE_VERSION``. Builds go to a temporary directory renamed into place, so a killed
  run never leaves a half-written cache and concurrent runs of a sweep at worst build twice.
  Streaming runs cache only the held-out set; training blocks are tokenized on the fly.
* **Packing.** Documents are concatenated (each ending in EOS) in batches of ``pack_batch_docs``
  documents and cut into ``seq_len`` blocks; the < ``seq_len`` tokens left at the end of each
  batch are dropped (the standard ``run_clm`` trade: at most one block lost per batch). Packing is
  single-process, so results do not depend on ``num_proc``.
* **Prepacked data.** ``prepacked: true`` skips all of the above: the rows are the study's (see
  ``looped_hf.prepack``), read in file order, each ``seq_len + 1`` tokens (inputs ``row[:-1]``,
  targets ``row[1:]``; ``collator(tok, args)`` splits them, and a whole row given to the model's
  shifting loss has the same targets). The held-out set is the first ``eval_blocks`` rows of
  ``eval_split``. Tokenizers: ``NAME+TOKEN`` adds special tokens the study's way
  (``split_tokenizer_spec``).
* **Labels.** Packed blocks contain no padding, so the labels are the inputs (the model's loss
  shifts them). ``collator()`` does exactly that. ``DataCollatorForLanguageModeling(tok,
  mlm=False)`` gives the same batches because every tokenizer from ``load_tokenizer`` has a pad
  token distinct from EOS (so EOS labels are not masked).
"""

import hashlib
import json
import logging
import lzma
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset, Features, IterableDataset, List, Value, load_dataset, load_from_disk
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

#: Bump when tokenization, splitting or packing semantics change: it is part of every cache key.
DATA_PIPELINE_VERSION = "1"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
EMBEDDED = "embedded"
BYTES = "bytes"
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

# Builders of `datasets` for local files, by extension (after a compression suffix is removed).
_LOCAL_BUILDERS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".json": "json", ".jsonl": "json", ".jsonlines": "json",
    ".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow",
}  # fmt: skip
_COMPRESSION_SUFFIXES = {".gz", ".xz", ".bz2", ".zst", ".lz4"}
# DataArguments fields that only shape text -> blocks; prepacked data rejects non-default values.
_TEXT_ONLY_FIELDS = ("dataset_config", "text_column", "text_sample_by", "streaming_eval_fraction",
                     "stratify_column", "pack_batch_docs", "num_proc")  # fmt: skip


@dataclass
class DataArguments:
    """Where the training text comes from and how it becomes blocks (parsed by ``HfArgumentParser``)."""

    dataset: str | None = field(
        default=None,
        metadata={"help": "None or 'embedded': the shipped public-domain classics. Otherwise a Hub dataset "
                  "name, or a local text/JSON/JSONL/CSV/parquet file or a directory of them."},
    )  # fmt: skip
    dataset_config: str | None = field(
        default=None, metadata={"help": "Hub dataset configuration name (load_dataset's `name`)."}
    )
    dataset_split: str = field(
        default="train",
        metadata={
            "help": "Hub split to read (local files form one 'train' split); held-out is carved out of it."
        },
    )
    dataset_revision: str | None = field(
        default=None, metadata={"help": "Hub dataset revision (commit/tag) to pin; part of the cache key."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the document text."})
    text_sample_by: str = field(
        default="paragraph",
        metadata={"help": "For .txt inputs, what one document is: 'line', 'paragraph' or 'document' (file)."},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Stream the dataset (for large Hub datasets): the train set is an IterableDataset "
                  "tokenized on the fly; only the held-out set is cached. Needs Trainer max_steps."},
    )  # fmt: skip
    streaming_eval_fraction: float = field(
        default=0.01,
        metadata={"help": "Streaming only: fraction of documents (by hash) reserved for the held-out split."},
    )
    shuffle_buffer: int = field(
        default=1000,
        metadata={"help": "Streaming only: shuffle buffer (in blocks) for the train stream; 0 = off."},
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "None or 'embedded': the shipped 4096-token BPE; 'bytes': byte-level (258 tokens); "
                  "a Hub tokenizer name; a local tokenizer directory or tokenizer.json file."},
    )  # fmt: skip
    seq_len: int = field(default=256, metadata={"help": "Tokens per packed block (>= 2)."})
    eval_blocks: int = field(
        default=64,
        metadata={"help": "Held-out blocks of seq_len tokens (fixed size, disjoint from training)."},
    )
    split_seed: int = field(
        default=0, metadata={"help": "Seed of the document hash that decides the train / held-out split."}
    )
    stratify_column: str | None = field(
        default="source",
        metadata={"help": "If the dataset has this column, the held-out documents alternate between its "
                  "values (e.g. the embedded corpus's 'source'). None or '' to disable."},
    )  # fmt: skip
    pack_batch_docs: int = field(
        default=10_000,
        metadata={"help": "Documents concatenated per packing batch; the remainder (< seq_len tokens) of each "
                  "batch is dropped."},
    )  # fmt: skip
    data_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Cache for tokenized data; default $LOOPED_HF_CACHE/data or ~/.cache/looped_hf/data."
        },
    )
    num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenization (None = 1)."})
    prepacked: bool = field(
        default=False,
        metadata={"help": "dataset is already tokenized and packed in the study's format (a local directory or "
                  "Hub dataset repo of {split}-*.parquet shards with a `tokens` column of seq_len + 1 tokens per "
                  "row and meta_{split}.json; `looped-hf prepare-data` makes it): rows are read in file order, "
                  "dataset_split is the train split, the held-out set is the first eval_blocks rows of "
                  "eval_split. Text settings (text_column, stratify_column, ...) do not apply."},
    )  # fmt: skip
    eval_split: str = field(
        default="val",
        metadata={"help": "prepacked only: the split whose first eval_blocks rows are the held-out set."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and value for settings that cannot work."""
        if self.seq_len < 2:
            raise ValueError(
                f"DataArguments.seq_len must be >= 2 (a block needs an input and a target), got {self.seq_len}"
            )
        if self.eval_blocks < 1:
            raise ValueError(f"DataArguments.eval_blocks must be >= 1, got {self.eval_blocks}")
        if not 0.0 < self.streaming_eval_fraction < 1.0:
            raise ValueError(
                f"DataArguments.streaming_eval_fraction must be in (0, 1), got {self.streaming_eval_fraction}"
            )
        if self.text_sample_by not in ("line", "paragraph", "document"):
            raise ValueError(
                f"DataArguments.text_sample_by must be 'line', 'paragraph' or 'document', got {self.text_sample_by!r}"
            )
        if self.pack_batch_docs < 1:
            raise ValueError(f"DataArguments.pack_batch_docs must be >= 1, got {self.pack_batch_docs}")
        if self.shuffle_buffer < 0:
            raise ValueError(f"DataArguments.shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"DataArguments.num_proc must be >= 1 or None, got {self.num_proc}")
        if not self.text_column:
            raise ValueError(f"DataArguments.text_column must be a column name, got {self.text_column!r}")
        self._check_prepacked_fields()

    def _check_prepacked_fields(self) -> None:
        """No setting is silently unused: text-only fields with prepacked data, eval_split without."""
        defaults = {f.name: f.default for f in fields(self) if f.init}
        if not self.prepacked:
            if self.eval_split != defaults["eval_split"]:
                raise ValueError(
                    f"DataArguments.eval_split={self.eval_split!r}: used only with prepacked: true (text data "
                    "carves its held-out split out of dataset_split by document hash)"
                )
            return
        if self.dataset is None or self.dataset == EMBEDDED:
            raise ValueError(
                f"DataArguments.prepacked=True needs dataset to name prepacked shards (a directory or Hub "
                f"repo), got {self.dataset!r}"
            )
        for name in _TEXT_ONLY_FIELDS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"DataArguments.{name}={getattr(self, name)!r}: a text setting, not used with prepacked: "
                    "true (the rows are already tokenized and packed); remove it"
                )
        if self.eval_split == self.dataset_split:
            raise ValueError(
                f"DataArguments.eval_split={self.eval_split!r}: the same split as dataset_split; held-out rows "
                "would be trained on"
            )


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------
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


def _cache_root(args: DataArguments) -> Path:
    return Path(args.data_cache_dir).expanduser() if args.data_cache_dir else default_cache_dir()


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


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_tokenizer_object():
    """Byte-level tokenizer: id = byte value (0-255), then EOS (256) and PAD (257). No training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS_TOKEN], vocab[PAD_TOKEN] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return tok


def _wrap(tokenizer_object: Any, name: str) -> PreTrainedTokenizerFast:
    # BOS = EOS as in GPT-2: generation from nothing starts "after a document end". Packing never
    # adds BOS; documents are separated by EOS only.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    tok.name_or_path = name
    return tok


def _ensure_special_tokens(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give a loaded tokenizer an EOS and a pad token distinct from EOS, adding tokens only if needed.

    A pad equal to EOS would make ``DataCollatorForLanguageModeling`` mask every EOS label, so the
    model would never learn to end a document. Reusing an existing unknown token as pad keeps the
    vocabulary size; only when there is none is a new ``<|pad|>`` added (then ``len(tok)`` grows
    by one: size the model's embedding with ``len(tok)``, not ``tok.vocab_size``).
    """
    if tok.eos_token is None:
        if tok.sep_token is not None:
            tok.eos_token = tok.sep_token
        else:
            tok.add_special_tokens({"eos_token": EOS_TOKEN})
    if tok.pad_token is None:
        if tok.unk_token is not None and tok.unk_token != tok.eos_token:
            tok.pad_token = tok.unk_token
        else:
            tok.add_special_tokens({"pad_token": PAD_TOKEN})
    return tok


def split_tokenizer_spec(spec: str | None) -> tuple[str | None, list[str]]:
    """``"NAME+TOKEN+..."`` -> ``(NAME, [TOKEN, ...])``: a tokenizer plus special tokens added to it.

    The study's tokenizer is ``NousResearch/Llama-2-7b-hf+<|assistant_end|>`` (nanochat/tokenizer.py:
    Llama-2's 32,000 tokens plus one added special token, vocabulary 32,001). One string, so every
    place that loads a recipe's tokenizer by name gets the same vocabulary. An existing local path
    is taken whole; Hub ids cannot contain ``+``.
    """
    if spec is None or "+" not in spec or os.path.exists(spec):
        return spec, []
    name, *extra = spec.split("+")
    if not name or not all(extra):
        raise ValueError(f"DataArguments.tokenizer={spec!r}: expected NAME+TOKEN[+TOKEN...], with no empty part")
    return name, extra


def add_study_special_tokens(raw_tokenizer: Any, tokens: Sequence[str]) -> None:
    """Add ``tokens`` to a ``tokenizers.Tokenizer`` as nanochat/tokenizer.py does: special
    ``AddedToken``s after the base vocabulary, ids in order."""
    from tokenizers import AddedToken

    if tokens:
        raw_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in tokens])


def load_tokenizer(name: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer by name: the embedded BPE, the byte-level one, a local path or a Hub name.

    Args:
        name: ``None`` or ``"embedded"``: byte-level BPE shipped in ``looped_hf/assets`` (4096 tokens,
            trained on the embedded corpus, ~3.3 characters per token). ``"bytes"``: one token per
            UTF-8 byte plus EOS and PAD (258 tokens; needs no file, for unit tests). A path to a
            ``tokenizer.json`` file or to a directory saved with ``save_pretrained``; otherwise a
            Hub name through ``AutoTokenizer.from_pretrained``. Any of these followed by
            ``+TOKEN[+TOKEN...]`` adds those special tokens (see ``split_tokenizer_spec``; the
            study's: ``NousResearch/Llama-2-7b-hf+<|assistant_end|>``).

    Returns:
        A transformers tokenizer with ``eos_token`` and a ``pad_token`` distinct from it (added if
        the loaded one lacks them, see ``_ensure_special_tokens``). Use ``len(tokenizer)`` as the
        model's vocabulary size.
    """
    spec = name
    name, extra = split_tokenizer_spec(spec)
    raw = None
    if name is None or name == EMBEDDED:
        from tokenizers import Tokenizer

        raw, label = Tokenizer.from_file(str(embedded_tokenizer_path())), "looped_hf/embedded-bpe-4096"
    elif name == BYTES:
        raw, label = _byte_tokenizer_object(), "looped_hf/bytes"
    elif os.path.isfile(name) and name.endswith(".json"):
        from tokenizers import Tokenizer

        raw, label = Tokenizer.from_file(name), name
    if raw is not None:
        add_study_special_tokens(raw, extra)  # before wrapping: exactly the study's step
        tok = _wrap(raw, label if not extra else spec)
    else:
        tok = AutoTokenizer.from_pretrained(name)  # local directory or Hub name
        if extra:
            from tokenizers import AddedToken

            tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in extra], special_tokens=True)
    tok = _ensure_special_tokens(tok)
    # Decoder-only generation pads on the left, so every prompt of a batch ends at the last
    # position; the tokenizer saved with each checkpoint carries this. Training packs full blocks
    # (no padding), so it changes nothing there.
    tok.padding_side = "left"
    tok.init_kwargs["padding_side"] = "left"  # what save_pretrained writes to tokenizer_config.json
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable hash of what determines token ids: the serialized tokenizer (or vocabulary) and EOS."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # slow (Python) tokenizers: the vocabulary is the best stable proxy we have
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Loading raw documents
# --------------------------------------------------------------------------------------------
def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes.pop()
    return _LOCAL_BUILDERS.get(suffixes[-1]) if suffixes else None


def _resolve_source(args: DataArguments) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Return (kind, load_dataset kwargs, identity dict for the cache key)."""
    if args.dataset is None or args.dataset == EMBEDDED:
        sha = _sha256_of(embedded_corpus_path())
        path = embedded_corpus_jsonl(_cache_root(args))
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
    cache_dir = str(_cache_root(args) / "hf") if kind != "hub" else None
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


# --------------------------------------------------------------------------------------------
# Tokenize, split, pack
# --------------------------------------------------------------------------------------------
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

        return load_prepacked(args, tokenizer, cache_dir=str(_cache_root(args) / "hf"))
    kind, kwargs, identity = _resolve_source(args)
    key = _cache_key(args, tokenizer, identity)
    root = _cache_root(args) / "tokenized"
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
    meta = _cache_root(args) / "tokenized" / _cache_key(args, tokenizer, identity) / "meta.json"
    return json.loads(meta.read_text())["stats"]


# --------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------
class PackedBlockCollator:
    """Stack fixed-length blocks into ``input_ids`` and ``labels`` (a copy; the model's loss shifts).

    Packed blocks have no padding, so nothing is masked: equivalent to
    ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` on this data (whose pad token is
    distinct from EOS), without its per-batch padding pass.
    """

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        return {"input_ids": ids, "labels": ids.clone()}


class TokenBlocks(torch.utils.data.Dataset):
    """The equal-length ``input_ids`` rows of a map-style ``datasets.Dataset`` as zero-copy NumPy
    views of its Arrow buffers (memory-mapped from the cache, so nothing is loaded up front).

    Why: the ``Trainer``'s loader asks the dataset for each batch (``__getitems__``), and a
    ``datasets`` row goes through an Arrow take and the torch formatter, every step, on the
    training process's critical path; here a batch is one NumPy index. Measured on a CPU, batch
    read + collate of 2-4 rows of 32-256 tokens: 0.26-0.44 ms -> 0.08 ms back to back, 1.6 -> 1.0
    ms per batch of 4 x 256 between steps of compute (cold caches). Rows are what the formatted
    dataset gives (``{"input_ids": int64 tensor}``), so collators and batches are unchanged, and the
    same indices give the same rows. Pickles as the source dataset (by file, for
    ``dataloader_num_workers`` with spawn), not as the arrays.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._views, self._starts = self._arrays(dataset)

    @staticmethod
    def _arrays(dataset: Dataset) -> tuple[list[np.ndarray], np.ndarray]:
        import pyarrow as pa

        views = []
        for chunk in dataset.data.table.column("input_ids").chunks:
            if chunk.null_count:
                raise ValueError("input_ids has null rows")
            if pa.types.is_fixed_size_list(chunk.type):
                width = chunk.type.list_size
            else:
                offsets = chunk.offsets.to_numpy()
                width = int(offsets[1] - offsets[0]) if len(chunk) else 0
                if np.any(np.diff(offsets) != width):
                    raise ValueError("input_ids rows differ in length")
            values = chunk.flatten().to_numpy(zero_copy_only=True)
            views.append(values.reshape(len(chunk), width))
        if len({v.shape[1] for v in views if len(v)}) > 1:
            raise ValueError("input_ids rows differ in length between chunks")
        starts = np.cumsum([0, *(len(v) for v in views)])
        return views, starts

    @classmethod
    def wrap(cls, dataset: Any) -> Any:
        """``TokenBlocks(dataset)`` where its rows allow it (map-style, only ``input_ids``, equal
        lengths, no index mapping from ``select``/``shuffle``, no nulls); else ``dataset`` itself."""
        if not isinstance(dataset, Dataset) or dataset.column_names != ["input_ids"] or dataset._indices is not None:
            return dataset
        try:
            return cls(dataset)
        except (ValueError, TypeError, AttributeError, NotImplementedError) as err:  # pyarrow: no zero-copy view
            logger.info("TokenBlocks: %s; the dataset is read row by row", err)
            return dataset

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _rows(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + len(self), idx)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"TokenBlocks: index out of range for {len(self)} rows")
        if len(self._views) == 1:
            return self._views[0][idx]
        which = np.searchsorted(self._starts, idx, side="right") - 1
        return np.stack([self._views[c][i - self._starts[c]] for c, i in zip(which, idx)])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self._rows([index])[0].astype(np.int64))}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        rows = torch.from_numpy(self._rows(indices).astype(np.int64))
        return [{"input_ids": row} for row in rows]

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dataset"])


def heldout_from_recipe(recipe: Mapping[str, Any], tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The held-out blocks of a finished run, rebuilt from its recorded recipe (the run record's
    ``recipe``): same source, ``seq_len``, ``eval_blocks`` and split seed, so the same blocks its
    ``loss`` was measured on. Recipe keys that are not data fields are ignored."""
    names = {f.name for f in fields(DataArguments) if f.init}
    _, heldout = build_datasets(DataArguments(**{k: v for k, v in recipe.items() if k in names}), tokenizer)
    return heldout


def collator(
    tokenizer: PreTrainedTokenizerBase | None = None, data_args: DataArguments | None = None
) -> Callable[[list[Mapping[str, Any]]], dict[str, torch.Tensor]]:
    """The data collator to give the ``Trainer`` for rows from ``build_datasets(data_args, ...)``.

    Blocks of text data: ``PackedBlockCollator``. Prepacked rows (``data_args.prepacked``) of
    ``seq_len + 1`` tokens: ``PrepackedRowCollator``, the study's inputs ``row[:-1]`` and targets
    ``row[1:]``. (Given whole to ``PackedBlockCollator``, such a row trains on the same targets, as
    the model's loss shifts, but counts one input token more per row.)
    """
    del tokenizer  # kept in the signature so the call site reads like transformers' collators
    if data_args is not None and data_args.prepacked:
        from looped_hf.prepacked import PrepackedRowCollator

        return PrepackedRowCollator(data_args.seq_len)
    return PackedBlockCollator()


def iter_documents(args: DataArguments) -> Iterator[str]:
    """Yield the raw document texts of ``args`` (streamed; for inspection and tokenizer training)."""
    kind, kwargs, _ = _resolve_source(args)
    raw, _ = _load_raw(args, kind, kwargs, streaming=True)
    for row in raw:
        text = row[args.text_column]
        if isinstance(text, str) and text.strip():
            yield text


__all__ = [
    "DataArguments",
    "DATA_PIPELINE_VERSION",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "PackedBlockCollator",
    "TokenBlocks",
    "add_study_special_tokens",
    "build_datasets",
    "collator",
    "data_stats",
    "default_cache_dir",
    "embedded_corpus_jsonl",
    "embedded_corpus_path",
    "embedded_tokenizer_path",
    "heldout_from_recipe",
    "iter_documents",
    "load_tokenizer",
    "split_tokenizer_spec",
    "tokenizer_fingerprint",
]
