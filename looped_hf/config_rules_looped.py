"""The field rules of ``LoopedConfig`` (``configuration_looped.py``), in a file of their own: the
``@strict`` validators (``Interval`` and its shorthands), the per-call override check, the one-line
refusals (``LoopedConfigError``) and Llama's tensor-parallel plan. Shipped with every checkpoint as
remote code beside ``configuration_looped.py``, which re-exports every name here: it imports only
transformers and huggingface_hub.
"""

import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from huggingface_hub.dataclasses import validated_field
from huggingface_hub.errors import StrictDataclassError


# ---------------------------------------------------------------------------------------------
# Field rules, declared on the fields (transformers 5's ``@strict`` configs, as ``LlamaConfig``)
# ---------------------------------------------------------------------------------------------
def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Interval:
    """A field's range, as a ``@strict`` validator: ``None`` passes (the type says whether it may
    be None); NaN and infinities never do. Readable by tools (``describe()``, ``low`` / ``high``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    integer: bool = False
    why: str = ""

    def __call__(self, value: Any) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return  # the type check names a wrong type
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ValueError("is too large: integers must fit 64 bits (torch sizes, numpy seeds)")
        # NaN fails every comparison, so each test says what is inside, never what is outside.
        inside = math.isfinite(value) and (self.low is None or (value > self.low if self.low_open else value >= self.low))
        if not (inside and (self.high is None or value <= self.high)):
            raise ValueError(f"must be {self.describe()}")

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            # Both ends given: finite by the range itself.
            text = f"{'an integer' if self.integer else 'a number'} in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low}"
        else:
            text = kind
        return f"{text} ({self.why})" if self.why else text


def interval(low: float | None, high: float | None, *, low_open: bool = False, why: str = "") -> Callable[..., Any]:
    """``interval(0, 1)(default=0.0)``: a field whose value lies in [low, high]."""
    rule = Interval(low, high, low_open=low_open, why=why)
    return lambda default: validated_field(rule, default=default)


def at_least(low: int, *, why: str = "") -> Callable[..., Any]:
    """``at_least(1)(default=4)``: an integer field >= low."""
    rule = Interval(low, None, integer=True, why=why)
    return lambda default: validated_field(rule, default=default)


# The rules of the fields that ``forward`` / ``generate`` also take per call: the field and the
# keyword run the same rule (``check_override``), so one rule has one message.
R_RULE = Interval(1, None, integer=True)  # and at most MAX_NUM_RECURRENCES: validate_loop
KV_BUDGET_RULE = Interval(1, None, integer=True, why="None: every recurrence keeps its KV cache")
MIN_RECURRENCES_RULE = Interval(1, None, integer=True)
EXIT_GATE_THRESHOLD_RULE = Interval(0, 1, why="a cumulative exit probability")
# The largest embedding scale or initial-state std a config may name: Gemma's sqrt(d) and Huginn's
# are below 100; 1e308 (or a std of 1e200) overflows the first norm's square to inf, so NaN logits.
MAX_SCALE = 1e4
SCALE_WHY = "larger ones overflow the activations; the published models' are below 100"


def check_override(field: str, value: Any, rule: Interval) -> Any:
    """A per-call value of config field ``field`` (``num_recurrences=`` of ``forward``, ...) checked
    by the field's own ``rule``; returns it (an integer rule takes numpy and 0-d tensor integers,
    as a Python int: ``torch.compile`` builds one graph per r). Raises ``LoopedConfigError``
    "field=value: why" in the words of the field's own refusal."""
    if rule.integer:
        try:
            number = operator.index(value) if not isinstance(value, bool) else None
        except TypeError:
            number = None
    else:
        number = value if _is_real(value) else None
    if number is None:
        raise LoopedConfigError(f"{field}={value!r}: must be {rule.describe()}")
    try:
        rule(number)
    except ValueError as err:
        raise LoopedConfigError(f"{field}={value!r}: {err}") from None
    return number


def field_choices(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` field (or ``Literal[...] | None``) takes; () for other types."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    return tuple(c for arg in get_args(annotation) for c in field_choices(arg))


class LoopedConfigError(StrictDataclassError, ValueError):
    """A config value that cannot work, in one line naming the field and the value. Both a
    ``ValueError`` (as before ``@strict``) and huggingface_hub's ``StrictDataclassError``."""


def _field_refusal(cls: type, name: str, value: Any, err: StrictDataclassError) -> LoopedConfigError:
    """``@strict``'s refusal of ``cls.name = value`` as one line, "LoopedConfig.name=value: why".

    ``@strict`` wraps what a field's validator raises (chained as ``__cause__``) in a two-line
    message. The "why" comes from the field's declaration: its choices, or "expected T, got U"
    for a plain type, or else the validator's own words (an ``Interval``'s rule, a union's list)."""
    cause = err.__cause__
    why = str(cause) if cause is not None else str(err)
    if isinstance(cause, TypeError):  # the type check: an Interval only ever raises ValueError
        annotation = cls.__annotations__.get(name)
        if choices := field_choices(annotation):
            why = f"must be one of {tuple(c for c in choices if c is not None)}"
        elif isinstance(annotation, type):
            why = f"expected {annotation.__name__}, got {type(value).__name__}"
    return LoopedConfigError(f"{cls.__name__}.{name}={value!r}: {why}")


def _one_line_errors(cls: type) -> type:
    """Make ``@strict``'s refusals one line (``LoopedConfigError``), which a CLI can print as it is.

    Applied on top of ``@strict``, it wraps the two entry points every refusal passes through:
    field assignment (``__init__`` assigns each field, so construction too) and ``validate()``
    (run after ``__init__`` and before ``save_pretrained``). Nothing else can: ``@strict`` wraps
    every ``ValueError`` / ``TypeError`` a validator raises, ``LoopedConfigError`` included, and
    runs the type check before a field's own validator. ``functools.wraps`` keeps the wrapped
    methods' attributes, so a subclass may apply ``@strict`` again, as to any strict class."""
    strict_setattr, strict_validate = cls.__setattr__, cls.validate

    @functools.wraps(strict_setattr)
    def __setattr__(self: Any, name: str, value: Any) -> None:
        try:
            strict_setattr(self, name, value)
        except StrictDataclassError as err:
            raise _field_refusal(cls, name, value, err) from None

    @functools.wraps(strict_validate)
    def validate(self: Any) -> None:
        try:
            strict_validate(self)
        except StrictDataclassError as err:
            # The ``validate_*`` rules raise "LoopedConfig.field=value: why" themselves (``_bad``, in
            # the class's own name: a subclass's refusals name the subclass).
            raise LoopedConfigError(str(err.__cause__ or err)) from None

    cls.__setattr__, cls.validate = __setattr__, validate
    return cls


def tensor_parallel_plan(
    gated: bool = True, stacks: tuple[str, ...] = ("prelude_layers", "recurrent_layers", "coda_layers")
) -> dict[str, str]:
    """Llama's tensor-parallel plan for each layer list in ``stacks`` (a model names only the lists
    it has: transformers refuses a plan entry that matches no parameter).

    q/k/v and the MLP input projections are split by output (whole heads per rank, so
    num_key_value_heads must divide by the TP size), o_proj and down_proj by input, then
    all-reduced. The injection adapter reads the full (replicated) [e; h], so it stays replicated,
    as do the norms and the hyperconnection gains; transformers adds the vocabulary split of the
    embedding itself. ``gated=False`` (the squared-ReLU MLP) has no gate_proj to name.
    """
    modules = [("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
               ("self_attn.o_proj", "rowwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise")]  # fmt: skip
    if gated:
        modules.append(("mlp.gate_proj", "colwise"))
    return {
        f"{stack}.*.{module}": style
        for stack in stacks
        for module, style in modules
    }
