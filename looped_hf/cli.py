"""The ``looped-hf`` command line: a thin dispatcher.

Each subcommand lives with the module that owns its work and exposes ``main(argv) -> int``;
this file only routes, so the numpy-only commands (``fit``, a cached ``plan``) need no torch of
their own. The ``looped-hf`` console script enters through ``looped_hf_launcher``, which keeps
``import looped_hf`` from registering the Auto classes (torch and transformers) for those commands.
New knobs belong in recipes (YAML), not in new flags here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from looped_hf.fileio import first_line

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("looped_hf.train", "train one model from a recipe (YAML); flags override the file"),
    "sweep": ("looped_hf.sweep", "plan (--dry-run) or run a resumable iso-depth sweep, --jobs N runs at once"),
    "fit": ("looped_hf.scaling.cli", "fit the looped scaling law (phi) to a sweep's results"),
    "plan": ("looped_hf.planner", "from a fit: compute-optimal width, r and tokens per budget, predicted loss"),
    "card": ("looped_hf.cards", "write a sweep's model card (phi, plots, runs)"),
    "publish": ("looped_hf.publish", "write a Hub-ready folder for one run; --push uploads it"),
    "convert": ("looped_hf.convert", "convert a study (nanochat), Huginn or retrofitted checkpoint into a Hub-ready folder"),
    "retrofit": ("looped_hf.retrofit", "turn a dense Llama / Mistral / Qwen2 / Qwen3 / OLMo-2 checkpoint into a looped folder (layers, loop in place, RRT share)"),
    "eval": ("looped_hf.evaluation.cli", "downstream tasks (study bundles, built-in primitives, lm-eval) at every r"),
    "serve": ("looped_hf.serving.cli", "serve a checkpoint with vLLM's OpenAI-compatible server (r, kv_budget per server)"),
    "test-time": ("looped_hf.recurrence_curves", "held-out loss of a checkpoint at r = 1 .. 4x its trained r (table + plot)"),
    "prepare-data": ("looped_hf.prepack", "pack a text source into the study's prepacked rows (best fit, resumable)"),
    "demo": ("looped_hf.demo", "the main job: tiny iso-depth sweep -> fit -> cards"),
}


# The error types that mean "this input cannot be used" (each names its field or file): the
# dispatcher prints them as one line with exit status 2, in case a command's own handler missed
# one. Anything else is a bug and keeps its traceback. Looked up in sys.modules, so a command that
# never imported torch does not import it here either.
EXPECTED_ERRORS: dict[str, tuple[str, ...]] = {
    "looped_hf.field_checks": ("RecipeError",),
    "looped_hf.fileio": ("CheckpointError", "OutputPathError", "RunDirError"),
    "looped_hf.evaluation.scoring": ("EvalError",),
    "looped_hf.evaluation.bundle": ("BundleError",),
    "looped_hf.publish": ("PublishError",),
    "looped_hf.recurrence_curves": ("TestTimeError",),
    "looped_hf.convert": ("ConversionError",),
    "looped_hf.demo": ("DemoError",),
}


def expected_errors() -> tuple[type[BaseException], ...]:
    """The classes of `EXPECTED_ERRORS` whose modules are loaded."""
    found = []
    for module, names in EXPECTED_ERRORS.items():
        loaded = sys.modules.get(module)
        found += [getattr(loaded, name) for name in names if loaded is not None and hasattr(loaded, name)]
    return tuple(found)


def positive_int(flag: str) -> Callable[[str], int]:
    """argparse type of a count >= 1: a one-line error naming `flag` and the value (exit 2);
    `int` alone lets 0 and -5 through (a negative --max-runs once sliced the run list)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag}={text!r}: must be an integer >= 1")
        return value

    return parse


def bounded_int(flag: str, ceiling: int, why: str) -> Callable[[str], int]:
    """argparse type of a count in 1 .. `ceiling`; past it, one line naming the ceiling and `why`
    (what the count costs), so a typo (--recurrences 10000) is refused instead of running for days."""
    at_least_one = positive_int(flag)

    def parse(text: str) -> int:
        value = at_least_one(text)
        if value > ceiling:
            raise argparse.ArgumentTypeError(
                f"{flag} {value}: above the ceiling of {ceiling} ({why}; see docs/validation.md)"
            )
        return value

    return parse


def _usage() -> str:
    lines = ["usage: looped-hf <command> [args...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`looped-hf <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"looped-hf: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except Exception as err:
        if not isinstance(err, expected_errors()):
            raise  # a bug: its traceback is what a report needs
        print(f"looped-hf {name}: {first_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
