"""What a person sees while a sweep runs: one live progress line on a terminal, one line per
finished run otherwise (`_Console`)."""

from __future__ import annotations

import contextlib
import heapq
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .execution import LOG_NAME
from .plan import PlannedRun, SweepPlan


def _console_stream() -> tuple[Any, bool]:
    """The stream the sweep's own lines go to, and whether it is ours to close.

    A run's output is redirected at the file-descriptor level (see `execution._run_output`), so when
    sys.stdout is fd 1 the console keeps a duplicate of fd 1 that the redirect does not touch.
    Otherwise (a captured stdout, as under pytest) the stdout object itself is unaffected."""
    try:
        if sys.stdout.fileno() == 1:
            stream = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
            return stream, True
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    return sys.stdout, False


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _read_progress(run_dir: Path) -> dict[str, Any] | None:
    from looped_hf.train import PROGRESS_NAME

    try:
        return json.loads((run_dir / PROGRESS_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


class _Console:
    """What a person sees: one live progress line on a terminal, one line per finished run
    otherwise (a log file, CI, `--verbose`).

    Live: `[sweep] ██████░░░░ 47%  17/36 runs, 1 failed | loop2-w48-b1 62% loss 2.31 | 4m12s, ETA 5m40s`,
    redrawn in place at most every `interval` seconds; failed runs also get a permanent line.
    The bar weighs runs by their planned FLOPs and counts the finished fraction of the running
    ones (their `progress.json`). The ETA (`_eta`) schedules the runs left on the workers from the
    time per run measured on the runs done, as a function of their planned FLOPs."""

    def __init__(
        self, plan: SweepPlan, records: list[dict[str, Any]], todo: list[PlannedRun], log: Any, verbose: bool
    ) -> None:
        self.stream, self._owned = _console_stream()
        self.emit = log if log not in (None, print) else self._write_line
        self.live = self.emit == self._write_line and not verbose and _isatty(self.stream)
        self.total = len(plan.runs)
        self.flops = {r.run_id: r.flops for r in plan.runs}
        self.all_flops = sum(self.flops.values()) or 1.0
        recorded = {r.get("run_id"): r for r in records if r.get("run_id") in self.flops}
        self.done = set(recorded)
        self.failed = sum(r.get("status") != "ok" for r in recorded.values())
        self.done_flops = sum(self.flops[i] for i in self.done)
        self.running: dict[str, tuple[Path, float]] = {}  # run_id -> (run_dir, fraction at its start)
        self.waiting = 0
        self.start = time.time()
        self.queue = list(todo)  # the runner's order: the runs left start in this order
        self.began: dict[str, float] = {}  # run_id -> when this session started it
        self.measured: list[tuple[float, float]] = []  # (FLOPs trained this session, seconds) per ok run
        self.workers = 1  # the most runs seen in flight at once: the runner's parallelism
        self._drawn = 0.0
        self._width = 0

    def write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def _write_line(self, text: str) -> None:
        if self.live and self._width:
            self.write("\r\x1b[K")  # clear the live line; it is redrawn below the new one
            self._width = 0
        self.write(text + "\n")

    def started(self, run: PlannedRun, run_dir: Path) -> None:
        now = time.time()
        # A progress file written before this start is an earlier session's: the run resumes from
        # about there, and that part is not this session's work.
        progress = _read_progress(run_dir)
        earlier = progress is not None and isinstance(progress.get("time"), (int, float)) and progress["time"] < now
        self.running[run.run_id] = (run_dir, _fraction(progress) if earlier else 0.0)
        self.began[run.run_id] = now
        self.workers = max(self.workers, len(self.running))
        self.refresh(force=True)

    def finished(self, run: PlannedRun, record: dict[str, Any]) -> None:
        _, first = self.running.pop(run.run_id, (None, 0.0))
        began = self.began.pop(run.run_id, None)
        if record.get("status") == "ok" and began is not None:
            self.measured.append(((1.0 - first) * run.flops, time.time() - began))
        if run.run_id not in self.done:
            self.done.add(run.run_id)
            self.done_flops += run.flops
        ok = record.get("status") == "ok"
        self.failed += not ok
        if ok:
            loss = record.get("loss")
            wall = record.get("wall_time_s")
            what = f"ok, loss {loss:.4f}" if isinstance(loss, (int, float)) else "ok"
            what += f", {_fmt_time(wall)}" if isinstance(wall, (int, float)) else ""
        else:
            error = str(record.get("error") or "no error message").strip().splitlines()
            where = Path(str(record.get("run_dir") or "")) / LOG_NAME
            what = f"FAILED ({error[0] if error else ''}; log: {where})"
        if self.live and ok:
            self.refresh(force=True)
            return
        self.emit(f"[sweep] {len(self.done)}/{self.total} runs done ({self.failed} failed) | {run.run_id}: {what} | "
                  f"elapsed {_fmt_time(time.time() - self.start)} | ETA {self._eta()}")  # fmt: skip
        self.refresh(force=True)

    def _fractions(self) -> dict[str, float]:
        out = {}
        for run_id, (run_dir, _) in list(self.running.items()):
            out[run_id] = _fraction(_read_progress(run_dir))
        return out

    def _seconds_per_run(self) -> tuple[float, float] | None:
        """(start-up seconds, seconds per FLOP) of one run on one worker, measured this session.

        From the ok runs done: t = a + b F fitted when their FLOPs differ enough (>= 1.5x) to
        separate the fixed cost of a run (build, eval, save) from its training; otherwise b = total
        seconds / total FLOPs. Before any run is done: the FLOPs the running runs have trained so
        far over the seconds since they started. None: nothing measured yet."""
        points = [(f, t) for f, t in self.measured if f > 0 and t >= 0]
        if not points:
            now = time.time()
            fractions = self._fractions()
            trained = sum(max(0.0, frac - self.running[rid][1]) * self.flops[rid] for rid, frac in fractions.items())
            seconds = sum(now - self.began.get(rid, now) for rid in fractions)
            return (0.0, seconds / trained) if trained > 0 and seconds > 0 else None
        flops = [f for f, _ in points]
        if len(points) >= 2 and max(flops) >= 1.5 * min(flops):
            n = len(points)
            mean_f, mean_t = sum(flops) / n, sum(t for _, t in points) / n
            var = sum((f - mean_f) ** 2 for f in flops)
            slope = sum((f - mean_f) * (t - mean_t) for f, t in points) / var
            startup = mean_t - slope * mean_f
            if slope > 0 and startup >= 0:
                return startup, slope
        return 0.0, sum(t for _, t in points) / sum(flops)

    def _eta(self) -> str:
        """Time until the last run ends: the runs left, each taking the measured start-up plus its
        planned FLOPs at the measured seconds per FLOP (`_seconds_per_run`), handed in the runner's
        order to the first free of `workers` workers, after the runs in flight (their predicted
        time minus the time they have run). A plain extrapolation of the FLOPs done so far jumps
        when the largest runs finish first and ignores the workers that idle at the tail."""
        model = self._seconds_per_run()
        left = [r for r in self.queue if r.run_id not in self.done and r.run_id not in self.running]
        if not left and not self.running:
            return _fmt_time(0)
        if model is None:
            return "?"
        startup, per_flop = model
        now = time.time()
        free = [
            max(0.0, startup + per_flop * (1.0 - first) * self.flops[rid] - (now - self.began.get(rid, now)))
            for rid, (_, first) in self.running.items()
        ]
        free += [0.0] * max(0, self.workers - len(free))
        heapq.heapify(free)
        for run in left:
            heapq.heappush(free, heapq.heappop(free) + startup + per_flop * run.flops)
        return _fmt_time(max(free))

    def refresh(self, force: bool = False, interval: float = 0.5) -> None:
        if not self.live or (not force and time.monotonic() - self._drawn < interval):
            return
        self._drawn = time.monotonic()
        fractions = self._fractions()
        share = (self.done_flops + sum(f * self.flops[r] for r, f in fractions.items())) / self.all_flops
        filled = int(round(16 * min(1.0, share)))
        head = f"[sweep] {'█' * filled}{'░' * (16 - filled)} {100 * share:3.0f}%  {len(self.done)}/{self.total} runs"
        head += f", {self.failed} failed" if self.failed else ""
        tail = f" | {_fmt_time(time.time() - self.start)}, ETA {self._eta()}"
        parts = []
        for run_id, (run_dir, _) in self.running.items():
            progress = _read_progress(run_dir) or {}
            part = f"{run_id} {100 * fractions.get(run_id, 0.0):.0f}%"
            if isinstance(progress.get("loss"), (int, float)):
                part += f" loss {progress['loss']:.3f}"
            parts.append(part)
        if self.waiting:
            parts.append(f"{self.waiting} waiting for another process")
        middle = " | " + " · ".join(parts) if parts else ""
        width = max(40, shutil.get_terminal_size((120, 20)).columns - 1)
        room = width - len(head) - len(tail)
        if len(middle) > room:
            middle = middle[: max(0, room - 1)] + "…" if room > 4 else ""
        line = head + middle + tail
        self.write("\r" + line[:width] + "\x1b[K")
        self._width = len(line)

    def close(self) -> None:
        if self.live and self._width:
            self.write("\n")
            self._width = 0
        if self._owned:
            with contextlib.suppress(OSError):
                self.stream.close()


def _fraction(progress: dict[str, Any] | None) -> float:
    """The finished fraction of a run from its progress file (0 without one)."""
    progress = progress or {}
    step, total = progress.get("step"), progress.get("max_steps")
    return min(1.0, step / total) if isinstance(step, int) and isinstance(total, int) and total > 0 else 0.0


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _refresh_callback(console: _Console) -> Any:
    """A TrainerCallback that redraws the console while an in-process run trains (the runner
    itself is blocked inside `train`). Built here so importing this module needs no transformers."""
    from transformers import TrainerCallback

    class RefreshConsole(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            console.refresh()

    return RefreshConsole()
