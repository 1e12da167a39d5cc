"""The sweep runner: atomic results, resume after SIGKILL, failures recorded, submitit executor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
import yaml
from conftest import PYTHON, REPO, subprocess_env

from looped_hf import sweep as sweep_module
from looped_hf.sweep import append_jsonl, make_plan, read_jsonl, run_sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sweep_recipe(tiny_recipe: dict, tmp_path, **sweep) -> dict:
    """A 4-run sweep of depth-4 models: r in {1, 2} x 2 budgets, ~16-40 steps each."""
    drop = ("max_steps", "output_dir", "hidden_size", "head_dim", "num_prelude_layers", "num_recurrent_layers",
            "num_coda_layers", "num_recurrences", "save_strategy")  # fmt: skip
    base = {k: v for k, v in tiny_recipe.items() if k not in drop}
    section = {"effective_depth": 4, "prelude": 1, "coda": 1, "recurrences": [1, 2], "head_dim": 16,
               "budgets": [6e8, 1.2e9], "widths": [32], "checkpoints_per_run": 4,
               "output_dir": str(tmp_path / "sweep")}  # fmt: skip
    section.update(sweep)
    return {"sweep": section, **base}


def test_append_is_atomic_and_a_torn_tail_is_repaired(tmp_path):
    path = tmp_path / "results.jsonl"
    assert append_jsonl(path, {"run_id": "a", "loss": 1.0})
    with open(path, "ab") as fh:
        fh.write(b'{"run_id": "b", "lo')  # a writer killed mid-line
    assert [r["run_id"] for r in read_jsonl(path)] == ["a"]
    assert append_jsonl(path, {"run_id": "b", "loss": 2.0})
    assert not append_jsonl(path, {"run_id": "a", "loss": 3.0})  # each run once
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["run_id"] for x in lines[:-1]] == ["a", "b"]


def test_plan_is_iso_depth_and_on_budget(tiny_recipe, tmp_path):
    plan = make_plan(_sweep_recipe(tiny_recipe, tmp_path))
    assert [r.run_id for r in plan.runs] == ["base-w32-b0", "loop2-w32-b0", "base-w32-b1", "loop2-w32-b1"]
    assert {r.effective_num_layers for r in plan.runs} == {4}
    for run in plan.runs:
        assert run.budget <= run.flops < run.budget + run.flops_per_token * plan.tokens_per_step


def test_sweep_killed_mid_run_resumes_and_records_each_run_once(tiny_recipe, tmp_path):
    recipe = _sweep_recipe(tiny_recipe, tmp_path)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(recipe))
    sweep_dir = tmp_path / "sweep"
    results = sweep_dir / "results.jsonl"
    proc = subprocess.Popen([PYTHON, "-m", "looped_hf.sweep", str(path)], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    killed_in = None
    deadline = time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            if read_jsonl(results):
                # Kill once a later run has a checkpoint but no record yet: mid-run.
                for run_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
                    ckpts = run_dir / "checkpoints"
                    if ckpts.is_dir() and any(ckpts.glob("checkpoint-*/trainer_state.json")):
                        if not (run_dir / "run_record.json").exists():
                            killed_in = run_dir.name
                            break
            if killed_in:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None and not killed_in:
            proc.kill()
        proc.wait()
    assert killed_in, "the sweep finished before it could be killed mid-run"
    before = {r["run_id"] for r in read_jsonl(results)}
    assert killed_in not in before and len(before) < 4
    with open(results, "ab") as fh:
        fh.write(b'{"run_id": "torn')  # as if a writer had also died mid-line

    records = run_sweep(path, log=lambda _: None)
    assert [r["run_id"] for r in records] == [r.run_id for r in make_plan(path).runs]
    lines = results.read_text().splitlines()
    ids = [json.loads(line)["run_id"] for line in lines]  # every line is valid JSON
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 4
    assert all(r["status"] == "ok" for r in records)
    resumed = next(r for r in records if r["run_id"] == killed_in)
    assert resumed["resumed_from"] and "checkpoint-" in resumed["resumed_from"]
    assert resumed["tokens"] == resumed["max_steps"] * resumed["tokens_per_step"]
    # A third invocation has nothing left to do.
    assert len(run_sweep(path, log=lambda _: None)) == 4 and len(results.read_text().splitlines()) == 4


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tiny_recipe, tmp_path, monkeypatch):
    original = sweep_module._run_inprocess

    def flaky(recipe_path):
        if recipe_path.parent.name == "loop2-w32-b0":
            raise torch.OutOfMemoryError("simulated out of memory")
        return original(recipe_path)

    monkeypatch.setattr(sweep_module, "_run_inprocess", flaky)
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0)
    records = run_sweep(recipe, log=lambda _: None)
    by_id = {r["run_id"]: r for r in records}
    assert by_id["loop2-w32-b0"]["status"] == "failed" and "out of memory" in by_id["loop2-w32-b0"]["error"]
    assert by_id["base-w32-b0"]["status"] == "ok"
    # The failed record still carries the fit's keys.
    assert by_id["loop2-w32-b0"]["n_rec"] > 0 and by_id["loop2-w32-b0"]["budget"] == 6e8


def test_submitit_executor_runs_jobs_with_the_local_cluster(tiny_recipe, tmp_path, monkeypatch):
    pytest.importorskip("submitit")
    env = subprocess_env()
    for key in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, env[key])
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], recurrences=[2], checkpoints_per_run=0,
                           executor="submitit", submitit={"cluster": "local", "timeout_min": 5})  # fmt: skip
    records = run_sweep(recipe, log=lambda _: None)
    assert len(records) == 1 and records[0]["status"] == "ok", records
    sweep_dir = tmp_path / "sweep"
    assert (sweep_dir / "loop2-w32-b0" / "job_id").exists()
    assert any((sweep_dir / "submitit").iterdir())
    assert len(read_jsonl(sweep_dir / "results.jsonl")) == 1  # the job appended; the runner did not again


def test_accelerate_executor_runs_each_run_on_two_processes(tiny_recipe, tmp_path, monkeypatch):
    env = subprocess_env()
    for key in ("PYTHONPATH", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "OMP_NUM_THREADS"):
        monkeypatch.setenv(key, env[key])
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], recurrences=[2], checkpoints_per_run=0,
                           executor="accelerate", num_processes=2)  # fmt: skip
    plan = make_plan(recipe)
    records = run_sweep(recipe, log=lambda _: None)
    assert len(records) == 1 and records[0]["status"] == "ok", records
    assert records[0]["num_processes"] == 2 and plan.tokens_per_step == 2 * 4 * 32
    assert records[0]["tokens"] == plan.runs[0].tokens  # the plan's steps, on both processes
    assert (tmp_path / "sweep" / "loop2-w32-b0" / "train.log").exists()
