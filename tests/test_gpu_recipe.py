"""recipes/iso_depth_gpu.yaml: its plan keeps the sizing its comment promises, and one of its runs,
shrunk to seconds (fp32, CPU, a tiny budget and width), trains through the unchanged sweep runner."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from looped_hf.sweep import default_jobs, main, make_plan, run_sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "iso_depth_gpu.yaml"
#: Training tokens of the embedded corpus with its BPE (looped_hf.data: ~4.0M at vocab 4096).
CORPUS_TOKENS = 4.0e6


@pytest.fixture(scope="module")
def plan():
    return make_plan(RECIPE)


def test_plan_is_the_documented_iso_depth_grid(plan):
    assert len(plan.runs) == 48 and plan.tokens_per_step == 64 * 256 and plan.vocab_size == 4096
    assert {r.effective_num_layers for r in plan.runs} == {10}
    assert {r.arch for r in plan.runs} == {"base", "loop2", "loop4", "loop8"}
    assert plan.base_recipe["optimizer"] == "muonh" and plan.base_recipe["bf16"] is True
    # The comment's totals: 2.8e15 FLOPs, 22,084 steps.
    assert sum(r.flops for r in plan.runs) == pytest.approx(2.8e15, rel=0.01)
    assert sum(r.steps for r in plan.runs) == 22_084


def test_widths_straddle_the_compute_optimum_within_four_passes(plan):
    for b, budget in enumerate(plan.sweep.budgets):
        base = sorted((r for r in plan.runs if r.budget_index == b and r.num_recurrences == 1),
                      key=lambda r: r.hidden_size)  # fmt: skip
        per_param = [r.tokens / (r.n_once + r.n_rec) for r in base]
        assert per_param == sorted(per_param, reverse=True), budget  # wider: fewer tokens per parameter
        assert 10 <= per_param[1] <= 25, (budget, per_param)  # the second width near the optimum
        assert per_param[0] > 20 and per_param[-1] < 8, (budget, per_param)  # both sides of it
    passes = max(r.tokens for r in plan.runs) / CORPUS_TOKENS
    assert passes <= 4.0, passes
    assert min(r.steps for r in plan.runs) >= 150  # every run has enough steps for its schedule


def test_dry_run_prints_the_plan_on_a_cpu_machine(capsys):
    assert main([str(RECIPE), "--dry-run"]) == 0  # bf16 / tf32 do not stop planning without a GPU
    out = capsys.readouterr().out
    assert "48 runs (base 12, loop2 12, loop4 12, loop8 12)" in out
    assert "loop8-w112-b2" in out and "default --jobs here:" in out


def test_default_jobs_share_a_16_core_gpu_machine_four_ways(plan, monkeypatch):
    from looped_hf.sweep import runner as sweep_runner

    monkeypatch.setattr(sweep_runner, "available_cores", lambda: 16)
    assert default_jobs(plan) == 4


def test_one_run_shrunk_to_seconds_trains_on_cpu(small_corpus: Path, data_cache: Path, tmp_path: Path):
    recipe = yaml.safe_load(RECIPE.read_text())
    # The same recipe with the GPU-only parts and the size taken out: fp32 on CPU, a width of 32,
    # r = 2, a budget of 4 steps of 4 x 256 tokens, a ~120 KB slice of the corpus.
    recipe["sweep"].update(budgets=[1.0e10], widths=[32], recurrences=[2], output_dir=str(tmp_path / "sweep"))
    recipe.update(bf16=False, tf32=False, torch_num_threads=1, dataset=str(small_corpus),
                  data_cache_dir=str(data_cache), eval_blocks=4, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4)  # fmt: skip
    lines: list[str] = []
    records = run_sweep(recipe, log=lines.append, jobs=1)
    assert len(records) == 1, lines
    record = records[0]
    assert record["status"] == "ok", record.get("error")
    assert record["run_id"] == "loop2-w32-b0" and record["num_recurrences"] == 2
    assert record["effective_num_layers"] == 10 and record["config"]["num_recurrent_layers"] == 4
    assert record["tokens"] == record["max_steps"] * 4 * 256 and record["train_flops"] >= 1.0e10
    assert math.isfinite(record["loss"]) and record["loss"] < math.log(4096) + 1  # trained, not diverged
    assert record["recipe"]["optimizer"] == "muonh"
