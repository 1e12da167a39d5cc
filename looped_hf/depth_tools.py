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

import contextlib
import math
import os
import time
from collections.abc import Iterator, Mapping
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
#: The curve's files are a looped checkpoint's (`looped_hf.recurrence_curves.CURVE_STEM`, which
#: imports this module: the name is spelled here, and a test pins the two equal), so that
#: `recurrence_curves.load_curve` and the cards read them alike.
CURVE_STEM = "test_time_scaling"


class DepthToolError(ValueError):
    """Held-out data or an option the depth tools cannot measure with: the message names it."""


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


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' progress bar and loading report off while a folder loads (restored after):
    `load_native` reads the report itself and refuses a mismatch in one line."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def load_native(folder: PathLike, tokenizer: str | None = None) -> tuple[Any, Any, DepthEntry]:
    """(model in eval mode, float32, tokenizer, registry entry) of a transformers-native looped
    folder; every failure is a `CheckpointError` in one line."""
    import torch
    from transformers import AutoModelForCausalLM

    entry = check_native_dir(folder)
    vocab = int(read_json_object(Path(folder) / "config.json").get("vocab_size") or 0)
    tok = load_tokenizer_for(folder, tokenizer, vocab)
    try:
        with _quiet_loading():  # its report would print a table before the one line below
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
    from looped_hf.train import versions

    model, tok, entry = load_native(folder, tokenizer)
    trained = entry.trained(model.config)
    if not isinstance(max_factor, int) or max_factor < 1:
        raise DepthToolError(f"max_factor={max_factor!r}: must be an integer >= 1")
    rs = list(range(1, max_factor * trained[0] + 1))
    try:
        heldout = heldout_from_recipe(dict(data), tok)
    except (ValueError, FileNotFoundError) as err:
        raise DepthToolError(f"--data {data.get('dataset')!r}: {first_line(err)}") from None
    if len(heldout) == 0:
        raise DepthToolError(
            f"--data {data.get('dataset')!r}: no held-out block of seq_len={data.get('seq_len')} tokens"
        )
    batch = int(batch_size or 8)
    started = time.time()
    with torch.no_grad():
        rows = [_loss_row(model, entry, heldout, batch, (r, *trained[1:])) for r in rs]
        cells = None
        if grid and len(entry.fields) == 2:
            seconds = list(range(1, max_factor * trained[1] + 1))
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
    from looped_hf.plotting import RSeries, plot_depth_grid, plot_metric_vs_r, write_result_triple

    data = curve["heldout_data"]
    text = (
        f"# Test-time scaling: {curve['run_id']} ({curve['model_class']})\n\n"
        f"Held-out loss on {data.get('dataset')!r} ({curve['heldout_blocks']} blocks of {curve['seq_len']} tokens, "
        f"token-weighted) at {curve['depth_fields'][0]} = {curve['rows'][0]['num_recurrences']} .. "
        f"{curve['rows'][-1]['num_recurrences']}, the other depth fields as trained "
        f"(`looped_hf.at_depth`).\n\n{native_summary(curve)}\n\n{native_markdown_table(curve)}\n\n"
        f"![held-out loss vs depth]({CURVE_STEM}.png)\n"
    )

    def plot(path: Path) -> Path:
        field, rows = curve["depth_fields"][0], curve["rows"]
        label = f"{curve['run_id']} ({curve['model_class']}, trained {field} = {curve['trained_num_recurrences']})"
        series = [RSeries(label, [row["num_recurrences"] for row in rows], [row["loss"] for row in rows],
                          curve["trained_num_recurrences"])]  # fmt: skip
        return plot_metric_vs_r(
            series, path, ylabel="held-out loss (nats/token)", xlabel=f"{field} at inference (log2)",
            title=f"{curve['run_id']}: held-out loss vs {field} (circle: trained)",
        )  # fmt: skip

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


def _load_curves(folder: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The curve and grid saved beside a folder by test-time, when measured on these weights."""
    import json

    sha = weights_sha256(folder)
    found: list[dict[str, Any] | None] = []
    for stem in (CURVE_STEM, GRID_STEM):
        path = folder / f"{stem}.json"
        found.append(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None)
    curve, grid = found
    if curve is not None and curve.get("weights_sha256") not in (None, sha):
        return None, None  # measured on other weights: a stale curve is not shown
    return curve, (grid if curve is not None else None)


def native_card_text(folder: PathLike, entry: DepthEntry, config: Any, repo_id: str, license: str) -> str:
    """The model card (README.md) of a transformers-native looped folder: the class, what a depth
    means, how to run one (`at_depth`), the cache rule and, when test-time measured it on these
    weights, the curve and the grid."""
    path = Path(folder)
    trained = dict(zip(entry.fields, entry.trained(config)))
    first, shown = entry.fields[0], ", ".join(f"{k}={v}" for k, v in trained.items())
    example = (
        f"({trained[first] * 2}, {trained[entry.fields[1]]})"
        if len(entry.fields) == 2
        else str(trained[first] * 2)
    )
    lines = [
        "---", f"license: {license}", "library_name: transformers", "tags:", "- looped", "- depth-recurrent",
        f"- {config.model_type}", "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"A `{entry.name}` checkpoint (transformers' own class; it loads with `AutoModelForCausalLM`, no remote "
        f"code). Trained depth: {shown}. A depth here means: {entry.meaning}.", "",
        "```python", "import looped_hf", "from transformers import AutoModelForCausalLM", "",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")',
        f"with looped_hf.at_depth(model, {example}):  # restored after the block",
        "    out = model.generate(input_ids, max_new_tokens=32)", "```", "",
        f"KV cache at another depth: {entry.cache}.", "",
    ]  # fmt: skip
    curve, grid = _load_curves(path)
    if curve is None:
        lines += [
            "No test-time curve was measured on these weights (`looped-hf test-time FOLDER --data FILE`).",
            "",
        ]
    else:
        lines += ["## Test-time scaling", "", native_summary(curve), "", native_markdown_table(curve), "",
                  f"![held-out loss vs depth]({CURVE_STEM}.png)", ""]  # fmt: skip
        if grid is not None:
            lines += [f"### {grid['rows']} x {grid['cols']}", "", grid_markdown_table({**curve, "grid": grid}), "",
                      f"![held-out loss over the depth grid]({GRID_STEM}.png)", ""]  # fmt: skip
    return "\n".join(lines)


def build_native_folder(
    folder: PathLike,
    repo_id: str,
    out: PathLike | None = None,
    *,
    tokenizer: str | None = None,
    overwrite: bool = False,
    license: str = "apache-2.0",
) -> Path:
    """The Hub-ready folder of a transformers-native looped checkpoint: its config, generation
    config and weights as they are (transformers owns the class: nothing is converted or re-saved),
    its tokenizer (or ``tokenizer``'s, saved into it), the test-time plots and a card
    (`native_card_text`). Built in a temporary sibling and renamed into place; an existing ``out``
    is replaced only with ``overwrite``. Returns the folder."""
    import shutil

    from transformers import AutoConfig

    from looped_hf.fileio import check_output_path, follow_umask, make_temp_dir, replace_dir

    src = Path(folder)
    entry = check_native_folder(src, tokenizer)
    dest = Path(out) if out is not None else src / "publish"
    if src.resolve().is_relative_to(dest.resolve()):
        raise DepthToolError(
            f"--out {dest} is (or contains) the checkpoint folder {src}; choose another folder"
        )
    check_output_path(dest, "--out", directory=True)
    if dest.exists() and not overwrite:
        raise DepthToolError(f"--out {dest} already exists; pass --overwrite to replace it")
    config = AutoConfig.from_pretrained(str(src))
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    tmp = make_temp_dir(dest)
    try:
        names = ["config.json", "generation_config.json", WEIGHTS_NAME, "model.safetensors.index.json",
                 *sorted(p.name for p in src.glob("model-*.safetensors")), f"{CURVE_STEM}.png", f"{GRID_STEM}.png"]  # fmt: skip
        if tokenizer is None:
            names += list(_TOKENIZER_FILES) + ["special_tokens_map.json", "merges.txt"]
        for name in names:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if tokenizer is not None:
            load_tokenizer_for(src, tokenizer, vocab).save_pretrained(tmp)
        (tmp / "README.md").write_text(
            native_card_text(src, entry, config, repo_id, license), encoding="utf-8"
        )
        follow_umask(tmp)
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


__all__ = [
    "CURVE_STEM",
    "GRID_STEM",
    "DepthToolError",
    "build_native_folder",
    "native_card_text",
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
