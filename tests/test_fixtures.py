"""The test data is in the repository, intact, accounted for, and small.

Every folder under tests/fixtures is one set with a PROVENANCE.md that says what made it, from which
code, under which licence, and lists every file with its size and sha256 in a table:

    | file | bytes | sha256 |
    |---|---|---|
    | `sub/dir/name.ext` | 1,234 | <64 hex digits> |

A missing, changed or unlisted file fails here; a test that names a missing fixture fails through
``conftest.fixture_path`` (never skips), so a checkout without the data cannot pass by running less.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO, fixture_path

#: The repository's budget for all test data together (a fresh clone stays small). 12 MiB since the
#: published looped LMs' tiny checkpoints (zoo/, about 3.3 MB with Ouro's) joined the study's 6.4 MB;
#: 14 MiB with this year's (zoo2/: Parcae's 1.0 MB).
BUDGET_BYTES = 14 * 1024 * 1024
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([\d,]+)\s*\|\s*([0-9a-f]{64})\s*\|\s*$")
SETS = sorted(p for p in FIXTURES.iterdir() if p.is_dir()) if FIXTURES.is_dir() else []
# The older test data with saved models carries its provenance too (the sweep recipe beside it is code).
SETS.append(REPO / "tests" / "data" / "v0_1_0")
#: The sets the tests need: each must be present (a clone without one fails here, by name).
REQUIRED = ("chinchilla", "study_checkpoints", "study_plan", "study_prepacked")


def listed_files(provenance: Path) -> dict[str, tuple[int, str]]:
    """``{relative path: (bytes, sha256)}`` from the ``## Files`` table of a PROVENANCE.md; a table
    row that does not parse fails with its line number, so a typo cannot drop a file from the check."""
    listed: dict[str, tuple[int, str]] = {}
    in_files = False
    for number, line in enumerate(provenance.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("## "):
            in_files = line.strip().lower() == "## files"
            continue
        if not in_files or not line.startswith("|") or line.startswith(("| file ", "|---")):
            continue
        match = ROW.match(line)
        if match is None:
            pytest.fail(f"{provenance}:{number}: not a `| \\`path\\` | bytes | sha256 |` row: {line!r}")
        name, size, digest = match.groups()
        if name in listed:
            pytest.fail(f"{provenance}:{number}: {name} is listed twice")
        listed[name] = (int(size.replace(",", "")), digest)
    return listed


def test_the_sets_the_tests_need_are_all_present() -> None:
    for name in REQUIRED:
        fixture_path(name, "PROVENANCE.md")


@pytest.mark.parametrize("folder", SETS, ids=[p.name for p in SETS])
def test_each_set_lists_every_file_with_its_sha256_and_says_where_it_came_from(folder: Path) -> None:
    provenance = folder / "PROVENANCE.md"
    assert provenance.is_file(), (
        f"{folder} has no PROVENANCE.md (what made it, from which code, licence, sha256)"
    )
    text = provenance.read_text(encoding="utf-8")
    assert re.search(r"licen[cs]e", text, re.IGNORECASE), f"{provenance} does not state a licence"
    if folder.name in REQUIRED:  # made by, or copied from, code outside this repository
        assert re.search(r"\b[0-9a-f]{40}\b", text), (
            f"{provenance} does not name the commit its data came from"
        )
    listed = listed_files(provenance)
    assert listed, f"{provenance} has no ## Files table"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"PROVENANCE.md"}
    missing, unlisted = sorted(set(listed) - present), sorted(present - set(listed))
    assert not missing, f"{provenance} lists files that are missing: {missing}"
    assert not unlisted, f"files in {folder} that its PROVENANCE.md does not list: {unlisted}"
    for name, (size, digest) in listed.items():
        data = (folder / name).read_bytes()
        assert len(data) == size, f"{folder / name}: {len(data)} bytes, PROVENANCE.md says {size}"
        assert hashlib.sha256(data).hexdigest() == digest, (
            f"{folder / name}: sha256 differs from PROVENANCE.md"
        )


def test_all_test_data_fits_the_budget() -> None:
    """tests/fixtures and the older tests/data (saved v0.1.0 models, a sweep recipe) together."""
    folders = [FIXTURES, REPO / "tests" / "data"]
    total = sum(p.stat().st_size for folder in folders for p in folder.rglob("*") if p.is_file())
    assert total < BUDGET_BYTES, (
        f"tests/fixtures + tests/data hold {total:,} bytes, over the {BUDGET_BYTES:,} budget"
    )


def test_each_study_checkpoint_records_the_sha256_of_its_weights() -> None:
    """reference.json ties the logits to the exact weights they were computed from."""
    folders = sorted(p for p in fixture_path("study_checkpoints").iterdir() if p.is_dir())
    assert len(folders) == 6
    for folder in folders:
        ref = json.loads((folder / "reference.json").read_text())
        weights = (folder / ref["checkpoint"]["model"]).read_bytes()
        assert hashlib.sha256(weights).hexdigest() == ref["checkpoint"]["model_sha256"], folder.name


def test_a_missing_fixture_fails_the_test_that_names_it() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"test fixture .*no_such_set.*missing.*PROVENANCE\.md"):
        fixture_path("no_such_set", "data.csv")


def test_no_test_reads_data_from_outside_the_repository() -> None:
    """The tests read tests/fixtures only; a folder beside the checkout is not part of a clone."""
    outside = [r"parents\[2\]", r"\.parent\s*/\s*\"shared\"", r"\"shared\"\s*/\s*\"data\"", r"\.\./shared",
               r"shared/data"]  # fmt: skip
    hits = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if any(re.search(p, line) for p in outside):
                hits.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not hits, "tests that read data from outside the repository:\n" + "\n".join(hits)


def _generator():
    """scripts/make_study_fixtures.py as a module (scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_study_fixtures", REPO / "scripts" / "make_study_fixtures.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_generator_describes_exactly_the_committed_checkpoints(capsys) -> None:
    """Every folder is a variant of scripts/make_study_fixtures.py with that variant's config, so the
    script in the repository is the one that made the data (it needs the study's code to run)."""
    gen = _generator()
    folders = {p.name for p in fixture_path("study_checkpoints").iterdir() if p.is_dir()}
    assert {v.name for v in gen.VARIANTS} == folders
    for v in gen.VARIANTS:
        meta = json.loads(fixture_path("study_checkpoints", v.name, "meta_000020.json").read_text())
        mc = meta["model_config"]
        assert (mc["n_embd"], mc["n_embd"] // mc["n_head"], mc["vocab_size"], mc["sequence_len"]) == (
            gen.WIDTH, gen.HEAD_DIM, v.vocab_size, gen.SEQ_LEN)  # fmt: skip
        assert (mc["n_prelude"], mc["n_recur_block"], mc["n_coda"], mc["num_recur"], mc["bptt_k"]) == (
            v.n_prelude, v.n_recur_block, v.n_coda, v.num_recur, v.bptt_k)  # fmt: skip
        assert mc["input_injection"] == v.input_injection and meta["user_config"]["model_tag"] == v.name
        assert meta["tokens"] == gen.STEPS * gen.BATCH * gen.SEQ_LEN
        extras = {f"logits_num_recur_{r}" for r in v.extra_num_recur} | {
            f"logits_kv_budget_{k}" for k in v.extra_kv_budget}  # fmt: skip
        ref = json.loads(fixture_path("study_checkpoints", v.name, "reference.json").read_text())
        assert set(ref["extra_logits"]) == extras
    assert gen.main([]) == 2  # without the study's code it says what it needs and writes nothing
    assert "--study-src DIR is required" in capsys.readouterr().err
