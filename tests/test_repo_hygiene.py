"""The repository explains itself: no tracker numbers stand in for a reason.

A reader of a clone has no access to the tracker this project was built with, so a tracker number
in place of a reason tells them nothing. Code, tests, recipes, benchmarks, scripts and docs say what a thing is or why.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A tracker reference ("issue" + a number, "#" optional, any case), not the English word.
TRACKER_REF = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".sh", ""}
SKIP_DIRS = {".git", "model_cards", "runs", "__pycache__", "fixtures"}


def _repo_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout.split()
        paths = [REPO / p for p in out]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): walk the tree
        paths = [p for p in REPO.rglob("*") if p.is_file()]
    keep = []
    for path in paths:
        rel = path.relative_to(REPO)
        if set(rel.parts[:-1]) & SKIP_DIRS or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        keep.append(path)
    return keep


def test_no_tracker_issue_numbers_in_code_tests_recipes_or_docs() -> None:
    files = _repo_text_files()
    assert any(p.name == "modeling_looped.py" for p in files), "the walk found none of the package's files"
    hits = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if TRACKER_REF.search(line):
                hits.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not hits, "tracker numbers instead of an explanation:\n" + "\n".join(hits)


def test_the_pattern_catches_the_forms_it_is_meant_to() -> None:
    word = "issue"  # spelt apart so that this file passes its own check
    for text in (f"see {word} 8", f"{word.title()} 11, item 3", f"{word} #17's cost", f"{word}s 8 and 9"):
        assert TRACKER_REF.search(text), text
    for text in ("an issue with padding", "the issue is silent", "issued 3 requests"):
        assert not TRACKER_REF.search(text), text
