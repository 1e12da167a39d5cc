"""What a person sees while a sweep runs: one live progress line on a terminal, one line per
finished run otherwise (`_Console`)."""

from __future__ import annotations

import contextlib
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
    The bar and the ETA weigh runs by their planned FLOPs and count the finished fraction of the
    running ones (their `progress.json`), so the ETA reflects all runs in flight."""

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
        self.todo_flops = sum(r.flops for r in todo)
        self.session_flops = 0.0
        self.running: dict[str, tuple[Path, float | None]] = {}  # run_id -> (run_dir, fraction at start)
        self.waiting = 0
        self.start = time.time()
        self.clock: float | None = None  # when the first run of this session began training
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
        self.running[run.run_id] = (run_dir, None)
        self.refresh(force=True)

    def finished(self, run: PlannedRun, record: dict[str, Any]) -> None:
        self._fractions()  # sets the ETA clock from this run's start if it is the first seen
        self.running.pop(run.run_id, None)
        if run.run_id not in self.done:
            self.done.add(run.run_id)
            self.done_flops += run.flops
        self.session_flops += run.flops
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
        for run_id, (run_dir, first) in list(self.running.items()):
            progress = _read_progress(run_dir) or {}
            began = progress.get("started")
            if isinstance(began, (int, float)) and began >= self.start and (self.clock is None or began < self.clock):
                self.clock = began
            step, total = progress.get("step"), progress.get("max_steps")
            frac = min(1.0, step / total) if isinstance(step, int) and isinstance(total, int) and total > 0 else 0.0
            if first is None and progress:
                self.running[run_id] = (run_dir, frac)  # a resumed run: its earlier progress is not this session's
            out[run_id] = frac
        return out

    def _eta(self, fractions: dict[str, float] | None = None) -> str:
        fractions = self._fractions() if fractions is None else fractions
        partial = sum(
            max(0.0, frac - (self.running[rid][1] or 0.0)) * self.flops[rid] for rid, frac in fractions.items()
        )
        progressed = self.session_flops + partial
        remaining = self.todo_flops - progressed
        if progressed <= 0:
            return "?"
        # The rate is measured from the first training start: imports and worker start-up happen
        # once, before it, and would inflate an ETA taken early.
        since = time.time() - (self.clock if self.clock is not None else self.start)
        return _fmt_time(max(0.0, since * remaining / progressed))

    def refresh(self, force: bool = False, interval: float = 0.5) -> None:
        if not self.live or (not force and time.monotonic() - self._drawn < interval):
            return
        self._drawn = time.monotonic()
        fractions = self._fractions()
        share = (self.done_flops + sum(f * self.flops[r] for r, f in fractions.items())) / self.all_flops
        filled = int(round(16 * min(1.0, share)))
        head = f"[sweep] {'█' * filled}{'░' * (16 - filled)} {100 * share:3.0f}%  {len(self.done)}/{self.total} runs"
        head += f", {self.failed} failed" if self.failed else ""
        tail = f" | {_fmt_time(time.time() - self.start)}, ETA {self._eta(fractions)}"
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
