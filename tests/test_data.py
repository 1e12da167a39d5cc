"""The data module: embedded corpus and tokenizers, packing, the fixed held-out split, the cache."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset, IterableDataset, load_dataset
from transformers import DataCollatorForLanguageModeling, HfArgumentParser, PreTrainedTokenizerFast

from looped_hf import data as data_mod
from looped_hf.data import (
    DataArguments,
    TokenBlocks,
    build_datasets,
    collator,
    data_stats,
    embedded_corpus_jsonl,
    embedded_corpus_path,
    embedded_tokenizer_path,
    load_tokenizer,
)
from looped_hf.data import cache as data_cache
from looped_hf.data import heldout as data_heldout

SEQ = 32
MARK = re.compile(r"\[(\d{3})\]")


def _doc(i: int, lines: int = 12) -> str:
    # Every line carries its document's marker, so any block of SEQ bytes names its documents.
    return "".join(f"[{i:03d}] line {j} of document {i}: the quick brown fox.\n" for j in range(lines))


@pytest.fixture(scope="module")
def bytes_tok() -> PreTrainedTokenizerFast:
    return load_tokenizer("bytes")


@pytest.fixture
def marked_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(80):
            f.write(json.dumps({"text": _doc(i), "source": ["a", "b"][i % 2], "n": i}) + "\n")
        for empty in ("", "  \n", None):  # skipped, not turned into lone EOS tokens
            f.write(json.dumps({"text": empty, "source": "a", "n": -1}) + "\n")
    return path


def _args(path: Path, cache: Path, **kw) -> DataArguments:
    base = {
        "dataset": str(path),
        "tokenizer": "bytes",
        "seq_len": SEQ,
        "eval_blocks": 8,
        "data_cache_dir": str(cache),
    }
    return DataArguments(**{**base, **kw})


def _ids(ds: Dataset) -> torch.Tensor:
    return ds[:]["input_ids"]  # whole column as one [rows, seq_len] tensor (torch format)


def _doc_ids(ds, tok, limit: int | None = None) -> set[str]:
    found: set[str] = set()
    for n, row in enumerate(ds):
        if limit is not None and n >= limit:
            break
        found.update(MARK.findall(tok.decode(row["input_ids"])))
    return found


# ---------------------------------------------------------------------------------------------
# Embedded corpus and tokenizers
# ---------------------------------------------------------------------------------------------
def test_embedded_corpus_is_shipped_compressed_with_attribution(tmp_path: Path) -> None:
    assert embedded_corpus_path().name.endswith(".jsonl.xz")
    assert 1_000_000 < embedded_corpus_path().stat().st_size < 8_000_000
    attribution = (embedded_corpus_path().parent / "ATTRIBUTION.md").read_text()
    assert "Open Knowledge Foundation" in attribution and "CC-BY-2.5" in attribution
    assert "public domain" in attribution

    ds = load_dataset(
        "json", data_files=str(embedded_corpus_jsonl(tmp_path)), split="train", cache_dir=str(tmp_path)
    )
    assert {"id", "source", "title", "text"} <= set(ds.column_names)
    assert set(ds["source"]) == {"shakespeare", "bible", "austen"}
    assert len(ds) > 1000 and len(set(ds["id"])) == len(ds)
    assert sum(len(t) for t in ds["text"]) > 10_000_000


def test_embedded_tokenizer_round_trips_and_has_distinct_pad() -> None:
    tok = load_tokenizer()
    assert len(tok) == 4096 == load_tokenizer("embedded").vocab_size
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    text = "To be, or not to be: that is the question.\nMr. Darcy paid £10,000 — naïve café 🙂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    english = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    assert len(english) / len(tok(english)["input_ids"]) > 3.0  # BPE compresses English well beyond bytes
    assert tok(text)["input_ids"] == ids  # no BOS/EOS added implicitly


def test_embedded_tokenizer_file_loads_by_path() -> None:
    by_path = load_tokenizer(str(embedded_tokenizer_path()))
    assert by_path("Hark!")["input_ids"] == load_tokenizer()("Hark!")["input_ids"]


def test_bytes_tokenizer_is_one_token_per_utf8_byte(bytes_tok, tmp_path: Path) -> None:
    text = "héllo £ 🙂\n\tend"
    ids = bytes_tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert bytes_tok.decode(ids) == text
    assert len(bytes_tok) == 258 and bytes_tok.eos_token_id == 256 and bytes_tok.pad_token_id == 257
    bytes_tok.save_pretrained(tmp_path / "tok")  # a saved directory loads back as a local path
    assert load_tokenizer(str(tmp_path / "tok"))(text)["input_ids"] == ids


def test_hub_style_tokenizer_without_pad_gets_a_distinct_one(monkeypatch, bytes_tok) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_str(bytes_tok.backend_tokenizer.to_str())
    no_pad = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    assert no_pad.pad_token is None
    monkeypatch.setattr(data_mod.AutoTokenizer, "from_pretrained", lambda name, **kw: no_pad)
    tok = load_tokenizer("some-org/some-tokenizer")
    assert tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id


# ---------------------------------------------------------------------------------------------
# Packing and the held-out split
# ---------------------------------------------------------------------------------------------
def test_blocks_have_exact_length_and_preserve_text(marked_jsonl: Path, tmp_path: Path, bytes_tok) -> None:
    train, held_out = build_datasets(_args(marked_jsonl, tmp_path), bytes_tok)
    assert isinstance(train, Dataset) and isinstance(held_out, Dataset)
    assert train.column_names == ["input_ids"] == held_out.column_names
    assert len(held_out) == 8
    for row in list(train) + list(held_out):
        assert row["input_ids"].shape == (SEQ,) and row["input_ids"].dtype == torch.long
    # Concatenated training blocks are the training documents, each followed by EOS, in order.
    flat = torch.cat([row["input_ids"] for row in train]).tolist()
    eos = bytes_tok.eos_token_id
    docs = bytes_tok.decode([t for t in flat], skip_special_tokens=False).split(bytes_tok.eos_token)
    full = [d for d in docs[:-1]]  # the last piece may be cut at the block boundary
    assert full and all(d == _doc(int(MARK.search(d).group(1))) for d in full)
    assert flat.count(eos) >= len(full)
    stats = data_stats(_args(marked_jsonl, tmp_path), bytes_tok)
    assert stats["train_blocks"] == len(train) and stats["documents"] == 80


def test_held_out_never_shares_a_document_with_train(marked_jsonl: Path, tmp_path: Path, bytes_tok) -> None:
    train, held_out = build_datasets(_args(marked_jsonl, tmp_path, eval_blocks=60), bytes_tok)
    eval_docs, train_docs = _doc_ids(held_out, bytes_tok), _doc_ids(train, bytes_tok)
    assert eval_docs and train_docs
    assert not eval_docs & train_docs
    # Stratified by the `source` column: held-out documents come from both sources.
    assert {int(i) % 2 for i in eval_docs} == {0, 1}


def test_held_out_is_identical_across_runs_and_other_settings(
    marked_jsonl: Path, tmp_path: Path, bytes_tok
) -> None:
    _, first = build_datasets(_args(marked_jsonl, tmp_path / "c1"), bytes_tok)
    _, again = build_datasets(_args(marked_jsonl, tmp_path / "c1"), bytes_tok)
    # Settings that do not define the held-out set: cache location, packing batch, workers.
    _, other = build_datasets(
        _args(marked_jsonl, tmp_path / "c2", pack_batch_docs=3, num_proc=2, shuffle_buffer=7), bytes_tok
    )
    _, bigger = build_datasets(_args(marked_jsonl, tmp_path / "c1", eval_blocks=16), bytes_tok)
    assert torch.equal(_ids(first), _ids(again))
    assert torch.equal(_ids(first), _ids(other))
    assert torch.equal(_ids(first), _ids(bigger)[:8])  # a larger held-out set extends it
    _, reseeded = build_datasets(_args(marked_jsonl, tmp_path / "c1", split_seed=1), bytes_tok)
    assert not torch.equal(_ids(first), _ids(reseeded))


def test_second_call_loads_cache_without_tokenizing(
    marked_jsonl: Path, tmp_path: Path, bytes_tok, monkeypatch
) -> None:
    calls = {"n": 0}
    original = data_heldout._tokenize_batch

    def counting(*a, **kw):
        calls["n"] += 1
        return original(*a, **kw)

    monkeypatch.setattr(data_heldout, "_tokenize_batch", counting)  # where the split calls it
    args = _args(marked_jsonl, tmp_path)
    t0 = time.perf_counter()
    train1, eval1 = build_datasets(args, bytes_tok)
    cold = time.perf_counter() - t0
    assert calls["n"] > 0
    calls["n"] = 0
    t0 = time.perf_counter()
    train2, eval2 = build_datasets(args, bytes_tok)
    warm = time.perf_counter() - t0
    assert calls["n"] == 0 and warm < cold
    assert torch.equal(_ids(train1), _ids(train2)) and torch.equal(_ids(eval1), _ids(eval2))
    entries = list((tmp_path / "tokenized").iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".tmp")
    # A different seq_len is a different cache entry.
    build_datasets(_args(marked_jsonl, tmp_path, seq_len=16), bytes_tok)
    assert len(list((tmp_path / "tokenized").iterdir())) == 2


def test_interrupted_build_leaves_no_cache_entry(
    marked_jsonl: Path, tmp_path: Path, bytes_tok, monkeypatch
) -> None:
    def crash(*a, **kw):
        raise KeyboardInterrupt("killed mid-build")

    monkeypatch.setattr(data_heldout, "_pack_batch", crash)
    with pytest.raises(KeyboardInterrupt):
        build_datasets(_args(marked_jsonl, tmp_path), bytes_tok)
    assert list((tmp_path / "tokenized").iterdir()) == []
    monkeypatch.undo()
    train, _ = build_datasets(_args(marked_jsonl, tmp_path), bytes_tok)
    assert len(train) > 0


def test_concurrent_build_keeps_the_first_published_cache(tmp_path: Path) -> None:
    final, loser = tmp_path / "key", tmp_path / ".tmp-key-2"
    for d, tag in ((final, "first"), (loser, "second")):
        d.mkdir()
        (d / "meta.json").write_text(tag)
    data_cache._publish(loser, final)  # another run of the sweep finished first: keep its cache
    assert (final / "meta.json").read_text() == "first" and not loser.exists()


@pytest.mark.parametrize("fmt", ["txt", "csv", "parquet", "dir"])
def test_local_files_go_through_the_same_pipeline(fmt: str, tmp_path: Path, bytes_tok) -> None:
    docs = [_doc(i, lines=6) for i in range(60)]
    path = tmp_path / f"docs.{fmt}"
    if fmt == "txt":  # one document per paragraph (blank-line separated)
        path.write_text("\n\n".join(d.strip() for d in docs) + "\n")
    elif fmt == "dir":  # a directory of JSONL shards (hidden files ignored)
        path.mkdir()
        for shard in range(2):
            rows = [json.dumps({"text": d}) + "\n" for d in docs[shard::2]]
            (path / f"part-{shard}.jsonl").write_text("".join(rows))
        (path / ".DS_Store").write_bytes(b"\0")
    else:
        getattr(Dataset.from_dict({"text": docs}), f"to_{fmt}")(str(path))
    train, held_out = build_datasets(_args(path, tmp_path / "cache"), bytes_tok)
    assert len(held_out) == 8 and len(train) > 10
    assert all(len(r["input_ids"]) == SEQ for r in train)
    assert not _doc_ids(held_out, bytes_tok) & _doc_ids(train, bytes_tok)


def test_streaming_local_file(marked_jsonl: Path, tmp_path: Path, bytes_tok) -> None:
    args = _args(marked_jsonl, tmp_path, streaming=True, streaming_eval_fraction=0.25, eval_blocks=4)
    train, held_out = build_datasets(args, bytes_tok)
    assert isinstance(train, IterableDataset) and isinstance(held_out, Dataset) and len(held_out) == 4
    rows = list(train)
    assert rows and all(r["input_ids"].shape == (SEQ,) for r in rows)
    assert not _doc_ids(held_out, bytes_tok) & _doc_ids(rows, bytes_tok)
    _, held_again = build_datasets(args, bytes_tok)  # held-out comes from the cache the second time
    assert torch.equal(_ids(held_out), _ids(held_again))
    batch = collator(bytes_tok)(rows[:3])
    assert batch["input_ids"].shape == (3, SEQ)


# ---------------------------------------------------------------------------------------------
# Collator, arguments, errors
# ---------------------------------------------------------------------------------------------
def test_collator_copies_inputs_to_labels_like_the_hf_collator(
    marked_jsonl: Path, tmp_path: Path, bytes_tok
) -> None:
    train, _ = build_datasets(_args(marked_jsonl, tmp_path), bytes_tok)
    eos = bytes_tok.eos_token_id
    with_eos = [i for i in range(len(train)) if (train[i]["input_ids"] == eos).any()]
    features = [train[i] for i in (0, 1, with_eos[0], with_eos[1])]
    ours = collator(bytes_tok)(features)
    hf = DataCollatorForLanguageModeling(bytes_tok, mlm=False)(
        [{"input_ids": f["input_ids"].tolist()} for f in features]
    )
    assert torch.equal(ours["input_ids"], hf["input_ids"]) and torch.equal(ours["labels"], hf["labels"])
    assert torch.equal(ours["labels"], ours["input_ids"])
    assert (ours["labels"] == bytes_tok.eos_token_id).any()  # EOS is a target, not masked


def test_data_arguments_parse_from_cli_and_dict() -> None:
    parser = HfArgumentParser(DataArguments)
    (args,) = parser.parse_args_into_dataclasses(["--seq_len", "64", "--tokenizer", "bytes", "--streaming"])
    assert args.seq_len == 64 and args.tokenizer == "bytes" and args.streaming and args.dataset is None
    (args,) = parser.parse_dict({"dataset": "embedded", "eval_blocks": 4})
    assert args.eval_blocks == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [("seq_len", 1), ("eval_blocks", 0), ("streaming_eval_fraction", 1.5), ("text_sample_by", "sentence")],
)
def test_bad_argument_values_raise_naming_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(str(value))}"):
        DataArguments(**{field: value})


def test_unknown_text_column_and_too_small_corpus_raise(
    marked_jsonl: Path, tmp_path: Path, bytes_tok
) -> None:
    with pytest.raises(ValueError, match=r"text_column='body'.*columns"):
        build_datasets(_args(marked_jsonl, tmp_path, text_column="body"), bytes_tok)
    with pytest.raises(ValueError, match=r"too small.*eval_blocks=100000"):
        build_datasets(_args(marked_jsonl, tmp_path, eval_blocks=100_000), bytes_tok)
    with pytest.raises(ValueError, match=r"dataset=.*no such file"):
        build_datasets(_args(tmp_path / "missing.jsonl", tmp_path), bytes_tok)
    (tmp_path / "notes.xyz").write_text("not a data format")
    with pytest.raises(ValueError, match=r"dataset=.*notes.xyz"):
        build_datasets(_args(tmp_path / "notes.xyz", tmp_path), bytes_tok)


@pytest.mark.slow
def test_embedded_default_builds_with_embedded_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer()
    args = DataArguments(data_cache_dir=str(tmp_path), seq_len=256, eval_blocks=64)
    train, held_out = build_datasets(args, tok)
    assert len(held_out) == 64 and len(train) > 10_000
    stats = data_stats(args, tok)
    assert 3_000_000 < stats["tokens"] < 5_000_000
    text = tok.decode(held_out[0]["input_ids"])
    assert len(text) > 256 * 2.5


# --------------------------------------------------------------------------------------------
# TokenBlocks: the training rows as zero-copy views
# --------------------------------------------------------------------------------------------
def test_token_blocks_give_the_datasets_rows(marked_jsonl, tmp_path, bytes_tok):
    """Every row, any batch of indices (also negative), in one chunk or many: the same int64
    tensors as the torch-formatted dataset; pickles by reference to the dataset, not its arrays."""
    import pickle

    from datasets import concatenate_datasets

    train, _ = build_datasets(_args(marked_jsonl, tmp_path / "c"), bytes_tok)
    many = concatenate_datasets(
        [train.select(range(0, 10)).flatten_indices(), train.select(range(10, len(train))).flatten_indices()]
    ).with_format("torch")
    for ds in (train, many):
        blocks = TokenBlocks.wrap(ds)
        assert isinstance(blocks, TokenBlocks) and len(blocks) == len(ds)
        whole = _ids(ds)
        assert torch.equal(torch.stack([blocks[i]["input_ids"] for i in range(len(ds))]), whole)
        assert blocks[-1]["input_ids"].dtype == whole.dtype == torch.int64
        idx = [7, 0, len(ds) - 1, 3, 3, -2]
        got = [row["input_ids"] for row in blocks.__getitems__(idx)]
        assert all(torch.equal(g, whole[i]) for g, i in zip(got, idx))
        with pytest.raises(IndexError, match="out of range"):
            blocks.__getitems__([len(ds)])
    assert len(many.data.table.column("input_ids").chunks) >= 2
    clone = pickle.loads(pickle.dumps(TokenBlocks.wrap(train)))
    assert torch.equal(clone[5]["input_ids"], train[5]["input_ids"])
    assert len(pickle.dumps(TokenBlocks.wrap(train))) < 0.2 * whole.numel() * 4


def test_token_blocks_leave_other_datasets_as_they_are(marked_jsonl, tmp_path, bytes_tok):
    train, _ = build_datasets(_args(marked_jsonl, tmp_path / "c"), bytes_tok)
    selected = train.select([3, 1, 2])  # an index mapping: rows are not the table's order
    ragged = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]}).with_format("torch")
    extra = Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "mask": [[1, 1], [1, 0]]})
    for ds in (selected, ragged, extra, [{"input_ids": torch.zeros(2)}]):
        assert TokenBlocks.wrap(ds) is ds


def test_cache_key_of_a_build_is_stable(monkeypatch) -> None:
    """The key hashes the settings exactly as releases before the data package did, so caches
    built by an earlier looped_hf are hit, not rebuilt (the tokenizer's own hash is stubbed:
    it follows the tokenizers library's serialization)."""
    monkeypatch.setattr(data_cache, "tokenizer_fingerprint", lambda tokenizer: "tok")
    embedded = {"kind": "embedded", "sha256": "x"}
    assert data_cache._cache_key(DataArguments(), None, embedded) == "caa8b4186d5ccf8628a880b6"
    hub = {"kind": "hub", "name": "a/b", "config": None, "revision": "r"}
    args = DataArguments(seq_len=64, streaming=True, split_seed=3)
    assert data_cache._cache_key(args, None, hub) == "22d0a5c7ca7c083dbb7075d9"
