"""The README and docs/ cannot drift from the code: their runnable blocks run, their links resolve.

A fenced code block whose info string carries the word ``runnable`` (```` ```python runnable ````,
```` ```bash runnable ````) is executed here, page by page, in a fresh temporary directory that holds
a copy of ``recipes/`` and ``model_cards/`` (the examples are written for the repository root).
The python blocks of one page share one namespace, in page order; bash blocks run in the same
directory with ``bash -eo pipefail``. Everything is offline and CPU-only; tokenized data is cached
once per session. Blocks without the word are shown, never run (``make demo``, GPU commands).

A ```` ```text output ```` block right after a runnable block is what that block prints, checked
here: ``...`` inside a line matches any text, a line of just ``...`` any number of lines.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
# Pages that index others rather than document a task: they need no runnable example.
INDEX_PAGES = {DOCS / "index.md"}
RUNNABLE_LANGUAGES = ("python", "bash")

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, first line (1-based, the fence), language, words, code."""

    page: Path
    line: int
    language: str
    words: tuple[str, ...]
    code: str

    @property
    def runnable(self) -> bool:
        return "runnable" in self.words

    @property
    def is_output(self) -> bool:
        return self.language == "text" and "output" in self.words

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order (CommonMark fences: ``` or ~~~)."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, words = m["fence"], tuple(m["info"].split())
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{start}: code fence never closed")
        i += 1
        language = words[0] if words else ""
        blocks.append(Block(page, start, language, words, "\n".join(body) + "\n"))
    return blocks


def _pages_with_runnable_blocks() -> list[Path]:
    return [p for p in PAGES if any(b.runnable for b in code_blocks(p))]


@pytest.fixture(scope="session")
def docs_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One looped_hf data cache for every page, so a corpus is tokenized once per session."""
    return tmp_path_factory.mktemp("docs_cache")


def _workdir(tmp_path: Path) -> Path:
    """A scratch repository root: the examples read recipes/ and model_cards/ relative to it;
    copies, so an example that writes there cannot touch the checkout."""
    for name in ("recipes", "model_cards"):
        shutil.copytree(REPO / name, tmp_path / name)
    return tmp_path


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        MPLBACKEND="Agg",
        LOOPED_HF_CACHE=str(cache),
        # `python` and `looped-hf` in a bash block are this interpreter's.
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


@pytest.mark.parametrize("page", _pages_with_runnable_blocks(), ids=lambda p: str(p.relative_to(REPO)))
def test_runnable_blocks_run(
    page: Path, tmp_path: Path, docs_cache: Path, monkeypatch, one_torch_thread
) -> None:
    """Every block marked runnable on the page runs without error, in page order."""
    cwd = _workdir(tmp_path)
    env = _env(docs_cache)
    for key in (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TOKENIZERS_PARALLELISM",
        "MPLBACKEND",
        "LOOPED_HF_CACHE",
    ):
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(cwd)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    blocks = code_blocks(page)
    for i, block in enumerate(blocks):
        if not block.runnable:
            continue
        expected = blocks[i + 1] if i + 1 < len(blocks) and blocks[i + 1].is_output else None
        if block.language == "python":
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed) if expected else contextlib.nullcontext():
                    exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - the docs are the test
            except Exception as exc:
                raise AssertionError(f"{block.where}: the runnable python block failed: {exc!r}") from exc
            if expected:
                _assert_prints(expected, printed.getvalue())
        elif block.language == "bash":
            done = subprocess.run(
                ["bash", "-eo", "pipefail", "-c", block.code],
                cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, (
                f"{block.where}: the runnable bash block exited {done.returncode}\n"
                f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
            )
            if expected:
                _assert_prints(expected, done.stdout)
        else:
            raise AssertionError(
                f"{block.where}: runnable blocks are {RUNNABLE_LANGUAGES}, got {block.language!r}"
            )


def _output_pattern(expected: str) -> re.Pattern[str]:
    """The regex of an output block: ``...`` in a line matches any text, a ``...`` line any lines."""
    parts = []
    for line in expected.splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(map(re.escape, line.rstrip().split("..."))) + r"[ \t]*\n")
    return re.compile("".join(parts))


def _assert_prints(expected: Block, printed: str) -> None:
    text = "\n".join(line.rstrip() for line in printed.splitlines()) + "\n"
    assert _output_pattern(expected.code).fullmatch(text), (
        f"{expected.where}: the block before it no longer prints this; it printed:\n{printed[-3000:]}"
    )


def test_output_pattern_matches_what_it_should() -> None:
    """``...`` stands for text in a line and for whole lines; everything else must be equal."""
    pattern = _output_pattern("a = 1\n...\nb = ...s\n")
    assert pattern.fullmatch("a = 1\nnoise\nmore\nb = 2.5 s\n")
    assert pattern.fullmatch("a = 1\nb = 3 s\n")
    assert not pattern.fullmatch("a = 2\nb = 3 s\n")
    assert not pattern.fullmatch("a = 1\nb = 3 s\nextra\n")


def test_output_blocks_follow_a_runnable_block() -> None:
    """An output block is checked against the runnable block just before it; anywhere else it
    would be checked against nothing."""
    stray = []
    for page in PAGES:
        blocks = code_blocks(page)
        stray += [
            b.where for i, b in enumerate(blocks) if b.is_output and (i == 0 or not blocks[i - 1].runnable)
        ]
    assert not stray, f"output blocks that follow no runnable block: {stray}"


def test_every_docs_page_has_a_runnable_example() -> None:
    """A page per concern, each with an example the test above keeps true."""
    pages = [p for p in PAGES if p.parent == DOCS and p not in INDEX_PAGES] + [REPO / "README.md"]
    missing = [str(p.relative_to(REPO)) for p in pages if not any(b.runnable for b in code_blocks(p))]
    assert not missing, f"pages without a block marked runnable: {missing}"


def test_runnable_marker_only_on_runnable_languages() -> None:
    """A typo such as ```` ```py runnable ```` would otherwise be skipped without a word."""
    bad = [f"{b.where} ({b.language!r})" for p in PAGES for b in code_blocks(p)
           if b.runnable and b.language not in RUNNABLE_LANGUAGES]  # fmt: skip
    assert not bad, f"blocks marked runnable in a language the test cannot run: {bad}"


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""(?:href|src)=["']([^"']+)["']""")


def _relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link or image in the page, outside code blocks."""
    in_code = {n for b in code_blocks(page) for n in range(b.line, b.line + b.code.count("\n") + 2)}
    links = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if n in in_code:
            continue
        for target in _LINK.findall(line) + _HTML_LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue  # http(s)://, mailto:, an anchor on the same page
            links.append((n, target))
    return links


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces -> '-'."""
    in_code = {n for b in code_blocks(page) for n in range(b.line, b.line + b.code.count("\n") + 2)}
    anchors = set()
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and n not in in_code:
            anchors.add(re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-"))
    return anchors


def test_relative_links_resolve() -> None:
    """Every relative link in the README and docs/ points at a file or folder of the repository,
    and a link to a heading of a Markdown page (``page.md#heading``) at a heading it has."""
    broken = []
    for page in PAGES:
        for line, target in _relative_links(page) + [(n, page.name + t) for n, t in _same_page_anchors(page)]:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)}:{line}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(REPO)}:{line}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _same_page_anchors(page: Path) -> list[tuple[int, str]]:
    """(line, "#anchor") of every link to a heading of the same page, outside code blocks."""
    in_code = {n for b in code_blocks(page) for n in range(b.line, b.line + b.code.count("\n") + 2)}
    return [(n, t) for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
            if n not in in_code for t in _LINK.findall(line) if t.startswith("#")]  # fmt: skip


def test_every_docs_page_is_linked_from_the_index() -> None:
    """docs/index.md lists every page, and the README links the index."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = {(DOCS / t.split("#", 1)[0]).resolve() for _, t in _relative_links(DOCS / "index.md")}
    missing = [p.name for p in DOCS.glob("*.md") if p not in INDEX_PAGES and p.resolve() not in linked]
    assert index and not missing, f"docs pages missing from docs/index.md: {missing}"
    readme_targets = {t for _, t in _relative_links(REPO / "README.md")}
    assert "docs/index.md" in readme_targets


def test_readme_table_lists_every_cli_command() -> None:
    """The README's command table has a row for every `looped-hf` command the CLI dispatches."""
    from looped_hf.cli import COMMANDS

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = {m for m in re.findall(r"^\|\s*`looped-hf ([a-z-]+)[^`]*`\s*\|", readme, re.M)}
    missing = sorted(set(COMMANDS) - rows)
    assert not missing, f"commands missing from the README's CLI table: {missing}"
    unknown = sorted(rows - set(COMMANDS))
    assert not unknown, f"README table rows for commands the CLI does not have: {unknown}"


def test_code_blocks_parse_on_the_test_pages() -> None:
    """The fence parser finds blocks and their markers (so a parser bug cannot pass every page)."""
    blocks = [b for p in PAGES for b in code_blocks(p)]
    assert sum(b.runnable for b in blocks) >= 10
    assert any(b.language == "bash" and not b.runnable for b in blocks)
