"""Benchmark the command line's start-up: ``looped-hf --help``, ``fit --help`` and ``fit`` of 116
runs end to end, and what the candidate designs for looped_hf's Auto registration cost at import.

    python benchmarks/bench_cli_startup.py [--old DIR] [--repeats 5]

Every case is a fresh process (``sys.executable``), timed from outside: wall seconds (a monotonic
clock around the child) and CPU seconds (the child's user + system time, from ``getrusage``). The
cases run interleaved, ``--repeats`` rounds of all of them, so a machine that slows down during the
run slows every case alike; each cell is the median with the min-max spread. On a shared machine
wall time grows with the load and CPU time does not: the fit pins BLAS to one thread and an import
is single-threaded, so on an idle machine wall is about CPU.

Tables:

- **the command line**: the console script exactly as pip writes it for each checkout's
  ``[project.scripts] looped-hf`` target (``looped_hf_launcher:main`` here; ``looped_hf.cli:main``
  before), run from this checkout and, with ``--old DIR`` (e.g. ``git archive HEAD~1 looped_hf
  pyproject.toml | tar -x -C DIR``), from that one, side by side. The fit's data is the study's
  116-run design (``looped_hf.scaling.synthetic.study_runs(seed=0)``, bench_fit's), as
  ``results.jsonl``.
- **what each design pays at import**: the floors the candidates stand on. Registering anything with
  ``AutoConfig`` needs ``transformers.models.auto.configuration_auto``, which imports torch (through
  ``configuration_utils``), so a design that registers the config at import and defers only the
  model classes (lightweight proxies in the Auto mappings) pays that row; eager registration pays
  ``import looped_hf``; a deferred one pays numpy and scipy.

Targets (idle 2-core machine): ``looped-hf fit`` of 116 runs < 2 s end to end,
``looped-hf --help`` and ``fit --help`` < 1.5 s. docs/development.md quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]

# What a design that registers at import pays, from the bare interpreter up.
IMPORT_FLOORS = {
    "python (nothing imported)": "pass",
    "numpy + scipy.optimize (the fit's own)": "import numpy, scipy.optimize",
    "import transformers (its lazy top level)": "import transformers",
    "import torch": "import torch",
    "AutoConfig (registering the config alone)": "from transformers import AutoConfig",
    "import looped_hf (eager registration)": "import looped_hf",
    "import looped_hf.scaling": "import looped_hf.scaling",
}


def console_script(checkout: Path) -> str:
    """The code of the ``looped-hf`` script pip writes for ``checkout``'s pyproject."""
    target = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["scripts"]["looped-hf"]
    module, func = target.split(":")
    return f"import sys\nfrom {module} import {func}\nsys.exit({func}())"


def run_once(argv: list[str], checkout: Path) -> tuple[float, float]:
    """(wall, cpu) seconds of ``python argv`` with ``checkout`` first on the path; fails loudly."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, cwd=checkout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv} in {checkout} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})"


def measure(cases: dict[str, list[tuple[list[str], Path]]], repeats: int) -> dict[str, list[list[tuple]]]:
    """Each case's sides, ``repeats`` rounds, every case and side once per round (interleaved)."""
    times: dict[str, list[list[tuple]]] = {name: [[] for _ in sides] for name, sides in cases.items()}
    for _ in range(repeats):
        for name, sides in cases.items():
            for i, (argv, checkout) in enumerate(sides):
                times[name][i].append(run_once(argv, checkout))
    return times


def print_table(title: str, headers: list[str], times: dict[str, list[list[tuple]]]) -> None:
    print(f"\n{title}\n")
    width = max(map(len, times)) + 2
    cols = "".join(f"{h + ' wall':>22}{h + ' cpu':>22}" for h in headers)
    print(f"{'case':<{width}}{cols}")
    for name, sides in times.items():
        row = "".join(f"{cell([w for w, _ in s]):>22}{cell([c for _, c in s]):>22}" for s in sides)
        print(f"{name:<{width}}{row}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, default=None, help="another checkout (looped_hf/ and pyproject.toml)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    sys.path.insert(0, str(REPO))
    from looped_hf.scaling.synthetic import study_runs

    tmp = Path(tempfile.mkdtemp(prefix="bench_cli_"))
    results = tmp / "results.jsonl"
    runs = study_runs(seed=0)
    results.write_text("".join(json.dumps(r) + "\n" for r in runs))
    checkouts = [REPO] + ([args.old.resolve()] if args.old else [])
    headers = ["new"] + (["old"] if args.old else [])
    commands = {
        "looped-hf --help": ["--help"],
        "looped-hf fit --help": ["fit", "--help"],
        f"looped-hf fit results.jsonl ({len(runs)} runs)": ["fit", str(results)],
    }
    cli = {
        name: [(["-c", console_script(c), *argv], c) for c in checkouts] for name, argv in commands.items()
    }
    floors = {name: [(["-c", code], REPO)] for name, code in IMPORT_FLOORS.items()}

    print(f"python {' '.join(sys.argv)}")
    print(f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the start")  # fmt: skip
    print(f"median (min-max) of {args.repeats} interleaved runs, seconds; new = {REPO}" + (
        f", old = {args.old}" if args.old else ""))  # fmt: skip
    for sides in [*cli.values(), *floors.values()]:  # one unmeasured round: the file cache
        for argv, checkout in sides:
            run_once(argv, checkout)
    times = measure({**cli, **floors}, args.repeats)
    print_table("the command line (the console script as pip writes it)", headers, {k: times[k] for k in cli})
    print_table("what each design pays at import (this checkout)", ["this"], {k: times[k] for k in floors})
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
