"""Nothing private leaves the machine: the records and cards the commands write hold no absolute
path of the working directory or the home folder (a card is published, `retrofit.json` and the run
record travel with the weights). Run from a working directory with relative paths, as a user does:
retrofit -> train (init_from, distill_from) -> test-time -> publish; every text file they write is
scanned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from test_retrofit_train import _llama_parent

from looped_hf.cli import main as looped_hf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = {".json", ".jsonl", ".yaml", ".yml", ".md", ".txt"}


def test_no_command_writes_the_working_directory_or_home_into_a_record_or_card(
    tiny_recipe, small_corpus, tmp_path, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shutil.copyfile(small_corpus, "corpus.jsonl")
    _llama_parent(Path("parent"), num_layers=4, seed=3)
    assert looped_hf(["retrofit", "parent", "--loop-in-place", "--layers", "1,2,1", "--out", "rf"]) == 0
    recipe = {k: v for k, v in tiny_recipe.items() if k not in {"hidden_size", "head_dim", "num_prelude_layers",
                                                                "num_recurrent_layers", "num_coda_layers"}}  # fmt: skip
    recipe.update(init_from="rf", distill_from="parent", dataset="corpus.jsonl", data_cache_dir="cache",
                  output_dir="run", max_steps=2, num_recurrences=2, results_file="results.jsonl")  # fmt: skip
    Path("recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert looped_hf(["train", "recipe.yaml"]) == 0
    assert (
        json.loads(Path("run/run_record.json").read_text())["parent_loss"] is not None
    )  # the parent, found by name
    assert looped_hf(["test-time", "run", "--data", "corpus.jsonl", "--seq-len", "32", "--eval-blocks", "2",
                      "--max-factor", "1"]) == 0  # fmt: skip
    assert looped_hf(["publish", "run", "--repo-id", "me/rf", "--out", "pub"]) == 0
    private = {str(work), str(work.resolve()), str(Path.home())}
    written = [
        p for p in Path(".").rglob("*") if p.is_file() and p.suffix in TEXT and p.parts[0] not in ("cache",)
    ]
    assert {"rf/retrofit.json", "rf/README.md", "run/run_record.json", "pub/README.md"} <= {
        str(p) for p in written
    }
    leaks = {str(p): sorted(s for s in private if s in p.read_text(errors="replace")) for p in written}
    assert not {p: found for p, found in leaks.items() if found}, leaks
