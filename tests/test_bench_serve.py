"""benchmarks/bench_serve.py without vLLM: its generate() worker, its tables and its refusals (the
vLLM sides need the serving environment and minutes of engine start-up; docs/serving.md shows a run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", REPO / "benchmarks" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_throughput_table_gives_medians_spread_and_the_target_ratios(bench) -> None:
    results = {
        "vllm_looped": {1: [90.0, 100.0, 300.0], 32: [3000.0, 3300.0, 2900.0]},
        "generate_looped": {1: [50.0, 40.0, 45.0], 32: [1000.0, 1100.0, 900.0]},
        "vllm_llama": {1: [100.0, 110.0, 120.0], 32: [3000.0, 3000.0, 3000.0]},
    }
    lines = bench.throughput_table(results).splitlines()
    assert lines[2] == "| 1 | 100 (90 .. 300) | 45 (40 .. 50) | 110 (100 .. 120) | 2.22x | 0.91 |"
    assert lines[3] == "| 32 | 3,000 (2,900 .. 3,300) | 1,000 (900 .. 1,100) | 3,000 (3,000 .. 3,000) | 3.00x | 1.00 |"


def test_the_kv_table_shows_measured_beside_expected(bench) -> None:
    row = {"r": 8, "kv_budget": 2, "slots": 6, "tokens_per_gib": 174720.0, "expected_tokens_per_gib": 174762.7}
    assert bench.kv_table([row]).splitlines()[-1] == "| 8 | 2 | 6 | 174,720 | 174,763 |"


def test_bad_sizes_are_refused_with_exit_2(bench, capsys) -> None:
    assert bench.main(["--hidden", "100"]) == 2
    assert "--hidden 100" in capsys.readouterr().err


def test_the_generate_worker_answers_each_batch(bench, tmp_path) -> None:
    """The worker protocol end to end, in the interpreter the benchmark would pick."""
    from looped_hf import LoopedConfig, LoopedForCausalLM

    config = LoopedConfig(vocab_size=64, hidden_size=32, num_attention_heads=2, num_prelude_layers=1,
                          num_recurrent_layers=1, num_coda_layers=1, num_recurrences=2)  # fmt: skip
    LoopedForCausalLM(config).save_pretrained(tmp_path / "m")
    worker = bench.GenerateWorker(bench.generate_python(None), tmp_path / "m", [[1, 2, 3], [4, 5, 6]], new_tokens=3, dtype="float32")
    try:
        rates = [worker.tokens_per_s(n) for n in (1, 2)]
    finally:
        worker.close()
    assert all(rate > 0 for rate in rates)


def test_the_depth_mix_table_gives_each_sides_spread_and_the_target_ratios(bench) -> None:
    results = {
        "mixed": {32: [6.0, 6.5, 7.0]},
        "all_deep": {32: [10.0, 9.0, 11.0]},
        "separate": {32: [6.0, 5.5, 5.0]},
        "stock": {32: [10.0, 10.0, 10.0]},
    }
    lines = bench.depth_mix_table(results, 2, 8).splitlines()
    assert lines[0].startswith("| requests | mixed r=2 + r=8 (s) | all r=8 (s) |")
    assert lines[2] == "| 32 | 6.50 (6.00 .. 7.00) | 10.00 (9.00 .. 11.00) | 5.50 (5.00 .. 6.00) | 10.00 (10.00 .. 10.00) | 0.65 | 1.18 | 1.00 |"


def test_a_shallow_depth_above_r_is_refused_with_exit_2(bench, capsys) -> None:
    assert bench.main(["--depth-mix", "--r", "4", "--shallow", "5"]) == 2
    assert "--shallow 5" in capsys.readouterr().err


def test_the_single_depth_table_gives_tokens_per_second_with_spread_and_the_ratios(bench) -> None:
    """Seconds per repeat become tokens/s (n requests x new tokens / s); ratios are of the medians."""
    results = {"default": {8: [1.0, 2.0, 1.0]}, "stock": {8: [1.0, 1.0, 1.0]}, "default_eager": {8: [2.0, 2.0, 4.0]}}
    lines = bench.single_depth_table(results, 16, compiled=True).splitlines()
    assert lines[0].startswith("| requests | default server, compiled (tokens/s) | stock worker, compiled (tokens/s) |")
    assert lines[2] == "| 8 | 128 (64 .. 128) | 128 (128 .. 128) | 64 (32 .. 64) | 1.00 | 0.50 |"
