"""The study's prepacked data: packing reproduces the study's rows, shards and meta; the reader and the
Trainer see exactly the fixture's rows; resume, atomicity, errors; the study's tokenizer."""

from __future__ import annotations

import json
import lzma
import random
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import fixture_path

from looped_hf import prepack
from looped_hf.data import (
    DataArguments,
    TokenBlocks,
    build_datasets,
    collator,
    embedded_tokenizer_path,
    load_tokenizer,
    split_tokenizer_spec,
)
from looped_hf.prepack import PackSettings, pack_rows, pack_split, prepare_data, split_files

#: The study's prepacked format made by its own packing code (tests/fixtures/study_prepacked/PROVENANCE.md):
#: shards and metas as the study writes them; the documents and the rows in packing order as xz'd JSON.
PREPACKED = fixture_path("study_prepacked")
REPO = Path(__file__).resolve().parents[1]
STUDY_TOKEN = "<|assistant_end|>"


def _fixture_json(name: str):
    """One of the fixture's xz-compressed JSON files (``docs``, ``rows_<split>_in_order``)."""
    with lzma.open(fixture_path("study_prepacked", f"{name}.json.xz"), "rt", encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def fixture_docs() -> dict:
    return _fixture_json("docs")


def _docs(fixture_docs: dict, split: str) -> list[list[int]]:
    return [[fixture_docs["bos_token_id"], *d] for d in fixture_docs["docs_without_bos"][split]]


def _rows(path: Path) -> list[list[int]]:
    return pq.read_table(path).column("tokens").to_pylist()


def _fixture_rows(split: str) -> list[list[int]]:
    return [row for f in split_files(PREPACKED, split) for row in _rows(f)]


def _assert_same_output(out: Path, skip_meta: tuple[str, ...] = ()) -> None:
    """Shards of ``out`` equal the fixture's table for table (rows, order after shuffle, type)."""
    for split in ("train", "val"):
        ours, theirs = split_files(out, split), split_files(PREPACKED, split)
        assert [f.name for f in ours] == [f.name for f in theirs]
        for a, b in zip(ours, theirs):
            assert pq.read_table(a).equals(pq.read_table(b)), a.name
        meta, ref = (json.loads((d / f"meta_{split}.json").read_text()) for d in (out, PREPACKED))
        assert {k: v for k, v in meta.items() if k not in skip_meta} == {
            k: v for k, v in ref.items() if k not in skip_meta
        }
    assert not list(out.glob(".*.tmp-*")), "a temporary shard was left behind"


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------
def _naive_best_fit(docs: list[list[int]], capacity: int, buffer_size: int) -> list[list[int]]:
    """The rule written as plainly as possible (a list scanned per choice) to check BestFitBuffer."""
    stream, buf, rows = iter(docs), [], []
    while True:
        buf.extend(d for _, d in zip(range(buffer_size - len(buf)), stream))
        row: list[int] = []
        while len(row) < capacity and buf:
            room = capacity - len(row)
            fits = [i for i, d in enumerate(buf) if len(d) <= room]
            if fits:
                i = max(fits, key=lambda i: (len(buf[i]), -i))
                row += buf.pop(i)
            else:
                i = min(range(len(buf)), key=lambda i: (len(buf[i]), i))
                row += buf.pop(i)[:room]
        if len(row) < capacity:
            return rows
        rows.append(row)


@pytest.mark.parametrize(("seed", "buffer_size"), [(0, 4), (1, 10), (2, 40)])
def test_best_fit_buffer_chooses_as_the_plain_rule(seed, buffer_size):
    """Many equal lengths (ties), documents longer than a row (crops), buffers of 4 to 40."""
    rng = random.Random(seed)
    lengths = [0, 1, 2, 3, 7, 9, 15, 30, 40]
    docs = [[1] + [rng.randrange(2, 50) for _ in range(rng.choice(lengths))] for _ in range(600)]
    got = [r.tolist() for r in pack_rows(docs, 17, buffer_size=buffer_size)]
    assert got == _naive_best_fit(docs, 17, buffer_size) and len(got) > 20
    assert all(r[0] == 1 for r in got)  # BOS-aligned: every row starts a document


@pytest.mark.parametrize("split", ["train", "val"])
def test_pack_rows_equal_the_studys_rows_in_order(fixture_docs, split):
    rows = [r.tolist() for r in pack_rows(_docs(fixture_docs, split), fixture_docs["row_capacity"],
                                          fixture_docs["buffer_size"])]  # fmt: skip
    assert rows == _fixture_json(f"rows_{split}_in_order")


def test_pack_split_writes_the_studys_shards_and_meta(fixture_docs, tmp_path):
    settings = PackSettings(row_capacity=65, buffer_size=1000, rows_per_shard=400, seed=0)
    extra = {"dataset": prepack.STUDY_SOURCE, "vocab_size": 500, "bos_token_id": 1}
    for split in ("train", "val"):
        docs = _docs(fixture_docs, split)
        pack_split(split, lambda skip, docs=docs: docs[skip:], tmp_path, settings, meta_extra=extra)
    _assert_same_output(tmp_path)


class _Killed(Exception):
    pass


def test_a_killed_split_resumes_to_the_same_output_and_leaves_no_half_shard(fixture_docs, tmp_path):
    settings = PackSettings(row_capacity=65, buffer_size=1000, rows_per_shard=400, seed=0)
    extra = {"dataset": prepack.STUDY_SOURCE, "vocab_size": 500, "bos_token_id": 1}
    docs = _docs(fixture_docs, "train")
    reads: list[int] = []

    def dying(skip: int):
        reads.append(skip)
        for i, doc in enumerate(docs[skip:], start=skip):
            if i == 2900:  # 1,000 documents ahead of the rows (the buffer): in shard 2
                raise _Killed
            yield doc

    with pytest.raises(_Killed):
        pack_split("train", dying, tmp_path, settings, meta_extra=extra)
    written = sorted(p.name for p in tmp_path.glob("train-*.parquet"))
    assert written == [f"train-{i:05d}.parquet" for i in range(len(written))] and 1 <= len(written) < 4
    assert not (tmp_path / "meta_train.json").exists()
    # A kill inside the parquet write: the temporary file goes, no shard name appears.
    real_write = pq.write_table

    def torn_write(table, where, **kw):
        real_write(table.slice(0, 3), where, **kw)
        raise _Killed

    with mock.patch.object(pq, "write_table", torn_write), pytest.raises(_Killed):
        pack_split("train", lambda skip: docs[skip:], tmp_path, settings, meta_extra=extra)
    assert sorted(p.name for p in tmp_path.glob("train-*.parquet")) == written and not list(
        tmp_path.glob(".*tmp*")
    )
    reads.clear()
    pack_split(
        "train", lambda skip: (reads.append(skip), docs[skip:])[1], tmp_path, settings, meta_extra=extra
    )
    assert reads and reads[0] > 0  # resumed from its saved state, not from the first document
    pack_split("val", lambda skip: _docs(fixture_docs, "val")[skip:], tmp_path, settings, meta_extra=extra)
    _assert_same_output(tmp_path)
    with pytest.raises(ValueError, match="other settings"):
        pack_split("train", lambda skip: docs, tmp_path, PackSettings(65, 999, 400), meta_extra=extra)


# --------------------------------------------------------------------------------------------
# prepare-data on text
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_source(tmp_path_factory, fixture_docs) -> tuple[Path, Path]:
    """The fixture's documents as text (token i written ``t<i>``) in 4 parquet files (3 train, 1 val),
    and a word-level tokenizer.json mapping them back (``<|endoftext|>`` = 1 = the fixture's BOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("text_source")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"t{i}": i for i in range(2, 500)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(root / "tokenizer.json"))
    data = root / "data"
    data.mkdir()
    as_text = [" ".join(f"t{i}" for i in d) for d in fixture_docs["docs_without_bos"]["train"]]
    for k in range(3):
        pq.write_table(
            pa.table({"text": as_text[k * 1000 : (k + 1) * 1000]}), data / f"shard_{k:05d}.parquet"
        )
    val = [" ".join(f"t{i}" for i in d) for d in fixture_docs["docs_without_bos"]["val"]]
    pq.write_table(pa.table({"text": val}), data / "shard_00003.parquet")
    return data, root / "tokenizer.json"


@pytest.mark.parametrize("num_proc", [1, 2])
def test_prepare_data_cli_packs_text_as_the_study(text_source, tmp_path, num_proc, capsys):
    from looped_hf.cli import main as cli

    data, tok = text_source
    argv = ["prepare-data", str(data), "--output-dir", str(tmp_path), "--tokenizer", str(tok), "--seq-len", "64",
            "--rows-per-shard", "400", "--val-files", "1", "--num-proc", str(num_proc)]  # fmt: skip
    assert cli(argv) == 0
    _assert_same_output(tmp_path, skip_meta=("dataset",))
    assert json.loads((tmp_path / "meta_train.json").read_text())["dataset"] == str(data)
    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")}
    assert cli(argv) == 0  # a rerun of a finished preparation writes nothing
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")} == mtimes
    assert "done already" in capsys.readouterr().out


def test_prepare_data_rejects_bad_settings(tmp_path, small_corpus):
    with pytest.raises(ValueError, match="exactly one of --val-files, --val-docs, --val-split"):
        prepare_data(str(small_corpus), tmp_path, tokenizer="bytes", val_files=1, val_docs=3)
    with pytest.raises(ValueError, match="--val-files 1: source .* has 1 data file"):
        prepare_data(str(small_corpus), tmp_path, tokenizer="bytes", val_files=1)
    with pytest.raises(ValueError, match="--val-split 'validation': only a Hub dataset"):
        prepare_data(str(small_corpus), tmp_path, tokenizer="bytes", val_split="validation")
    with pytest.raises(ValueError, match="--num-proc must be >= 1, got 0"):
        prepare_data(str(small_corpus), tmp_path, tokenizer="bytes", val_docs=2, num_proc=0)
    from looped_hf.cli import main as cli

    assert cli(["prepare-data", str(small_corpus), "--output-dir", str(tmp_path), "--val-docs", "0"]) == 2


def test_prepare_data_val_docs_on_any_text_source(tmp_path, small_corpus):
    """A single JSONL file: the first documents are val; every row is BOS-aligned and full."""
    metas = prepare_data(str(small_corpus), tmp_path, tokenizer="bytes", seq_len=31, val_docs=5, rows_per_shard=10,
                         log=None)  # fmt: skip
    bos = load_tokenizer("bytes").bos_token_id
    n_docs = sum(1 for _ in open(small_corpus, encoding="utf-8"))
    assert metas["val"]["total_docs"] == 5 and metas["train"]["total_docs"] == n_docs - 5
    rows = [r for f in split_files(tmp_path, "train") for r in _rows(f)]
    assert (
        len(rows) == metas["train"]["total_rows"] > 10
        and metas["train"]["num_shards"] >= 2
        and {len(r) for r in rows} == {32}
    )
    assert all(r[0] == bos for r in rows)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fixture_tok(tmp_path_factory):
    """A tokenizer with the fixture's 500 ids (it only sizes the vocabulary here)."""
    from tokenizers import Tokenizer, models

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"t{i}": i for i in range(2, 500)}}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")).save(str(path))
    return load_tokenizer(str(path))


def _prepacked_args(tmp_path: Path, **kw) -> DataArguments:
    base = {
        "dataset": str(PREPACKED),
        "prepacked": True,
        "seq_len": 64,
        "eval_blocks": 187,
        "data_cache_dir": str(tmp_path),
    }
    return DataArguments(**{**base, **kw})


def test_reader_gives_the_fixture_rows_in_file_order(tmp_path, fixture_tok):
    train, held = build_datasets(_prepacked_args(tmp_path, eval_blocks=100), fixture_tok)
    assert train[:]["input_ids"].tolist() == _fixture_rows("train")
    assert held[:]["input_ids"].tolist() == _fixture_rows("val")[:100]
    batch = collator(fixture_tok, _prepacked_args(tmp_path))([train[0], train[1]])
    rows = torch.tensor(_fixture_rows("train")[:2])
    assert torch.equal(batch["input_ids"], rows[:, :-1]) and torch.equal(batch["shift_labels"], rows[:, 1:])


def test_reader_errors_name_the_field(tmp_path, fixture_tok):
    with pytest.raises(ValueError, match="DataArguments.seq_len=128: .*row_capacity=65.*seq_len must be 64"):
        build_datasets(_prepacked_args(tmp_path, seq_len=128), fixture_tok)
    with pytest.raises(ValueError, match="DataArguments.eval_blocks=188: split 'val' .* only 187 rows"):
        build_datasets(_prepacked_args(tmp_path, eval_blocks=188), fixture_tok)
    with pytest.raises(ValueError, match="DataArguments.tokenizer='bytes' has 258 tokens.*vocab_size 500"):
        build_datasets(_prepacked_args(tmp_path, tokenizer="bytes"), load_tokenizer("bytes"))
    with pytest.raises(ValueError, match="DataArguments.text_column='body': a text setting"):
        _prepacked_args(tmp_path, text_column="body")
    with pytest.raises(ValueError, match="DataArguments.eval_split='test': used only with prepacked"):
        DataArguments(eval_split="test")
    with pytest.raises(ValueError, match="DataArguments.eval_split='train': the same split as dataset_split"):
        _prepacked_args(tmp_path, eval_split="train")
    no_meta = tmp_path / "rows"
    no_meta.mkdir()
    shutil.copy(PREPACKED / "val-00000.parquet", no_meta / "val-00000.parquet")
    with pytest.raises(ValueError, match="no train-\\*.parquet shards"):
        build_datasets(_prepacked_args(tmp_path, dataset=str(no_meta)), fixture_tok)


def test_reader_from_the_hub_downloads_only_the_two_splits(tmp_path, fixture_tok):
    with mock.patch("huggingface_hub.snapshot_download", return_value=str(PREPACKED)) as hub:
        train, held = build_datasets(
            _prepacked_args(
                tmp_path, dataset="KristianS7/prepacked-fineweb-edu-llama2-32K-T2048", eval_blocks=5
            ),
            fixture_tok,
        )
    kw = hub.call_args.kwargs
    assert hub.call_args.args[0] == "KristianS7/prepacked-fineweb-edu-llama2-32K-T2048"
    assert kw["repo_type"] == "dataset"
    assert sorted(kw["allow_patterns"]) == sorted(
        ["meta_train.json", "train-*.parquet", "meta_val.json", "val-*.parquet"]
    )
    assert len(train) == 1421 and held[:]["input_ids"].tolist() == _fixture_rows("val")[:5]


def test_streaming_reader_keeps_file_order(tmp_path, fixture_tok):
    train, _ = build_datasets(_prepacked_args(tmp_path, streaming=True, shuffle_buffer=0), fixture_tok)
    assert [r["input_ids"].tolist() for r in train] == _fixture_rows("train")


# --------------------------------------------------------------------------------------------
# Training reads exactly the fixture's rows
# --------------------------------------------------------------------------------------------
def _rows_the_trainer_model_receives(tmp_path: Path, tok, batch: int, steps: int | None, wrap: bool = True):
    """Train a tiny model with the Trainer on the fixture; record what its forward receives.
    `wrap`: the train split as `looped_hf.train` gives it (TokenBlocks), else the datasets rows."""
    from conftest import tiny_looped_model
    from transformers import Trainer, TrainingArguments

    args = _prepacked_args(tmp_path, eval_blocks=8)
    train, held = build_datasets(args, tok)
    if wrap:
        train = TokenBlocks.wrap(train)
        assert isinstance(train, TokenBlocks)
    model = tiny_looped_model(
        vocab_size=len(tok), hidden_size=16, num_attention_heads=2, num_recurrences=1
    ).train()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, a, kw):
        if module.training:
            seen.append((kw["input_ids"].clone(), kw["shift_labels"].clone()))

    model.register_forward_pre_hook(record, with_kwargs=True)
    steps = steps or -(-len(train) // batch)  # default: one epoch, the last batch partial
    targs = TrainingArguments(str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=batch,
                              train_sampling_strategy="sequential", report_to="none", save_strategy="no",
                              learning_rate=1e-3, use_cpu=True, dataloader_num_workers=0)  # fmt: skip
    Trainer(model=model, args=targs, train_dataset=train, eval_dataset=held,
            data_collator=collator(tok, args)).train()  # fmt: skip
    return torch.cat([x for x, _ in seen]), torch.cat([y for _, y in seen])


@pytest.mark.parametrize("wrap", [True, False], ids=["TokenBlocks", "datasets"])
def test_trainer_model_receives_the_fixture_rows_in_order(tmp_path, fixture_tok, one_torch_thread, wrap):
    inputs, targets = _rows_the_trainer_model_receives(tmp_path, fixture_tok, batch=8, steps=3, wrap=wrap)
    rows = torch.tensor(_fixture_rows("train")[:24])
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])


@pytest.mark.slow
def test_trainer_model_receives_exactly_the_fixture_rows_for_an_epoch(
    tmp_path, fixture_tok, one_torch_thread
):
    inputs, targets = _rows_the_trainer_model_receives(tmp_path, fixture_tok, batch=64, steps=None)
    rows = torch.tensor(_fixture_rows("train"))
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(targets, rows[:, 1:])


def test_under_ddp_each_process_reads_its_own_rows_and_a_step_reads_the_studys_rows(tmp_path, fixture_tok):
    """What the Trainer does with N processes: accelerate shards its DataLoader (BatchSamplerShard):
    per optimizer step process k gets batch k of N consecutive batches, so a step trains on the same
    B x N consecutive rows as the study's loader (rank k: every N-th row), split differently."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, SequentialSampler

    args = _prepacked_args(tmp_path)
    train, _ = build_datasets(args, fixture_tok)
    rows = torch.tensor(_fixture_rows("train"))
    batch, world = 8, 2
    per_rank = []
    for rank in range(world):
        loader = DataLoader(
            train, batch_size=batch, sampler=SequentialSampler(train), collate_fn=collator(fixture_tok, args)
        )
        shard = prepare_data_loader(loader, num_processes=world, process_index=rank, put_on_device=False)
        per_rank.append([b["input_ids"] for b in shard])
    steps = min(len(p) for p in per_rank) - 1  # full steps (accelerate pads the last one)
    for step in range(steps):
        together = torch.cat([per_rank[k][step] for k in range(world)])
        assert torch.equal(together, rows[step * batch * world : (step + 1) * batch * world, :-1])
    assert not set(map(tuple, per_rank[0][0].tolist())) & set(map(tuple, per_rank[1][0].tolist()))


# --------------------------------------------------------------------------------------------
# The study's tokenizer
# --------------------------------------------------------------------------------------------
def _study_style(tokenizer_json: Path):
    """What nanochat/tokenizer.py does to Llama-2's tokenizer.json, applied to a local file."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    tok.add_special_tokens([AddedToken(STUDY_TOKEN, special=True)])
    return tok


TEXTS = [
    "The quick brown fox.",
    f"an answer{STUDY_TOKEN}next turn",
    f"{STUDY_TOKEN}",
    "x <|assistant_end| > y",
]


def test_split_tokenizer_spec():
    assert split_tokenizer_spec(None) == (None, [])
    assert split_tokenizer_spec("NousResearch/Llama-2-7b-hf+<|assistant_end|>") == (
        "NousResearch/Llama-2-7b-hf",
        [STUDY_TOKEN],
    )
    assert split_tokenizer_spec("a/b+<x>+<y>") == ("a/b", ["<x>", "<y>"])
    with pytest.raises(ValueError, match="DataArguments.tokenizer='a/b\\+': expected NAME\\+TOKEN"):
        split_tokenizer_spec("a/b+")


@pytest.mark.parametrize("form", ["json_file", "saved_directory"])
def test_added_token_matches_the_studys_step(tmp_path, form):
    base = embedded_tokenizer_path()
    if form == "json_file":
        name = str(base)
    else:
        load_tokenizer().save_pretrained(tmp_path)
        name, base = str(tmp_path), tmp_path / "tokenizer.json"
    study = _study_style(base)
    ours = load_tokenizer(f"{name}+{STUDY_TOKEN}")
    plain = load_tokenizer(name)
    assert (
        ours.convert_tokens_to_ids(STUDY_TOKEN)
        == study.token_to_id(STUDY_TOKEN)
        == study.get_vocab_size() - 1
    )
    assert len(ours) == len(plain) + 1
    for text in TEXTS:
        assert (
            ours(text, add_special_tokens=False)["input_ids"]
            == study.encode(text, add_special_tokens=False).ids
        )


def test_packing_tokenizer_takes_the_hub_file_as_the_study(tmp_path):
    """A Hub name: the raw tokenizer.json (what tokenizers.Tokenizer.from_pretrained loads) plus the
    added token; BOS from the tokenizer. The Hub is mocked with a local copy."""
    load_tokenizer().save_pretrained(tmp_path)
    local = load_tokenizer(str(tmp_path))
    with (
        mock.patch("huggingface_hub.hf_hub_download", return_value=str(tmp_path / "tokenizer.json")) as hub,
        mock.patch("looped_hf.data.AutoTokenizer.from_pretrained", return_value=local),
    ):
        raw, bos, vocab = prepack.packing_tokenizer(f"org/llama+{STUDY_TOKEN}")
    assert hub.call_args.args == ("org/llama", "tokenizer.json")
    study = _study_style(tmp_path / "tokenizer.json")
    assert vocab == study.get_vocab_size() and bos == local.bos_token_id
    assert [raw.encode(t, add_special_tokens=False).ids for t in TEXTS] == [
        study.encode(t, add_special_tokens=False).ids for t in TEXTS
    ]


# --------------------------------------------------------------------------------------------
# The paper recipes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["iso_depth_paper.yaml", "iso_depth_paper_truncated.yaml",
                                  "iso_depth_paper_hyperconnection.yaml"])  # fmt: skip
def test_paper_recipes_read_the_studys_prepacked_data_and_tokenizer(name):
    recipe = yaml.safe_load((REPO / "recipes" / name).read_text())
    data_fields = {f for f in DataArguments.__dataclass_fields__}
    args = DataArguments(**{k: v for k, v in recipe.items() if k in data_fields})
    assert args.dataset == "KristianS7/prepacked-fineweb-edu-llama2-32K-T2048" and args.prepacked
    assert args.eval_split == "val" and args.eval_blocks == 34_560 and args.seq_len == 2048
    assert (
        args.tokenizer == f"NousResearch/Llama-2-7b-hf+{STUDY_TOKEN}"
        and "meta-llama" not in yaml.safe_dump(recipe)
    )
    assert recipe["train_sampling_strategy"] == "sequential"


def test_default_data_is_still_the_embedded_corpus():
    args = DataArguments()
    assert args.dataset is None and args.tokenizer is None and not args.prepacked
    assert collator(None, args).__class__.__name__ == "PackedBlockCollator"
    assert np.array_equal(
        np.asarray(load_tokenizer()("a b")["input_ids"]),
        np.asarray(load_tokenizer("embedded")("a b")["input_ids"]),
    )


def test_val_files_of_a_hub_source_are_its_last_data_files():
    """The study's rule on a Hub repo of shards (listing mocked): last N files val, hf:// paths, sorted."""
    files = ["README.md", "shard_00002.parquet", "shard_00000.parquet", "shard_00001.parquet"]
    with mock.patch("huggingface_hub.HfApi.list_repo_files", return_value=files) as hub:
        splits, identity = prepack.resolve_splits("org/shards", val_files=1, revision="abc")
    assert hub.call_args.kwargs["repo_type"] == "dataset"
    url = "hf://datasets/org/shards@abc/shard_{:05d}.parquet"
    assert splits["train"].load_kwargs["data_files"] == [url.format(0), url.format(1)]
    assert splits["val"].load_kwargs["data_files"] == [url.format(2)]
    assert splits["train"].load_kwargs["path"] == "parquet" and identity["rule"] == {"val_files": 1}


def test_looped_hf_train_on_prepacked_rows_counts_the_studys_tokens_and_steps(
    tmp_path, fixture_tok, one_torch_thread
):
    """Through `looped_hf.train.train`: a row trains seq_len tokens (inputs row[:-1]), not seq_len + 1,
    and `train_steps_rounding: nearest` gives the study's round(tokens / tokens_per_step)."""
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train

    tok_path = tmp_path / "tok.json"
    fixture_tok.backend_tokenizer.save(str(tok_path))
    recipe = {
        "hidden_size": 16, "num_attention_heads": 2, "num_prelude_layers": 0, "num_recurrent_layers": 1,
        "num_coda_layers": 0, "num_recurrences": 1, "input_injection": "none",
        "dataset": str(PREPACKED), "prepacked": True, "seq_len": 64, "eval_blocks": 8, "tokenizer": str(tok_path),
        "data_cache_dir": str(tmp_path / "cache"), "output_dir": str(tmp_path / "run"),
        "per_device_train_batch_size": 4, "per_device_eval_batch_size": 8, "train_sampling_strategy": "sequential",
        # 2.4 steps of 4 x 64 tokens: "up" would train 3 steps, the study's nearest trains 2.
        "train_tokens": int(2.4 * 4 * 64), "train_steps_rounding": "nearest",
        "save_strategy": "no", "report_to": "none", "logging_steps": 1, "use_cpu": True,
    }  # fmt: skip
    record = train(*parse_recipe(recipe))
    assert record["status"] == "ok", record.get("error")
    assert record["tokens"] == 2 * 4 * 64  # 2 steps of 4 rows x 64 tokens (2 x 4 x 65 if rows counted whole)
