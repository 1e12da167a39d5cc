"""Evaluation bundles: a YAML file listing tasks and one JSONL file per task (the study's format).

Two layouts read the same way, so DCLM's CORE bundle, the study's Saunshi et al. suite and its
"owned" bundle, and looped_hf's built-in primitives all load with :func:`load_bundle`:

- CORE (``core.yaml``): tasks under ``icl_tasks``, the type in ``icl_task_type``, ``num_fewshot``
  a one-element list, the group the first folder of ``dataset_uri``, and the random baselines (in
  percent) in ``eval_meta_data.csv`` (columns ``Eval Task``, ``Random baseline``) beside the YAML.
- The study's own bundles (``saunshi.yaml``, ``owned.yaml``): tasks under ``tasks``, the type in
  ``task_type``, ``num_fewshot`` an integer and a ``group`` field. A task may carry its own
  ``random_baseline`` (percent); without one the baseline is 0 and the centered score equals the
  accuracy, as the study reports those suites.

Data files live in ``eval_data/<dataset_uri>`` (the study's layout), or beside the YAML. Rows are
``{"query", "choices", "gold"}`` (multiple choice), ``{"context_options", "continuation",
"gold"}`` (schema) or ``{"context", "continuation"}`` (language modelling). Every check names the
file, the line and the field that is wrong.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from looped_hf.fileio import first_line, yaml_load

PathLike = str | os.PathLike[str]

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
#: The study shuffles every task with this seed before subsampling (``--max-per-task``) and
#: before the few-shot draw, which indexes the shuffled rows; the same seed gives the same items.
SHUFFLE_SEED = 1337
META_CSV = "eval_meta_data.csv"
DATA_DIR = "eval_data"


class BundleError(ValueError):
    """A bundle that cannot be read: the message names the file, the line and the field."""


@dataclass
class Task:
    """One task of a bundle, its rows already read and checked.

    ``rows`` are in file order; :meth:`items` gives the study's shuffled (and optionally
    subsampled) order, which is what prompts and few-shot draws index."""

    label: str
    task_type: str
    num_fewshot: int
    continuation_delimiter: str
    group: str
    random_baseline: float  # percent, as the CORE table gives it
    path: Path
    rows: list[dict[str, Any]] = field(repr=False)

    def items(self, max_per_task: int | None = None) -> list[dict[str, Any]]:
        """The rows shuffled with ``random.Random(1337)`` and cut to ``max_per_task`` (None or <= 0:
        all), exactly as the study's ``evaluate_core`` / ``evaluate_saunshi`` do."""
        rows = list(self.rows)
        random.Random(SHUFFLE_SEED).shuffle(rows)
        if max_per_task is not None and max_per_task > 0:
            rows = rows[:max_per_task]
        return rows

    def to_meta(self) -> dict[str, Any]:
        """The task's description as the results file records it (no rows)."""
        return {
            "label": self.label,
            "task_type": self.task_type,
            "num_fewshot": self.num_fewshot,
            "continuation_delimiter": self.continuation_delimiter,
            "group": self.group,
            "random_baseline": self.random_baseline,
            "dataset": str(self.path),
            "rows": len(self.rows),
        }


@dataclass
class Bundle:
    """A bundle: its YAML file and its tasks, in the YAML's order."""

    name: str
    path: Path
    tasks: list[Task]

    def select(self, labels: Sequence[str] | None) -> Bundle:
        """Only the tasks named in ``labels`` (None: all); an unknown label is an error."""
        if not labels:
            return self
        known = {t.label for t in self.tasks}
        missing = [label for label in labels if label not in known]
        if missing:
            raise BundleError(f"{self.path}: no task named {missing!r}; tasks: {sorted(known)}")
        return Bundle(self.name, self.path, [t for t in self.tasks if t.label in set(labels)])


def _yaml_file(path: Path) -> Path:
    """The bundle YAML: ``path`` itself, or the one YAML file in the directory ``path``."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle (a directory with a YAML task list, or the YAML file)")
    found = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    if len(found) != 1:
        names = [p.name for p in found]
        raise BundleError(
            f"{path}: expected exactly one YAML task list in the bundle directory, found {names}"
        )
    return found[0]


def _line_of(text: str, needle: str) -> int:
    """1-based line of the first occurrence of ``needle`` in ``text`` (1 when absent)."""
    pos = text.find(needle)
    return text.count("\n", 0, pos) + 1 if pos >= 0 else 1


def _baselines(yaml_path: Path) -> dict[str, float]:
    csv_path = yaml_path.parent / META_CSV
    if not csv_path.is_file():
        return {}
    out: dict[str, float] = {}
    with open(csv_path, encoding="utf-8", newline="") as fh:
        for lineno, row in enumerate(csv.DictReader(fh), start=2):
            try:
                out[row["Eval Task"]] = float(row["Random baseline"])
            except (KeyError, TypeError, ValueError) as err:
                raise BundleError(
                    f"{csv_path}, line {lineno}: field 'Random baseline' of task {row.get('Eval Task')!r}: "
                    f"not a number ({row.get('Random baseline')!r})"
                ) from err
    return out


def _data_path(yaml_path: Path, uri: str) -> Path:
    for base in (yaml_path.parent / DATA_DIR, yaml_path.parent):
        if (base / uri).is_file():
            return base / uri
    return yaml_path.parent / DATA_DIR / uri


def _check_row(row: Any, task_type: str, where: str) -> None:
    """Raise a BundleError naming ``where`` (file, line) and the field when ``row`` cannot be scored."""
    if not isinstance(row, dict):
        raise BundleError(f"{where}: expected a JSON object, got {type(row).__name__}")

    def need(name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in row:
            raise BundleError(f"{where}: field {name!r} missing (a {task_type} row needs it)")
        if not isinstance(row[name], kind):
            raise BundleError(
                f"{where}: field {name!r} = {row[name]!r}: expected {getattr(kind, '__name__', kind)}"
            )
        return row[name]

    if task_type == "multiple_choice":
        need("query", str)
        options = need("choices", list)
        field_name = "choices"
    elif task_type == "schema":
        need("continuation", str)
        options = need("context_options", list)
        field_name = "context_options"
    else:
        need("context", str)
        need("continuation", str)
        return
    if len(options) < 2:
        raise BundleError(f"{where}: field {field_name!r} has {len(options)} option(s); need at least 2")
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option.strip():  # None, a number, "": nothing to score
            raise BundleError(f"{where}: field {field_name!r}[{i}] = {option!r}: expected a non-empty string")
    gold = need("gold", int)
    if isinstance(gold, bool) or not 0 <= gold < len(options):
        raise BundleError(
            f"{where}: field 'gold' = {gold!r} out of range: {field_name!r} has {len(options)} options "
            f"(0 .. {len(options) - 1})"
        )


def read_rows(path: Path, task_type: str) -> list[dict[str, Any]]:
    """The rows of one task's JSONL file, each checked for its type (errors name file and line)."""
    if not path.is_file():
        raise BundleError(f"{path}: data file missing")
    rows = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise BundleError(f"{where}: not valid JSON ({err.msg})") from err
            except UnicodeDecodeError:
                raise BundleError(f"{where}: not UTF-8 text") from None
            _check_row(row, task_type, where)
            rows.append(row)
    if not rows:
        raise BundleError(f"{path}: no rows")
    return rows


def load_bundle(path: PathLike, tasks: Sequence[str] | None = None) -> Bundle:
    """Read and check a bundle (a directory holding its YAML, or the YAML file itself).

    ``tasks``: only these labels. Raises :class:`BundleError` naming the file, line and field of
    anything that is wrong: an unknown task type, a missing data file, a ``gold`` out of range."""
    yaml_path = _yaml_file(Path(path))
    try:
        text = yaml_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BundleError(f"{yaml_path}: cannot be read as text ({first_line(err)})") from None
    try:
        config = yaml_load(text) or {}
    except yaml.YAMLError as err:
        raise BundleError(f"{yaml_path}: not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(config, dict):
        raise BundleError(f"{yaml_path}: expected a mapping with 'tasks' or 'icl_tasks'")
    core = "icl_tasks" in config
    entries = config.get("icl_tasks" if core else "tasks")
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{yaml_path}: field 'tasks' (or CORE's 'icl_tasks') missing or empty")
    baselines = _baselines(yaml_path)
    wanted = set(tasks) if tasks else None
    out = []
    for n, entry in enumerate(entries):
        label = entry.get("label") if isinstance(entry, dict) else None
        line = _line_of(text, f"label: {label}") if label else 1
        where = f"{yaml_path}, line {line} (task {n}{f' {label!r}' if label else ''})"
        if not isinstance(entry, dict) or not isinstance(label, str):
            raise BundleError(f"{where}: field 'label' missing")
        if wanted is not None and label not in wanted:
            continue
        type_key = "icl_task_type" if core else "task_type"
        task_type = entry.get(type_key)
        if task_type not in TASK_TYPES:
            raise BundleError(
                f"{where}: field {type_key!r} = {task_type!r}: unknown task type; one of {list(TASK_TYPES)}"
            )
        uri = entry.get("dataset_uri")
        if not isinstance(uri, str):
            raise BundleError(f"{where}: field 'dataset_uri' missing")
        shots = entry.get("num_fewshot", 0)
        if isinstance(shots, list):  # CORE lists the few-shot counts; the study evaluates the first
            shots = shots[0] if shots else 0
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise BundleError(f"{where}: field 'num_fewshot' = {shots!r}: expected an integer >= 0")
        delimiter = entry.get("continuation_delimiter", " ")
        if not isinstance(delimiter, str):
            raise BundleError(f"{where}: field 'continuation_delimiter' = {delimiter!r}: expected a string")
        group = uri.split("/")[0] if core else str(entry.get("group", "ungrouped"))
        baseline = entry.get("random_baseline", baselines.get(label, 0.0))
        if core and label not in baselines and "random_baseline" not in entry:
            raise BundleError(
                f"{where}: no random baseline for {label!r} (CORE reads it from {yaml_path.parent / META_CSV})"
            )
        if not isinstance(baseline, (int, float)) or not 0 <= baseline < 100:
            raise BundleError(
                f"{where}: field 'random_baseline' = {baseline!r}: expected a percentage in [0, 100)"
            )
        data = _data_path(yaml_path, uri)
        root = yaml_path.parent.resolve()
        if Path(uri).is_absolute() or not data.resolve().is_relative_to(root):
            # ../../etc/hostname or a link out: a bundle reads only files inside its own folder
            raise BundleError(f"{where}: field 'dataset_uri' = {uri!r}: outside the bundle folder {root}")
        if not data.is_file():
            raise BundleError(f"{where}: field 'dataset_uri' = {uri!r}: data file missing ({data})")
        rows = read_rows(data, task_type)
        if shots >= len(rows):
            raise BundleError(
                f"{where}: field 'num_fewshot' = {shots}: the task has only {len(rows)} rows "
                "(few-shot examples are drawn from the other rows)"
            )
        out.append(Task(label, task_type, shots, delimiter, group, float(baseline), data, rows))
    if wanted is not None:
        missing = sorted(wanted - {t.label for t in out})
        if missing:
            raise BundleError(f"{yaml_path}: no task named {missing}")
    return Bundle(yaml_path.stem, yaml_path, out)


__all__ = ["TASK_TYPES", "Bundle", "BundleError", "Task", "load_bundle", "read_rows"]
