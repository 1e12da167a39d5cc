"""Which parent layer becomes which looped layer: the three layer choices, as small functions.

* ``paper_rule(L, P, R, C)``: retrofitted recurrence (McLeish et al. 2025,
  LoopedLMs/retrofitting-recurrence ``convert_llama.py``'s ``mapping_cfg``): the first P layers are
  the prelude, the last C the coda, the R just before the coda the recurrent block; the layers
  between prelude and block are dropped (TinyLlama's 22 with 4,8,4: 0-3 / 10-17 / 18-21).
* ``explicit(L, prelude, recurrent, coda)``: the same, with the ranges named.
* ``loop_in_place(L, P, R, C)``: every layer kept (``convert_olmo_loop_in_place.py``), so at
  r = 1 the looped model is the parent.
* ``share(L, K, strategy)``: Relaxed Recursive Transformers (Bae et al. 2024; the
  Mixture-of-Recursions code's ``sharing_strategy/llama.py``): K shared layers looped L / K
  times; loop t's layer j stands for parent layer t*K + j (their "cycle" sharing). The shared
  layer j is initialised from parent layer ``round(linspace(0, L-1, K))[j]`` (``stepwise``), layer
  j (``lower``) or the mean of the layers it stands for (``average``).

The only layers a plan may drop are those between the prelude and the recurrent block (the
paper's rule); every other gap, an overlap or a layer past the last is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..convert.common import ConversionError

SHARE_STRATEGIES = ("stepwise", "average", "lower")


@dataclass(frozen=True)
class LayerPlan:
    """The parent layers each looped stack is built from.

    ``prelude`` / ``coda``: one parent layer per looped layer. ``recurrent``: for each looped block
    layer j, the parent layers whose weights make it (one; several are averaged). ``unrolled``: for
    a shared plan, parent layer of (loop t, block layer j), the target of per-loop LoRA."""

    method: str
    num_parent_layers: int
    prelude: tuple[int, ...]
    recurrent: tuple[tuple[int, ...], ...]
    coda: tuple[int, ...]
    num_recurrences: int = 1
    share: str | None = None
    unrolled: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def kept(self) -> list[int]:
        return sorted({*self.prelude, *(i for group in self.recurrent for i in group), *self.coda})

    @property
    def dropped(self) -> list[int]:
        return sorted(set(range(self.num_parent_layers)) - set(self.kept))

    def as_dict(self) -> dict:
        """The layer map as ``retrofit.json`` and the card record it."""
        out = {"method": self.method, "num_parent_layers": self.num_parent_layers, "prelude": list(self.prelude),
               "recurrent": [list(g) if len(g) > 1 else g[0] for g in self.recurrent], "coda": list(self.coda),
               "dropped": self.dropped}  # fmt: skip
        if self.share is not None:
            out["share"] = self.share
            out["unrolled"] = [list(row) for row in self.unrolled]
        return out


def parse_range(flag: str, text: str) -> list[int]:
    """``"10-17"`` -> [10, ..., 17], ``"4"`` -> [4]; a bad range names the flag and the value."""
    parts = text.split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None or low < 0 or high < low:
        raise ConversionError(
            f"{flag}={text!r}: expected a layer range FIRST-LAST (e.g. 10-17) or one layer index"
        )
    return list(range(low, high + 1))


def _check_bounds(num_layers: int, ranges: dict[str, list[int]]) -> None:
    for flag, layers in ranges.items():
        if layers and layers[-1] >= num_layers:
            raise ConversionError(f"{flag}={layers[0]}-{layers[-1]}: passes the parent's last layer "
                                  f"({num_layers - 1}; it has num_hidden_layers={num_layers})")  # fmt: skip


def explicit(num_layers: int, prelude: list[int], recurrent: list[int], coda: list[int], *,
             method: str = "retrofit", num_recurrences: int = 1) -> LayerPlan:  # fmt: skip
    """The plan of three named ranges (``--prelude 0-3 --recurrent 10-17 --coda 18-21``), checked:
    inside the parent, no overlap, the prelude from layer 0, the coda ending at the last layer and
    starting right after the block; layers between prelude and block are the ones dropped."""
    ranges = {"--prelude": prelude, "--recurrent": recurrent, "--coda": coda}
    _check_bounds(num_layers, ranges)
    if not recurrent:
        raise ConversionError("--recurrent: the recurrent block needs at least one layer")
    names = list(ranges)
    for a in range(3):
        for b in range(a + 1, 3):
            both = sorted(set(ranges[names[a]]) & set(ranges[names[b]]))
            if both:
                raise ConversionError(f"{names[a]} and {names[b]} overlap at layer {both[0]}")
    if prelude and prelude[0] != 0:
        raise ConversionError(f"--prelude={prelude[0]}-{prelude[-1]}: leaves a gap, layers 0-{prelude[0] - 1} before "
                              "it (the prelude starts at layer 0)")  # fmt: skip
    if prelude and recurrent[0] < prelude[-1]:
        raise ConversionError(f"--recurrent={recurrent[0]}-{recurrent[-1]}: comes before --prelude "
                              f"{prelude[0]}-{prelude[-1]}")  # fmt: skip
    end = coda[0] if coda else num_layers
    if recurrent[-1] + 1 != end:
        what = f"--coda starts at {coda[0]}" if coda else f"the parent's last layer is {num_layers - 1}"
        raise ConversionError(f"--recurrent={recurrent[0]}-{recurrent[-1]}: leaves a gap before the coda ({what}); only "
                              "the layers between prelude and recurrent block may be dropped")  # fmt: skip
    if coda and coda[-1] != num_layers - 1:
        raise ConversionError(f"--coda={coda[0]}-{coda[-1]}: leaves a gap, layers {coda[-1] + 1}-{num_layers - 1} "
                              "after it (the coda ends at the parent's last layer)")  # fmt: skip
    return LayerPlan(method, num_layers, tuple(prelude), tuple((i,) for i in recurrent), tuple(coda),
                     num_recurrences=num_recurrences)  # fmt: skip


def paper_rule(
    num_layers: int, prelude: int, recurrent: int, coda: int, *, num_recurrences: int = 1
) -> LayerPlan:
    """``--layers P,R,C``: the first P, the R before the last C, the last C (McLeish et al. 2025)."""
    counts = {"P": prelude, "R": recurrent, "C": coda}
    bad = [f"{k}={v}" for k, v in counts.items() if v < 0] + (["R=0"] if recurrent == 0 else [])
    if bad or prelude + recurrent + coda > num_layers:
        raise ConversionError(f"--layers={prelude},{recurrent},{coda}: needs P, C >= 0, R >= 1 and P + R + C <= "
                              f"num_hidden_layers={num_layers} of the parent")  # fmt: skip
    start = num_layers - coda - recurrent
    return explicit(num_layers, list(range(prelude)), list(range(start, num_layers - coda)),
                    list(range(num_layers - coda, num_layers)), num_recurrences=num_recurrences)  # fmt: skip


def loop_in_place(plan: LayerPlan) -> LayerPlan:
    """``--loop-in-place``: ``plan`` refused unless it keeps every parent layer."""
    if plan.dropped:
        d = plan.dropped
        raise ConversionError(f"--loop-in-place keeps every layer, but the layer choice drops layers {d[0]}-{d[-1]}; "
                              f"give ranges that cover all {plan.num_parent_layers} layers (e.g. --layers P,R,C with "
                              f"P + R + C = {plan.num_parent_layers})")  # fmt: skip
    return LayerPlan("loop_in_place", plan.num_parent_layers, plan.prelude, plan.recurrent, plan.coda,
                     num_recurrences=plan.num_recurrences)  # fmt: skip


def default_loop_in_place_split(num_layers: int) -> tuple[int, int, int]:
    """P, R, C when ``--loop-in-place`` names no span: a quarter, the middle half, a quarter (OLMo-2's
    16 -> 4 / 8 / 4; the paper's OLMo script uses 7 / 4 / 5, given as ``--layers 7,4,5``)."""
    quarter = num_layers // 4
    if num_layers - 2 * quarter < 1:
        return 0, num_layers, 0
    return quarter, num_layers - 2 * quarter, quarter


def share(num_layers: int, blocks: int, strategy: str) -> LayerPlan:
    """``--share STRATEGY --blocks K``: K shared layers looped L / K times (see the module docstring)."""
    if strategy not in SHARE_STRATEGIES:
        raise ConversionError(f"--share={strategy!r}: must be one of {SHARE_STRATEGIES}")
    if blocks < 1 or blocks > num_layers or num_layers % blocks:
        raise ConversionError(f"--blocks={blocks}: must divide the parent's num_hidden_layers={num_layers} "
                              "(each loop stands for K consecutive parent layers)")  # fmt: skip
    loops = num_layers // blocks
    unrolled = tuple(tuple(t * blocks + j for j in range(blocks)) for t in range(loops))
    if strategy == "stepwise":
        sources = [(round(x),) for x in np.linspace(0, num_layers - 1, blocks)]
    elif strategy == "lower":
        sources = [(j,) for j in range(blocks)]
    else:
        sources = [tuple(row[j] for row in unrolled) for j in range(blocks)]
    return LayerPlan("share", num_layers, (), tuple(sources), (), num_recurrences=loops, share=strategy,
                     unrolled=unrolled)  # fmt: skip


__all__ = ["SHARE_STRATEGIES", "LayerPlan", "default_loop_in_place_split", "explicit", "loop_in_place",
           "paper_rule", "parse_range", "share"]  # fmt: skip
