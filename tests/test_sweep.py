"""The sweep runner: atomic results, resume after SIGKILL (one run or N at once), failures recorded,
run locks, the console, submitit / accelerate executors."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
import yaml
from conftest import PYTHON, REPO, subprocess_env

from looped_hf import sweep as sweep_module
from looped_hf.fileio import write_json_atomic
from looped_hf.sweep import append_jsonl, default_jobs, make_plan, read_jsonl, run_sweep
from looped_hf.sweep import console as sweep_console
from looped_hf.sweep import runner as sweep_runner

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


def _locks_free(sweep_dir, timeout: float) -> bool:
    """Whether every run lock of the sweep is free within `timeout` s (no process trains a run)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(sweep_module._read_lock_free(p) for p in sweep_dir.iterdir() if p.is_dir()):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("jobs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sweep_killed_mid_run_resumes_and_records_each_run_once(tiny_recipe, tmp_path, jobs):
    recipe = _sweep_recipe(tiny_recipe, tmp_path)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(recipe))
    sweep_dir = tmp_path / "sweep"
    results = sweep_dir / "results.jsonl"
    proc = subprocess.Popen([PYTHON, "-m", "looped_hf.sweep", str(path), "--jobs", str(jobs)], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
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
    # Its workers (jobs=2) notice that the sweep is gone and exit, releasing their run locks.
    assert _locks_free(sweep_dir, timeout=10), "a process still trains a run of the killed sweep"
    before = {r["run_id"] for r in read_jsonl(results)}
    assert killed_in not in before and len(before) < 4
    # With workers (jobs=2) the run may still finish in the instant between the sweep's death and
    # its worker's: then it left a complete record that only the sweep had not yet appended.
    finished_by_worker = (sweep_dir / killed_in / "run_record.json").exists()
    if jobs == 1:
        assert not finished_by_worker  # in process, the run died with the sweep
    with open(results, "ab") as fh:
        fh.write(b'{"run_id": "torn')  # as if a writer had also died mid-line

    records = run_sweep(path, log=lambda _: None, jobs=jobs)
    assert [r["run_id"] for r in records] == [r.run_id for r in make_plan(path).runs]
    lines = results.read_text().splitlines()
    ids = [json.loads(line)["run_id"] for line in lines]  # every line is valid JSON
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 4
    assert all(r["status"] == "ok" for r in records)
    resumed = next(r for r in records if r["run_id"] == killed_in)
    if not finished_by_worker:
        assert resumed["resumed_from"] and "checkpoint-" in resumed["resumed_from"]
    assert resumed["tokens"] == resumed["max_steps"] * resumed["tokens_per_step"]
    # A third invocation has nothing left to do.
    assert len(run_sweep(path, log=lambda _: None, jobs=jobs)) == 4 and len(results.read_text().splitlines()) == 4


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tiny_recipe, tmp_path, monkeypatch):
    original = sweep_module._run_inprocess

    def flaky(recipe_path, callbacks=None):
        if recipe_path.parent.name == "loop2-w32-b0":
            raise torch.OutOfMemoryError("simulated out of memory")
        return original(recipe_path, callbacks)

    monkeypatch.setattr(sweep_runner, "_run_inprocess", flaky)
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0)
    records = run_sweep(recipe, log=lambda _: None)
    by_id = {r["run_id"]: r for r in records}
    assert by_id["loop2-w32-b0"]["status"] == "failed" and "out of memory" in by_id["loop2-w32-b0"]["error"]
    assert by_id["base-w32-b0"]["status"] == "ok"
    # The failed record still carries the fit's keys.
    assert by_id["loop2-w32-b0"]["n_rec"] > 0 and by_id["loop2-w32-b0"]["budget"] == 6e8


@pytest.mark.slow  # several processes: minutes on a busy 2-core machine; CI runs it
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


@pytest.mark.slow  # several processes: minutes on a busy 2-core machine; CI runs it
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


@pytest.mark.slow
def test_jobs_2_trains_in_workers_and_gives_the_same_records_as_jobs_1(tiny_recipe, tmp_path):
    one = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0, output_dir=str(tmp_path / "one"))
    two = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0, output_dir=str(tmp_path / "two"))
    lines_one, lines_two = [], []
    by_one = {r["run_id"]: r for r in run_sweep(one, log=lines_one.append, jobs=1)}
    by_two = {r["run_id"]: r for r in run_sweep(two, log=lines_two.append, jobs=2)}
    assert "1 at once" in lines_one[0] and "2 at once in worker processes" in lines_two[0]
    # Two workers were started: the second only because the first was busy with a run.
    assert (tmp_path / "two" / "worker-0.log").is_file() and (tmp_path / "two" / "worker-1.log").is_file()
    assert set(by_one) == set(by_two) == {"base-w32-b0", "loop2-w32-b0"}
    for run_id, record in by_one.items():
        other = by_two[run_id]
        assert record["status"] == other["status"] == "ok"
        for key in ("loss", "tokens", "train_flops", "n_once", "n_rec", "max_steps"):
            assert other[key] == record[key], (run_id, key)  # same seed, one thread: bit-identical
    assert len(read_jsonl(tmp_path / "two" / "results.jsonl")) == 2


def test_a_run_locked_by_another_process_is_waited_for_not_trained_twice(tiny_recipe, tmp_path):
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0)
    sweep_dir = tmp_path / "sweep"
    held = make_plan(recipe, sweep_dir).runs[0]
    run_dir = sweep_dir / held.run_id
    lock = sweep_module._try_lock(run_dir)  # as if another sweep were training this run right now
    assert lock is not None and sweep_module._try_lock(run_dir) is None

    def the_other_process_finishes():
        write_json_atomic(run_dir / "run_record.json", {"run_id": held.run_id, "status": "ok", "loss": 9.5})
        sweep_module._unlock(lock)

    timer = threading.Timer(2.0, the_other_process_finishes)
    timer.start()
    lines = []
    try:
        records = {r["run_id"]: r for r in run_sweep(recipe, log=lines.append, jobs=1)}
    finally:
        timer.cancel()
    assert f"[sweep] {held.run_id} is being trained by another process (pid {os.getpid()})" in "\n".join(lines)
    assert records[held.run_id]["loss"] == 9.5  # recorded from the other process, not retrained
    assert not (run_dir / "model.safetensors").exists()
    assert all(r["status"] == "ok" for r in records.values()) and len(records) == 2
    assert len(read_jsonl(sweep_dir / "results.jsonl")) == 2


def test_run_output_goes_to_train_log_and_one_line_per_run_to_the_console(tiny_recipe, tmp_path, capfd):
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0)
    lines = []
    run_sweep(recipe, log=lines.append, jobs=1)
    out, err = capfd.readouterr()
    assert "'loss'" not in out + err and "pin_memory" not in out + err  # nothing of the runs on the console
    assert len(lines) == 3 and lines[0].startswith("[sweep] ") and "each run's log: <run>/train.log" in lines[0]
    assert lines[1].startswith("[sweep] 1/2 runs done (0 failed) | base-w32-b0: ok, loss ")
    assert lines[2].startswith("[sweep] 2/2 runs done (0 failed) | loop2-w32-b0: ok, loss ") and "ETA" in lines[2]
    log = (tmp_path / "sweep" / "base-w32-b0" / "train.log").read_text()
    assert "{'loss': " in log  # the Trainer's log lines are kept, in the run directory
    assert "pin_memory" not in log  # the cause is fixed: no pinned memory is asked for without a GPU
    progress = json.loads((tmp_path / "sweep" / "base-w32-b0" / "progress.json").read_text())
    assert progress["step"] == progress["max_steps"] > 0 and progress["loss"] > 0


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_live_line_and_verbose_brings_the_logs_back(tiny_recipe, tmp_path, monkeypatch):
    terminal = _FakeTerminal()
    monkeypatch.setattr(sweep_console, "_console_stream", lambda: (terminal, False))
    monkeypatch.setenv("TERM", "xterm")
    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0)
    run_sweep(recipe, jobs=1)
    shown = terminal.getvalue()
    assert shown.count("\n") == 2  # the header, and the live line's last state; ok runs get no line of their own
    last = shown.rstrip("\n").split("\r")[-1]
    assert last.startswith("[sweep] ████████████████ 100%  2/2 runs |") and "ETA 0m00s" in last
    assert "loop2-w32-b0 0%" in shown  # the running run was named while it ran
    assert "'loss'" not in shown

    terminal = _FakeTerminal()
    monkeypatch.setattr(sweep_console, "_console_stream", lambda: (terminal, False))
    verbose = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8], checkpoints_per_run=0,
                            output_dir=str(tmp_path / "verbose"))  # fmt: skip
    run_sweep(verbose, jobs=1, verbose=True)
    shown = terminal.getvalue()
    assert "[base-w32-b0] {'loss': " in shown and "\r[sweep]" not in shown  # run logs, prefixed; no live line
    assert "[sweep] 2/2 runs done" in shown
    assert "{'loss': " in (tmp_path / "verbose" / "base-w32-b0" / "train.log").read_text()  # still logged


def test_default_jobs_fills_the_cores_one_thread_per_run(tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setattr(sweep_runner, "available_cores", lambda: 16)
    plain = make_plan(_sweep_recipe(tiny_recipe, tmp_path))
    assert default_jobs(plain) == 1  # torch would use every core in each run
    assert default_jobs(make_plan(_sweep_recipe({**tiny_recipe, "torch_num_threads": 1}, tmp_path))) == 16
    assert default_jobs(make_plan(_sweep_recipe({**tiny_recipe, "torch_num_threads": 3}, tmp_path))) == 5
    monkeypatch.setattr(sweep_runner, "available_cores", lambda: 2)
    assert default_jobs(make_plan(_sweep_recipe({**tiny_recipe, "torch_num_threads": 4}, tmp_path))) == 1


def test_bad_jobs_are_refused_naming_the_flag(tiny_recipe, tmp_path, capsys):
    recipe = _sweep_recipe(tiny_recipe, tmp_path)
    with pytest.raises(sweep_module.RecipeError, match=r"--jobs=0: must be an integer >= 1"):
        run_sweep(recipe, jobs=0)
    with pytest.raises(SystemExit) as exit_info:
        sweep_module.main([str(tmp_path / "any.yaml"), "--jobs", "0"])
    assert exit_info.value.code == 2 and "--jobs='0': must be an integer >= 1" in capsys.readouterr().err


def test_workers_get_one_gpu_each_round_robin_and_the_same_source(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    envs = [sweep_module._worker_env(2, i) for i in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3", "5", "3"]
    assert all(e["OMP_NUM_THREADS"] == "2" for e in envs)
    assert envs[0]["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)  # the workers import this looped_hf
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # one GPU: every worker shares it
    assert sweep_module._worker_env(2, 1)["CUDA_VISIBLE_DEVICES"] == "7"


class _FakeClock:
    """Stands in for the console's `time` module: a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def _eta_seconds(text: str) -> float:
    """'12m05s' / '1h03m' -> seconds."""
    if "h" in text:
        hours, minutes = text.rstrip("m").split("h")
        return 3600 * int(hours) + 60 * int(minutes)
    minutes, seconds = text.rstrip("s").split("m")
    return 60 * int(minutes) + int(seconds)


def test_eta_tracks_the_true_end_as_runs_of_very_different_flops_finish(tmp_path, monkeypatch):
    """Two workers, runs largest first, each taking a fixed start-up (build, eval, save)
    plus time proportional to its FLOPs, each worker at the same FLOPs per second. After every
    finished run the ETA must land within 10% of the true end: no jumps from extrapolating the
    largest runs to the whole sweep, or from ignoring that a worker idles at the tail."""
    from types import SimpleNamespace

    clock = _FakeClock()
    monkeypatch.setattr(sweep_console, "time", clock)
    startup, seconds_per_unit = 20.0, 60.0  # a run of F units takes 20 s + 60 F s
    sizes = [16, 12, 8, 8, 6, 4, 3, 2, 2, 1, 1, 0.5, 0.5, 0.25]
    runs = [SimpleNamespace(run_id=f"run{i}", flops=1e15 * f) for i, f in enumerate(sizes)]
    plan = SimpleNamespace(runs=runs)
    # The runner's schedule: the next run goes to the first free worker.
    free, events = [0.0, 0.0], []
    for run in runs:
        w = free.index(min(free))
        start, end = free[w], free[w] + startup + seconds_per_unit * run.flops / 1e15
        free[w] = end
        events += [(start, 1, run), (end, 0, run)]
    events.sort(key=lambda e: (e[0], e[1]))
    last_end = max(free)
    lines: list[str] = []
    console = sweep_console._Console(plan, [], list(runs), lines.append, verbose=False)
    began: dict[str, float] = {}

    def write_progress(now: float) -> None:
        for run_id, start in began.items():
            run = next(r for r in runs if r.run_id == run_id)
            trained = max(0.0, now - start - startup) / (seconds_per_unit * run.flops / 1e15)
            progress = {"step": int(100 * min(1.0, trained)), "max_steps": 100, "loss": 3.0,
                        "started": start + startup, "time": now}  # fmt: skip
            write_json_atomic(tmp_path / run_id / "progress.json", progress)

    errors = []
    for when, starting, run in events:
        clock.now = when
        if starting:
            began[run.run_id] = when
            write_progress(when)
            console.started(run, tmp_path / run.run_id)
            continue
        began.pop(run.run_id)
        write_progress(when)
        console.finished(run, {"status": "ok", "loss": 3.0, "wall_time_s": when})
        if when < last_end:
            eta = _eta_seconds(lines[-1].rsplit("ETA ", 1)[1])
            errors.append((run.run_id, round(eta), round(last_end - when)))
    console.close()
    off = [(rid, eta, true) for rid, eta, true in errors if abs(eta - true) > 0.1 * true + 1]
    assert not off, f"ETA (run finished, ETA shown, true time left) off by > 10%: {off}"


def test_a_command_run_keeps_its_lock_when_the_sweep_dies(tmp_path):
    # A sweep that starts a run as a command hands the lock's descriptor to the child; the sweep
    # dying (os._exit: no release) must leave the run locked until the child ends. No step waits on
    # a clock: the child holds the lock until this test lets it go (a byte on a pipe whose only write
    # end is here), and the end of the sweep's stdout, which the child inherited, says it is gone.
    run_dir = tmp_path / "run"
    release_r, release_w = os.pipe()
    code = (
        "import os, pathlib, subprocess, sys\n"
        "from looped_hf.sweep import _try_lock\n"
        "lock = _try_lock(pathlib.Path(sys.argv[1]))\n"
        "release = int(sys.argv[2])\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import os, sys; os.read(int(sys.argv[1]), 1)', str(release)],\n"
        "                         pass_fds=(lock.fd, release))\n"
        "print(child.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    try:
        sweep = subprocess.Popen([PYTHON, "-c", code, str(run_dir), str(release_r)], stdout=subprocess.PIPE,
                                 text=True, env=subprocess_env(), pass_fds=(release_r,))  # fmt: skip
        os.close(release_r)
        assert int(sweep.stdout.readline()) > 0  # the child started, holding the lock
        assert sweep.wait(timeout=300) == 0
        assert sweep_module._try_lock(run_dir) is None  # the orphaned child still holds it
    finally:
        os.write(release_w, b"x")  # the child reads it and exits
        os.close(release_w)
    assert sweep.stdout.read() == ""  # end of file: the child, the last holder of the pipe, is gone
    sweep.stdout.close()
    # The OS drops the lock as the child's descriptors close, within its exit; a short bound for that.
    deadline = time.monotonic() + 30
    while (lock := sweep_module._try_lock(run_dir)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock is not None  # free once the child is gone
    sweep_module._unlock(lock)


def test_seeds_trains_another_seed_of_a_recipe_into_its_own_directory(tiny_recipe, tmp_path, capsys, monkeypatch):
    """`looped-hf sweep RECIPE --seeds 1`: the recipe's plan with seed 1 (a second seed of a finished
    sweep), by default in runs/<stem>-seeds-1, resumable with the same command; a bad seed is
    refused in one line naming the field."""
    import yaml

    recipe = _sweep_recipe(tiny_recipe, tmp_path, budgets=[6e8])
    recipe["sweep"].pop("output_dir")
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(tmp_path)
    assert sweep_module.main([str(path), "--seeds", "1"]) == 0
    out = tmp_path / "runs" / "two-seeds-1"
    records = read_jsonl(out / "results.jsonl")
    assert [(r["run_id"], r["seed"], r["status"]) for r in records] == [
        ("base-w32-b0", 1, "ok"), ("loop2-w32-b0", 1, "ok")]
    assert sweep_module.main([str(path), "--seeds", "1"]) == 0  # resumes: nothing left to train
    assert len(read_jsonl(out / "results.jsonl")) == 2
    assert "0 to run" in capsys.readouterr().out
    # The plan's seed is the model's: seed 1 trains other weights than the recipe's seed 0.
    seed0 = run_sweep(str(path), tmp_path / "seed0")
    assert [r["loss"] for r in seed0] != [r["loss"] for r in records]
    assert sweep_module.main([str(path), "--seeds", "-1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "sweep.seeds=[-1]" in err and "\n" not in err
