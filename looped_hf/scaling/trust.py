"""Which 95% interval to believe: the one rule behind every verdict on phi and on delta phi.

A fit of phi (and a comparison's delta phi) carries two intervals: the profile-likelihood one
(:mod:`.profile`) and the percentile bootstrap (:mod:`.resample`). The fit report's "is phi
identified?", the comparison's "does it decide the sign of delta phi?", the cards and the
planner all read them through :func:`trusted_interval`, so that no two of them can disagree
about the same numbers.

The rule, and why:

1. One interval only: that one, unless it is a suspect bootstrap (2.): then none.
2. The bootstrap is *suspect* when more than :data:`DROPPED_TRUSTED` of its resamples (and more
   than one: one failure in a dozen quick resamples does not decide) failed their fit checks and
   were dropped, since the kept ones then understate the spread; or when it reaches beyond the
   profile interval by more than the profile's own width, the mark of resamples running along a
   flat direction of the objective rather than of a real spread. Then the profile is trusted.
3. Otherwise the bootstrap is trusted: its resample fits passed the checks, and it keeps the
   correlation of runs in one (budget, r) cell, which the profile's independent-error
   likelihood-ratio scale does not.

Which interval is trusted does not depend on the question asked of it. The question (is the
interval narrow and closed? does it exclude 0?) is asked of both; when the answers agree the
verdict says so, when they differ it says that they disagree and which one it follows and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from .formatting import interval

#: An interval with ``None`` for an open end (one the search box clipped, nothing measured).
Interval = tuple[float | None, float | None]
Answer = TypeVar("Answer")

#: A bootstrap that dropped more than this share of its resamples as failed fits is not trusted.
DROPPED_TRUSTED = 0.05
#: A phi interval at most this wide counts as a measurement: half the distance between the two
#: readings that matter (phi = 0: looping adds nothing; phi = 1: a recurrence is worth a unique block).
PHI_WIDTH_IDENTIFIED = 0.5


def too_many_dropped(n: int | None, dropped: int | None) -> bool:
    """More than :data:`DROPPED_TRUSTED` of ``n`` resamples, and more than one, failed their fits."""
    return bool(n) and (dropped or 0) > max(1.0, DROPPED_TRUSTED * n)


def _reaches_beyond(boot: Interval, prof: Interval) -> bool:
    p_lo = -math.inf if prof[0] is None else prof[0]
    p_hi = math.inf if prof[1] is None else prof[1]
    width = p_hi - p_lo
    if not math.isfinite(width):
        return False
    b_lo = -math.inf if boot[0] is None else boot[0]
    b_hi = math.inf if boot[1] is None else boot[1]
    return b_lo < p_lo - width or b_hi > p_hi + width


@dataclass(frozen=True)
class Trust(Generic[Answer]):
    """What the trusted interval answers, which one that is, and in words why.

    ``trusted`` is ``"both"`` when the two intervals give the same answer, else the name of the
    one followed. ``suspect`` is why the bootstrap is suspect (rule 2): ``"dropped"`` (too many
    failed resample fits), ``"flat"`` (it reaches far beyond the profile interval), else ``None``.
    ``disagree`` is the sentence a report prints when they differ (else ``None``).
    """

    answer: Answer
    trusted: Literal["both", "profile", "bootstrap", "none"]
    why: str
    suspect: Literal["dropped", "flat"] | None
    disagree: str | None


def trusted_interval(
    profile: Interval | None,
    bootstrap: Interval | None,
    ask: Callable[[Interval], Answer],
    *,
    n_resamples: int | None = None,
    n_dropped: int | None = None,
    describe: Callable[[Answer], str] = str,
) -> Trust[Answer | None]:
    """Ask ``ask`` of the interval the rule trusts (module docstring), and say how the other one
    answers. ``describe`` words an answer for the disagreement sentence."""
    suspect: Literal["dropped", "flat"] | None = None
    suspect_why = ""
    if bootstrap is not None and too_many_dropped(n_resamples, n_dropped):
        share = 100 * (n_dropped or 0) / max(1, n_resamples or 1)
        suspect, suspect_why = "dropped", f"the bootstrap dropped {share:.0f}% of its resamples as failed fits"
    elif bootstrap is not None and profile is not None and _reaches_beyond(bootstrap, profile):
        suspect = "flat"
        suspect_why = "the bootstrap reaches far beyond the profile interval (resamples in a flat direction)"
    if profile is None and bootstrap is None:
        return Trust(None, "none", "no interval", None, None)
    if profile is None and suspect_why:
        return Trust(None, "none", f"no profile interval, and {suspect_why}", suspect, None)
    if profile is None or bootstrap is None:
        name: Literal["profile", "bootstrap"] = "profile" if bootstrap is None else "bootstrap"
        only = profile if bootstrap is None else bootstrap
        assert only is not None
        return Trust(ask(only), name, f"{name} only", suspect, None)
    a_prof, a_boot = ask(profile), ask(bootstrap)
    if a_prof == a_boot:
        return Trust(a_prof, "both", "the two intervals agree", suspect, None)
    if suspect_why:
        trusted, answer = "profile", a_prof
        why = f"the profile interval is trusted: {suspect_why}"
    else:
        trusted, answer = "bootstrap", a_boot
        why = ("the bootstrap is trusted: its resample fits passed the checks and it keeps the correlation "
               "of runs in one (budget, r) cell, which the profile's LR scale does not")  # fmt: skip
    disagree = (f"the intervals disagree (profile {interval(profile)}: {describe(a_prof)}; "
                f"bootstrap {interval(bootstrap)}: {describe(a_boot)}); {why}")  # fmt: skip
    return Trust(answer, trusted, f"the intervals disagree; {why}", suspect, disagree)


def phi_measured(iv: Interval) -> bool:
    """Does one interval of phi measure it: closed inside the box and at most
    :data:`PHI_WIDTH_IDENTIFIED` wide."""
    lo, hi = iv
    return lo is not None and hi is not None and hi - lo <= PHI_WIDTH_IDENTIFIED


def sign_of(iv: Interval) -> int:
    """+1 / -1 when the interval excludes 0 above / below, else 0."""
    lo, hi = iv
    return 1 if (lo is not None and lo > 0) else (-1 if (hi is not None and hi < 0) else 0)
