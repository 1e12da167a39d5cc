"""The library versions a result was produced with, for run records, curves, evaluation reports and
cards. A module of its own so that what reads it (evaluation, cards, test-time) does not import the
training module, which imports the converters and, through them, the cards again.
"""

from __future__ import annotations

import importlib
import platform

import torch


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Versions that make a result reproducible: python, torch, transformers, looped_hf, + ``extra``."""
    import transformers

    import looped_hf

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "looped_hf": getattr(looped_hf, "__version__", "unknown"),
    }
    out.update({name: importlib.import_module(name).__version__ for name in extra})
    return out
