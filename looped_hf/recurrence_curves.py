"""Test-time scaling curve of a checkpoint: held-out loss at r = 1 .. 4x its training r.

    looped-hf test-time runs/tiny                          # r = 1 .. 4 x trained r
    looped-hf test-time runs/tiny runs/tiny_sampled_r --compare plots/test_time.png
    looped-hf test-time runs/tiny --max-factor 8 --batch-size 32
    looped-hf test-time huginn-looped --data heldout.txt --seq-len 512   # a converted checkpoint

A looped model can run its block any number of times at inference; whether more recurrences
help, and how far past the trained r they keep helping, is what a user choosing r needs to know
(a model trained at one fixed r often degrades when run longer; training with a sampled r,
`recurrence_sampling: poisson_lognormal`, is meant to fix that). For a finished run directory
this measures the held-out loss on the run's own held-out split (rebuilt from its recipe, as
``looped-hf publish --verify`` does) at every r from 1 to ``max_factor`` x the trained r, token-
weighted as the run record's ``loss`` (`looped_hf.train.heldout_loss`), and writes into the run
directory:

    test_time_scaling.json    the curve and what it was measured on (weights' sha256, tokens)
    test_time_scaling.md      the same as a markdown table
    test_time_scaling.png     the plot (`plot_test_time_scaling`)

``decoding_heldout_loss`` measures the held-out loss as decoding sees it (one token at a time
through a cache), for the settings that act only there: a KV budget and adaptive exit
(`benchmarks/bench_test_time.py`).

A checkpoint that was not trained here (one written by ``looped-hf convert``) has no run record
and so no recipe to rebuild a held-out split from: ``--data`` names the text to measure on (a local
file or a Hub dataset, as the recipe's ``dataset``), tokenized with the checkpoint's own tokenizer;
the trained r is the config's ``num_recurrences``. ``--data`` on a run directory measures on that
text instead of the run's split (the run record's loss is then not shown beside it).

The checkpoint card (`looped_hf.cards.render_checkpoint_card`) shows the table when the JSON is
next to the checkpoint; a converted folder's card (``looped-hf convert``'s) gets it as a section
(`looped_hf.convert.card_curve`). Models whose parameters are indexed by recurrence step (hyperconnections)
run only at their trained r and are refused (`LoopedConfig.resolve_num_recurrences` owns every r
rule, the ceiling included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from looped_hf.cli import positive_int
from looped_hf.fileio import (
    RECORD_NAME,
    CheckpointError,
    check_checkpoint_dir,
    check_finished_run,
    check_output_path,
    first_line,
)

PathLike = str | os.PathLike[str]

CURVE_STEM = "test_time_scaling"
CURVE_JSON = f"{CURVE_STEM}.json"
CURVE_MD = f"{CURVE_STEM}.md"
CURVE_PNG = f"{CURVE_STEM}.png"
DEFAULT_MAX_FACTOR = 4


class TestTimeError(ValueError):
    """A run directory or option the curve cannot be measured for; the message names it."""

    __test__ = False  # not a pytest test class


def recurrence_grid(trained_r: int, max_factor: int = DEFAULT_MAX_FACTOR) -> list[int]:
    """r = 1, 2, ..., max_factor x trained_r (every integer: the curve's shape near the trained r
    matters as much as its tail)."""
    if trained_r < 1:
        raise TestTimeError(f"num_recurrences={trained_r}: must be >= 1")
    if not isinstance(max_factor, int) or max_factor < 1:
        raise TestTimeError(f"max_factor={max_factor!r}: must be an integer >= 1")
    return list(range(1, max_factor * trained_r + 1))


#: Local ``--data`` files read as text (checked to be UTF-8); other types (parquet, arrow) only non-empty.
TEXT_SUFFIXES = (".txt", ".text", ".md", ".json", ".jsonl", ".jsonlines", ".csv", ".tsv")


def check_data_files(dataset: str) -> None:
    """A local ``--data`` file (or every file of a local folder) that holds something and, for a
    text type, is UTF-8 text: an empty or binary file is refused in one line naming it, before any
    model is loaded (datasets would raise a traceback). A name that is not a local path (a Hub
    dataset) is left to datasets."""
    import codecs

    path = Path(dataset)
    if not path.exists():
        return
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise TestTimeError(f"--data {dataset!r}: the folder holds no file")
    for file in files:
        with open(file, "rb") as fh:
            head = fh.read(1 << 20)
        if not head:
            raise TestTimeError(f"--data {str(file)!r}: empty file, no held-out text")
        if file.suffix.lower() in TEXT_SUFFIXES or not file.suffix:
            bad = head.find(b"\x00")  # NUL is valid UTF-8, and never in text
            if bad < 0:
                try:  # incremental: a character cut at the end of the first MiB is not an error
                    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
                except UnicodeDecodeError as err:
                    bad = err.start
            if bad >= 0:
                raise TestTimeError(f"--data {str(file)!r}: not UTF-8 text (byte {bad}); is it a binary file?")


def _read_record(run_dir: Path, required: bool = True) -> dict[str, Any]:
    """The run record of a finished run; ``required=False``: ``{}`` for a folder without one (a
    converted checkpoint measured on ``--data``), a record that is there must still be a finished run's."""
    if run_dir.is_dir() and not (run_dir / RECORD_NAME).exists():
        if not required:
            return {}
        raise TestTimeError(
            f"{run_dir} is not a finished run directory: no {RECORD_NAME} (for a checkpoint not trained "
            "here, e.g. a converted one, pass --data with held-out text)"
        )
    try:
        return check_finished_run(run_dir) or {}
    except ValueError as err:
        raise TestTimeError(str(err)) from None


def check_curve_recurrences(config: Any, recurrences: Sequence[int]) -> list[int]:
    """The r values of a curve (sorted, deduplicated), each checked by the model's config before any
    is measured (`LoopedConfig.resolve_num_recurrences`: >= 1, the ceiling, a recurrence-locked
    model); a model without a loop is refused too, as r changes nothing there."""
    if config.num_recurrent_layers == 0:
        raise TestTimeError("num_recurrent_layers=0: the model has no loop, r changes nothing")
    if not recurrences:
        raise TestTimeError("recurrences=[]: need at least one r")
    try:
        return sorted({config.resolve_num_recurrences(r) for r in recurrences})
    except ValueError as err:
        raise TestTimeError(str(err)) from None


def heldout_curve(
    model: Any, dataset: Any, recurrences: Sequence[int], batch_size: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Held-out loss of ``model`` at each r in ``recurrences`` (one table row per r).

    Each row: ``num_recurrences``, ``loss`` (nats/token, token-weighted), ``perplexity``,
    ``eval_tokens``, ``inference_flops_per_token`` at the blocks' length. ``seed`` re-seeds torch
    before each r, so a model with a random initial state (``state_init: noise``) gives the
    same curve every time.
    """
    import torch

    from looped_hf.train import heldout_loss

    check_curve_recurrences(model.config, recurrences)
    seq_len = len(dataset[0]["input_ids"])
    rows = []
    for r in recurrences:
        torch.manual_seed(seed)
        loss, tokens = heldout_loss(model, dataset, batch_size, num_recurrences=int(r))
        rows.append({
            "num_recurrences": int(r),
            "loss": loss,
            "perplexity": math.exp(loss) if math.isfinite(loss) and loss < 709 else math.inf,
            "eval_tokens": tokens,
            "inference_flops_per_token": model.inference_flops_per_token(seq_len, int(r)),
        })  # fmt: skip
    return rows


def load_run(
    run_dir: PathLike, data: Mapping[str, Any] | None = None
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model in eval mode, tokenizer, held-out split, run record) of a finished run directory.

    The held-out split is rebuilt from the run's recipe (as ``looped-hf publish --verify`` does),
    so it is the split the run record's ``loss`` was measured on. ``data``: data fields of a recipe
    (``dataset``, ``seq_len``, ``eval_blocks``, ...) to build the held-out split from instead; with
    it the folder needs no run record (the record is then ``{}``), so a converted checkpoint works."""
    from looped_hf.data import heldout_from_recipe
    from looped_hf.evaluation.runner import load_pretrained

    path = Path(run_dir)
    record = _read_record(path, required=data is None)
    try:
        model, tokenizer = load_pretrained(path)
    except ValueError as err:  # CheckpointError: not looped, truncated weights, a refused config value
        raise TestTimeError(str(err)) from None
    try:
        heldout = heldout_from_recipe(
            dict(data) if data is not None else record.get("recipe") or {}, tokenizer
        )
    except (ValueError, FileNotFoundError) as err:
        if data is None:
            raise
        raise TestTimeError(f"--data {data.get('dataset')!r}: {first_line(err)}") from None
    if data is not None and len(heldout) == 0:
        raise TestTimeError(
            f"--data {data.get('dataset')!r}: no held-out block of seq_len={data.get('seq_len')} tokens"
        )
    return model, tokenizer, heldout, record


def decoding_heldout_loss(
    model: Any, dataset: Any, batch_size: int, max_blocks: int | None = None, **call_kwargs: Any
) -> dict[str, float]:
    """Held-out loss as decoding sees it: every block is fed one token at a time through a cache.

    A plain forward over a block is what training sees; settings that act through the cache (a
    KV budget) or on each token as it is decoded (adaptive exit) are measured this way instead.
    ``call_kwargs`` go to every forward (``num_recurrences``, ``kv_budget``, ``exit_criterion``,
    ...). Returns ``loss`` (nats/token, token-weighted), ``eval_tokens``, and
    ``mean_recurrences`` (per predicting position; the call's r when there is no adaptive exit).
    """
    import torch
    from transformers import DynamicCache

    from looped_hf.generation_looped import generation_depth

    rows = dataset[: len(dataset) if max_blocks is None else int(max_blocks)]["input_ids"]
    device = next(model.parameters()).device
    # Decoding's defaults are generate()'s: the keywords, else the generation config's, else the config's.
    depth = generation_depth(model.config, getattr(model, "generation_config", None),
                             num_recurrences=call_kwargs.get("num_recurrences"), kv_budget=call_kwargs.get("kv_budget"))  # fmt: skip
    call_kwargs = {**call_kwargs, "num_recurrences": depth["num_recurrences"], "kv_budget": depth["kv_budget"]}
    r = depth["num_recurrences"]
    nll, tokens, recurrences = 0.0, 0, 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            ids = torch.as_tensor(rows[start : start + batch_size], dtype=torch.long, device=device)
            cache = DynamicCache(config=model.config)
            for t in range(ids.shape[1] - 1):
                out = model(ids[:, t : t + 1], cache=cache, use_cache=True, **call_kwargs)
                logp = torch.log_softmax(out.logits[:, -1].double(), dim=-1)
                nll -= float(logp.gather(1, ids[:, t + 1 : t + 2]).sum())
                used = out.recurrences_used
                recurrences += float(used.sum()) if used is not None else r * ids.shape[0]
                tokens += ids.shape[0]
    loss = nll / max(tokens, 1)
    return {"loss": loss, "eval_tokens": tokens, "mean_recurrences": recurrences / max(tokens, 1)}


def evaluate_recurrences(
    run_dir: PathLike,
    *,
    max_factor: int = DEFAULT_MAX_FACTOR,
    recurrences: Sequence[int] | None = None,
    batch_size: int | None = None,
    data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The test-time scaling curve of a finished run directory (see the module docstring); writes nothing.

    Args:
        run_dir: a directory written by ``looped-hf train`` / a sweep (weights, tokenizer, run record).
        max_factor: r runs from 1 to ``max_factor`` x the trained r.
        recurrences: explicit r values instead (sorted, each >= 1).
        batch_size: held-out blocks per forward (default: the run's ``per_device_eval_batch_size``).
        data: recipe data fields to measure on instead of the run's held-out split (see
            :func:`load_run`); a folder without a run record (a converted checkpoint) needs it.

    Returns:
        A JSON-ready dict: ``rows`` (one per r), ``trained_num_recurrences``, ``recurrence_sampling``,
        ``variant``, ``recorded_loss`` (the run record's loss at the trained r) and provenance.

    Raises:
        TestTimeError: not a finished run (and no ``data``), an r-locked or loop-less model, bad
            ``recurrences``.
    """
    import torch

    from looped_hf.fileio import weights_sha256
    from looped_hf.generation_looped import generation_depth
    from looped_hf.train import versions

    path = Path(run_dir)
    model, _, heldout, record = load_run(path, data)
    config = model.config
    trained = int(config.num_recurrences)
    if recurrences is None:
        try:  # the largest r first: a --max-factor past the ceiling is refused before its grid is built
            check_curve_recurrences(config, [max_factor * trained])
        except TestTimeError as err:
            raise TestTimeError(f"max_factor={max_factor}: {err}") from None
    # The r generate() runs by default (a generation_config.json's num_recurrences) is on the default grid.
    default_r = generation_depth(config, model.generation_config)["num_recurrences"]
    grid = check_curve_recurrences(
        config, sorted({*recurrence_grid(trained, max_factor), default_r}) if recurrences is None else recurrences
    )
    recipe = record.get("recipe") or {}
    batch = int(batch_size or recipe.get("per_device_eval_batch_size") or 8)
    if batch < 1:
        raise TestTimeError(f"batch_size={batch}: must be >= 1")
    started = time.time()
    rows = heldout_curve(model, heldout, grid, batch, seed=int(record.get("seed") or 0))
    at_trained = next((row for row in rows if row["num_recurrences"] == trained), None)
    best = min(rows, key=lambda row: row["loss"] if math.isfinite(row["loss"]) else math.inf)
    fpt_trained = model.inference_flops_per_token(len(heldout[0]["input_ids"]), trained)
    for row in rows:
        row["relative_compute"] = row["inference_flops_per_token"] / fpt_trained
    return {
        "run_id": record.get("run_id") or path.name,
        "run_dir": str(path),
        "trained_num_recurrences": trained,
        "default_num_recurrences": default_r,
        "recurrence_sampling": record.get("recurrence_sampling") or "fixed",
        "sampled_recurrences": record.get("sampled_recurrences"),
        "variant": record.get("variant") or "base",
        "backprop_recurrences": config.backprop_recurrences,
        "seq_len": len(heldout[0]["input_ids"]),
        "heldout_blocks": len(heldout),
        # Measured on other blocks than the record's loss when ``data`` is given: not shown beside it.
        "recorded_loss": record.get("loss") if data is None else None,
        "heldout_data": None if data is None else dict(data),
        "loss_at_trained_r": at_trained["loss"] if at_trained else None,
        "best": {"num_recurrences": best["num_recurrences"], "loss": best["loss"]},
        "rows": rows,
        "weights_sha256": weights_sha256(path),
        "wall_time_s": round(time.time() - started, 3),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
    }


def _signed(delta: float) -> str:
    """``+0.0123`` / ``-0.0123``; a difference that rounds to zero reads ``+0.0000``, not ``-0.0000``."""
    return f"{round(delta, 4) + 0.0:+.4f}"


def markdown_table(curve: Mapping[str, Any]) -> str:
    """The curve as a markdown table (r, loss, perplexity, change vs the trained r, compute)."""
    trained = curve["trained_num_recurrences"]
    ref = curve.get("loss_at_trained_r")
    lines = [
        "| r | held-out loss (nats/token) | perplexity | vs trained r | inference FLOPs/token (x trained r) |",
        "|---|---|---|---|---|",
    ]
    for row in curve["rows"]:
        r = row["num_recurrences"]
        delta = "-" if ref is None else _signed(row["loss"] - ref)
        mark = f"**{r}** (trained)" if r == trained else str(r)
        lines.append(
            f"| {mark} | {row['loss']:.4f} | {row['perplexity']:.2f} | {delta} | "
            f"{row['inference_flops_per_token']:.3g} (x{row['relative_compute']:.2f}) |"
        )
    return "\n".join(lines)


def summary_sentence(curve: Mapping[str, Any]) -> str:
    """One sentence: where the curve is best and what running 2x / max r longer does."""
    trained = curve["trained_num_recurrences"]
    ref = curve.get("loss_at_trained_r")
    rows = {row["num_recurrences"]: row for row in curve["rows"]}
    best = curve["best"]
    parts = [f"lowest held-out loss {best['loss']:.4f} at r = {best['num_recurrences']}"]
    if ref is not None:
        parts.append(f"{ref:.4f} at the trained r = {trained}")
        for r in sorted({2 * trained, max(rows)}):  # once each: at --max-factor 2 they are one r
            if r in rows and r != trained:
                parts.append(f"{_signed(rows[r]['loss'] - ref)} at r = {r}")
    sampling = curve.get("recurrence_sampling") or "fixed"
    how = "a fixed r" if sampling == "fixed" else f"a sampled r ({sampling}, mean {trained})"
    return f"Trained with {how}: " + "; ".join(parts) + "."


def plot_test_time_scaling(curves: Any, path: PathLike, title: str | None = None) -> Path:
    """Held-out loss against the r run at inference, one line per checkpoint; writes a PNG
    (``looped_hf.plotting.plot_metric_vs_r``).

    ``curves``: one result of :func:`evaluate_recurrences` (``rows`` of ``num_recurrences`` and
    ``loss``, ``trained_num_recurrences``) or a list of them. Each checkpoint's trained r gets a
    hollow circle; a sampled-r run is labelled with its scheme, so fixed-r and sampled-r training
    read apart.
    """
    from looped_hf.plotting import RSeries, plot_metric_vs_r

    items = [curves] if isinstance(curves, Mapping) else list(curves)
    if not items:
        raise ValueError("plot_test_time_scaling: no curves to draw")
    series = []
    for i, curve in enumerate(items):
        rows = curve.get("rows") or []
        if not rows:
            raise ValueError(f"plot_test_time_scaling: curve {i} ({curve.get('run_id')!r}) has no rows")
        trained = curve.get("trained_num_recurrences")
        sampling = curve.get("recurrence_sampling") or "fixed"
        label = curve.get("label") or curve.get("run_id") or f"run {i}"
        label = f"{label} (trained r = {trained}{'' if sampling == 'fixed' else ', ' + sampling})"
        series.append(RSeries(label, [row["num_recurrences"] for row in rows], [row["loss"] for row in rows], trained))
    return plot_metric_vs_r(
        series,
        path,
        ylabel="held-out loss (nats/token)",
        title=title or "test-time scaling: held-out loss vs r (circle: trained r)",
        xlabel="recurrences r at inference (log2)",
    )


def write_curve(curve: Mapping[str, Any], out_dir: PathLike) -> list[Path]:
    """Write the plot, the markdown table and the JSON (last) into ``out_dir``; returns their paths,
    JSON first (``looped_hf.plotting.write_result_triple``)."""
    from looped_hf.plotting import write_result_triple

    text = (
        f"# Test-time scaling: {curve['run_id']}\n\n"
        f"Held-out loss (the run's own held-out split, {curve['heldout_blocks']} blocks of {curve['seq_len']} "
        f"tokens, token-weighted) at r = {curve['rows'][0]['num_recurrences']} .. "
        f"{curve['rows'][-1]['num_recurrences']}.\n\n{summary_sentence(curve)}\n\n{markdown_table(curve)}\n\n"
        f"![held-out loss vs r]({CURVE_PNG})\n"
    )

    def plot(path: Path) -> Path:
        return plot_test_time_scaling(curve, path, title=f"{curve['run_id']}: held-out loss vs r")

    return write_result_triple(out_dir, CURVE_STEM, curve, text, plot)


def load_curve(checkpoint_dir: PathLike, weights_sha256: str | None = None) -> dict[str, Any] | None:
    """The curve saved next to a checkpoint, or None when there is none (or it was measured on other
    weights: ``weights_sha256`` given and different)."""
    path = Path(checkpoint_dir) / CURVE_JSON
    if not path.is_file():
        return None
    curve = json.loads(path.read_text(encoding="utf-8"))
    if weights_sha256 is not None and curve.get("weights_sha256") not in (None, weights_sha256):
        return None
    return curve


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf test-time",
        description="Held-out loss of a checkpoint at r = 1 .. max-factor x its trained r: writes "
        f"{CURVE_JSON}, {CURVE_MD} and {CURVE_PNG} into each run directory.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories")
    p.add_argument(
        "--max-factor", default=DEFAULT_MAX_FACTOR, type=positive_int("--max-factor"),
        help="largest r = this x trained r (4); every r up to it must be within the model's ceiling "
        "(config.max_recurrences, else 64x the trained r)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=positive_int("--batch-size"), default=None,
        help="held-out blocks per forward (the run's eval batch)",
    )  # fmt: skip
    p.add_argument(
        "--data", default=None, metavar="DATASET",
        help="held-out text to measure on (a local text/JSONL/... file or a Hub dataset, as a recipe's dataset), "
        "tokenized with the checkpoint's tokenizer; needed for a folder without run_record.json (a converted one)",
    )  # fmt: skip
    p.add_argument("--seq-len", type=positive_int("--seq-len"), default=None,
                   help="with --data: tokens per held-out block (256)")  # fmt: skip
    p.add_argument("--eval-blocks", type=positive_int("--eval-blocks"), default=None,
                   help="with --data: held-out blocks (64)")  # fmt: skip
    p.add_argument(
        "--compare", default=None, metavar="PNG", help="also draw every run's curve in one plot here"
    )
    p.add_argument(
        "--tokenizer", default=None, metavar="NAME",
        help="with --data: the tokenizer of a folder that has none (a transformers looped class's, e.g. "
        "HRM-Text: looped_hf.depth_tools); a Hub name, a folder or a tokenizer.json",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: 0 ok, 2 a run directory or option that cannot be measured."""
    args = _parser().parse_args(argv)
    if args.data is None and (args.seq_len is not None or args.eval_blocks is not None):
        print("looped-hf test-time: --seq-len / --eval-blocks apply to --data only (a run directory's "
              "held-out split is its recipe's)", file=sys.stderr)  # fmt: skip
        return 2
    if args.seq_len is not None and args.seq_len < 2:
        print(f"looped-hf test-time: --seq-len {args.seq_len}: must be >= 2", file=sys.stderr)
        return 2
    from looped_hf.depth_tools import check_native_folder, native_entry

    native = {run_dir for run_dir in args.run_dirs if native_entry(run_dir) is not None}
    try:  # every run and output path before any curve is measured, not after the first
        for run_dir in args.run_dirs:
            if run_dir in native:  # a looped class transformers ships: its depth through at_depth
                if args.data is None:
                    raise TestTimeError(f"{run_dir}: a transformers {native_entry(run_dir).name} folder has no "
                                        "run record: pass --data with held-out text")  # fmt: skip
                check_native_folder(run_dir, args.tokenizer)  # its tokenizer too: --tokenizer for one without
            else:
                _read_record(Path(run_dir), required=args.data is None)  # a finished run (a missing folder is named here too)
                check_checkpoint_dir(run_dir)  # looped, weights not truncated
            check_output_path(run_dir, "RUN_DIR", directory=True)
        if args.tokenizer is not None and not native:
            raise TestTimeError("--tokenizer applies to a folder without a tokenizer of a transformers looped "
                                "class only (a looped checkpoint measures with its own)")  # fmt: skip
        if args.data is not None:
            check_data_files(args.data)
        if args.compare is not None:
            check_output_path(args.compare, "--compare")
    except ValueError as err:
        print(f"looped-hf test-time: {err}", file=sys.stderr)
        return 2
    data = None
    if args.data is not None:
        data = {"dataset": args.data}
        data.update(
            {k: v for k, v in (("seq_len", args.seq_len), ("eval_blocks", args.eval_blocks)) if v is not None}
        )
    curves = []
    try:
        for run_dir in args.run_dirs:
            if run_dir in native:
                from looped_hf.depth_tools import (
                    grid_markdown_table,
                    native_curve,
                    native_markdown_table,
                    native_summary,
                    write_native_curve,
                )

                try:
                    curve = native_curve(run_dir, data, max_factor=args.max_factor, batch_size=args.batch_size,
                                         tokenizer=args.tokenizer)  # fmt: skip
                except ValueError as err:  # DepthToolError, CheckpointError: one line naming the value
                    raise TestTimeError(str(err)) from None
                paths = write_native_curve(curve, run_dir)
                grid = grid_markdown_table(curve)
                print(f"[test-time] {native_summary(curve)}\n{native_markdown_table(curve)}\n"
                      f"{grid + chr(10) if grid else ''}-> {', '.join(map(str, paths))}")  # fmt: skip
                curves.append(curve)
                continue
            curve = evaluate_recurrences(
                run_dir, max_factor=args.max_factor, batch_size=args.batch_size, data=data
            )
            paths = write_curve(curve, run_dir)
            from looped_hf.convert.card_curve import add_curve_to_converted_card

            if add_curve_to_converted_card(run_dir, curve):  # a converted folder's card shows its curve
                paths.append(Path(run_dir) / "README.md")
            print(
                f"[test-time] {summary_sentence(curve)}\n{markdown_table(curve)}\n-> {', '.join(map(str, paths))}"
            )
            curves.append(curve)
        if args.compare:
            print(f"-> {plot_test_time_scaling(curves, args.compare)}")
    except (TestTimeError, CheckpointError, FileNotFoundError) as err:
        print(f"looped-hf test-time: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # checked before measuring, but a disk can fill or a folder vanish meanwhile
        print(f"looped-hf test-time: cannot be written: {err.filename or ''} ({err.strerror or err})",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


__all__ = [
    "CURVE_JSON",
    "CURVE_MD",
    "CURVE_PNG",
    "TestTimeError",
    "check_curve_recurrences",
    "check_data_files",
    "evaluate_recurrences",
    "decoding_heldout_loss",
    "heldout_curve",
    "load_curve",
    "load_run",
    "markdown_table",
    "plot_test_time_scaling",
    "recurrence_grid",
    "summary_sentence",
    "write_curve",
]


if __name__ == "__main__":
    sys.exit(main())
