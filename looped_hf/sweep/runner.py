"""The runner: keeps `--jobs` runs in flight, records each finished one exactly once, resumes
after any kill (`run_sweep`), and the default number of runs at once (`default_jobs`)."""

from __future__ import annotations

import dataclasses
import os
import select
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

from looped_hf.arguments import RecipeError, load_yaml, read_recipe_text
from looped_hf.fileio import yaml_load

from .console import _Console, _refresh_callback
from .execution import (
    _INTERRUPTS,
    LOCK_NAME,
    LOG_NAME,
    _failed_record,
    _Job,
    _log_tail,
    _read_lock_free,
    _read_record,
    _run_inprocess,
    _run_output,
    _try_lock,
    _unlock,
    _Worker,
    _worker_env,
    run_job,
    train_command,
)
from .plan import EXECUTORS, PlannedRun, SweepPlan, make_plan
from .results import RESULTS_NAME, append_jsonl, read_jsonl

PLAN_NAME = "plan.json"
RECIPE_COPY = "sweep.yaml"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_jobs(plan: SweepPlan) -> int:
    """Runs trained at once without `--jobs`: the available cores divided by the cores one run
    uses (the recipe's `torch_num_threads` x `sweep.num_processes`), at least 1.

    A recipe without `torch_num_threads` lets torch use every core in each run, so its default
    is 1. On a GPU machine the same rule applies: a recipe for small models that sets
    `torch_num_threads: 4` on 16 cores shares the GPU among 4 runs (`--jobs 1` to avoid that); with
    several GPUs the local executor's workers take one each, round-robin.
    submitit: 1 (give `--jobs` to keep that many cluster jobs in flight)."""
    if plan.sweep.executor == "submitit":
        return 1
    threads = plan.base_recipe.get("torch_num_threads")
    if not isinstance(threads, int) or threads < 1:
        return 1
    return max(1, available_cores() // (threads * plan.sweep.num_processes))


def _prepare(plan: SweepPlan, sweep_dir: Path, recipe_text: str | None) -> None:
    from looped_hf.fileio import write_json_atomic, write_yaml_atomic

    sweep_dir.mkdir(parents=True, exist_ok=True)
    copy = sweep_dir / RECIPE_COPY
    if copy.exists():
        old = yaml_load(copy.read_text())
        new = yaml_load(recipe_text) if recipe_text is not None else None
        if new is not None and old != new:
            raise RecipeError(
                f"{sweep_dir} holds a different sweep recipe ({copy}); resume with that one or use another --output"
            )
    elif recipe_text is not None:
        copy.write_text(recipe_text)
    else:
        write_yaml_atomic(copy, {"sweep": dataclasses.asdict(plan.sweep), **plan.base_recipe})
    write_json_atomic(sweep_dir / PLAN_NAME, plan.to_json())


class _Runner:
    """Keeps up to `jobs` runs in flight and records each finished one exactly once.

    Every run is trained under its run lock (`_try_lock`), by this process (`--jobs 1`, local),
    a persistent worker (`--jobs N`, local), a command (subprocess / accelerate) or a submitit
    job. Records are appended by this process with `append_jsonl`, which skips a run_id already
    in the file; a run that finished without being appended (the sweep was killed in between) is
    appended from its run_record.json on the next start. A run whose lock is held elsewhere waits
    until it is free, then is either appended (it finished there) or resumed here."""

    def __init__(self, plan: SweepPlan, sweep_dir: Path, jobs: int, console: _Console, verbose: bool) -> None:
        self.plan, self.sweep_dir, self.jobs, self.console, self.verbose = plan, sweep_dir, jobs, console, verbose
        self.results = sweep_dir / RESULTS_NAME
        self.kind = plan.sweep.executor
        self.running: list[_Job] = []
        self.waiting: list[PlannedRun] = []
        self.workers: list[_Worker] = []
        threads = plan.base_recipe.get("torch_num_threads")
        self.threads = threads if isinstance(threads, int) else max(1, available_cores() // jobs)

    # --- one run -----------------------------------------------------------------------------
    def _wait_for(self, run: PlannedRun) -> None:
        """`run` is locked by another process: say so, and retry it when its lock is free."""
        self.waiting.append(run)
        try:
            holder = (self.sweep_dir / run.run_id / LOCK_NAME).read_text().strip()
        except OSError:
            holder = "?"
        self.console.emit(f"[sweep] {run.run_id} is being trained by another process (pid {holder}); "
                          "it is recorded or resumed here once that one stops")  # fmt: skip

    def _record(self, run: PlannedRun, record: dict[str, Any]) -> None:
        append_jsonl(self.results, record)
        self.console.finished(run, record)

    def start(self, run: PlannedRun) -> None:
        """Record, train here, or launch `run`; a run locked elsewhere goes to the waiting list."""
        from looped_hf.fileio import write_yaml_atomic

        run_dir = self.sweep_dir / run.run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        existing = _read_record(run_dir)
        if existing is not None and existing.get("status") in ("ok", "failed"):
            self._record(run, existing)  # finished, but killed before its line was appended
            return
        recipe_path = run_dir / "recipe.yaml"
        if self.kind == "submitit":
            write_yaml_atomic(recipe_path, run.recipe)
            self.console.started(run, run_dir)
            self.running.append(_Job(run, run_dir, job=self._submit(run, run_dir, recipe_path)))
            return
        if self.kind == "local" and self.jobs > 1:
            self._start_in_worker(run, run_dir, recipe_path)
            return
        lock = _try_lock(run_dir)
        if lock is None:
            self._wait_for(run)
            return
        try:
            write_yaml_atomic(recipe_path, run.recipe)
            self.console.started(run, run_dir)
            if self.kind == "local":
                self._record(run, self._train_here(run, run_dir, recipe_path))
                return
            n = 1 if self.kind == "subprocess" else self.plan.sweep.num_processes
            with open(run_dir / LOG_NAME, "ab") as log:
                # The child inherits the lock: it stays held while the run trains, even if this
                # process dies first.
                inherit = () if lock.fd is None else (lock.fd,)
                proc = subprocess.Popen(train_command(recipe_path, n, self.kind), stdout=log,
                                        stderr=subprocess.STDOUT, pass_fds=inherit)  # fmt: skip
            self.running.append(_Job(run, run_dir, proc=proc, lock=lock))
            lock = None
        finally:
            _unlock(lock)

    def _train_here(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> dict[str, Any]:
        prefix = f"[{run.run_id}] "
        with _run_output(run_dir / LOG_NAME, self.verbose, self.console.stream, prefix):
            try:
                return _run_inprocess(recipe_path, [_refresh_callback(self.console)])
            except RecipeError:
                raise
            except Exception as err:  # noqa: BLE001 - one failed run must not stop the sweep
                traceback.print_exc()
                return _failed_record(run, run_dir, f"{type(err).__name__}: {err}")

    def _start_in_worker(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> None:
        from looped_hf.fileio import write_yaml_atomic

        if not _read_lock_free(run_dir):
            self._wait_for(run)
            return
        worker = next((w for w in self.workers if w.job is None and w.proc.poll() is None), None)
        if worker is None:
            log_path = self.sweep_dir / f"worker-{len(self.workers)}.log"
            worker = _Worker(_worker_env(self.threads, len(self.workers)), self.threads, log_path, self.verbose)
            self.workers.append(worker)
        write_yaml_atomic(recipe_path, run.recipe)
        worker.job = _Job(run, run_dir, worker=worker)
        worker.send({"recipe": str(recipe_path), "verbose": self.verbose})
        self.running.append(worker.job)
        self.console.started(run, run_dir)

    def _submit(self, run: PlannedRun, run_dir: Path, recipe_path: Path) -> Any:
        """Submit one run through submitit (SLURM, or `cluster: local` for tests)."""
        import submitit

        params = dict(self.plan.sweep.submitit)
        cluster = params.pop("cluster", None)
        executor = submitit.AutoExecutor(folder=str(run_dir.parent / "submitit"), cluster=cluster)
        params.setdefault("name", run.run_id)
        executor.update_parameters(**params)
        job = executor.submit(run_job, str(recipe_path), self.plan.sweep.num_processes, str(self.results))
        (run_dir / "job_id").write_text(str(job.job_id))
        return job

    # --- runs in flight ----------------------------------------------------------------------
    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for runs in flight; record every one that finished."""
        busy = [j.worker for j in self.running if j.worker is not None]
        if busy:
            ready, _, _ = select.select(busy, [], [], timeout)
        else:
            ready = []
            time.sleep(timeout if self.running or self.waiting else 0)
        for worker in ready:
            self._read_worker(worker)  # a reply, or EOF: the worker died
        for worker in list(self.workers):
            # Exited while its reply pipe stays open (a forked DataLoader process still holds it).
            if worker.job is not None and worker.proc.poll() is not None:
                if select.select([worker], [], [], 0)[0]:
                    self._read_worker(worker)
                if worker in self.workers:
                    self._worker_died(worker)
        for job in list(self.running):
            if job.proc is not None and job.proc.poll() is not None:
                self._finish_command(job)
            elif job.job is not None and job.job.done():
                self._finish_submitit(job)
        self.console.refresh()

    def _read_worker(self, worker: _Worker) -> None:
        replies, exited = worker.read_replies()
        for reply in replies:
            job = worker.job
            assert job is not None, reply
            worker.job = None
            self.running.remove(job)
            if reply.get("busy"):
                self.console.running.pop(job.run.run_id, None)
                self._wait_for(job.run)
            elif "recipe_error" in reply:
                raise RecipeError(reply["recipe_error"])
            else:
                record = _read_record(job.run_dir)
                if record is None:
                    error = reply.get("error") or "the worker left no run record"
                    record = _failed_record(job.run, job.run_dir, error)
                self._record(job.run, record)
        if exited:
            self._worker_died(worker)

    def _worker_died(self, worker: _Worker) -> None:
        worker.proc.wait()
        code = worker.proc.returncode
        if worker in self.workers:
            self.workers.remove(worker)
        worker.close()
        job, worker.job = worker.job, None
        if job is None:
            return
        self.running.remove(job)
        self.console.running.pop(job.run.run_id, None)
        if code in _INTERRUPTS:
            self.waiting.append(job.run)  # stopped, not failed: it resumes from its checkpoint
            return
        record = _read_record(job.run_dir)
        if record is None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            record = _failed_record(job.run, job.run_dir, f"the worker training it died ({how}); log tail:\n"
                                    f"{_log_tail(job.run_dir / LOG_NAME)}")  # fmt: skip
        self._record(job.run, record)

    def _finish_command(self, job: _Job) -> None:
        self.running.remove(job)
        _unlock(job.lock)
        assert job.proc is not None
        record = _read_record(job.run_dir)
        if record is None:
            tail = _log_tail(job.run_dir / LOG_NAME)
            record = _failed_record(job.run, job.run_dir, f"exit code {job.proc.returncode} and no run record; "
                                    f"log tail:\n{tail}")  # fmt: skip
        self._record(job.run, record)

    def _finish_submitit(self, job: _Job) -> None:
        self.running.remove(job)
        try:
            record = job.job.result()
        except Exception as err:  # noqa: BLE001 - the job failed: record it, go on
            record = _read_record(job.run_dir) or _failed_record(
                job.run, job.run_dir, f"submitit job {job.job.job_id} failed: {err}"
            )
        self._record(job.run, record)

    def retry_waiting(self) -> list[PlannedRun]:
        """The waiting runs whose lock is free again (their holder finished or died)."""
        free = [r for r in self.waiting if _read_lock_free(self.sweep_dir / r.run_id)]
        self.waiting = [r for r in self.waiting if r not in free]
        return free

    def close(self, kill: bool = False) -> None:
        for worker in self.workers:
            worker.close(kill=kill)
        self.workers = []
        for job in self.running:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.kill()  # Ctrl-C of the sweep ends the runs it started (they resume on rerun)
                job.proc.wait()
            _unlock(job.lock)
        self.running = []


def run_sweep(
    recipe: str | os.PathLike | dict[str, Any],
    sweep_dir: str | os.PathLike | None = None,
    executor: str | None = None,
    max_runs: int | None = None,
    log: Any = None,
    jobs: int | None = None,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """Run every planned run that `results.jsonl` lacks, `jobs` at a time; return the records of
    all planned runs.

    Safe to kill at any point (SIGKILL included) and rerun: every run is recorded exactly once
    and an interrupted one resumes from its last checkpoint (see `_Runner`). `jobs`: runs in
    flight at once (default `default_jobs`); with the local executor and jobs > 1 they train in
    persistent worker processes, largest runs first (the shortest finish). Each run's output goes
    to `<run_dir>/train.log`; `verbose` also shows it, each line prefixed with its run id. `log`:
    where the sweep's own lines go (default: a live progress line on a terminal, else one line
    per finished run on stdout). `max_runs` stops after starting that many runs this session.
    """
    for flag, count in (("--max-runs", max_runs), ("--jobs", jobs)):
        # checked first: a negative --max-runs would slice the run list from its end
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise RecipeError(f"{flag}={count!r}: must be an integer >= 1")
    if isinstance(recipe, dict):
        recipe_text = yaml.safe_dump(recipe, sort_keys=False)
        default_dir = Path("runs") / "sweep"
        data = dict(recipe)
    else:
        recipe_text = read_recipe_text(recipe, "sweep recipe")
        default_dir = Path("runs") / Path(recipe).stem
        data = load_yaml(recipe, "sweep recipe", text=recipe_text)  # the file is read once
    section = data.get("sweep")
    if not isinstance(section, dict):
        section = {}  # make_plan names what is wrong with it
    sweep_dir = Path(sweep_dir or section.get("output_dir") or default_dir).resolve()
    if isinstance(recipe, dict):
        plan = make_plan(recipe, sweep_dir)
    else:
        plan = make_plan(Path(recipe), sweep_dir, text=recipe_text)  # the text read above, not the file again
    if executor is not None:
        if executor not in EXECUTORS:
            raise RecipeError(f"--executor={executor!r}: must be one of {EXECUTORS}")
        plan.sweep.executor = executor
    _prepare(plan, sweep_dir, recipe_text)
    results = sweep_dir / RESULTS_NAME
    records = read_jsonl(results)
    done = {r.get("run_id") for r in records}
    todo = [r for r in plan.runs if r.run_id not in done]
    recorded = len(plan.runs) - len(todo)
    if max_runs is not None:
        todo = todo[:max_runs]
    jobs = min(jobs or default_jobs(plan), max(1, len(todo)))
    if jobs > 1:
        todo.sort(key=lambda r: -r.flops)  # longest first: the last runs in flight are the short ones
    console = _Console(plan, records, todo, log, verbose)
    mode = f"{jobs} at once" + (" in worker processes" if jobs > 1 and plan.sweep.executor == "local" else "")
    console.emit(f"[sweep] {sweep_dir}: {len(plan.runs)} planned, {recorded} already recorded, {len(todo)} to run "
                 f"(executor {plan.sweep.executor}, {mode}; each run's log: <run>/{LOG_NAME})")  # fmt: skip
    runner = _Runner(plan, sweep_dir, jobs, console, verbose)
    pending = list(todo)
    clean = False
    try:
        while pending or runner.running or runner.waiting:
            while pending and len(runner.running) < jobs:
                runner.start(pending.pop(0))
            console.waiting = len(runner.waiting)
            if not pending and runner.waiting and len(runner.running) < jobs:
                pending.extend(runner.retry_waiting())
                if pending:
                    continue
            if runner.running or runner.waiting:
                runner.poll(0.25 if runner.running else 1.0)
        clean = True
    finally:
        runner.close(kill=not clean)
        console.close()
    by_id = {r.get("run_id"): r for r in read_jsonl(results)}
    return [by_id[r.run_id] for r in plan.runs if r.run_id in by_id]
