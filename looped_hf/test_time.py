"""Deprecated: renamed to ``looped_hf.recurrence_curves`` (the old name read as a test file to the
tools and people that look for tests by name). This alias keeps old imports working for one
release, with a ``DeprecationWarning``; it is the same module object, so nothing differs."""

from __future__ import annotations

import sys
import warnings

from looped_hf import recurrence_curves

warnings.warn(
    "looped_hf.test_time is deprecated and will be removed in the next release: import looped_hf.recurrence_curves",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = recurrence_curves
