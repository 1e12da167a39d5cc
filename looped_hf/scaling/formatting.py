"""How numbers and intervals read, everywhere the fit, the comparison, the plan, the plots and
the cards print them: one place, so that the same value never reads two ways."""

from __future__ import annotations

import math
from collections.abc import Iterable

_UNITS = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def si(x: float | None, digits: int = 3, missing: str = "-") -> str:
    """A count with an SI-style suffix, ``digits`` significant: 123456789 -> ``123M``, 6000 -> ``6k``
    (``B`` for 1e9, as parameter counts are written); ``missing`` for None, NaN or inf."""
    if x is None or not math.isfinite(x):
        return missing
    for div, unit in _UNITS:
        if abs(x) >= div:
            return f"{x / div:.{digits}g}{unit}"
    return f"{x:.{digits}g}"


def flop_budget(x: float) -> str:
    """A compute budget in FLOPs, 3 significant digits, the exponent without its plus sign:
    ``3e+18`` reads ``3e18`` (the budgets of the report, the cards and the plots)."""
    return f"{x:.3g}".replace("e+", "e")


def interval(iv: Iterable[float | None], spec: str = ".3g", open_end: str = "box") -> str:
    """``[lo, hi]`` with each end formatted by ``spec``; an end that is None (an open end: the
    search box clipped it, nothing measured it) reads ``open_end``."""
    lo, hi = iv
    return "[" + ", ".join(open_end if v is None else format(v, spec) for v in (lo, hi)) + "]"


#: How the report and the sweep card word :func:`~.diagnose.budget_table`'s ``optimal_vs_widths``.
OPTIMAL_VS_WIDTHS = {"below": "below the widths", "above": "above the widths", "inside": "inside"}
