"""Writing and reading the results: ``eval_results.json``, ``eval_results.md``, ``eval_results.png``.

The JSON is written whole (temp file, fsync, rename: ``looped_hf.fileio.write_json_atomic``), so a
reader (the checkpoint card, a sweep card) never sees half of it. The markdown holds three task x r
tables (centered score, accuracy, mean continuation loss), each with the groups' and bundles'
means, and, when exit or KV-budget settings were on, the mean recurrences used per task. The plot
draws each group's mean centered score against r.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PathLike = str | os.PathLike[str]

RESULTS_STEM = "eval_results"
RESULTS_JSON = f"{RESULTS_STEM}.json"
RESULTS_MD = f"{RESULTS_STEM}.md"
RESULTS_PNG = f"{RESULTS_STEM}.png"


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def _table(results: Mapping[str, Any], key: str, with_groups: bool) -> str:
    rows = results["rows"]
    head = "| task | group | " + " | ".join(f"r = {row['num_recurrences']}" for row in rows) + " |"
    lines = [head, "|---|---|" + "---:|" * len(rows)]
    for task in results["tasks"]:
        label = task["label"]
        cells = [_fmt(row["tasks"].get(label, {}).get(key)) for row in rows]
        lines.append(f"| {label} | {task['group']} | " + " | ".join(cells) + " |")
    if with_groups:
        for bundle in rows[0]["bundles"]:
            for group in rows[0]["bundles"][bundle]["groups"]:
                gkey = "centered" if key == "centered" else key
                cells = [_fmt(row["bundles"][bundle]["groups"][group][gkey]) for row in rows]
                lines.append(f"| **{group}** (mean) | {bundle} | " + " | ".join(cells) + " |")
            if key == "centered":
                name = "CORE" if bundle == "core" else "mean of tasks"
                cells = [_fmt(row["bundles"][bundle]["mean_centered"]) for row in rows]
                lines.append(f"| **{name}** | {bundle} | " + " | ".join(cells) + " |")
                cells = [_fmt(row["bundles"][bundle]["group_mean"]) for row in rows]
                lines.append(f"| **mean of groups** | {bundle} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def score_table(results: Mapping[str, Any], key: str = "centered", with_groups: bool = True) -> str:
    """One task x r markdown table of ``key`` (``centered``, ``accuracy``, ``loss`` or
    ``mean_recurrences``), with the groups' and bundles' means below the tasks."""
    return _table(results, key, with_groups)


def markdown_tables(results: Mapping[str, Any]) -> str:
    """The task x r tables of a results dict (centered score, accuracy, loss; recurrences used when
    adaptive settings were on)."""
    trained = results.get("trained_num_recurrences")
    parts = [
        f"Centered score (accuracy rescaled so chance is 0 and perfect is 1; trained r = {trained}):",
        _table(results, "centered", True),
        "Accuracy:",
        _table(results, "accuracy", True),
        "Mean continuation loss (nats/token, gold continuation, token-weighted; lm-eval tasks report none):",
        _table(results, "loss", True),
    ]
    if results.get("adaptive"):
        parts += ["Mean recurrences used per scored token (adaptive exit / KV budget on):",
                  _table(results, "mean_recurrences", False)]  # fmt: skip
    return "\n\n".join(parts)


def summary_line(results: Mapping[str, Any]) -> str:
    """One sentence: each bundle's mean centered score at the smallest, trained and largest r."""
    rows = results["rows"]
    trained = results.get("trained_num_recurrences")
    picks = {rows[0]["num_recurrences"], rows[-1]["num_recurrences"]}
    if any(row["num_recurrences"] == trained for row in rows):
        picks.add(trained)
    parts = []
    for bundle in rows[0]["bundles"]:
        cells = [
            f"r = {row['num_recurrences']}: {_fmt(row['bundles'][bundle]['mean_centered'], 3)}"
            for row in rows
            if row["num_recurrences"] in picks
        ]
        parts.append(f"{bundle} mean centered score " + ", ".join(cells))
    return "; ".join(parts) + "."


def plot_scores(results: Mapping[str, Any], path: PathLike, title: str | None = None) -> Path:
    """Mean centered score of every group against r (log2 axis), one line per group, the trained r
    circled (``looped_hf.plotting.plot_metric_vs_r``)."""
    from looped_hf.plotting import RSeries, plot_metric_vs_r

    rows = results["rows"]
    if not rows:
        raise ValueError("plot_scores: the results have no rows")
    rs = [row["num_recurrences"] for row in rows]
    trained = results.get("trained_num_recurrences")
    series = [
        RSeries(f"{group} ({bundle})", rs, [row["bundles"][bundle]["groups"][group]["centered"] for row in rows],
                trained)  # fmt: skip
        for bundle in rows[0]["bundles"]
        for group in rows[0]["bundles"][bundle]["groups"]
    ]
    return plot_metric_vs_r(
        series,
        path,
        ylabel="centered score (0 = chance, 1 = perfect)",
        title=title or "task score vs r per group (circle: trained r)",
        zero_line=True,
    )


def write_results(results: Mapping[str, Any], out_dir: PathLike) -> list[Path]:
    """Write the plot, the markdown tables and the JSON (last) into ``out_dir``
    (``looped_hf.plotting.write_result_triple``)."""
    from looped_hf.plotting import write_result_triple

    name = results.get("run_id") or results.get("checkpoint") or "checkpoint"
    text = (
        f"# Downstream evaluation: {name}\n\n{summary_line(results)}\n\n{markdown_tables(results)}\n\n"
        f"![task score vs r]({RESULTS_PNG})\n"
    )

    def plot(path: Path) -> Path:
        return plot_scores(results, path, title=f"{name}: task score vs r")

    return write_result_triple(out_dir, RESULTS_STEM, results, text, plot)


def load_results(directory: PathLike, weights_sha256: str | None = None) -> dict[str, Any] | None:
    """The results saved in ``directory``, or None when there are none (or they were measured on
    other weights: ``weights_sha256`` given and different)."""
    path = Path(directory) / RESULTS_JSON
    if not path.is_file():
        return None
    results = json.loads(path.read_text(encoding="utf-8"))
    if weights_sha256 is not None and results.get("weights_sha256") not in (None, weights_sha256):
        return None
    return results


def collect_sweep_results(sweep_dir: PathLike) -> list[dict[str, Any]]:
    """The evaluation results of a sweep's runs: one entry per finished run whose directory
    (``<sweep>/<run_id>``) holds ``eval_results.json`` measured on its current weights, with the
    run's ``run_id``, ``train_flops``, trained ``num_recurrences`` and ``results``."""
    from looped_hf.fileio import is_finished, read_jsonl, weights_sha256

    sweep = Path(sweep_dir)
    records = read_jsonl(sweep / "results.jsonl") if (sweep / "results.jsonl").is_file() else []
    out = []
    for record in records:
        run_dir = sweep / str(record.get("run_id"))
        if not is_finished(record) or not (run_dir / RESULTS_JSON).is_file():
            continue
        results = load_results(run_dir, weights_sha256(run_dir))
        if results is None or not record.get("train_flops"):
            continue
        out.append({
            "run_id": record["run_id"],
            "train_flops": float(record["train_flops"]),
            "num_recurrences": int(record.get("num_recurrences") or results["trained_num_recurrences"]),
            "results": results,
        })  # fmt: skip
    return sorted(out, key=lambda e: (e["num_recurrences"], e["train_flops"]))


def _bundle_names(collected: list[Mapping[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for entry in collected:
        for row in entry["results"]["rows"]:
            names.update(dict.fromkeys(row["bundles"]))
    return list(names)


def sweep_score_table(collected: list[Mapping[str, Any]]) -> str:
    """Runs x inference r: each bundle's mean centered score (markdown), runs by trained r and FLOPs."""
    rs = sorted({row["num_recurrences"] for e in collected for row in e["results"]["rows"]})
    bundles = _bundle_names(collected)
    head = "| run | trained r | training FLOPs | bundle | " + " | ".join(f"r = {r}" for r in rs) + " |"
    lines = [head, "|---|---:|---:|---|" + "---:|" * len(rs)]
    for e in collected:
        for bundle in bundles:
            rows = {row["num_recurrences"]: row for row in e["results"]["rows"]}
            cells = [
                _fmt(rows[r]["bundles"][bundle]["mean_centered"], 3)
                if r in rows and bundle in rows[r]["bundles"]
                else "-"
                for r in rs
            ]
            lines.append(
                f"| {e['run_id']} | {e['num_recurrences']} | {e['train_flops']:.3g} | {bundle} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def plot_score_vs_flops(collected: list[Mapping[str, Any]], path: PathLike) -> Path:
    """Mean centered score against training FLOPs (log axis), a panel per bundle, a line per
    (trained r, inference r): how task scores scale with compute, and what extra recurrences at
    inference add at each budget."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not collected:
        raise ValueError("plot_score_vs_flops: no runs with evaluation results")
    bundles = _bundle_names(collected)
    fig = Figure(figsize=(6.4 * len(bundles), 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    for k, bundle in enumerate(bundles):
        ax = fig.add_subplot(1, len(bundles), k + 1)
        series: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for e in collected:
            for row in e["results"]["rows"]:
                if bundle in row["bundles"]:
                    key = (e["num_recurrences"], row["num_recurrences"])
                    series.setdefault(key, []).append(
                        (e["train_flops"], row["bundles"][bundle]["mean_centered"])
                    )
        for (trained, r), points in sorted(series.items()):
            points.sort()
            ls = "-" if trained == r else "--"
            ax.plot(
                *zip(*points), marker="o", ms=3.5, lw=1.4, ls=ls, label=f"trained r = {trained}, eval r = {r}"
            )
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel("mean centered score")
        ax.set_title(f"{bundle}: task score vs training compute (solid: eval at trained r)", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def row_at(results: Mapping[str, Any], r: int) -> Mapping[str, Any] | None:
    """The results row measured at r, or None."""
    return next((row for row in results.get("rows", []) if row["num_recurrences"] == r), None)


__all__ = [
    "RESULTS_JSON",
    "RESULTS_MD",
    "RESULTS_PNG",
    "collect_sweep_results",
    "load_results",
    "markdown_tables",
    "plot_score_vs_flops",
    "plot_scores",
    "row_at",
    "score_table",
    "summary_line",
    "sweep_score_table",
    "write_results",
]
