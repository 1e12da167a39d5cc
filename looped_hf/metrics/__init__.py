"""``evaluate`` metrics shipped with looped_hf; load them by path (works offline):
``evaluate.load(TOKEN_PERPLEXITY_PATH)``."""

from __future__ import annotations

from pathlib import Path

#: Directory of the token-weighted perplexity metric (``evaluate.load`` accepts it directly).
TOKEN_PERPLEXITY_PATH = str(Path(__file__).resolve().parent / "token_perplexity")

__all__ = ["TOKEN_PERPLEXITY_PATH"]
