"""lm-evaluation-harness tasks at every r, offline: a local task YAML over a local JSON dataset."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import tiny_looped_model

pytest.importorskip("lm_eval")

from looped_hf.data import load_tokenizer  # noqa: E402
from looped_hf.evaluation import evaluate_model  # noqa: E402
from looped_hf.evaluation.lm_eval_bridge import pick_metric  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DOCS = [
    {"question": "2 + 2 =", "choices": ["4", "5", "22"], "label": 0},
    {"question": "Opposite of up:", "choices": ["left", "down", "in"], "label": 1},
    {"question": "First letter:", "choices": ["z", "b", "a"], "label": 2},
    {"question": "Sky colour:", "choices": ["blue", "green", "red"], "label": 0},
    {"question": "Ice is:", "choices": ["hot", "cold", "loud"], "label": 1},
]


def _local_task(folder: Path) -> Path:
    data = folder / "toy_qa.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "toy_qa.yaml").write_text(
        "task: looped_toy_qa\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


def test_lm_eval_task_runs_at_every_r_and_fills_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # lm-eval may write caches beside the working directory
    (tmp_path / "tasks").mkdir()
    tasks_dir = _local_task(tmp_path / "tasks")
    model = tiny_looped_model(vocab_size=258, pad_token_id=257, eos_token_id=256, bos_token_id=256,
                              max_position_embeddings=512, noise=0.5)  # fmt: skip
    tokenizer = load_tokenizer("bytes")
    results = evaluate_model(
        model,
        tokenizer,
        [],
        [1, 3],
        lm_eval_tasks=["looped_toy_qa"],
        lm_eval_include=tasks_dir,
        max_per_task=4,
    )
    rows = {row["num_recurrences"]: row["tasks"]["looped_toy_qa"] for row in results["rows"]}
    for r, row in rows.items():
        assert row["metric"] == "acc" and row["num_items"] == 4
        assert 0.0 <= row["accuracy"] <= 1.0 and row["accuracy"] * 4 == pytest.approx(
            round(row["accuracy"] * 4)
        )
        assert row["mean_recurrences"] == pytest.approx(r)  # lm-eval's forwards ran at this r
        assert row["loss"] is None
    assert results["rows"][0]["bundles"]["lm_eval"]["mean_centered"] == pytest.approx(rows[1]["accuracy"])
    assert {"label": "looped_toy_qa", "group": "lm_eval", "source": "lm-eval", "metric": "acc"} in results[
        "tasks"
    ]
    assert math.isfinite(results["rows"][1]["mean_recurrences"])


def test_pick_metric_prefers_accuracy_and_skips_stderr():
    assert pick_metric({"alias": "x", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.7}) == (
        "acc",
        0.5,
    )
    assert pick_metric({"exact_match,strict": 0.25, "exact_match_stderr,strict": 0.1}) == (
        "exact_match",
        0.25,
    )
    with pytest.raises(ValueError, match="no numeric metric"):
        pick_metric({"alias": "x"})
