"""What both cards share: number formatting, the template lookup, the held-out numbers, phi's caveat.

The file names and the template folder are here too, so the checkpoint card, the sweep card and
the CLI read one definition of each.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from looped_hf.fileio import sha256_file as sha256_file
from looped_hf.scaling.formatting import interval
from looped_hf.scaling.formatting import si as si

if TYPE_CHECKING:
    from looped_hf.scaling import ScalingLawFit

PathLike = str | os.PathLike[str]

#: Where the templates live: ``model_cards/templates`` in a source checkout. An installed wheel
#: has no ``model_cards/``; ``LOOPED_HF_CARD_TEMPLATES`` points elsewhere if needed.
TEMPLATES_DIR = Path(
    os.environ.get(
        "LOOPED_HF_CARD_TEMPLATES", Path(__file__).resolve().parents[2] / "model_cards" / "templates"
    )
)
CHECKPOINT_TEMPLATE = "checkpoint.md"
SWEEP_TEMPLATE = "sweep.md"
#: Project URL for the cards' links; empty (no link, plain "looped_hf") until the project has one.
LOOPED_HF_URL = os.environ.get("LOOPED_HF_URL", "")
CARD_NAME = "README.md"
FIT_NAME = "fit.json"
PLOTS_DIR = "plots"


# --------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-" if x is None else str(x)
    return f"{x:.{digits}g}"


def _ci(ci: Iterable[float] | None, digits: int = 3) -> str:
    if not ci:
        return "-"
    return interval(ci, f".{digits}g")


def _count(n: int | float | None) -> str:
    return "-" if n is None else f"{int(n):,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _round(x: float | None, digits: int = 6) -> float | None:
    """``digits`` significant digits, for YAML metadata a person reads."""
    return None if x is None else float(f"{x:.{digits}g}")


def _project_link() -> str:
    return f"[looped_hf]({LOOPED_HF_URL})" if LOOPED_HF_URL else "looped_hf"


def _template(name: str) -> Path:
    path = TEMPLATES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"model card template {path} not found (set LOOPED_HF_CARD_TEMPLATES to the folder holding {name})"
        )
    return path


def perplexity_from_loss(loss: float) -> float:
    """exp(token-weighted mean NLL); ``inf`` where exp overflows."""
    return math.exp(loss) if loss < 709 else math.inf


def heldout_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The card's held-out numbers from a run record: ``loss``, ``perplexity``, ``eval_tokens``.

    Raises ``ValueError`` naming the field when the record lacks a finite loss."""
    loss = record.get("loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise ValueError(f"run record field 'loss'={loss!r}: need a finite held-out loss for the card")
    ppl = record.get("eval_perplexity")
    if not isinstance(ppl, (int, float)):
        ppl = perplexity_from_loss(float(loss))
    return {"loss": float(loss), "perplexity": float(ppl), "eval_tokens": record.get("eval_tokens")}



# --------------------------------------------------------------------------------------------
# phi's caveat: on the sweep card next to phi, on a checkpoint card next to N_eff
# --------------------------------------------------------------------------------------------
def phi_caveat(fit: ScalingLawFit) -> str | None:
    """A warning when the runs do not pin phi down, so the card does not oversell the estimate.

    It is the fit's verdict line when phi is not identified: one rule
    (:mod:`looped_hf.scaling.trust`) for the fit report, the comparison, the cards and the
    planner. An older ``fit.json``, saved before the diagnosis, is diagnosed now by that rule.
    """
    if fit.params.get("phi") is None:
        return "phi is not identifiable from these runs (no run has r > 1 and N_rec > 0)."
    verdict = (fit.diagnostics or {}).get("verdict")
    see_below = verdict is not None  # the card's *Is phi identified?* section needs the diagnosis
    if verdict is None:
        from looped_hf.scaling.diagnose import diagnose

        verdict = diagnose(fit)["verdict"]
    if verdict.get("identified") is False:
        return verdict["line"] + (" See *Is phi identified?* below." if see_below else "")
    return None
