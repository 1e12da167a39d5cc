"""The rules the data and training fields of a recipe declare, and the one check that reads them.

A field declares its type and its range or rule in its annotation, ``Annotated[int | None, AT_LEAST_1]``
(the rule: a callable that raises ``ValueError``, so `LoopedConfig`'s ``Interval`` serves here too;
`field_rule` reads it), and its choices in ``metadata["choices"]`` (`HfArgumentParser`'s convention,
which ``--help`` shows). The metadata holds argparse's keywords only, so a plain
``HfArgumentParser(DataArguments)`` builds (it resolves annotations without their ``Annotated``
extras and passes every metadata key to ``add_argument``). `check_value` checks one value against
them: pydantic (lax: ``"64"`` for an integer, ``1.5e8`` for an integer, ``"true"`` for a boolean;
never NaN or infinity) for the type, then the rule, then the choices. Model fields are
`LoopedConfig`'s, which validates itself. This module imports no dataclass of a recipe, so both
`looped_hf.arguments` and `looped_hf.data` can read it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from looped_hf.configuration_looped import Interval


class RecipeError(ValueError):
    """A recipe (YAML file or flags) that cannot be trained; the message names the field."""


# Rules shared by the recipe dataclasses (``Annotated[float, POSITIVE]``). They are module globals
# of the declaring module too: under ``from __future__ import annotations`` the annotation is a
# string that `typing.get_type_hints` evaluates in the module's namespace.
AT_LEAST_0, AT_LEAST_1 = Interval(0, None, integer=True), Interval(1, None, integer=True)
NON_NEGATIVE, POSITIVE = Interval(0, None), Interval(0, None, low_open=True)
UNIT = Interval(0, 1)
SEED = Interval(0, 2**32 - 1, integer=True, why="numpy's RandomState takes 0 .. 2**32 - 1")


def below_one(value: Any) -> None:
    """In [0, 1): an Adam beta (1 divides by 1 - beta**t = 0) or a smoothing factor."""
    UNIT(value)
    if value == 1:
        raise ValueError("must be a finite number in [0, 1)")


def open_unit(value: Any) -> None:
    """In (0, 1): a fraction of documents that leaves some on each side."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 < value < 1:  # NaN too
        raise ValueError("must be a finite number in (0, 1)")


def steps_or_unset(value: Any) -> None:
    """An optimizer-step count >= 1, or -1 (TrainingArguments' "unset")."""
    if value != -1:
        try:
            AT_LEAST_1(value)
        except ValueError:
            raise ValueError("must be an integer >= 1, or -1 (unset)") from None


def non_empty(value: Any) -> None:
    """A name, path or choice: an empty string is never one."""
    if value == "":
        raise ValueError("must not be empty")


def _is(test: Callable[[Path], bool], text: str) -> bool:
    # A name the OS cannot even look up (too long, a NUL byte, an unknown ~user) is simply not one.
    try:
        return bool(test(Path(text).expanduser()))
    except (OSError, ValueError, RuntimeError):
        return False


def names_file(value: Any) -> None:
    """A mapping, or the path of the JSON file transformers opens (``accelerator_config``, ...)."""
    if isinstance(value, str) and not _is(Path.is_file, value):
        raise ValueError("names no file (give a mapping, or the path of a JSON file)")


def names_dir(value: Any) -> None:
    """The path of an existing directory."""
    non_empty(value)
    if isinstance(value, str) and not _is(Path.is_dir, value):
        raise ValueError("no such directory")


def show(value: Any) -> str:
    """A value as a recipe would spell it: 0 not 0.0, nan, inf, 'text', [1, 2]."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


@functools.cache
def _adapter(annotation: Any) -> Any:
    # Imported here: pydantic is needed only when a recipe is checked.
    from pydantic import ConfigDict, TypeAdapter

    # extra='forbid': a mapping for a dataclass-typed field (parallelism_config) has no unknown key.
    return TypeAdapter(annotation, config=ConfigDict(allow_inf_nan=False, extra='forbid'))


def _why(err: Any) -> str:
    """pydantic's errors (one per member of a union) as one phrase: 'must be a valid integer'."""
    kinds, others = [], []
    for item in err.errors(include_url=False):
        msg = str(item["msg"])
        if msg.startswith("Input should be "):
            kinds.append(msg.removeprefix("Input should be "))
        elif item["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            others.append(f"has an unknown key {item['loc'][-1]!r}")
        else:
            others.append(msg[:1].lower() + msg[1:])
    kind = ["must be " + " or ".join(dict.fromkeys(kinds))] if kinds else []
    return "; ".join([*kind, *dict.fromkeys(others)])


def _numbers(value: Any) -> list[Any]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _numbers(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    return []


@functools.cache
def _annotations(dtype: type) -> dict[str, Any]:
    """A class's resolved annotations with their ``Annotated`` extras."""
    try:
        return typing.get_type_hints(dtype, include_extras=True)
    except NameError:
        # Annotations that name what only type checkers import (transformers' PreTrainedConfig
        # names torch): such a class (LoopedConfig) declares its rules in huggingface_hub's
        # metadata. A recipe dataclass always resolves: HfArgumentParser cannot parse it otherwise.
        return {}


def _rules(annotation: Any) -> list[Any]:
    """The callables an annotation's ``Annotated`` carries: ``Annotated[int | None, R]``, or
    ``Annotated[int, R] | None`` (a union member's)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return [extra for extra in annotation.__metadata__ if callable(extra)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [rule for member in typing.get_args(annotation) for rule in _rules(member)]
    return []


def field_rule(dtype: type, name: str) -> Any:
    """The rule a field of `dtype` declares: the callable (or tuple of callables) in its
    ``Annotated`` annotation, else huggingface_hub's ``metadata["validator"]`` (``validated_field``:
    `LoopedConfig`'s ``@strict`` fields); None when it declares none."""
    rules = _rules(_annotations(dtype).get(name))
    if not rules:
        declared = getattr(dtype, "__dataclass_fields__", {}).get(name)
        return declared.metadata.get("validator") if declared is not None else None
    return rules[0] if len(rules) == 1 else tuple(rules)


def check_value(name: str, value: Any, field: dataclasses.Field, annotation: Any, rule: Any, where: str) -> Any:
    """Check one value against its field's declarations (`declared_fields`: the field, its type
    and its rule); return it as the type asks ("64" as 64). Raises `RecipeError` with one line:
    where, field, value and why. The rule applies to each number of a list or mapping."""

    def bad(why: str) -> RecipeError:
        return RecipeError(f"{where}: {name}={show(value)}: {why}")

    from pydantic import ValidationError

    try:
        checked = _adapter(annotation).validate_python(value)
    except ValidationError as err:
        raise bad(_why(err)) from None
    if checked is None:
        return None  # "unset": the type says whether a field may be
    if isinstance(value, bool) and not isinstance(checked, bool):  # lax pydantic reads true as 1
        raise bad("must not be a boolean")
    if type(value) is int and type(checked) is float and checked == value:
        checked = value  # 0 stays 0 where a number is asked, as TrainingArguments' own defaults
    for x in _numbers(checked):
        if isinstance(x, int) and not -(2**63) <= x < 2**63:
            raise bad("is too large: integers must fit 64 bits (numpy, torch)")
    for check in rule if isinstance(rule, (list, tuple)) else [rule] if rule else []:
        for x in _numbers(checked) if _numbers(checked) else [checked]:
            try:
                check(x)
            except ValueError as err:
                raise bad(f"{err}{'' if x is checked else f' (contains {show(x)})'}") from None
    allowed = field.metadata.get("choices")
    words = [checked] if isinstance(checked, str) else checked if isinstance(checked, list) else []
    if allowed is not None and any(isinstance(w, str) and w not in allowed for w in words):
        raise bad(f"must be one of {list(allowed)}")
    return checked


@functools.cache
def declared_fields(dtype: type) -> dict[str, tuple[dataclasses.Field, Any, Any]]:
    """Each init field of a recipe dataclass with its resolved type (``Annotated`` stripped: what
    pydantic checks) and its rule (`field_rule`)."""
    hints = typing.get_type_hints(dtype)
    return {f.name: (f, hints.get(f.name, Any), field_rule(dtype, f.name)) for f in dataclasses.fields(dtype) if f.init}


def check_declared_fields(obj: Any) -> None:
    """Check a recipe dataclass built in Python against its declarations: every field that
    declares a rule or choices, and the class's own fields' types. Raises `RecipeError` naming
    the class, the field and the value."""
    dtype = type(obj)
    own = set(vars(dtype).get("__annotations__", {}))
    for name, (field, annotation, rule) in declared_fields(dtype).items():
        if name in own or rule is not None or "choices" in field.metadata:
            setattr(obj, name, check_value(name, getattr(obj, name), field, annotation, rule, dtype.__name__))
