"""``looped-hf convert FORMAT CKPT_DIR [--out DIR]``: the one command over every source format.

Each format's module (``nanochat.py``, ``huginn_raven.py``, ...) provides
``convert_cli(source_format, ckpt_dir, out, *, repo_id, license, overwrite, **options) -> Path``
and names the format-only flags it reads in ``CLI_OPTIONS``; a flag given to a format that does
not read it is refused (a flag swallowed silently would be a wrong conversion). A new format is
one module and one ``FORMATS`` entry.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..publish import PublishError
from .common import ConversionError, default_out

#: source format -> (module, one-line help), in the order ``--help`` lists them.
FORMATS: dict[str, tuple[str, str]] = {
    "nanochat": ("looped_hf.convert.nanochat",
                 "the iso-depth study's looped-lm-scaling (model_<step>.pt + meta_<step>.json)"),
    "huginn": ("looped_hf.convert.huginn_raven", "Huginn-0125 (huginn_raven config.json + safetensors)"),
    "retrofit": ("looped_hf.convert.huginn_raven",
                 "a retrofitted-recurrence huginn_raven model, its Llama or OLMo-2 variant read from the weights"),
    "retrofit-llama": ("looped_hf.convert.huginn_raven", "the Llama-style retrofit, named"),
    "retrofit-olmo": ("looped_hf.convert.huginn_raven", "the OLMo-2-style retrofit, named"),
    "huginn_raven": ("looped_hf.convert.huginn_raven", "any huginn_raven checkpoint: Huginn or a retrofit, detected"),
    "ouro": ("looped_hf.convert.ouro", "ByteDance's Ouro-1.4B / 2.6B (model_type ouro: config.json + safetensors)"),
    "nanbeige": ("looped_hf.convert.nanbeige", "Nanbeige4.2-3B (model_type nanbeige: config.json + safetensors)"),
    "parcae": ("looped_hf.convert.parcae",
               "Sandy Research's Parcae (ParcaeConfig config.json + pytorch_model.bin or model.safetensors)"),

    "iquest": ("looped_hf.convert.iquest",
               "IQuest-Coder-V1-Loop (model_type iquestloopcoder: config.json + safetensors)"),
}  # fmt: skip
#: The format-only flags (argparse dest -> flag), refused for a format whose module does not read them.
FORMAT_FLAGS = {"step": "--step", "tokenizer": "--tokenizer", "state_init": "--state-init"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf convert",
        description="Convert another code base's looped-LM checkpoint into a Hub-ready looped_hf folder.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="formats:\n" + "\n".join(f"  {name:<15} {help_}" for name, (_, help_) in FORMATS.items()),
    )
    p.add_argument("source_format", choices=tuple(FORMATS), help="the checkpoint's format (see below)")
    p.add_argument("ckpt_dir", help="the checkpoint directory (nanochat: model_<step>.pt + meta_<step>.json; "
                                    "others: config.json + model.safetensors)")  # fmt: skip
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"the folder to write (default: CKPT_DIR{default_out('x').name[1:]} beside CKPT_DIR)")  # fmt: skip
    p.add_argument("--step", default=None, help="nanochat: step number or alias to convert (default: the latest)")
    p.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="nanochat: tokenizer (Hub id or path) to ship with the model; its size must match vocab_size "
                        "(default: the checkpoint folder's own tokenizer, if it has one)")  # fmt: skip
    p.add_argument("--state-init", default=None, choices=("zeros", "truncated_normal", "like_init"),
                   help="huginn_raven: the converted model's h_0, zeros (default: deterministic, the references' "
                        "init_scale=0) or truncated_normal (Huginn's random start); parcae: zeros (default) or "
                        "like_init (Parcae's random start, seed-reproducible)")  # fmt: skip
    p.add_argument(
        "--repo-id", default=None, metavar="ORG/NAME", help="Hub id shown in the card's loading code"
    )
    p.add_argument("--license", default=None, help="license id for the card metadata (default: none stated)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    return p


def main(argv: list[str] | None = None) -> int:
    """``looped-hf convert``; returns 0, or 2 on bad input (one line, nothing written)."""
    args = _parser().parse_args(argv)
    module = importlib.import_module(FORMATS[args.source_format][0])
    accepted = getattr(module, "CLI_OPTIONS", ())
    options = {}
    for dest, flag in FORMAT_FLAGS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if dest not in accepted:
            print(f"looped-hf convert: error: {flag}={value!r}: not an option of the {args.source_format} format",
                  file=sys.stderr)  # fmt: skip
            return 2
        options[dest] = value
    if "step" in options and options["step"].isdigit():
        options["step"] = int(options["step"])
    out = default_out(args.ckpt_dir) if args.out is None else args.out
    try:
        folder = module.convert_cli(args.source_format, args.ckpt_dir, out, repo_id=args.repo_id,
                                    license=args.license, overwrite=args.overwrite, **options)  # fmt: skip
    except (ConversionError, PublishError) as err:
        print(f"looped-hf convert: error: {err}", file=sys.stderr)
        return 2
    print(f"[convert] wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    return 0


__all__ = ["FORMATS", "main"]


if __name__ == "__main__":
    sys.exit(main())
