"""A sweep's runs: loading and validating run records for the scaling-law fit.

A run record is one JSON object per line of the training side's ``results.jsonl`` (or a CSV
row, a DataFrame row, a dict). Columns used:

- ``loss`` (final held-out eval loss, nats/token), ``tokens`` (D);
- looped: ``n_once``, ``n_rec``, ``num_recurrences`` (r); plain: ``params`` (N, Chinchilla form);
- optional: ``budget`` (planned FLOPs, for the cell bootstrap, leave-one-budget-out and the
  IsoFLOP diagnostics), ``train_flops`` (for plots and compute-optimal sizes), ``hidden_size``
  (width, to name the models in the diagnostics), ``arch``, ``seed``, ``status`` (rows not
  ``"ok"`` are dropped with a note), ``variant`` (a file mixing variants must be split with
  ``variant=``).

Every error is a ``ValueError`` that names the row (``line 7`` of a file, ``index 3`` of a
DataFrame, ``row 3`` of a list) and the column, so a broken sweep can be fixed by hand.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..fileio import read_json

LOOPED_COLUMNS = ("n_once", "n_rec", "num_recurrences")


def error_prefix(source: str) -> str:
    """How an error about runs from ``source`` begins: ``"results.jsonl: "``, or nothing for runs
    that come from no file (``"<memory>"``, ``"<DataFrame>"``)."""
    return "" if source.startswith("<") else f"{source}: "


@dataclass
class Runs:
    """Validated runs as numpy arrays (plain runs have ``n_rec = 0``, ``num_recurrences = 1``)."""

    loss: np.ndarray
    tokens: np.ndarray
    n_once: np.ndarray
    n_rec: np.ndarray
    num_recurrences: np.ndarray
    kind: Literal["looped", "plain"]
    labels: list[str]
    budget: np.ndarray | None = None
    train_flops: np.ndarray | None = None
    arch: list[str] | None = None
    seed: np.ndarray | None = None
    width: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)
    source: str = "<memory>"
    shared: np.ndarray | None = None
    """Rows taken from the base sweep to stand in for a probe's missing r = 1 runs (bool mask;
    ``None``: no row is shared). See :func:`share_base_r1`."""
    variant: str | None = None
    """The probe's variant name when rows are shared (written back by :meth:`to_records`)."""

    def __len__(self) -> int:
        return int(self.loss.shape[0])

    @property
    def where(self) -> str:
        """How an error about these runs begins (:func:`error_prefix` of ``source``)."""
        return error_prefix(self.source)

    @property
    def params(self) -> np.ndarray:
        """Unique parameters ``N_once + N_rec``."""
        return self.n_once + self.n_rec

    @property
    def flops(self) -> np.ndarray:
        """Training FLOPs: ``train_flops`` where recorded, else ``6 * (N_once + r N_rec) * D``."""
        fallback = 6.0 * (self.n_once + self.num_recurrences * self.n_rec) * self.tokens
        if self.train_flops is None:
            return fallback
        return np.where(np.isfinite(self.train_flops), self.train_flops, fallback)

    @property
    def non_looped(self) -> np.ndarray:
        """Runs without a loop (``r = 1`` or ``N_rec = 0``): the law's plain-model anchor."""
        return (self.num_recurrences == 1) | (self.n_rec == 0)

    @property
    def n_shared(self) -> int:
        """How many rows are shared from the base sweep (0 when none)."""
        return 0 if self.shared is None else int(self.shared.sum())

    @property
    def flops_is_fallback(self) -> bool:
        return self.train_flops is None or not bool(np.all(np.isfinite(self.train_flops)))

    def subset(self, mask: np.ndarray) -> Runs:
        """The runs where ``mask`` is true (labels and notes kept)."""
        idx = np.flatnonzero(mask)

        def take(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[idx]

        return Runs(
            loss=self.loss[idx],
            tokens=self.tokens[idx],
            n_once=self.n_once[idx],
            n_rec=self.n_rec[idx],
            num_recurrences=self.num_recurrences[idx],
            kind=self.kind,
            labels=[self.labels[i] for i in idx],
            budget=take(self.budget),
            train_flops=take(self.train_flops),
            arch=None if self.arch is None else [self.arch[i] for i in idx],
            seed=take(self.seed),
            width=take(self.width),
            notes=list(self.notes),
            source=self.source,
            shared=take(self.shared),
            variant=self.variant,
        )

    def to_records(self) -> list[dict[str, Any]]:
        """Plain dicts (JSON-safe), the inverse of :func:`load_runs` on a list."""
        out = []
        for i in range(len(self)):
            rec: dict[str, Any] = {
                "label": self.labels[i],
                "loss": float(self.loss[i]),
                "tokens": float(self.tokens[i]),
            }
            if self.kind == "looped":
                rec.update(
                    n_once=float(self.n_once[i]),
                    n_rec=float(self.n_rec[i]),
                    num_recurrences=float(self.num_recurrences[i]),
                )
            else:
                rec["params"] = float(self.n_once[i])
            for name, key in (("budget", "budget"), ("train_flops", "train_flops"), ("seed", "seed"),
                              ("width", "hidden_size")):  # fmt: skip
                arr = getattr(self, name)
                if arr is not None and np.isfinite(arr[i]):
                    rec[key] = float(arr[i])
            if self.arch is not None:
                rec["arch"] = self.arch[i]
            if self.shared is not None:
                # load_runs re-derives the sharing from these (see share_base_r1).
                rec["variant"] = "base" if self.shared[i] else (self.variant or "probe")
            out.append(rec)
        return out


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    records, labels = [], []
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: line {lineno}: expected a JSON object, got {type(rec).__name__}")
            records.append(rec)
            labels.append(f"line {lineno}")
    return records, labels


def _read_csv(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    records, labels = [], []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        for rec in reader:
            # Empty cells are missing values; numbers are parsed later, column by column.
            records.append({k: (None if v == "" else v) for k, v in rec.items() if k is not None})
            labels.append(f"line {reader.line_num}")
    return records, labels


def _records_from(source: Any) -> tuple[list[dict[str, Any]], list[str], str]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".ndjson"):
            recs, labels = _read_jsonl(path)
        elif suffix == ".csv":
            recs, labels = _read_csv(path)
        elif suffix == ".json":
            obj = read_json(path)
            if not isinstance(obj, list):
                raise ValueError(f"{path}: expected a JSON list of run records, got {type(obj).__name__}")
            for i, rec in enumerate(obj):
                if not isinstance(rec, dict):
                    raise ValueError(f"{path}: item {i}: expected a JSON object, got {type(rec).__name__}")
            recs, labels = obj, [f"item {i}" for i in range(len(obj))]
        else:
            raise ValueError(f"{path}: unsupported file type {suffix!r} (use .jsonl or .csv)")
        return recs, labels, str(path)
    if hasattr(source, "to_dict") and hasattr(source, "columns"):  # a pandas DataFrame, duck-typed
        recs = source.to_dict("records")
        return recs, [f"index {idx}" for idx in source.index], "<DataFrame>"
    if isinstance(source, Iterable) and not isinstance(source, Mapping):
        recs = list(source)
        for i, rec in enumerate(recs):
            if not isinstance(rec, Mapping):
                raise ValueError(f"row {i}: expected a dict, got {type(rec).__name__}")
        return [dict(r) for r in recs], [f"row {i}" for i in range(len(recs))], "<records>"
    raise ValueError(
        f"cannot read runs from {type(source).__name__}: pass a path, DataFrame or list of dicts"
    )


#: Token and parameter counts above this are refused: a million times the largest models and
#: corpora trained, so only a units or typing error reaches it, and FLOPs of such counts overflow.
MAX_COUNT = 1e18


def _show(x: Any) -> str:
    """A number as Python writes it (``0``, ``-2``, ``0.5``), never numpy's ``np.float64(0.0)``."""
    if isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool):
        f = float(x)
        return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)
    return repr(x)


def _number(rec: Mapping[str, Any], col: str, label: str, where: str) -> float:
    """Parse ``rec[col]`` as a finite float or raise a ValueError naming row and column."""
    if col not in rec or rec[col] is None:
        raise ValueError(f"{where}{label}: column {col!r} is missing")
    v = rec[col]
    if isinstance(v, bool):
        raise ValueError(f"{where}{label}: column {col!r} is a boolean ({v!r}), expected a number")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{where}{label}: column {col!r} is not a number ({_show(v)})") from None
    if not math.isfinite(x):
        raise ValueError(
            f"{where}{label}: column {col!r} is {_show(x)}; losses, sizes and tokens must be finite"
        )
    return x


def _optional_number(rec: Mapping[str, Any], col: str, label: str, where: str) -> float:
    v = rec.get(col)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return math.nan
    x = _number(rec, col, label, where)
    if x <= 0 and col != "seed":
        raise ValueError(f"{where}{label}: column {col!r} must be > 0, got {_show(x)}")
    return x


def load_runs(source: Any, *, variant: str | None = None) -> Runs:
    """Read and validate run records.

    Args:
        source: a ``.jsonl`` / ``.csv`` path, a pandas DataFrame, a list of dicts, or a
            :class:`Runs` (returned as is).
        variant: keep only rows whose ``variant`` equals this (rows without the key count as
            ``"base"``). Required when the records mix variants, except in the study's probe
            layout: one probe variant with no r = 1 runs plus ``"base"`` rows that are all r = 1
            runs. A probe without r = 1 runs is fitted with the base's r = 1 runs of the same
            records (as the study does; marked in ``Runs.shared``, see :func:`share_base_r1`).

    Returns:
        :class:`Runs`; ``kind`` is ``"looped"`` when ``n_once``, ``n_rec`` and
        ``num_recurrences`` are columns, ``"plain"`` when ``params`` is.

    Raises:
        ValueError: naming the row and the column for a missing column, a non-number, NaN or
            inf, a zero or negative size/loss/token count, ``num_recurrences < 1``, or a
            duplicate run (same model, tokens and seed); also for mixed variants.
    """
    if isinstance(source, Runs):
        return source
    records, labels, src = _records_from(source)
    where = error_prefix(src)
    notes: list[str] = []

    # 1. failed runs: dropped, with a note (they carry no usable loss).
    keep = [i for i, r in enumerate(records) if str(r.get("status", "ok")).lower() == "ok"]
    dropped = [labels[i] for i in range(len(records)) if i not in set(keep)]
    if dropped:
        shown = ", ".join(dropped[:8]) + (" ..." if len(dropped) > 8 else "")
        notes.append(f"ignored {len(dropped)} run(s) whose status is not 'ok' ({shown})")
    if dropped and not keep:
        raise ValueError(
            f"{where}no successful runs: all {len(dropped)} record(s) have a status other than 'ok'"
        )
    records = [records[i] for i in keep]
    labels = [labels[i] for i in keep]

    # 2. variants: a probe and its baseline are not one sweep, except as the study fits a probe
    #    sweep that has no r = 1 runs: with the base's r = 1 runs (the same models, since
    #    truncation and lanes only act on a loop).
    def variant_of(rec: Mapping[str, Any]) -> str:
        return str(rec.get("variant") or "base")

    variants = {variant_of(r) for r in records}
    if variant is None and len(variants) > 1:
        variant = _probe_with_base_r1(records, variants)
        if variant is None:
            raise ValueError(
                f"{where}the runs mix variants {sorted(variants)}; fit one at a time with "
                "variant=... (CLI: --variant NAME) and compare them with compare_fits / --compare "
                "(a probe file may hold the base's r = 1 runs besides its own r > 1 runs: the study's "
                "probe fit)"
            )
    if variant is not None:
        sel = [i for i, r in enumerate(records) if variant_of(r) == variant]
        if not sel:
            raise ValueError(f"{where}no runs with variant {variant!r} (found: {sorted(variants)})")
        shared = []
        if variant != "base" and not any(_plain_record(records[i]) for i in sel):
            shared = [i for i, r in enumerate(records) if variant_of(r) == "base" and _plain_record(r)]
        notes.append(f"variant {variant!r}: {len(sel)} run(s)")
        if shared:
            base = _build_runs([records[i] for i in shared], [labels[i] for i in shared], src, where, [])
            probe = _build_runs([records[i] for i in sel], [labels[i] for i in sel], src, where, notes)
            return share_base_r1(probe, base, variant=variant)
        records = [records[i] for i in sel]
        labels = [labels[i] for i in sel]
    return _build_runs(records, labels, src, where, notes)


def _plain_record(rec: Mapping[str, Any]) -> bool:
    """A record of a run without a loop (``r = 1`` or ``n_rec = 0``); unparsable fields: False
    (the validation names them later)."""
    for col, value in (("num_recurrences", 1.0), ("n_rec", 0.0)):
        try:
            if float(rec.get(col)) == value:  # type: ignore[arg-type]
                return True
        except (TypeError, ValueError):
            pass
    return False


def _probe_with_base_r1(records: list[dict[str, Any]], variants: set[str]) -> str | None:
    """The probe's variant when the records are one probe's runs plus base r = 1 runs and the
    probe has no r = 1 run of its own (the study's probe fit); else ``None``."""
    probes = variants - {"base"}
    if "base" not in variants or len(probes) != 1:
        return None
    name = next(iter(probes))
    for rec in records:
        is_base = str(rec.get("variant") or "base") == "base"
        if is_base != _plain_record(rec):  # a looped base run, or an r = 1 probe run
            return None
    return name


def _cat(a: np.ndarray | None, b: np.ndarray | None, n_a: int, n_b: int, fill: bool) -> np.ndarray | None:
    """Concatenate optional columns; a column missing on one side is NaN there (``fill``) or
    dropped (``None``, for columns that must be complete)."""
    if a is None and b is None:
        return None
    if (a is None or b is None) and not fill:
        return None
    a = np.full(n_a, np.nan) if a is None else a
    b = np.full(n_b, np.nan) if b is None else b
    return np.concatenate([a, b])


def share_base_r1(probe: Runs, base: Runs, *, variant: str | None = None) -> Runs:
    """The study's probe sweep: the base's r = 1 runs, then the probe's own runs.

    A probe (truncated backprop, hyperconnections) changes only what a loop does, so its r = 1
    runs would be the base's; the study trains none and fits the probe with the base's. phi is
    then measured, as for the base, against the plain models of the same sweep. The shared rows
    are marked (``shared``), so a paired bootstrap can resample them together with the base's.

    Raises:
        ValueError: the probe has r = 1 runs of its own, the base has none, or a side is plain.
    """
    if probe.kind != "looped" or base.kind != "looped":
        raise ValueError(
            "sharing r = 1 runs needs looped runs (n_once, n_rec, num_recurrences) on both sides"
        )
    if probe.non_looped.any():
        raise ValueError(
            f"the probe ({probe.source}) has {int(probe.non_looped.sum())} r = 1 run(s) of its own: nothing to share"
        )
    plain = base.non_looped
    if not plain.any():
        raise ValueError(f"the base ({base.source}) has no r = 1 run to share with the probe")
    b, n_b, n_p = base.subset(plain), int(plain.sum()), len(probe)
    same_source = b.source == probe.source
    labels = [lab if same_source else f"base {lab}" for lab in b.labels] + list(probe.labels)
    budget = _cat(b.budget, probe.budget, n_b, n_p, fill=False)
    notes = list(probe.notes)
    if budget is None and (b.budget is not None or probe.budget is not None):
        notes.append("'budget' is recorded on one side only: ignored (no cell bootstrap)")
    notes.append(
        f"r = 1 runs shared from the base ({n_b} runs): the probe sweep has none, so, as in the study, "
        "its phi is fitted against the base's r = 1 runs"
    )
    return Runs(
        loss=np.concatenate([b.loss, probe.loss]),
        tokens=np.concatenate([b.tokens, probe.tokens]),
        n_once=np.concatenate([b.n_once, probe.n_once]),
        n_rec=np.concatenate([b.n_rec, probe.n_rec]),
        num_recurrences=np.concatenate([b.num_recurrences, probe.num_recurrences]),
        kind="looped",
        labels=labels,
        budget=budget,
        train_flops=_cat(b.train_flops, probe.train_flops, n_b, n_p, fill=True),
        arch=None if b.arch is None or probe.arch is None else [*b.arch, *probe.arch],
        seed=_cat(b.seed, probe.seed, n_b, n_p, fill=True),
        width=_cat(b.width, probe.width, n_b, n_p, fill=False),
        notes=notes,
        source=probe.source if same_source else f"{probe.source} + r = 1 runs of {b.source}",
        shared=np.r_[np.ones(n_b, bool), np.zeros(n_p, bool)],
        variant=variant or probe.variant,
    )


def _build_runs(
    records: list[dict[str, Any]], labels: list[str], src: str, where: str, notes: list[str]
) -> Runs:
    """Validate one variant's records (see :func:`load_runs`) into :class:`Runs`."""
    # 3. the form: looped if any looped column is present, plain if 'params' is.
    columns = set().union(*(r.keys() for r in records))
    if any(c in columns for c in LOOPED_COLUMNS):
        kind: Literal["looped", "plain"] = "looped"
        model_cols: tuple[str, ...] = LOOPED_COLUMNS
    elif "params" in columns:
        kind = "plain"
        model_cols = ("params",)
    else:
        raise ValueError(
            f"{where}missing columns: need 'loss', 'tokens' and either 'n_once', 'n_rec', "
            f"'num_recurrences' (looped) or 'params' (plain); found {sorted(columns)}"
        )

    n = len(records)
    loss, tokens = np.empty(n), np.empty(n)
    n_once, n_rec, reps = np.empty(n), np.zeros(n), np.ones(n)
    budget, flops, seed = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    width = np.full(n, np.nan)
    for i, (rec, label) in enumerate(zip(records, labels)):
        for col in ("loss", "tokens"):
            x = _number(rec, col, label, where)
            if x <= 0:
                raise ValueError(f"{where}{label}: column {col!r} must be > 0, got {_show(x)}")
            (loss if col == "loss" else tokens)[i] = x
        if kind == "plain":
            n_once[i] = _number(rec, "params", label, where)
            if n_once[i] <= 0:
                raise ValueError(f"{where}{label}: column 'params' must be > 0, got {_show(n_once[i])}")
        else:
            n_once[i] = _number(rec, "n_once", label, where)
            n_rec[i] = _number(rec, "n_rec", label, where)
            reps[i] = _number(rec, "num_recurrences", label, where)
            for col, x in (("n_once", n_once[i]), ("n_rec", n_rec[i])):
                if x < 0:
                    raise ValueError(f"{where}{label}: column {col!r} must be >= 0, got {_show(x)}")
            if n_once[i] + n_rec[i] <= 0:
                raise ValueError(f"{where}{label}: columns 'n_once' + 'n_rec' must be > 0 (both are 0)")
            if reps[i] < 1 or not reps[i].is_integer():
                raise ValueError(
                    f"{where}{label}: column 'num_recurrences' must be an integer >= 1, got {_show(reps[i])}"
                )
        for col, x in (("tokens", tokens[i]), ("n_once", n_once[i]), ("n_rec", n_rec[i])):
            if x > MAX_COUNT:
                name = "params" if kind == "plain" and col == "n_once" else col
                raise ValueError(f"{where}{label}: column {name!r} is {_show(x)}; counts above {MAX_COUNT:g} "
                                 "are a units or typing error, not a training run")  # fmt: skip
        budget[i] = _optional_number(rec, "budget", label, where)
        flops[i] = _optional_number(rec, "train_flops", label, where)
        seed[i] = _optional_number(rec, "seed", label, where)
        width[i] = _optional_number(rec, "hidden_size", label, where)

    # 4. duplicates: the same model trained on the same tokens with the same seed, twice.
    key_cols = (*model_cols, "tokens", "seed")
    seen: dict[tuple[float, ...], str] = {}
    for i, label in enumerate(labels):
        key = (n_once[i], n_rec[i], reps[i], tokens[i], seed[i])
        key = tuple(-1.0 if math.isnan(k) else k for k in key)
        if key in seen:
            raise ValueError(
                f"{where}{label}: duplicate run: same {', '.join(repr(c) for c in key_cols)} as {seen[key]}"
            )
        seen[key] = label

    n_budget = int(np.isfinite(budget).sum())
    if 0 < n_budget < n:
        notes.append(
            f"'budget' is recorded for {n_budget} of {n} runs only: ignored (no cell bootstrap, no "
            "leave-one-budget-out check)"
        )
    arch = [str(r["arch"]) for r in records] if all("arch" in r for r in records) else None
    return Runs(
        loss=loss,
        tokens=tokens,
        n_once=n_once,
        n_rec=n_rec,
        num_recurrences=reps,
        kind=kind,
        labels=list(labels),
        budget=budget if np.all(np.isfinite(budget)) else None,
        train_flops=flops if np.any(np.isfinite(flops)) else None,
        arch=arch,
        seed=seed if np.any(np.isfinite(seed)) else None,
        width=width if np.all(np.isfinite(width)) else None,
        notes=notes,
        source=src,
    )


def load_chinchilla_svg(path: str | os.PathLike[str], drop_highest: int = 5) -> list[dict[str, float]]:
    """Epoch AI's points extracted from Chinchilla's Figure 4 as plain run records.

    Besiroglu et al. 2024 drop the ``drop_highest`` highest-loss points (5) and derive tokens as
    ``D = C / (6 N)`` (``N = Model Size``, ``C = Training FLOP``).
    """
    recs, _ = _read_csv(Path(path))
    rows = [
        {"params": float(r["Model Size"]), "train_flops": float(r["Training FLOP"]), "loss": float(r["loss"])}
        for r in recs
    ]
    rows.sort(key=lambda r: -r["loss"])
    rows = rows[drop_highest:]
    for r in rows:
        r["tokens"] = r["train_flops"] / (6.0 * r["params"])
    return rows
