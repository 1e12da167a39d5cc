"""The ``looped-hf`` command line: a thin dispatcher.

Each subcommand lives with the module that owns its work and exposes ``main(argv) -> int``;
this file only routes, so ``looped-hf fit`` never imports torch and ``--help`` stays fast.
New knobs belong in recipes (YAML), not in new flags here.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("looped_hf.train", "train one model from a recipe (YAML); flags override the file"),
    "sweep": ("looped_hf.sweep", "plan (--dry-run) or run a resumable iso-depth sweep, --jobs N runs at once"),
    "fit": ("looped_hf.scaling.cli", "fit the looped scaling law (phi) to a sweep's results"),
    "plan": ("looped_hf.planner", "from a fit: compute-optimal width, r and tokens per budget, predicted loss"),
    "card": ("looped_hf.cards", "write a sweep's model card (phi, plots, runs)"),
    "publish": ("looped_hf.publish", "write a Hub-ready folder for one run; --push uploads it"),
    "convert": ("looped_hf.convert", "convert a study (nanochat) checkpoint into a Hub-ready looped_hf folder"),
    "eval": ("looped_hf.evaluation.cli", "downstream tasks (study bundles, built-in primitives, lm-eval) at every r"),
    "serve": ("looped_hf.serving.cli", "serve a checkpoint with vLLM's OpenAI-compatible server (r, kv_budget per server)"),
    "test-time": ("looped_hf.recurrence_curves", "held-out loss of a checkpoint at r = 1 .. 4x its trained r (table + plot)"),
    "prepare-data": ("looped_hf.prepack", "pack a text source into the study's prepacked rows (best fit, resumable)"),
    "demo": ("looped_hf.demo", "the main job: tiny iso-depth sweep -> fit -> cards"),
}


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
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
