"""Recipe values checked against one table: each field's type (its annotation), range
(`FIELD_LIMITS`) and choices (the field's ``metadata["choices"]``, plus `extra_choices` for the
TrainingArguments fields looped_hf does not declare).

`looped_hf.arguments` checks a recipe's values with `check_value` before it builds any dataclass;
the dataclasses (`ModelArguments`, `DataArguments`, `LoopedTrainingArguments`) check an instance
built in Python with `check_declared_fields`, against the same table. This module imports no
dataclass of a recipe, so both `looped_hf.arguments` and `looped_hf.data` can read it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """A recipe (YAML file or flags) that cannot be trained; the message names the field."""


@dataclass(frozen=True)
class Limit:
    """The range a number of a recipe field must lie in (for a list: each of its numbers).

    Every number must also be finite: NaN and infinity are never a setting. `special` lists
    values outside the range that the field gives a meaning (`max_steps: -1`, unset).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()

    def admits(self, x: float) -> bool:
        if x in self.special:
            return True
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_show(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_show(self.high)}")
        text = " and ".join(parts)
        if self.special:
            text += f", or {' or '.join(_show(s) for s in self.special)}"
        return text


_AT_LEAST_0, _AT_LEAST_1, _POSITIVE = Limit(0), Limit(1), Limit(0, low_open=True)
_UNIT, _UNIT_OPEN, _BETA = Limit(0, 1), Limit(0, 1, True, True), Limit(0, 1, high_open=True)
# Seeds feed numpy's RandomState, which takes 0 .. 2**32 - 1.
_SEED = Limit(0, 2**32 - 1)

#: Ranges of the recipe fields that take numbers (model, data and training fields alike). A
#: number field not listed here is still checked for its type and for being finite.
FIELD_LIMITS: dict[str, Limit] = {
    # model
    "hidden_size": _AT_LEAST_1, "num_attention_heads": _AT_LEAST_1, "head_dim": _AT_LEAST_1,
    "num_key_value_heads": _AT_LEAST_1, "intermediate_size": _AT_LEAST_1,
    "num_prelude_layers": _AT_LEAST_0, "num_recurrent_layers": _AT_LEAST_0, "num_coda_layers": _AT_LEAST_0,
    "num_recurrences": _AT_LEAST_1, "num_hyperconnection_lanes": _AT_LEAST_1,
    "backprop_recurrences": _AT_LEAST_1, "logit_softcap": _POSITIVE, "initializer_range": _POSITIVE,
    "max_position_embeddings": Limit(2), "pad_vocab_size_to_multiple_of": _AT_LEAST_1,
    # data
    "seq_len": Limit(2), "eval_blocks": _AT_LEAST_1, "split_seed": _SEED, "pack_batch_docs": _AT_LEAST_1,
    "shuffle_buffer": _AT_LEAST_0, "num_proc": _AT_LEAST_1, "streaming_eval_fraction": _UNIT_OPEN,
    # training length and batch
    "max_steps": Limit(1, special=(-1,)), "train_tokens": _AT_LEAST_1, "train_flops_budget": _POSITIVE,
    "num_train_epochs": _POSITIVE, "per_device_train_batch_size": _AT_LEAST_1,
    "per_device_eval_batch_size": _AT_LEAST_1, "gradient_accumulation_steps": _AT_LEAST_1,
    "eval_accumulation_steps": _AT_LEAST_1,
    # optimizer and schedule
    "learning_rate": _POSITIVE, "muon_learning_rate": _POSITIVE, "embedding_learning_rate": _POSITIVE,
    "lm_head_learning_rate": _POSITIVE, "norm_learning_rate": _POSITIVE,
    "hyperconnection_learning_rate": _POSITIVE, "weight_decay": _AT_LEAST_0, "adam_beta1": _BETA,
    "adam_beta2": _BETA, "adam_epsilon": _POSITIVE, "max_grad_norm": _AT_LEAST_0,
    "label_smoothing_factor": _BETA, "warmup_steps": _AT_LEAST_0, "final_lr_ratio": _UNIT,
    "neftune_noise_alpha": _POSITIVE,
    # logging, saving, evaluation
    "logging_steps": _POSITIVE, "save_steps": _POSITIVE, "eval_steps": _POSITIVE, "eval_delay": _AT_LEAST_0,
    "save_total_limit": _AT_LEAST_0, "torch_empty_cache_steps": _AT_LEAST_1,
    # processes and loading
    "seed": _SEED, "data_seed": _SEED, "dataloader_num_workers": _AT_LEAST_0,
    "dataloader_prefetch_factor": _AT_LEAST_1, "ddp_timeout": _AT_LEAST_1, "ddp_bucket_cap_mb": _AT_LEAST_1,
    "torch_num_threads": _AT_LEAST_1, "peak_flops": _POSITIVE,
}  # fmt: skip

#: String fields for which an empty string is never a setting (a name, a path, a choice).
NON_EMPTY_FIELDS = frozenset({
    "hidden_act", "input_injection", "state_init", "qk_norm", "init_scheme", "rope_table_dtype",
    "dataset", "dataset_config", "dataset_split", "dataset_revision", "text_column", "text_sample_by",
    "tokenizer", "data_cache_dir", "eval_split",
    "output_dir", "optimizer", "lr_scaling", "lr_schedule", "train_steps_rounding", "run_id", "arch", "variant",
    "recurrence_sampling", "results_file", "resume_from_checkpoint", "run_name", "logging_dir",
})  # fmt: skip

#: Types a field accepts beyond its annotation: `qk_norm: true / false` (recipes written for
#: looped_hf 0.1.0; ModelArguments reads them as after_rope / none).
TYPE_OVERRIDES: dict[str, Any] = {"qk_norm": str | bool}

#: Fields whose string value is the path of a JSON/YAML file that transformers opens.
FILE_FIELDS = ("accelerator_config", "deepspeed", "fsdp_config")
#: Fields whose string value is the path of a directory that must exist.
DIR_FIELDS = ("resume_from_checkpoint",)


@functools.cache
def extra_choices() -> dict[str, tuple[str, ...]]:
    """Choices of fields whose declaration cannot carry them in its metadata: recurrence_sampling
    (its list lives with the schedule, in a module that imports torch), and the TrainingArguments
    fields that transformers checks only once training starts (report_to, the multiprocessing
    context, the compile mode), so they fail up front. (qk_norm, which also takes true / false,
    is checked by `ModelArguments` itself.)"""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    from looped_hf.recurrence import RECURRENCE_SAMPLINGS

    return dict(
        recurrence_sampling=tuple(RECURRENCE_SAMPLINGS),
        report_to=("all", "none", *sorted(INTEGRATION_TO_CALLBACK)),
        include_num_input_tokens_seen=("all", "non_padding", "no"),
        dataloader_multiprocessing_context=("fork", "spawn", "forkserver"),
        torch_compile_mode=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )  # fmt: skip


def declared_choices(*dtypes: type) -> dict[str, tuple[str, ...]]:
    """The choices the fields of `dtypes` declare in their metadata, and `extra_choices`."""
    out: dict[str, tuple[str, ...]] = {}
    for dtype in dtypes:
        for f in dataclasses.fields(dtype):
            if f.init and f.metadata.get("choices"):
                out[f.name] = tuple(str(c) for c in f.metadata["choices"])
    return {**out, **extra_choices()}


def _show(value: Any) -> str:
    """A value as a recipe would spell it: 0 not np.float64(0.0), nan, inf, 'text', [1, 2]."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, float) or (hasattr(value, "dtype") and hasattr(value, "item")):
        number = value.item() if hasattr(value, "item") else value
        if isinstance(number, float) and number.is_integer() and abs(number) < 1e16:
            return str(int(number))
        return repr(number)
    return repr(value)


_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a mapping", type(None): "null"}  # fmt: skip


def _plural(annotation: Any) -> str:
    """'integers', 'lists of integers', 'values from [...]': what a list's items must be."""
    if annotation in _PLURALS:
        return _PLURALS[annotation]
    if typing.get_origin(annotation) is list and typing.get_args(annotation):
        return f"lists of {_plural(typing.get_args(annotation)[0])}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"values from {[m.value for m in annotation]}"
    return _kind(annotation)


def _kind(annotation: Any) -> str:
    """What an annotation asks for, in words (for error messages)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
            members = [m for m in members if m is not str]  # the enum's values are the strings it takes
        text = " or ".join(dict.fromkeys(_kind(m) for m in members))
        return f"{text} (or null)" if type(None) in typing.get_args(annotation) else text
    if origin is typing.Literal:
        return " or ".join(_show(a) for a in typing.get_args(annotation))
    if origin is list or annotation is list:
        args = typing.get_args(annotation)
        if not args:
            return "a list"
        return f"a list of {_plural(args[0])}"
    if origin is dict or annotation is dict:
        return "a mapping"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"one of {[m.value for m in annotation]}"
    return f"a {getattr(annotation, '__name__', str(annotation))}"


def _from_text(value: Any, annotation: Any) -> Any:
    """A recipe file's string for a number or boolean field, as that number or boolean.

    YAML reads `1e-3` and `1.0e5` (no sign in the exponent) as strings; argparse would convert
    them, but its error would name a flag the user never gave. Anything else is returned as is.
    """
    if not isinstance(value, str):
        return value
    members = (
        set(typing.get_args(annotation))
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else {annotation}
    )
    if str in members or any(isinstance(m, type) and issubclass(m, enum.Enum) for m in members):
        return value
    text = value.strip()
    if bool in members and text.lower() in ("true", "false", "yes", "no", "1", "0"):
        return text.lower() in ("true", "yes", "1")
    if members & {int, float}:
        try:
            return int(text) if int in members and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            return value
    return value


class _Mismatch(Exception):
    """A value that does not have its field's type (internal: becomes a RecipeError)."""


def _coerce(value: Any, annotation: Any) -> Any:
    """`value` as the type `annotation` asks for, or `_Mismatch`. Whole floats are accepted for
    integers (YAML's 1.5e+8 for train_tokens); strings are never numbers here (argparse has
    already converted the ones a recipe file or flag gave for a number field)."""
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(annotation)
        # A string for an enum-typed field must be one of its values, even where str is allowed too.
        enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
        if isinstance(value, str) and enums and not any(value in {e.value for e in m} for m in enums):
            raise _Mismatch
        for member in sorted(members, key=lambda m: m is not type(value)):  # exact type first
            try:
                return _coerce(value, member)
            except _Mismatch:
                continue
        raise _Mismatch
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(annotation)):
            return value
        raise _Mismatch
    if origin is list or annotation is list:
        if not isinstance(value, list):
            raise _Mismatch
        args = typing.get_args(annotation)
        return [_coerce(v, args[0]) for v in value] if args else value
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        args = typing.get_args(annotation)
        if args:
            # Keys from JSON are strings ("2" for r = 2): read them as the key type asks.
            return {_coerce(_from_text(k, args[0]), args[0]): _coerce(v, args[1]) for k, v in value.items()}
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        raise _Mismatch
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(annotation, type):
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            try:
                return annotation(value)
            except ValueError:
                raise _Mismatch from None
        if isinstance(value, annotation):
            return value
        raise _Mismatch
    return value  # an annotation we cannot check (a forward reference): left to the dataclass


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    return []


def _is(test: Any, text: str) -> bool:
    """`test` (Path.is_file, Path.is_dir) of a user's path; a name the OS cannot even look up
    (too long, a NUL byte) is simply not one."""
    try:
        return bool(test(Path(text).expanduser()))
    except (OSError, ValueError, RuntimeError):  # RuntimeError: ~user that does not exist
        return False


def check_value(
    name: str,
    value: Any,
    annotation: Any,
    where: str,
    limits: Mapping[str, Limit] | None = None,
    choices: Mapping[str, tuple[str, ...]] | None = None,
) -> Any:
    """Check one recipe value against its field's type and range; return it (whole floats of an
    integer field as ints). Raises `RecipeError` with one line: where, field, value, and why.

    `where` says where the value came from (the file and line, or the flag); `limits` defaults to
    `FIELD_LIMITS`; `choices` (field -> the strings it takes; `declared_choices`) to none.
    """
    limit = (FIELD_LIMITS if limits is None else limits).get(name.rsplit(".", 1)[-1])

    def bad(why: str) -> RecipeError:
        return RecipeError(f"{where}: {name}={_show(value)}: {why}")

    try:
        checked = _coerce(value, annotation)
    except _Mismatch:
        got = _TYPE_NAMES.get(type(value), type(value).__name__)
        wanted = "a mapping or the path of a JSON file" if name in FILE_FIELDS else _kind(annotation)
        if limit is not None and wanted.removesuffix(" (or null)") in ("an integer", "a number"):
            # "an integer >= 1 (or null)": the range belongs to the number, before the null.
            plain = wanted.removesuffix(" (or null)")
            wanted = wanted.replace(plain, f"{plain} {limit.describe()}", 1)
        raise bad(f"must be {wanted}, got {got}") from None
    for x in _numbers(checked):
        if not math.isfinite(x):
            raise bad("must be a finite number")
        if isinstance(x, int) and not -(2**63) <= x < 2**63:
            raise bad("is too large: integers must fit 64 bits (numpy, torch)")
        if limit is not None and not limit.admits(x):
            shown = "" if x == checked else f" (contains {_show(x)})"
            raise bad(f"must be {limit.describe()}{shown}")
    if isinstance(checked, str):
        if not checked and name in NON_EMPTY_FIELDS:
            raise bad("must not be empty")
        if name in FILE_FIELDS and not _is(Path.is_file, checked):
            raise bad("names no file (give a mapping, or the path of a JSON file)")
        if name in DIR_FIELDS and not _is(Path.is_dir, checked):
            raise bad("no such directory")
    allowed = (choices or {}).get(name)
    if allowed is not None:
        words = [checked] if isinstance(checked, str) else checked if isinstance(checked, list) else []
        for word in words:
            if isinstance(word, str) and word not in allowed:
                raise bad(f"must be one of {list(allowed)}")
    return checked


@functools.cache
def _field_types(dtype: type) -> dict[str, Any]:
    hints = typing.get_type_hints(dtype)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(dtype) if f.init}


def check_declared_fields(obj: Any) -> None:
    """Check a dataclass instance built in Python against the one table a recipe is checked
    against (`check_value`: the annotation's type, `FIELD_LIMITS`, the declared choices): its own fields
    and every inherited one the table gives a range or choices. Raises `RecipeError` naming the
    class, the field and the value; whole floats of integer fields become ints."""
    dtype = type(obj)
    types_ = {**_field_types(dtype), **{k: v for k, v in TYPE_OVERRIDES.items() if k in _field_types(dtype)}}
    own = set(vars(dtype).get("__annotations__", {}))
    choices = declared_choices(dtype)
    ruled = set(FIELD_LIMITS) | set(choices) | NON_EMPTY_FIELDS
    for name, annotation in types_.items():
        if name in own or name in ruled:
            value = check_value(name, getattr(obj, name), annotation, dtype.__name__, choices=choices)
            setattr(obj, name, value)


