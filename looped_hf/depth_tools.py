"""The depth tools on a folder of a looped class that transformers ships (HRM-Text, Inkling2Loop).

    looped-hf test-time hrm-text-folder --data heldout.txt --tokenizer gpt2
    looped-hf eval hrm-text-folder --bundle builtin --recurrences 1 2 4 --tokenizer gpt2

Such a folder is transformers' own ``save_pretrained`` (its config.json ``model_type`` is the
class's, e.g. ``hrm_text``), read with ``AutoModelForCausalLM`` and never converted: looped_hf
only drives its depth (`looped_hf.depth.at_depth`). The registry entry (`looped_hf.depth`) says
which config fields are the depth; r is the first of them. ``test-time`` measures the held-out loss
at r = 1 .. ``max_factor`` x the trained r (the other axes as trained), and for a class with a
second axis (HRM-Text's ``L_cycles``) the whole grid of both, 1 .. ``max_factor`` x trained on each,
as a table and a heat map. The compute column is decoder-layer applications per token
(``DepthEntry.layer_applications``), relative to the trained depth: these classes have no FLOP
accounting of looped_hf's.

A folder without a tokenizer (the zoo2 fixtures) takes the one ``--tokenizer`` names (any name
`looped_hf.data.load_tokenizer` resolves) or is refused in one line; a tokenizer with more ids than
the model's vocabulary is refused too. The weights are checked by transformers' own loading report
(the files are in the upstream layout, renamed on load): a weight missing, unexpected or of another
shape is refused in one line instead of being drawn at random.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from looped_hf.depth import DepthEntry, at_depth, entry_for_model_type
from looped_hf.fileio import (
    WEIGHTS_NAME,
    CheckpointError,
    check_safetensors,
    first_line,
    read_json_object,
    weights_sha256,
)

PathLike = str | os.PathLike[str]
GRID_STEM = "depth_grid"
#: What a folder's tokenizer is saved as (one of them): as `looped_hf.evaluation.runner` reads it.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def native_entry(folder: PathLike) -> DepthEntry | None:
    """The registry entry of a local folder whose config.json names a class transformers ships
    (``setting == "config"``), read without loading anything; None for any other folder (a looped
    one, a foreign one: the caller's own checks name those)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        model_type = read_json_object(path).get("model_type")
    except ValueError:
        return None
    entry = entry_for_model_type(model_type)
    return entry if entry is not None and entry.setting == "config" else None


def check_native_dir(folder: PathLike) -> DepthEntry:
    """A transformers-native looped folder, checked before torch reads it: its class is registered
    and is in the installed transformers, and a single-file model.safetensors is whole."""
    entry = native_entry(folder)
    if entry is None:
        raise CheckpointError(f"{folder}: not a folder of a registered transformers looped class")
    model_type = read_json_object(Path(folder) / "config.json").get("model_type")
    from transformers import CONFIG_MAPPING, __version__

    if model_type not in CONFIG_MAPPING:
        raise CheckpointError(f"{Path(folder) / 'config.json'}: model_type={model_type!r} ({entry.name}) is not in "
                              f"the installed transformers {__version__}; upgrade transformers")  # fmt: skip
    weights = Path(folder) / WEIGHTS_NAME
    if weights.is_file():
        check_safetensors(weights)
    return entry


def load_tokenizer_for(folder: PathLike, tokenizer: str | None, vocab_size: int) -> Any:
    """The folder's own tokenizer, else the one ``tokenizer`` names; neither is one line naming
    ``--tokenizer``. One with more ids than ``vocab_size`` is refused (its last ids would index
    past the embedding)."""
    from looped_hf.data.tokenizer import load_tokenizer

    own = any((Path(folder) / name).is_file() for name in _TOKENIZER_FILES)
    if tokenizer is None and not own:
        raise CheckpointError(f"checkpoint {str(folder)!r} has no tokenizer: name one with --tokenizer "
                              "(a Hub name, a folder or a tokenizer.json)")  # fmt: skip
    name = tokenizer if tokenizer is not None else str(folder)
    try:
        tok = load_tokenizer(name)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, ...: one line naming it
        raise CheckpointError(f"--tokenizer {name!r} cannot be loaded: {first_line(err)}") from None
    if len(tok) > vocab_size:
        raise CheckpointError(f"--tokenizer {name!r}: {len(tok)} tokens, more than the model's vocab_size="
                              f"{vocab_size}; it is not this model's tokenizer")  # fmt: skip
    return tok


def check_native_folder(folder: PathLike, tokenizer: str | None) -> DepthEntry:
    """`check_native_dir` and its tokenizer (`load_tokenizer_for`), before any weight is read: what
    a command checks for every folder before it measures the first."""
    entry = check_native_dir(folder)
    load_tokenizer_for(
        folder, tokenizer, int(read_json_object(Path(folder) / "config.json").get("vocab_size") or 0)
    )
    return entry


def load_native(folder: PathLike, tokenizer: str | None = None) -> tuple[Any, Any, DepthEntry]:
    """(model in eval mode, float32, tokenizer, registry entry) of a transformers-native looped
    folder; every failure is a `CheckpointError` in one line."""
    import torch
    from transformers import AutoModelForCausalLM

    entry = check_native_dir(folder)
    vocab = int(read_json_object(Path(folder) / "config.json").get("vocab_size") or 0)
    tok = load_tokenizer_for(folder, tokenizer, vocab)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, output_loading_info=True
        )
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, SafetensorError: the folder is named
        raise CheckpointError(f"checkpoint {str(folder)!r} cannot be loaded: {first_line(err)}") from err
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(map(str, info.get(kind) or ()))
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise CheckpointError(f"checkpoint {str(folder)!r}: the weights are not the model its config.json "
                                  f"builds: {kind.replace('_', ' ')} {keys[0]}{more}")  # fmt: skip
    return model.eval(), tok, entry


class DepthConfig:
    """The config of a transformers-native looped model as the eval scorer reads a looped one: the
    trained r (``num_recurrences``), the r rules (``resolve_num_recurrences``: the registry's range),
    no adaptive exit and no KV budget; every other attribute is the model's own config's."""

    def __init__(self, config: Any, entry: DepthEntry) -> None:
        self._config, self._entry = config, entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    @property
    def num_recurrences(self) -> int:
        return self._entry.trained(self._config)[0]

    @property
    def recurrence_ceiling(self) -> int:
        # No ceiling of the class's own: eval's default grid (1, 2, 4, ... 2x trained) stays below this.
        return 64 * self.num_recurrences

    exit_criterion = None

    def resolve_num_recurrences(self, num_recurrences: int | None = None) -> int:
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        return self._entry.resolve(self._config, r)[0]

    def exit_settings(self, *settings: Any) -> None:
        if any(value is not None for value in settings):
            raise ValueError(
                f"{self._entry.name} has no adaptive exit: the exit flags apply to looped checkpoints"
            )

    def num_kv_slots(self, r: int, kv_budget: int | None = None) -> None:
        if kv_budget is not None:
            raise ValueError(
                f"--kv-budget {kv_budget}: {self._entry.name} has no KV budget (looped checkpoints only)"
            )


def depth_call_model(model: Any, entry: DepthEntry) -> Any:
    """``model`` called as eval calls a looped model: ``forward(input_ids, num_recurrences=r, ...)``
    runs it `at_depth` r (the other axes as trained); ``config`` is a `DepthConfig`."""
    import torch

    class DepthCall(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model
            self.config = DepthConfig(model.config, entry)

        def forward(self, input_ids: Any = None, num_recurrences: int | None = None, **kwargs: Any) -> Any:
            with at_depth(self.inner, self.config.resolve_num_recurrences(num_recurrences)):
                return self.inner(input_ids=input_ids, **kwargs)

    return DepthCall().eval()


def native_checkpoint(folder: PathLike, tokenizer: str | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """(`depth_call_model`, tokenizer, info) of a transformers-native looped folder, as
    `looped_hf.evaluation.runner.load_checkpoint` returns a looped one's (no run record)."""
    model, tok, entry = load_native(folder, tokenizer)
    info = {
        "checkpoint": str(folder),
        "run_id": Path(folder).name,
        "local": True,
        "weights_sha256": weights_sha256(folder),
        "model_class": entry.name,
        "depth_fields": list(entry.fields),
        "trained_depth": dict(zip(entry.fields, entry.trained(model.config))),
        "tokenizer": tokenizer,
    }
    return depth_call_model(model, entry), tok, info


def _loss_row(model: Any, entry: DepthEntry, dataset: Any, batch_size: int, values: tuple[int, ...]) -> dict:
    from looped_hf.train import heldout_loss

    with at_depth(model, values):
        loss, tokens = heldout_loss(model, dataset, batch_size)
        applications = entry.layer_applications(model.config)
    return {
        "num_recurrences": values[0],
        "depth": dict(zip(entry.fields, values)),
        "loss": loss,
        "perplexity": math.exp(loss) if math.isfinite(loss) and loss < 709 else math.inf,
        "eval_tokens": tokens,
        "layer_applications": applications,
    }


def native_curve(
    folder: PathLike,
    data: Mapping[str, Any],
    *,
    max_factor: int = 4,
    batch_size: int | None = None,
    tokenizer: str | None = None,
    grid: bool = True,
) -> dict[str, Any]:
    """The test-time curve of a transformers-native looped folder on the held-out text ``data``
    (recipe data fields: ``dataset``, ``seq_len``, ``eval_blocks``, ...): held-out loss at r = 1 ..
    ``max_factor`` x the trained r, and (``grid``, a class with a second axis) every (r, second)
    with each axis 1 .. ``max_factor`` x trained. Writes nothing; the result reads like
    `looped_hf.recurrence_curves.evaluate_recurrences`'s (``rows`` keyed ``num_recurrences``)."""
    import torch

    from looped_hf.data import heldout_from_recipe
    from looped_hf.recurrence_curves import TestTimeError, recurrence_grid
    from looped_hf.train import versions

    model, tok, entry = load_native(folder, tokenizer)
    trained = entry.trained(model.config)
    rs = recurrence_grid(trained[0], max_factor)
    try:
        heldout = heldout_from_recipe(dict(data), tok)
    except (ValueError, FileNotFoundError) as err:
        raise TestTimeError(f"--data {data.get('dataset')!r}: {first_line(err)}") from None
    if len(heldout) == 0:
        raise TestTimeError(
            f"--data {data.get('dataset')!r}: no held-out block of seq_len={data.get('seq_len')} tokens"
        )
    batch = int(batch_size or 8)
    started = time.time()
    with torch.no_grad():
        rows = [_loss_row(model, entry, heldout, batch, (r, *trained[1:])) for r in rs]
        cells = None
        if grid and len(entry.fields) == 2:
            seconds = recurrence_grid(trained[1], max_factor)
            cells = [[_loss_row(model, entry, heldout, batch, (r, s))["loss"] for s in seconds] for r in rs]
    at_trained = next(row for row in rows if row["num_recurrences"] == trained[0])
    for row in rows:
        row["relative_compute"] = row["layer_applications"] / at_trained["layer_applications"]
    best = min(rows, key=lambda row: row["loss"] if math.isfinite(row["loss"]) else math.inf)
    path = Path(folder)
    return {
        "run_id": path.name,
        "run_dir": str(path),
        "model_class": entry.name,
        "depth_fields": list(entry.fields),
        "trained_depth": dict(zip(entry.fields, trained)),
        "trained_num_recurrences": trained[0],
        "recurrence_sampling": "fixed",
        "seq_len": len(heldout[0]["input_ids"]),
        "heldout_blocks": len(heldout),
        "recorded_loss": None,
        "heldout_data": dict(data),
        "tokenizer": tokenizer,
        "loss_at_trained_r": at_trained["loss"],
        "best": {"num_recurrences": best["num_recurrences"], "loss": best["loss"]},
        "rows": rows,
        "grid": None
        if cells is None
        else {
            "rows": entry.fields[0],
            "cols": entry.fields[1],
            "row_values": rs,
            "col_values": seconds,
            "loss": cells,
        },
        "weights_sha256": weights_sha256(path),
        "wall_time_s": round(time.time() - started, 3),
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
    }


def native_markdown_table(curve: Mapping[str, Any]) -> str:
    """The curve as a markdown table: depth, loss, perplexity, change vs trained, layer applications."""
    field = curve["depth_fields"][0]
    trained = curve["trained_num_recurrences"]
    ref = curve["loss_at_trained_r"]
    lines = [
        f"| {field} | held-out loss (nats/token) | perplexity | vs trained | layer applications/token (x trained) |",
        "|---|---|---|---|---|",
    ]
    for row in curve["rows"]:
        r = row["num_recurrences"]
        mark = f"**{r}** (trained)" if r == trained else str(r)
        delta = f"{round(row['loss'] - ref, 4) + 0.0:+.4f}"
        lines.append(f"| {mark} | {row['loss']:.4f} | {row['perplexity']:.2f} | {delta} | "
                     f"{row['layer_applications']} (x{row['relative_compute']:.2f}) |")  # fmt: skip
    return "\n".join(lines)


def grid_markdown_table(curve: Mapping[str, Any]) -> str:
    """The two-axis grid as a markdown table (rows: r's field, columns: the second axis); the
    trained cell in bold. Empty for a curve without a grid."""
    grid = curve.get("grid")
    if not grid:
        return ""
    trained = curve["trained_depth"]
    head = f"| {grid['rows']} \\ {grid['cols']} | " + " | ".join(map(str, grid["col_values"])) + " |"
    lines = [head, "|---" * (len(grid["col_values"]) + 1) + "|"]
    for r, losses in zip(grid["row_values"], grid["loss"]):
        cells = [
            f"**{loss:.4f}**" if (r, c) == (trained[grid["rows"]], trained[grid["cols"]]) else f"{loss:.4f}"
            for c, loss in zip(grid["col_values"], losses)
        ]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def native_summary(curve: Mapping[str, Any]) -> str:
    """One sentence: the best depth and the loss at the trained one."""
    trained = ", ".join(f"{k}={v}" for k, v in curve["trained_depth"].items())
    best = curve["best"]
    field = curve["depth_fields"][0]
    return (f"{curve['model_class']}: lowest held-out loss {best['loss']:.4f} at {field} = {best['num_recurrences']}; "
            f"{curve['loss_at_trained_r']:.4f} at the trained {trained}.")  # fmt: skip


def write_native_curve(curve: Mapping[str, Any], out_dir: PathLike) -> list[Path]:
    """``test_time_scaling.{json,md,png}`` (the curve; the card and `load_curve` read them as a
    looped checkpoint's) and, with a grid, ``depth_grid.{json,md,png}`` (the heat map) into
    ``out_dir``; returns the paths, JSON first in each set."""
    from looped_hf.plotting import plot_depth_grid, write_result_triple
    from looped_hf.recurrence_curves import CURVE_PNG, CURVE_STEM, plot_test_time_scaling

    data = curve["heldout_data"]
    text = (
        f"# Test-time scaling: {curve['run_id']} ({curve['model_class']})\n\n"
        f"Held-out loss on {data.get('dataset')!r} ({curve['heldout_blocks']} blocks of {curve['seq_len']} tokens, "
        f"token-weighted) at {curve['depth_fields'][0]} = {curve['rows'][0]['num_recurrences']} .. "
        f"{curve['rows'][-1]['num_recurrences']}, the other depth fields as trained "
        f"(`looped_hf.at_depth`).\n\n{native_summary(curve)}\n\n{native_markdown_table(curve)}\n\n"
        f"![held-out loss vs depth]({CURVE_PNG})\n"
    )

    def plot(path: Path) -> Path:
        return plot_test_time_scaling(
            curve, path, title=f"{curve['run_id']}: held-out loss vs {curve['depth_fields'][0]}"
        )

    paths = write_result_triple(out_dir, CURVE_STEM, curve, text, plot)
    grid = curve.get("grid")
    if grid:
        trained = curve["trained_depth"]
        grid_text = (
            f"# {grid['rows']} x {grid['cols']}: {curve['run_id']}\n\nHeld-out loss at every ({grid['rows']}, "
            f"{grid['cols']}); the trained cell in bold.\n\n{grid_markdown_table(curve)}\n\n"
            f"![held-out loss over the depth grid]({GRID_STEM}.png)\n"
        )

        def heat(path: Path) -> Path:
            return plot_depth_grid(
                grid["loss"], grid["row_values"], grid["col_values"], path,
                row_label=grid["rows"], col_label=grid["cols"],
                title=f"{curve['run_id']}: held-out loss (box: trained)",
                trained=(trained[grid["rows"]], trained[grid["cols"]]),
            )  # fmt: skip

        paths += write_result_triple(out_dir, GRID_STEM, grid, grid_text, heat)
    return paths


__all__ = [
    "GRID_STEM",
    "check_native_dir",
    "check_native_folder",
    "DepthConfig",
    "depth_call_model",
    "grid_markdown_table",
    "load_native",
    "load_tokenizer_for",
    "native_curve",
    "native_checkpoint",
    "native_entry",
    "native_markdown_table",
    "native_summary",
    "write_native_curve",
]
