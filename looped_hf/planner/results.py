"""What a plan returns: per budget and r an entry, the decisions, and ``Plan`` with its
``to_markdown`` / ``to_dict`` / ``to_json``."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from looped_hf.scaling.formatting import interval, si

PLAN_FORMAT = "looped_hf.plan/1"

# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Extrapolation:
    """How far a plan lies outside the fitted sweep (factors > 1 beyond, < 1 below; None inside)."""

    budget: float | None = None
    width: float | None = None
    r: bool = False
    grid_edge: str | None = None

    @property
    def any(self) -> bool:
        return self.budget is not None or self.width is not None or self.r or self.grid_edge is not None

    def text(self) -> str:
        parts = []
        if self.budget is not None:
            parts.append(f"budget {_factor(self.budget)} the sweep's {'largest' if self.budget > 1 else 'smallest'}")
        if self.width is not None:
            parts.append(f"width {_factor(self.width)} its {'widest' if self.width > 1 else 'narrowest'}")
        if self.r:
            parts.append("r not in the sweep")
        if self.grid_edge:
            parts.append(f"optimum at the {self.grid_edge} width searched")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "text": self.text()}


def _factor(x: float) -> str:
    return f"{x:.3g}x" if x > 1 else f"1/{1 / x:.3g}x of"


@dataclass
class PlanEntry:
    """The compute-optimal model for one budget and one r (all counts the model's own)."""

    budget: float
    r: int
    width: int
    n_once: float
    n_rec: float
    tokens: float
    loss: float
    loss_band: tuple[float, float] | None
    width_band: tuple[float, float] | None
    tokens_band: tuple[float, float] | None
    performs_like: float
    costs_like: float
    same_width_nonlooped: float
    """Unique parameters of the non-looped member at the same width and depth (the iso-depth
    sibling: the study's "costs like" reading); its training FLOPs per token relative to this
    model's are ``same_width_nonlooped_flops_ratio``."""
    same_width_nonlooped_flops_ratio: float
    train_flops_per_token: float
    inference_recurrences: float
    inference_flops_per_token: float
    kv_bytes_per_token: float
    kv_bytes_per_token_budget: float | None
    extrapolation: Extrapolation

    @property
    def unique_params(self) -> float:
        return self.n_once + self.n_rec

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.unique_params

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(unique_params=self.unique_params, tokens_per_param=self.tokens_per_param)
        out["extrapolation"] = self.extrapolation.to_dict()
        return out


@dataclass
class CostEntry:
    """The cheapest model at one r that reaches a loss: training (+ T x inference) FLOPs."""

    r: int
    loss: float
    reachable: bool
    width: int | None = None
    tokens: float | None = None
    train_flops: float | None = None
    inference_flops: float | None = None
    total_flops: float | None = None
    total_band: tuple[float, float] | None = None
    share_reaching: float | None = None
    extrapolation: Extrapolation = field(default_factory=Extrapolation)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["extrapolation"] = self.extrapolation.to_dict()
        return out


@dataclass
class CostDecision:
    """Per r, the cheapest way to a loss; the best r and how often each r wins over the resamples."""

    loss: float
    why: str
    budget: float | None
    inference_tokens: float | None
    entries: list[CostEntry]
    best_r: int | None
    share_best: dict[int, float]
    floor: float

    def sentence(self) -> str:
        """The decision in one paragraph."""
        where = f"loss {self.loss:.4g} ({self.why})"
        if self.best_r is None:
            return (
                f"The law does not reach {where} at any r: its floor is E = {self.floor:.4g} and no width up to "
                f"the search cap gets there."
            )
        serve = (
            f" + {self.inference_tokens:.3g} tokens of inference" if self.inference_tokens else ""
        )
        parts = []
        for e in self.entries:
            if e.reachable:
                parts.append(f"r = {e.r}: {e.total_flops:.3g} FLOPs (width {e.width}, {e.tokens:.3g} tokens)")
            else:
                parts.append(f"r = {e.r}: not reached")
        share = self.share_best.get(self.best_r)
        tail = f" It is cheapest in {100 * share:.0f}% of the resamples." if share is not None else ""
        return f"To reach {where} with training{serve}: " + "; ".join(parts) + f". Cheapest: r = {self.best_r}.{tail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss, "why": self.why, "budget": self.budget, "inference_tokens": self.inference_tokens,
            "entries": [e.to_dict() for e in self.entries], "best_r": self.best_r,
            "share_best": {str(k): v for k, v in self.share_best.items()}, "floor": self.floor,
            "sentence": self.sentence(),
        }  # fmt: skip


@dataclass
class BudgetDecision:
    """Best r for one training budget: lowest predicted loss, and its share of the resamples."""

    budget: float
    best_r: int
    loss: float
    share_best: dict[int, float]
    margins: dict[int, float]

    def sentence(self, entries: Sequence[PlanEntry]) -> str:
        best = next(e for e in entries if e.budget == self.budget and e.r == self.best_r)
        band = f" {interval(best.loss_band, '.4g')}" if best.loss_band else ""
        others = ", ".join(f"r = {r} +{m:.3g}" for r, m in self.margins.items() if r != self.best_r)
        share = self.share_best.get(self.best_r)
        s = (
            f"With {self.budget:.3g} FLOPs train r = {self.best_r}: width {best.width}, "
            f"{si(best.unique_params)} unique parameters, {best.tokens:.3g} tokens, loss {best.loss:.4g}{band}"
        )
        if others:
            s += f" ({others} nats)"
        if share is not None:
            s += f"; best in {100 * share:.0f}% of the resamples"
        if best.extrapolation.any:
            s += f" (extrapolated: {best.extrapolation.text()})"
        return s + "."

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget, "best_r": self.best_r, "loss": self.loss,
            "share_best": {str(k): v for k, v in self.share_best.items()},
            "margins": {str(k): v for k, v in self.margins.items()},
        }  # fmt: skip


@dataclass
class Plan:
    """What :func:`plan` returns: one entry per (budget, r) and the decisions.

    ``to_markdown()`` / ``table()`` for people, ``to_dict()`` / ``to_json()`` for scripts."""

    entries: list[PlanEntry]
    decisions: list[BudgetDecision]
    lifetime: list[CostDecision]
    target: CostDecision | None
    params: dict[str, Any]
    n_resamples: int
    family: dict[str, Any]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def entry(self, budget: float, r: int) -> PlanEntry:
        for e in self.entries:
            if e.budget == budget and e.r == r:
                return e
        raise KeyError(f"no plan entry for budget {budget:g}, r {r}")

    def sentences(self) -> list[str]:
        out = [d.sentence(self.entries) for d in self.decisions]
        out += [d.sentence() for d in self.lifetime]
        if self.target is not None:
            out.append(self.target.sentence())
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "params": self.params,
            "n_resamples": self.n_resamples,
            "family": self.family,
            "settings": self.settings,
            "entries": [e.to_dict() for e in self.entries],
            "decisions": [d.to_dict() for d in self.decisions],
            "lifetime": [d.to_dict() for d in self.lifetime],
            "target": None if self.target is None else self.target.to_dict(),
            "sentences": self.sentences(),
            "notes": self.notes,
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """JSON text; written atomically to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=True)
        if path is not None:
            from looped_hf.fileio import write_text_atomic

            write_text_atomic(path, text)
        return text

    def _rows(self) -> list[list[str]]:
        kv = self.settings.get("kv_budget")
        rows = []
        for e in self.entries:
            band = interval(e.loss_band, ".4g") if e.loss_band else "-"
            kv_text = si(e.kv_bytes_per_token, 3) + (
                f" / {si(e.kv_bytes_per_token_budget, 3)}" if kv is not None else ""
            )
            rows.append([
                f"{e.budget:.3g}", str(e.r), str(e.width), si(e.unique_params), f"{e.tokens:.3g}",
                f"{e.tokens_per_param:.3g}", f"{e.loss:.4g}", band, si(e.performs_like), si(e.costs_like),
                f"{e.inference_flops_per_token:.3g}", kv_text, e.extrapolation.text() or "-",
            ])  # fmt: skip
        return rows

    def _header(self) -> list[str]:
        kv = self.settings.get("kv_budget")
        return [
            "budget", "r", "width", "unique params", "tokens", "tokens/param", "loss", "95% band",
            "performs like", "costs like", "inference FLOPs/token",
            "KV bytes/token" + (f" (/ kv_budget {kv})" if kv is not None else ""), "extrapolation",
        ]  # fmt: skip

    def to_markdown(self) -> str:
        """A markdown table of the entries, then the decisions as sentences."""
        head = self._header()
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in self._rows()]
        lines.append("")
        lines += [f"- {s}" for s in self.sentences()]
        lines.append("")
        lines.append(self.legend())
        return "\n".join(lines)

    def table(self) -> str:
        """Fixed-width console table, the decisions and the legend."""
        head, rows = self._header(), self._rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        lines.append("")
        lines += self.sentences()
        lines += ["", self.legend()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def legend(self) -> str:
        band = (
            f"the 2.5-97.5 percentiles of the optimal loss over {self.n_resamples} bootstrap resamples, each planning "
            "its own optimum" if self.n_resamples else "no band: the fit has no bootstrap resamples"
        )  # fmt: skip
        return (
            f"Law: L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta with phi = {_fmt_phi(self.params)}; family "
            f"{Path(self.family['source']).name} (widths in steps of {self.family['width_step']}, seq_len {self.family['seq_len']}). "
            f"Unique params: N_once + N_rec (no embedding, no head); performs like: N_once + r^phi N_rec; costs like: "
            f"the non-looped member with the same training FLOPs per token; band: {band}. Inference FLOPs per token "
            f"at context {self.family['seq_len']}; KV bytes per token of context at {self.settings['kv_bytes_per_element']:g} "
            "bytes per element."
        )


def _fmt_phi(params: Mapping[str, Any]) -> str:
    phi = params.get("phi")
    return "none (plain fit)" if phi is None else f"{phi:.3g}"
