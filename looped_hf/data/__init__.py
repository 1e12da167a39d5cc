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

Where things are (one file per concern)::

    arguments.py   DataArguments: the data fields of a recipe and their checks
    corpus.py      the embedded corpus and tokenizer files (package data), the cache directory
    tokenizer.py   load_tokenizer, special tokens, tokenizer_fingerprint
    sources.py     a data source -> raw documents (embedded, local files, Hub), iter_documents
    packing.py     documents -> token ids -> blocks of seq_len
    heldout.py     the fixed held-out split (by document hash), map-style and streaming
    cache.py       the cache key, atomic publishing of a build, cleanup of killed builds
    build.py       build_datasets / data_stats / heldout_from_recipe: the entry points
    blocks.py      collators and TokenBlocks (zero-copy rows for the Trainer's loader)
"""

# Patched by tests as looped_hf.data.AutoTokenizer.from_pretrained (the Hub is mocked there).
from transformers import AutoTokenizer as AutoTokenizer

from .blocks import PackedBlockCollator, TokenBlocks, collator
from .build import build_datasets, data_stats, heldout_from_recipe
from .cache import DATA_PIPELINE_VERSION
from .corpus import ASSETS_DIR as ASSETS_DIR
from .corpus import EMBEDDED as EMBEDDED
from .corpus import default_cache_dir, embedded_corpus_jsonl, embedded_corpus_path, embedded_tokenizer_path
from .data_arguments import DataArguments
from .sources import _builder_for as _builder_for  # looped_hf.prepack reads local files the same way
from .sources import _resolve_source as _resolve_source
from .sources import iter_documents
from .tokenizer import BYTES as BYTES
from .tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    add_study_special_tokens,
    load_tokenizer,
    split_tokenizer_spec,
    tokenizer_fingerprint,
)

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
