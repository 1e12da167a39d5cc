"""benchmarks/gpu_check.py: the one prepared GPU command, rehearsed on CPU with --tiny."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import load_benchmark

from looped_hf import LoopedForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")


gpu_check = load_benchmark("gpu_check")


@pytest.mark.slow
def test_tiny_check_runs_every_section_and_reports_mfu_from_the_models_own_flops(
    tmp_path, capsys, fresh_dynamo
):
    # In this process, as the other tests here call it: a subprocess would only add ~10 s of imports.
    out = tmp_path / "gc"
    peak = 1e12
    rc = gpu_check.main(["--out", str(out), "--tiny", "--peak-flops", str(peak)])
    printed = capsys.readouterr().out
    assert rc == 0, printed[-3000:]
    assert "[micro_sweep] start" in printed  # progress is printed as it goes
    result = json.loads((out / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["environment", "logits", "train_eager", "trainer_overhead", "decode", "micro_sweep",
                              "train_compiled", "decode_compiled"]  # fmt: skip
    assert {name: sec["status"] for name, sec in sections.items()} == dict.fromkeys(sections, "ok")

    logits = sections["logits"]
    assert {r["backend"] for r in logits["rows"]} == {"eager", "sdpa"} and logits["all_agree"]
    assert 0 < logits["rows"][0]["rel_l2_vs_fp32"] < 0.05  # bf16 differs from fp32, but not by much

    sizes = gpu_check.TINY
    with torch.device("meta"):
        loop_fpt = LoopedForCausalLM(gpu_check.loop4_config(sizes)).training_flops_per_token(sizes.seq_len)
    for name in ("train_eager", "train_compiled"):
        rows = {r["model"]: r for r in sections[name]["rows"]}
        assert set(rows) == {"loop4", "llama20"}
        assert rows["loop4"]["flops_per_token"] == loop_fpt
        for row in rows.values():
            assert row["tokens_per_s"] > 0 and row["peak_memory_gib"] is None  # CPU: no CUDA allocator
            assert row["mfu"] == pytest.approx(row["flops_per_token"] * row["tokens_per_s"] / peak)
            assert row["attention"] == "sdpa"  # what apply_attention_backend picks without CUDA
            assert 1 <= len(row["kernels"]) <= gpu_check.TOP_KERNELS and row["kernels"][0]["ms"] > 0
    assert [r["compiled"] for r in sections["train_compiled"]["rows"]] == ["eager", "eager"]  # tiny: dynamo only

    overhead = sections["trainer_overhead"]["rows"]
    assert len(overhead) == 2 and all(r["trainer_step_ms"] > 0 and r["bare_step_ms"] > 0 for r in overhead)
    for r in overhead:
        assert r["overhead_ms"] == pytest.approx(r["trainer_step_ms"] - r["bare_step_ms"])
        assert r["looped_overhead_ms"] == pytest.approx(r["looped_trainer_step_ms"] - r["bare_step_ms"])

    decode = {r["setting"]: r for r in sections["decode"]["rows"]}
    assert set(decode) == {"plain r=4", "kv_budget=1", "exit kl 1e-3", "self-draft k=1"}
    drafted = decode["self-draft k=1"]
    assert drafted["identical_to_plain"] and 0 <= drafted["acceptance"] <= 1  # fp32 on the CPU: identical
    assert drafted["greedy_within_rounding"] and drafted["agree_until"] == gpu_check.TINY.decode_new
    assert 1 <= decode["exit kl 1e-3"]["mean_recurrences"] <= 4
    compiled = {r["setting"]: r for r in sections["decode_compiled"]["rows"]}
    assert set(compiled) == {"loop4 r=4", "loop4 r=4 kv_budget=1", "llama20"}
    assert all(r["graphs"] > 0 and r["tokens_per_s"] > 0 for r in compiled.values())  # really compiled
    assert compiled["loop4 r=4"]["same_as_eager"] and compiled["loop4 r=4 kv_budget=1"]["greedy_within_rounding"]
    assert sections["decode_compiled"]["loop4_over_llama"] == pytest.approx(compiled["loop4 r=4"]["vs_llama"])

    sweep = sections["micro_sweep"]
    assert len(sweep["runs"]) == 8 and all(r["status"] == "ok" and r["s_per_step"] > 0 for r in sweep["runs"])
    assert set(sweep["fit"]["params"]) >= {"E", "A", "alpha", "B", "beta", "phi"}
    assert len((out / "micro_sweep_results.jsonl").read_text().splitlines()) == 8
    assert json.loads((out / "micro_sweep_fit.json").read_text())["params"]["phi"] == sweep["fit"]["params"]["phi"]

    md = (out / "gpu_check.md").read_text()
    for name in sections:
        assert f"## {name}: ok" in md
    assert "| loop4 |" in md and "Tolerance:" in md


def test_time_guard_skips_what_does_not_fit_and_says_so(tmp_path):
    rc = gpu_check.main(["--out", str(tmp_path), "--tiny", "--time-limit", "0.001"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 1
    for name in ("logits", "train_eager", "decode", "micro_sweep", "train_compiled"):
        assert result["sections"][name]["status"] == "skipped"
        assert "time guard" in result["sections"][name]["reason"]
    assert "## micro_sweep: skipped" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    def broken(rec, sizes, device):
        rec["rows"] = [{"backend": "eager"}]
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(gpu_check, "logits_agreement", broken)
    rc = gpu_check.main(["--out", str(tmp_path), "--tiny", "--only", "logits", "--only", "train_eager"])
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert rc == 1
    assert sections["logits"]["status"] == "error" and sections["logits"]["error"] == "RuntimeError: no such kernel"
    assert sections["logits"]["rows"] == [{"backend": "eager"}]  # what ran before the error is kept
    assert sections["train_eager"]["status"] == "ok" and len(sections["train_eager"]["rows"]) == 2
    assert "decode" not in sections


def test_the_time_guard_interrupts_a_section_that_overruns(tmp_path):
    check = gpu_check.Check(tmp_path, time_limit=0.3, tiny=True)

    def spin(rec):
        rec["started"] = True
        end = time.perf_counter() + 10
        while time.perf_counter() < end:
            pass

    t0 = time.perf_counter()
    check.section("spin", spin, min_s=0)
    assert time.perf_counter() - t0 < 3
    sec = check.result["sections"]["spin"]
    assert sec["status"] == "error" and "time guard" in sec["error"] and sec["started"]


def test_llama_flops_come_from_a_plain_looped_twin_of_its_exact_shape():
    sizes = gpu_check.TINY
    config = gpu_check.llama_config(sizes)
    assert config.intermediate_size == 256  # 8 x 64 / 3 = 171, rounded up to 256
    with torch.device("meta"):
        llama = gpu_check.LlamaForCausalLM(config)
    # The study's count: every weight but the embedding and the model-level final norm (in-layer norms count).
    dense = sum(p.numel() for n, p in llama.named_parameters() if n not in ("model.embed_tokens.weight",
                                                                              "model.norm.weight"))
    attention = 12 * sizes.width * sizes.seq_len * config.num_hidden_layers  # 12 h q T per layer
    assert gpu_check.llama_flops_per_token(config, sizes.seq_len) == 6 * dense + attention
    assert gpu_check.llama_ffn(640) == 1792


@pytest.mark.slow
def test_the_study_comparison_section_with_study_src(tmp_path):
    """``--study-src`` adds ``vs_study``: three sides at the check's width, tokens/s, MFU, phases
    and each side's top kernels, in the JSON and the markdown (a stand-in for the study's
    nanochat package here; its code is never in this repository)."""
    from test_bench_vs_study import write_fake_study

    study_src = write_fake_study(tmp_path / "study")
    out = tmp_path / "gc"
    argv = ["--out", str(out), "--tiny", "--only", "vs_study", "--study-src", str(study_src), "--peak-flops", "1e10"]
    assert gpu_check.main(argv) == 0
    sec = json.loads((out / "gpu_check.json").read_text())["sections"]["vs_study"]
    assert sec["status"] == "ok" and sec["shape"]["width"] == gpu_check.TINY.width
    rows = {r["side"]: r for r in sec["rows"]}
    assert set(rows) == {"study", "study core", "looped_hf", "bare"}
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows.values())
    assert set(rows["study"]["phases_ms"]) == {"fwd", "bwd", "stats", "opt"}
    assert set(sec["kernels"]) == {"study", "looped_hf", "bare"}
    assert sec["looped_hf_over_study"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "looped_hf / study tokens/s" in md and "Top of one profiled study step" in md


def test_a_study_src_without_nanochat_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "gc"), "--tiny", "--study-src", str(tmp_path)])
