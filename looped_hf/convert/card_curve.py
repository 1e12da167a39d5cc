"""A converted folder's card shows its test-time curve once ``looped-hf test-time`` has measured it.

A folder written by ``looped-hf convert`` has no run record, so the checkpoint card of a training
run (``looped_hf.cards.render_checkpoint_card``) does not apply; its card is the converter's short
one (front matter ``converted_from``). ``looped-hf test-time FOLDER --data TEXT`` measures the
held-out loss at r = 1 .. max-factor x the trained r on such a folder and calls
:func:`add_curve_to_converted_card`, which puts the curve (summary, table, plot) into that card
under one heading, replacing an earlier one; any other card is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The heading of the curve's section in a converted card.
CURVE_HEADING = "## Test-time scaling"


def is_converted_card(text: str) -> bool:
    """Whether ``text`` is a card ``looped-hf convert`` wrote (its front matter has ``converted_from``)."""
    if not text.startswith("---\n"):
        return False
    end = text.find("\n---", 4)
    return end > 0 and "\nconverted_from:" in "\n" + text[4:end]


def curve_section(curve: Mapping[str, Any]) -> str:
    """The card section for a curve (``recurrence_curves.evaluate_recurrences``'s result)."""
    from looped_hf.recurrence_curves import CURVE_PNG, markdown_table, summary_sentence

    data = curve.get("heldout_data") or {}
    where = f" on `{Path(str(data['dataset'])).name}`" if data.get("dataset") else ""
    return (
        f"{CURVE_HEADING}\n\nHeld-out loss{where} ({curve['heldout_blocks']} blocks of {curve['seq_len']} tokens) "
        f"at every r from {curve['rows'][0]['num_recurrences']} to {curve['rows'][-1]['num_recurrences']}, "
        f"measured by `looped-hf test-time`. {summary_sentence(curve)}\n\n{markdown_table(curve)}\n\n"
        f"![held-out loss vs r]({CURVE_PNG})\n"
    )


def add_curve_to_converted_card(folder: str | Path, curve: Mapping[str, Any]) -> bool:
    """Put ``curve`` into ``folder``'s README.md when it is a converted card (replacing the section
    an earlier run wrote); returns whether it did. The card is rewritten whole (a new file moved
    over the old one), so a reader never sees half of it."""
    import os
    import tempfile

    card = Path(folder) / "README.md"
    if not card.is_file():
        return False
    text = card.read_text(encoding="utf-8")
    if not is_converted_card(text):
        return False
    start = text.find(f"\n{CURVE_HEADING}\n")
    if start >= 0:
        after = text.find("\n## ", start + len(CURVE_HEADING) + 2)
        text = text[: start + 1].rstrip("\n") + ("\n" + text[after:] if after >= 0 else "\n")
    text = text.rstrip("\n") + "\n\n" + curve_section(curve)
    fd, tmp = tempfile.mkstemp(prefix=".README.md.", dir=card.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, card.stat().st_mode & 0o777)
        os.replace(tmp, card)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


__all__ = ["CURVE_HEADING", "add_curve_to_converted_card", "curve_section", "is_converted_card"]
