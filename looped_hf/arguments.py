"""Reading a recipe: YAML loading with each key's line, the command-line parser over the recipe's
dataclasses (`looped_hf.run_arguments`, whose names this module re-exports), and the checks that turn a file plus flags into the three
argument objects (`parse_recipe`), then back into the resolved recipe a run records.

An unknown key, a value of the wrong kind or range, or a budget that cannot buy one optimizer step
fails before any training with one line that names the recipe field and its value (and the file's
line).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import os
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser, TrainingArguments

from looped_hf.configuration_looped import LoopedConfig, field_choices
from looped_hf.field_checks import (
    RecipeError,
    check_declared_fields,
    check_value,
    declared_fields,
    field_rule,
    show,
)
from looped_hf.fileio import first_line, yaml_load

# The dataclasses a run is made of live in run_arguments.py; their names stay importable from here.
from looped_hf.run_arguments import (  # noqa: F401
    ATTN_HELP,
    LENGTH_FIELDS,
    LR_SCALINGS,
    LR_SCHEDULES,
    MUONH_ONLY_FIELDS,
    NOT_RECIPE_FIELDS,
    OPTIMIZERS,
    RETROFIT_DEPENDENT_FIELDS,
    STEPS_ROUNDINGS,
    LoopedTrainingArguments,
    ModelArguments,
    _data_arguments_class,
    model_fields,
    steps_for_tokens,
    tokens_per_step,
)

# YAML 1.2 floats: PyYAML (YAML 1.1) reads 1e-3 and 1.5e8 (no dot, or no sign in the exponent)
# as strings; a recipe means the number.
_YAML12_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)$")


def yaml_key_lines(path: str | os.PathLike, text: str | None = None) -> dict[str, int]:
    """Line (1-based) of each top-level key of a YAML mapping file, for error messages (`text`:
    the file's text, when already read)."""
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8") if text is None else text)
    except (yaml.YAMLError, OSError, ValueError):  # ValueError: not UTF-8 (load_yaml names it)
        return {}
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(key.value): key.start_mark.line + 1 for key, _ in node.value}


def _flag_value(text: str) -> Any:
    """A model flag's value as a recipe file would give it (8, true, null, silu, 1e-3): the flag
    carries it to `LoopedConfig` unchanged, which checks it against the field's type."""
    try:
        return _yaml12(yaml.safe_load(text))
    except yaml.YAMLError:
        return text


def _yaml12(value: Any) -> Any:
    return float(value) if isinstance(value, str) and _YAML12_FLOAT.match(value.strip()) else value


def _describe(rule: Any) -> str:
    """A declared rule in words: an `Interval`'s description, else its docstring's first line."""
    rules = rule if isinstance(rule, (list, tuple)) else [rule]
    return "; ".join(r.describe() if hasattr(r, "describe") else (r.__doc__ or "").strip().splitlines()[0] for r in rules)


@functools.cache
def _config_docs() -> dict[str, str]:
    """The first sentence of each field's entry in `LoopedConfig`'s docstring ("name[, name]:" then
    its indented text), for --help."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in (LoopedConfig.__doc__ or "").splitlines():
        head = re.fullmatch(r"    ([a-z_]+(?:\s*[,/]\s*[a-z_]+)*):", line)
        if head:
            names = re.split(r"\s*[,/]\s*", head.group(1))
        elif names and line.startswith("        "):
            for name in names:
                docs[name] = f"{docs.get(name, '')} {line.strip().replace('``', '')}".strip()
        elif line.strip():
            names = []
    return {name: text.split(". ")[0].rstrip(".") + "." for name, text in docs.items()}


def _model_help(name: str, f: dataclasses.Field, annotation: Any) -> str:
    """--help of a model flag, from `LoopedConfig`'s declaration: type, range or choices, default."""
    choices = [c for c in field_choices(annotation) if c is not None]
    rule = field_rule(LoopedConfig, name)
    kind = f"one of {', '.join(map(str, choices))}" if choices else _describe(rule) if rule else ""
    default = f.default if f.default is not dataclasses.MISSING else None
    return " ".join(p for p in (kind and f"{kind};", f"default {default}.", _config_docs().get(name, "")) if p)


class _RecipeParser(HfArgumentParser):
    """`HfArgumentParser` over the data and training dataclasses, plus one flag per `LoopedConfig`
    field a recipe sets, whose value goes to the config as given (it checks it)."""

    def __init__(self) -> None:
        super().__init__((_data_arguments_class(), LoopedTrainingArguments))
        group = self.add_argument_group("model: LoopedConfig's fields (looped_hf.LoopedConfig)")
        for name, f in model_fields().items():
            flags = [f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else [])]
            kwargs: dict[str, Any] = {"type": _flag_value, "default": argparse.SUPPRESS, "metavar": name.upper()}
            if f.type is bool:
                kwargs.update(nargs="?", const=True)
                if f.default is True:  # HfArgumentParser's convention for a boolean that defaults to true
                    group.add_argument(f"--no_{name}", dest=name, action="store_false", default=argparse.SUPPRESS)
            group.add_argument(*flags, help=_model_help(name, f, f.type), **kwargs)
        group.add_argument("--attn_implementation", type=str, default=argparse.SUPPRESS, help=ATTN_HELP)

    def _add_dataclass_arguments(self, dtype: type) -> None:
        self._dtype = dtype  # `_parse_dataclass_field` is given a field alone; its rule is on the class
        super()._add_dataclass_arguments(dtype)

    def _parse_dataclass_field(self, parser: argparse.ArgumentParser, f: dataclasses.Field) -> None:
        # The field's rule (its annotation's, which HfArgumentParser does not read) is shown in the help.
        rule = field_rule(self._dtype, f.name)
        if rule is not None:
            clone = copy.copy(f)
            clone.metadata = types.MappingProxyType(
                {**f.metadata, "help": f"{f.metadata.get('help', '')} ({_describe(rule)})".strip()}
            )
            f = clone
        HfArgumentParser._parse_dataclass_field(parser, f)

    # argparse exits the process on a bad value; a library call should raise instead.
    def error(self, message: str):
        raise RecipeError(message)


def recipe_parser() -> HfArgumentParser:
    """The parser of a flat recipe: model, data and training fields (names must not collide)."""
    return _RecipeParser()


def _blame(dtype: type, inputs: dict[str, Any], given: list[str], err: Exception) -> str:
    """An error from a dataclass's own checks (TrainingArguments': "Your setup doesn't support
    bf16/gpu") as one line that names the recipe field it is about: the given field that alone
    raises the same error, or else every given field of that dataclass."""
    message = first_line(err)
    names = [n for n in given if n in inputs]
    if any(n in message for n in names):
        return message
    for name in names:
        try:
            dtype(**{name: inputs[name]})
        except (TypeError, ValueError, ImportError, OverflowError) as alone:
            if str(alone) == str(err):
                return f"{name}={show(inputs[name])}: {message}"
    return f"{message} (fields set: {', '.join(names)})"


@functools.cache
def _shared_parser() -> HfArgumentParser:
    # Building the parser of ~230 fields takes ~25 ms; `parse_recipe` only reads it.
    return recipe_parser()


@functools.cache
def _declared() -> dict[str, tuple[dataclasses.Field, Any, Any]]:
    """The data and training fields with their types and rules (what `check_value` reads)."""
    return {**declared_fields(_data_arguments_class()), **declared_fields(LoopedTrainingArguments)}


def recipe_field_types() -> dict[str, Any]:
    """Every field a recipe may set, with its type annotation (model, data, training)."""
    # LoopedConfig's annotations are objects already (its module has no postponed annotations).
    return {**{name: f.type for name, f in model_fields().items()}, "attn_implementation": str | None,
            **{name: annotation for name, (_, annotation, _) in _declared().items()}}  # fmt: skip


def read_recipe_text(path: str | os.PathLike, what: str = "recipe") -> str:
    """The text of a recipe file; a missing file, a folder or a binary file is a `RecipeError`."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{what} {str(path)!r}: is a directory, not a YAML file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{what} {str(path)!r}: no such file") from None
    except UnicodeDecodeError as err:
        raise RecipeError(f"{what} {str(path)!r}: not UTF-8 text (byte {err.start}); is it a binary file?") from None
    except OSError as err:
        raise RecipeError(f"{what} {str(path)!r}: cannot be read ({err.strerror or err})") from None


def load_yaml(path: str | os.PathLike, what: str = "recipe", text: str | None = None) -> dict[str, Any]:
    """Read a YAML mapping (duplicate keys and alias bombs refused); anything else is an error
    naming the file. `text`: the file's text, when already read (`read_recipe_text`): parsed
    instead of reading the file again."""
    if text is None:
        text = read_recipe_text(path, what)
    try:
        data = yaml_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"{what} {str(path)!r}{at}: not valid YAML ({problem})") from None
    if not isinstance(data, dict):
        raise RecipeError(
            f"{what} {str(path)!r}: must be a YAML mapping of field: value, got {type(data).__name__}"
        )
    return {key: _yaml12(value) for key, value in data.items()}


def check_fields(data: dict[str, Any], known: set[str], where: str) -> None:
    """Reject unknown keys with an error naming them (and the closest known names)."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise RecipeError(
                f"{where}: unknown field {key!r} (not a model, data or training argument){hint}"
            )


def _flag_names(argv: list[str]) -> set[str]:
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            names.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return names


def parse_recipe(
    recipe: str | os.PathLike | dict[str, Any] | None = None,
    argv: list[str] | None = None,
    *,
    where: str | None = None,
    lines: Mapping[str, int] | None = None,
) -> tuple[ModelArguments, Any, LoopedTrainingArguments]:
    """Parse a recipe (YAML path or mapping) with command-line overrides into the three dataclasses.

    Values from the file become the parser's defaults, so flags given in `argv` win. Every data
    and training value the file or a flag gives is checked against its field's declarations
    (`check_value`) before any dataclass is built; the model's values are checked by building a
    `LoopedConfig`. Raises `RecipeError` with one line naming the field and the value. `where`
    and `lines` (field -> line) say where a mapping came from, for those messages (a sweep passes
    its file's).
    """
    argv = list(argv or [])
    parser = _shared_parser()
    declared = _declared()
    known = {*declared, *model_fields(), "attn_implementation"}
    if recipe is None:
        data, label = {}, "recipe"
    elif isinstance(recipe, dict):
        data, label = dict(recipe), "recipe"
    else:
        data, label = load_yaml(recipe), f"recipe {str(recipe)!r}"
        lines = yaml_key_lines(recipe) if lines is None else lines
    where = label if where is None else where
    lines = {} if lines is None else lines
    if "sweep" in data:
        raise RecipeError(
            f"{where}: has a 'sweep' section; run it with `looped-hf sweep`, not `train` "
            "(`looped-hf sweep RECIPE --dry-run` checks it and prints its plan)"
        )
    check_fields(data, known, where)
    overridden = _flag_names(argv) & known
    if overridden & set(LENGTH_FIELDS):
        for name in LENGTH_FIELDS:
            if name not in overridden:
                data.pop(name, None)

    def origin(name: str) -> str:
        if name in overridden:  # a flag replaces the file's value: only the flag's is checked
            return f"{where}: flag --{name}" if recipe is not None else f"flag --{name}"
        return f"{where}, line {lines[name]}" if name in lines else where

    for name in list(data):
        if name in declared and name not in overridden:
            data[name] = check_value(name, data[name], *declared[name], origin(name))
    try:
        # The file's values, already checked, are the namespace argparse starts from: it fills in
        # the defaults of the fields the file does not set and converts the flags to their types.
        # (The shared parser itself is never changed, so building it once serves every recipe.)
        namespace, rest = parser.parse_known_args(args=argv, namespace=argparse.Namespace(**data))
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None
    if rest:
        raise RecipeError(f"{where}: unknown command-line arguments {rest}")
    values = vars(namespace)
    for name in sorted(overridden & set(declared)):
        values[name] = check_value(name, values[name], *declared[name], origin(name))
    outputs = []
    given = [*data, *sorted(overridden - set(data))]
    for dtype in parser.dataclass_types:
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        inputs = {k: v for k, v in values.items() if k in names}
        try:
            outputs.append(dtype(**inputs))
        except RecipeError:
            raise
        except (TypeError, ValueError, ImportError, OverflowError) as err:  # ImportError: deepspeed, ... not installed
            raise RecipeError(f"{where}: {_blame(dtype, inputs, given, err)}") from err
    data_args, training_args = outputs
    # The model section goes to LoopedConfig as the recipe gives it: building one now (with the
    # default vocabulary; the run's comes from the tokenizer) checks every model value.
    try:
        model_args = ModelArguments(
            {k: v for k, v in values.items() if k in model_fields()}, values.get("attn_implementation")
        )
        model_args.to_config(LoopedConfig.__dataclass_fields__["vocab_size"].default, data_args.seq_len)
    except RecipeError as err:
        named = re.match(r"(?:LoopedConfig\.)?(\w+)=", str(err))
        raise RecipeError(f"{origin(named.group(1)) if named else where}: {err}") from None
    return model_args, data_args, training_args


def resolved_recipe(model_args: Any, data_args: Any, training_args: TrainingArguments) -> dict[str, Any]:
    """A flat mapping that `parse_recipe` turns back into the same run: every model field as the
    built config has it (so a later change of a LoopedConfig default cannot change the rerun),
    every data field, and the training fields that differ from their defaults (TrainingArguments
    has ~150)."""
    if getattr(training_args, "init_from", None) is not None:
        # The folder's config is the base: only the fields the recipe changes (the rest would
        # overwrite the folder's shapes with LoopedConfig's defaults on a rerun).
        out: dict[str, Any] = {name: _plain(value) for name, value in model_args.settings.items()}
    else:
        vocab = LoopedConfig.__dataclass_fields__["vocab_size"].default
        config = model_args.to_config(vocab, data_args.seq_len)
        out = {name: _plain(getattr(config, name)) for name in model_fields()}
    out["attn_implementation"] = model_args.attn_implementation
    for obj in (data_args,):
        for f in dataclasses.fields(obj):
            if f.init:
                out[f.name] = _plain(getattr(obj, f.name))
    for f in dataclasses.fields(training_args):
        raw = getattr(training_args, f.name) if f.init else None
        if not f.init:
            continue
        if dataclasses.is_dataclass(raw):
            # Built in __post_init__ from a mapping (accelerator_config): the keys set away from
            # the defaults, which parse_recipe accepts back as a mapping.
            changed = _changed_fields(raw)
            if changed:
                out[f.name] = changed
            continue
        value = _plain(raw)
        if f.default is not dataclasses.MISSING:
            default = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _plain(f.default_factory())
        else:
            default = object()
        if value != default and not f.name.endswith("_token") and f.name != "hub_token":
            out[f.name] = value
    return out


def _changed_fields(obj: Any) -> dict[str, Any]:
    """The fields of dataclass instance `obj` that differ from a default-built one (plain values)."""
    try:
        default = type(obj)()
    except TypeError:  # required fields: record them all
        default = None
    return {
        f.name: _plain(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if f.init and (default is None or _plain(getattr(obj, f.name)) != _plain(getattr(default, f.name)))
    }


def _plain(value: Any) -> Any:
    """YAML/JSON-safe form of a dataclass value (enums to their value, tuples to lists)."""
    if (
        hasattr(value, "value")
        and type(value).__module__ != "builtins"
        and not isinstance(value, (int, float))
    ):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


__all__ = [
    "LENGTH_FIELDS",
    "ModelArguments",
    "LoopedTrainingArguments",
    "RecipeError",
    "check_fields",
    "check_declared_fields",
    "load_yaml",
    "model_fields",
    "read_recipe_text",
    "parse_recipe",
    "recipe_field_types",
    "recipe_parser",
    "resolved_recipe",
    "steps_for_tokens",
    "tokens_per_step",
    "yaml_key_lines",
]
