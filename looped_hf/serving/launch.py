"""Run vLLM's server as a child of ``looped-hf serve``, its output passed through unchanged, and
when it fails, its root cause as the last line the user sees.

vLLM's engine runs in processes of its own; when one of them fails to start, the server's last
words are "Engine core initialization failed. See root cause above", after some 170 lines of log
and three tracebacks. The cause is the first exception of those tracebacks (vLLM logs the later
ones as it wraps and re-raises it), so this module reads every line the server and its engine
write, to both streams, and remembers the exception line of each traceback.

The child shares this process's group, so Ctrl-C at a terminal and a supervisor that stops the
group reach vLLM directly; a SIGTERM or SIGHUP sent to this process alone is passed on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from typing import BinaryIO

# vLLM's log prefixes: "(EngineCore pid=12) " for a line from another of its processes, then
# "ERROR 12-06 02:33:42 [core.py:1510] " for a logged line.
_PROCESS = re.compile(r"^\((?P<proc>[\w.-]+(?: [\w.-]+)? pid=\d+)\) ")
_LOG_HEADER = re.compile(r"^[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A traceback's last line: the exception's (dotted) class name, then its message; another line
# logged in between (another thread of the process) has words before any colon.
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?::\s.*)?$")
# Exceptions that only wrap and point back at an earlier one.
_WRAPPERS = ("root cause above", "stack trace above for the root cause")
STARTED = "Application startup complete"


class RootCause:
    """Reads a server's output line by line: the exception line of each traceback, in order, and
    whether the server got as far as serving (``STARTED``)."""

    def __init__(self) -> None:
        self.exceptions: list[str] = []
        self.started = False
        self._in_traceback: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def feed(self, stream: str, line: str) -> None:
        line = _ANSI.sub("", line.rstrip("\r\n"))
        match = _PROCESS.match(line)
        proc = match.group("proc") if match else ""
        text = _LOG_HEADER.sub("", line[match.end() :] if match else line, count=1)
        key = (stream, proc)  # tracebacks of different processes interleave on one stream
        with self._lock:
            if STARTED in text:
                self.started = True
            if text.startswith("Traceback (most recent call last)"):
                self._in_traceback.add(key)
            elif key in self._in_traceback and _EXCEPTION.match(text):
                self._in_traceback.discard(key)
                self.exceptions.append(text.strip())

    def cause(self) -> str | None:
        """The first exception that is not a wrapper pointing back at another, else the first."""
        for text in self.exceptions:
            if not any(w in text for w in _WRAPPERS):
                return text
        return self.exceptions[0] if self.exceptions else None


def _pump(source: BinaryIO, sink: BinaryIO, stream: str, reader: RootCause) -> None:
    """Copy ``source`` to ``sink`` as it arrives (progress bars' carriage returns included), and
    feed each complete line to ``reader``."""
    partial = b""
    fd = source.fileno()
    writable = True
    while chunk := os.read(fd, 65536):
        if writable:
            try:
                sink.write(chunk)
                sink.flush()
            except OSError:  # our reader went away (`| head`): keep draining, or vLLM blocks on a full pipe
                writable = False
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            reader.feed(stream, line.decode("utf-8", "replace"))
    if partial:
        reader.feed(stream, partial.decode("utf-8", "replace"))


def _terminal_delivers_ctrl_c() -> bool:
    """Whether a Ctrl-C here reaches the child already: this process group is a terminal's foreground."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def run_server(command: list[str], env: dict[str, str]) -> int:
    """Run ``command`` (vLLM's server) to its end; its exit status (128 + N for signal N). When it
    fails without being asked to stop, its root cause is printed to stderr as the last line."""
    proc = subprocess.Popen(command, env={"PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    reader = RootCause()
    stopped: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopped.append(signum)
        if signum != signal.SIGINT or not _terminal_delivers_ctrl_c():
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, sys.stdout.buffer, "stdout", reader), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, sys.stderr.buffer, "stderr", reader), daemon=True),
    ]
    try:
        for pump in pumps:
            pump.start()
        rc = proc.wait()
        for pump in pumps:
            pump.join(timeout=30)  # an engine process that outlives the server may hold the pipes
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rc != 0 and not stopped:
        cause = reader.cause()
        if cause is not None:
            what = "vLLM's server stopped" if reader.started else "vLLM's engine failed to start"
            sys.stdout.flush()
            print(f"looped-hf serve: {what}: {cause}", file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc


__all__ = ["RootCause", "run_server"]
