"""Running one run: in this process, in a persistent worker process (`--jobs N`, local executor),
as a command (subprocess / accelerate) or as a submitit job (`run_job`). Every run trains under
an exclusive lock on its directory, with its whole output in `<run_dir>/train.log`; each leaves
`run_record.json` in its run directory."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, SoftFileLock, Timeout

from looped_hf.arguments import RecipeError

from .plan import PlannedRun
from .results import append_jsonl


# ---------------------------------------------------------------------------------------------
# Executors: each takes a run directory holding recipe.yaml and leaves run_record.json there
# ---------------------------------------------------------------------------------------------
def _failed_record(run: PlannedRun, run_dir: Path, error: str) -> dict[str, Any]:
    from looped_hf.train import RECORD_KEYS

    record: dict[str, Any] = dict.fromkeys(RECORD_KEYS)
    record.update(
        run_id=run.run_id, run_dir=str(run_dir), arch=run.arch, variant=run.variant, budget=run.budget,
        hidden_size=run.hidden_size, num_recurrences=run.num_recurrences, n_once=run.n_once, n_rec=run.n_rec,
        effective_num_layers=run.effective_num_layers, backprop_recurrences=run.backprop_recurrences,
        seed=run.seed, status="failed", error=error, recipe=run.recipe,
    )  # fmt: skip
    return record


def _read_record(run_dir: Path) -> dict[str, Any] | None:
    from looped_hf.fileio import read_run_record

    try:
        return read_run_record(run_dir)
    except ValueError:  # a torn or foreign record: the run is not finished, rerun it
        return None


LOG_NAME = "train.log"
"""Each run's full output (Trainer log lines, warnings, tracebacks), in its run directory."""
LOCK_NAME = ".run.lock"


def _run_inprocess(recipe_path: Path, callbacks: list[Any] | None = None) -> dict[str, Any]:
    from looped_hf.arguments import parse_recipe
    from looped_hf.train import train

    return train(*parse_recipe(recipe_path), callbacks=callbacks)


def _log_tail(log_path: Path, lines: int = 15) -> str:
    """The last lines of a run's log (for the error of a run that left no record)."""
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- one process per run at a time ------------------------------------------------------------
@dataclass
class RunLock:
    """A held run lock: the `filelock` lock and its open descriptor (a command run inherits the
    descriptor, so the lock stays held while it trains even if the sweep dies first). No
    descriptor where filelock fell back to its marker-file lock (a filesystem without flock)."""

    lock: FileLock
    fd: int | None


def _try_lock(run_dir: Path) -> RunLock | None:
    """Take the run's exclusive lock (`<run_dir>/.run.lock`) without waiting, or None if another
    process (or another lock in this one) holds it.

    `filelock` locks the open file (flock on POSIX, msvcrt on Windows), and the OS drops the lock
    when the last holder dies, SIGKILL included, so the lock means "someone is training this run
    right now". A rerun that finds it held (a worker orphaned by a killed sweep, or a second
    `looped-hf sweep` on the same directory) leaves the run alone and comes back to it, so two
    processes never train, checkpoint or record the same run at once.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    held: list[int] = []

    def write_holder(fd: int) -> None:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
        held.append(fd)

    # thread_local=False: the sweep may release a lock from another thread than the one that took it.
    # Where the OS has no file locks at all, FileLock is filelock's marker-file lock: no descriptor.
    native = {} if issubclass(FileLock, SoftFileLock) else {"on_acquired": write_holder}
    lock = FileLock(run_dir / LOCK_NAME, thread_local=False, **native)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return RunLock(lock, held[0] if held else None)


def _unlock(lock: RunLock | None) -> None:
    # Releasing unlocks the open file for every descriptor of it, a command child's inherited copy
    # included: callers release only once that child has exited.
    if lock is not None:
        lock.lock.release()


def _read_lock_free(run_dir: Path) -> bool:
    """Whether no process holds the run's lock right now (a check: the lock is not kept)."""
    lock = _try_lock(run_dir)
    _unlock(lock)
    return lock is not None


# --- where a run's output goes -----------------------------------------------------------------
class _Tee:
    """Copies everything written to a pipe into the run's log and, line by line and prefixed with
    the run id, to the console (`--verbose`)."""

    def __init__(self, log: Any, console: Any, prefix: str) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.log, self.console, self.prefix = log, console, prefix
        self.thread = threading.Thread(target=self._pump, daemon=True, name="sweep-tee")
        self.thread.start()

    def _pump(self) -> None:
        pending = b""
        while data := os.read(self.read_fd, 65536):
            self.log.write(data)
            self.log.flush()
            pending += data
            *lines, pending = pending.split(b"\n")
            self._show(lines)
        self._show([pending] if pending else [])
        os.close(self.read_fd)

    def _show(self, lines: list[bytes]) -> None:
        for line in lines:
            text = line.decode("utf-8", errors="replace").rstrip("\r")
            with contextlib.suppress(OSError, ValueError):
                self.console.write(f"{self.prefix}{text}\n")
                self.console.flush()

    def close(self) -> None:
        os.close(self.write_fd)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def _run_output(log_path: Path, verbose: bool = False, console: Any = None, prefix: str = ""):
    """Send everything the run prints (Trainer log lines, warnings, C-level output, tracebacks)
    to `log_path`, appended; with `verbose` also to `console`, each line prefixed.

    Both levels are redirected: file descriptors 1 and 2 (C code, logging handlers bound to the
    real stderr, warnings) and the sys.stdout / sys.stderr objects (which are not fds 1 / 2 when
    the caller's output is captured)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    own_console = None
    if verbose and console is None:  # a copy of fd 2 made now: fd 2 itself is about to point at the tee
        own_console = console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    with open(log_path, "ab") as log:
        tee = _Tee(log, console, prefix) if verbose else None
        target = tee.write_fd if tee is not None else log.fileno()
        saved = (os.dup(1), os.dup(2))
        text = io.TextIOWrapper(os.fdopen(os.dup(target), "wb"), encoding="utf-8", errors="replace",
                                line_buffering=True)  # fmt: skip
        try:
            os.dup2(target, 1)
            os.dup2(target, 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            for stream in (text, sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            text.close()
            if tee is not None:
                tee.close()
            if own_console is not None:
                own_console.close()


# --- persistent workers: `--jobs N` with the local executor -----------------------------------
_WORKER_CODE = "import sys; from looped_hf.sweep.execution import _worker_main; sys.exit(_worker_main())"
_INTERRUPTS = (-signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP)


def _die_with_parent() -> None:
    """A worker must not outlive its sweep (a SIGKILLed sweep cannot stop it, and an orphan would
    go on training and checkpointing a run the next sweep resumes): on Linux the kernel kills it
    with its parent (PR_SET_PDEATHSIG); elsewhere a thread notices within 0.2 s. The run resumes
    from its last checkpoint on the next sweep."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _worker_main() -> int:
    """A training process of `--jobs N`: reads one task per stdin line (`{"recipe", "verbose"}`),
    trains that run in process under its run lock with its output in `<run_dir>/train.log`, and
    answers one JSON line on stdout. One process trains many runs, so torch, transformers and the
    tokenized data are loaded once per worker, not once per run (~8 s of CPU each on 2 cores)."""
    _die_with_parent()
    if len(sys.argv) > 1 and sys.argv[1].isdigit():
        import torch

        torch.set_num_threads(int(sys.argv[1]))  # a recipe's torch_num_threads still wins in train()
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to the worker's log, never into the reply pipe
    for line in sys.stdin:
        task = json.loads(line)
        replies.write(json.dumps(_worker_run(Path(task["recipe"]), bool(task.get("verbose")))) + "\n")
    return 0


def _worker_run(recipe_path: Path, verbose: bool) -> dict[str, Any]:
    run_dir = recipe_path.parent
    lock = _try_lock(run_dir)
    if lock is None:
        return {"busy": True}
    try:
        with _run_output(run_dir / LOG_NAME, verbose, None, f"[{run_dir.name}] "):
            try:
                record = _run_inprocess(recipe_path)
            except RecipeError as err:
                return {"recipe_error": str(err)}
            except Exception as err:  # noqa: BLE001 - the sweep records it and goes on
                traceback.print_exc()
                return {"error": f"{type(err).__name__}: {err}"}
        return {"status": record.get("status")}
    finally:
        _unlock(lock)


class _Worker:
    """The sweep's handle on one worker process."""

    def __init__(self, env: dict[str, str], threads: int, log_path: Path, verbose: bool) -> None:
        self.log = open(log_path, "ab")  # the worker's own output (outside its runs); open as long as it lives
        stderr = None if verbose else self.log
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, env=env)  # fmt: skip
        self.buffer = b""
        self.job: _Job | None = None

    def send(self, task: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(task) + "\n").encode())
        self.proc.stdin.flush()

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def read_replies(self) -> tuple[list[dict[str, Any]], bool]:
        """Replies readable now (call when select says so), and whether the worker has exited."""
        data = os.read(self.fileno(), 65536)
        if not data:
            return [], True
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(x) for x in lines if x.strip()], False

    def close(self, kill: bool = False) -> None:
        """Stop the worker. An idle one holds no run and has written everything, so it is killed
        rather than waited for (a Python with torch loaded takes seconds to shut down)."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # EOF: the worker finishes its loop and exits
        if (kill or self.job is None) and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@dataclass
class _Job:
    """A run in flight: in a worker, a command, or a submitit job."""

    run: PlannedRun
    run_dir: Path
    proc: subprocess.Popen | None = None
    lock: RunLock | None = None
    job: Any = None
    worker: _Worker | None = None


def _gpu_ids() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (none on a CPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [x.strip() for x in visible.split(",") if x.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _worker_env(threads: int, index: int = 0) -> dict[str, str]:
    """Worker `index`'s environment: looped_hf importable from the same source, OpenMP sized to
    its share of the cores (the user's own OMP_NUM_THREADS wins) and, on a machine with several
    GPUs, one GPU per worker round-robin (every run would otherwise land on the first GPU)."""
    import looped_hf

    env = dict(os.environ)
    gpus = _gpu_ids()
    if len(gpus) > 1:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    root = str(Path(looped_hf.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(recipe_path: Path, num_processes: int, launcher: str) -> list[str]:
    """The command line of one run (subprocess / accelerate executors)."""
    if launcher == "subprocess" or (launcher == "submitit" and num_processes == 1):
        return [sys.executable, "-m", "looped_hf.train", str(recipe_path)]
    import torch

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port())]  # fmt: skip
    if num_processes > 1:
        # Also on CPU: `--cpu` would start one process; looped_hf.train switches a multi-process
        # launch without GPUs to CPU (gloo) by itself.
        cmd.append("--multi_gpu")
    elif not torch.cuda.is_available():
        cmd.append("--cpu")
    return [*cmd, "-m", "looped_hf.train", str(recipe_path)]


def _run_command(cmd: list[str], log_path: Path) -> tuple[int, str]:
    """Run `cmd` with output to `log_path`; return (exit code, last lines of the log)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = proc.wait()
        except BaseException:
            proc.kill()  # Ctrl-C of the sweep ends the run it started (it resumes on rerun)
            proc.wait()
            raise
    return code, _log_tail(log_path)


def run_job(recipe_path: str, num_processes: int = 1, results_file: str | None = None) -> dict[str, Any]:
    """One run as a (submitit) job: train, then append the record to `results_file` itself, so
    the results survive a sweep process that died while the job ran."""
    path = Path(recipe_path)
    if num_processes == 1:
        with _run_output(path.parent / LOG_NAME):
            record = _run_inprocess(path)
    else:
        code, tail = _run_command(train_command(path, num_processes, "accelerate"), path.parent / LOG_NAME)
        record = _read_record(path.parent) or {"run_id": path.parent.name, "status": "failed",
                                               "error": f"exit code {code}: {tail}"}  # fmt: skip
    if results_file:
        append_jsonl(results_file, record)
    return record
