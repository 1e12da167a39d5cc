"""The sweep's results file (`results.jsonl`): one JSON line per run, appended atomically under a
file lock, read back tolerating a torn last line (a writer killed mid-append). The JSONL store
itself lives in ``looped_hf.fileio`` (training appends its record there too, without the sweep)."""

from __future__ import annotations

from looped_hf.fileio import _locked as _locked
from looped_hf.fileio import _parse_lines as _parse_lines
from looped_hf.fileio import append_jsonl as append_jsonl
from looped_hf.fileio import read_jsonl as read_jsonl

RESULTS_NAME = "results.jsonl"
