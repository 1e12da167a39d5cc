"""benchmarks/bench_vs_study.py keeps running: its Trainer-cost table (no study code needed) wraps
private Trainer methods, which a transformers release may move."""

from __future__ import annotations

import json

import pytest
import transformers
from conftest import load_benchmark
from transformers.trainer_callback import CallbackHandler

from looped_hf.trainer import LoopedTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_trainer_cost_table_runs_and_leaves_the_trainer_classes_as_they_were(tmp_path, capsys):
    bench = load_benchmark("bench_vs_study")
    before = {cls: dict(vars(cls)) for cls in (transformers.Trainer, LoopedTrainer, CallbackHandler)}
    out = tmp_path / "numbers.json"
    assert bench.main(["--overhead-only", "--overhead-steps", "3", "--overhead-rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LoopedTrainer" in printed and "transformers.Trainer" in printed and "of the paper step" in printed
    numbers = json.loads(out.read_text())
    classes = numbers["overhead"]["classes"]
    assert set(classes) == {"LoopedTrainer", "transformers.Trainer"}
    for name, c in classes.items():
        assert set(c["parts_ms"]) == set(bench.PartTimers.PARTS)
        assert c["parts_ms"]["batch fetch (get_batch_samples)"] > 0, name
    # The vanilla Trainer computes the gradient norm every step; LoopedTrainer's timer sees a call
    # that returns at once (no logging step among the timed ones).
    assert classes["transformers.Trainer"]["parts_ms"]["grad norm (_get_grad_norm)"] > 0
    assert {cls: dict(vars(cls)) for cls in before} == before  # every wrapper removed


def test_without_the_study_it_says_what_it_needs(capsys):
    assert load_benchmark("bench_vs_study").main([]) == 0
    assert "--study-src DIR" in capsys.readouterr().out
