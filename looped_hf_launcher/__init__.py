"""The ``looped-hf`` console script: ``looped_hf.cli.main``, with looped_hf's registration in
transformers' Auto API left to the first use of a model name when the command needs no model.

``import looped_hf`` registers the model classes at once (the README's quick start relies on it),
which imports torch and transformers: about 4 s of CPU on two cores. Python runs a package's
``__init__`` before any of its modules, so only a module outside the package can ask it not to:
this one sets ``defer_registration`` before it imports ``looped_hf``, whose ``__init__`` reads it.
For ``fit``, a cached ``plan`` and the help, the process then loads numpy and scipy only
(docs/development.md has the measurements). Every other command registers at import, as before.
A deferred process still registers when something reads a model name (``looped_hf.LoopedConfig``,
``from looped_hf import LoopedForCausalLM``): an uncached ``plan`` measuring its models does.
"""

from __future__ import annotations

import sys

#: The commands that run on numpy and scipy (``plan`` with its model family cached).
NUMERIC_COMMANDS = frozenset({"fit", "plan"})
_HELP = frozenset({"-h", "--help"})

#: Read by ``looped_hf/__init__`` when it first runs: True defers the Auto registration.
defer_registration = False


def main(argv: list[str] | None = None) -> int:
    """Run ``looped-hf`` with ``argv`` (default ``sys.argv[1:]``); its exit status."""
    global defer_registration
    argv = list(sys.argv[1:] if argv is None else argv)
    defer_registration = not argv or argv[0] in _HELP or argv[0] in NUMERIC_COMMANDS
    from looped_hf.cli import main as dispatch

    return dispatch(argv)
