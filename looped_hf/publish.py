"""Publish one run: a complete, Hub-ready repository folder, and optionally upload it.

    looped-hf publish runs/iso_depth_tiny/loop2-w128-b2                                        # folder only
    looped-hf publish runs/iso_depth_tiny/loop2-w128-b2 --repo-id me/looped-tiny               # card names it
    looped-hf publish runs/iso_depth_tiny/loop2-w128-b2 --repo-id me/looped-tiny --push        # + upload
    looped-hf publish RUN_DIR --repo-id me/looped-tiny --fit runs/iso_depth_tiny/fit.json       # card with phi

The folder (default ``RUN_DIR/publish``) holds ``config.json`` (with ``auto_map``),
``model.safetensors``, ``configuration_looped.py``, ``modeling_looped.py`` and the files it
imports, ``recurrent_block_looped.py``, ``decoder_layers_looped.py``, ``parcae_looped.py``, ``interface_looped.py``, ``generation_looped.py``,
``accounting_looped.py``, ``loop_attention_looped.py`` and ``config_rules_looped.py`` (the remote code; a per-loop LoRA
model's folder ``loop_lora_looped.py`` too),
``generation_config.json``, the tokenizer files and ``README.md`` (the model card). The model
is re-saved through ``from_pretrained`` + ``save_pretrained`` so the code files are this
version's and ``use_cache`` is on (the Trainer saves it off). The folder is built in a temporary
sibling and renamed into place at the end: an interrupted publish leaves nothing half-written,
and an existing folder is replaced only with ``--overwrite``.

``--push`` calls ``HfApi().create_repo(..., exist_ok=True)`` and ``HfApi().upload_folder(...)``;
the token is whatever huggingface_hub resolves (``HF_TOKEN``, ``hf auth login``). This module
never reads, prints or writes it, and refuses to upload a folder with anything that looks like
a token in it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looped_hf.fileio import (
    RECORD_NAME,
    CheckpointError,
    check_checkpoint_dir,
    check_finished_run,
    check_output_path,
    follow_umask,
    has_tokenizer,
    make_temp_dir,
)

PathLike = str | os.PathLike[str]

#: The folder written inside the run directory when ``--out`` is not given.
DEFAULT_OUT = "publish"
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")
#: Files every published folder has (plus README.md and at least one tokenizer file).
REQUIRED_OUTPUT = ("config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py",
                   "config_rules_looped.py", "interface_looped.py", "generation_looped.py", "accounting_looped.py",
                   "recurrent_block_looped.py", "decoder_layers_looped.py", "parcae_looped.py", "loop_attention_looped.py",
                   "generation_config.json", "tokenizer_config.json", "README.md")  # fmt: skip
#: Model type -> the remote code its folder has besides (the per-loop LoRA model's own file).
REQUIRED_BY_MODEL_TYPE = {"looped_loop_lora": ("loop_lora_looped.py",)}
# A Hub user access token: "hf_" + 30+ letters/digits. Checked before any upload.
_TOKEN_PATTERN = re.compile(rb"hf_[A-Za-z0-9]{30,}")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
#: The owner of the repository id a card names when none is given (nothing is uploaded then); the
#: demo's card uses it too.
PLACEHOLDER_OWNER = "your-name"


class PublishError(ValueError):
    """A run directory or option that cannot be published; the message names the file or field."""


@dataclass
class RunDir:
    """A checked run directory: its path, run record and what its weights/tokenizer files are."""

    path: Path
    record: dict[str, Any]


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def check_repo_id(repo_id: str) -> str:
    """``ORG/NAME`` with the Hub's characters; raises ``PublishError`` naming the value."""
    if (
        not isinstance(repo_id, str)
        or not _REPO_ID.match(repo_id)
        or ".." in repo_id
        or repo_id.endswith(".git")
    ):
        raise PublishError(f"--repo-id {repo_id!r}: expected ORG/NAME (letters, digits, '-', '_', '.')")
    return repo_id


def default_repo_id(run_dir: PathLike) -> str:
    """The id a card names when ``--repo-id`` is not given: ``your-name/<run folder name>``, a
    placeholder the user replaces (``--repo-id`` or ``--push``, which needs a real one)."""
    name = re.sub(r"[^\w.-]+", "-", Path(run_dir).resolve().name).strip("-._")[:96] or "looped-model"
    return f"{PLACEHOLDER_OWNER}/{name}"


def check_run_dir(run_dir: PathLike) -> RunDir:
    """Check that ``run_dir`` is a finished, successful run; raise ``PublishError`` naming what is missing.

    Needs ``config.json``, weights (``model.safetensors`` or a sharded index), a tokenizer file
    and ``run_record.json`` with ``status: ok`` and a finite ``loss``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise PublishError(f"run directory {path} does not exist")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / name).is_file() for name in WEIGHTS_FILES):
        missing.append("model.safetensors (the trained weights)")
    if not has_tokenizer(path):
        missing.append("tokenizer.json / tokenizer_config.json (the tokenizer)")
    if not (path / RECORD_NAME).is_file():
        missing.append(f"{RECORD_NAME} (the run record)")
    if missing:
        raise PublishError(
            f"{path} is not a finished run directory: missing {', '.join(missing)}. "
            "Publish a run after `looped-hf train` / `looped-hf sweep` has finished it."
        )
    try:
        record = check_finished_run(path) or {}
    except ValueError as err:
        raise PublishError(str(err)) from None
    from looped_hf.cards import heldout_metrics

    try:
        heldout_metrics(record)
    except ValueError as err:
        raise PublishError(f"{path / RECORD_NAME}: {err}") from err
    try:
        check_checkpoint_dir(path)  # model_type looped, weights not truncated: before any loading
    except CheckpointError as err:
        raise PublishError(str(err)) from None
    return RunDir(path=path, record=record)


def scan_for_tokens(folder: PathLike) -> list[Path]:
    """Files under ``folder`` containing something shaped like a Hub access token."""
    hits = []
    for file in sorted(Path(folder).rglob("*")):
        if file.is_file() and _TOKEN_PATTERN.search(file.read_bytes()):
            hits.append(file)
    return hits


# --------------------------------------------------------------------------------------------
# Building the folder
# --------------------------------------------------------------------------------------------
def _save_model_and_tokenizer(run: RunDir, dest: Path) -> Any:
    """Reload the run's model and tokenizer and save them into ``dest``; returns the model."""
    from looped_hf.evaluation.runner import load_pretrained

    try:
        model, tokenizer = load_pretrained(run.path)
    except CheckpointError as err:  # a config value LoopedConfig refuses, weights torch cannot read
        raise PublishError(str(err)) from None
    model.config.use_cache = True  # Trainer saved it off; generation wants the cache
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return model


#: `looped-hf convert` builds its folder the same way.
_make_readable = follow_umask


def build_folder(
    run_dir: PathLike,
    repo_id: str | None = None,
    out: PathLike | None = None,
    *,
    fit: Any = None,
    overwrite: bool = False,
    license: str = "apache-2.0",
    verify: bool = False,
) -> Path:
    """Write the Hub repository folder of one run and return its path.

    Args:
        run_dir: a finished run directory (see :func:`check_run_dir`).
        repo_id: ``ORG/NAME``, used in the card's loading code (default: `default_repo_id`, a
            placeholder for a folder that is not uploaded).
        out: destination folder (default ``run_dir/publish``).
        fit: a :class:`~looped_hf.scaling.ScalingLawFit` or path to ``fit.json``: the card then
            shows phi and this model's effective parameter count.
        overwrite: replace an existing ``out`` (otherwise refused).
        license: license id for the card metadata.
        verify: before moving the folder into place, recompute the held-out loss from the folder's
            own files (:func:`verify_folder`) and refuse if it differs from the run record's.

    Raises:
        PublishError: incomplete run directory, failed run, bad repo id, ``out`` exists, or
            (``verify``) the published model does not reproduce the recorded loss.
    """
    run = check_run_dir(run_dir)
    repo_id = check_repo_id(repo_id) if repo_id is not None else default_repo_id(run.path)
    dest = Path(out) if out is not None else run.path / DEFAULT_OUT
    if run.path.resolve().is_relative_to(dest.resolve()):  # --overwrite would delete the run itself
        raise PublishError(
            f"--out {dest} is (or contains) the run directory {run.path}; choose another folder"
        )
    try:  # before any model is loaded
        check_output_path(dest, "--out", directory=True)
    except ValueError as err:
        raise PublishError(str(err)) from None
    if dest.exists() and not overwrite:
        raise PublishError(f"--out {dest} already exists; pass --overwrite to replace it")
    fit_obj = _load_fit(fit)
    from looped_hf.cards import CARD_NAME, render_checkpoint_card
    from looped_hf.fileio import replace_dir

    try:
        tmp = make_temp_dir(dest)
    except OSError as err:
        raise PublishError(f"--out {dest}: cannot be written ({err.strerror or err})") from None
    try:
        model = _save_model_and_tokenizer(run, tmp)
        # The test-time scaling curve (`looped-hf test-time RUN_DIR`), when measured: its table is
        # found by the card beside the checkpoint; the plot travels with the card.
        plot = run.path / "test_time_scaling.png"
        if plot.is_file():
            shutil.copyfile(plot, tmp / plot.name)
        # `looped-hf eval`'s figure; its table the card finds beside the run (eval_results.json).
        eval_plot = run.path / "eval_results.png"
        if eval_plot.is_file():
            shutil.copyfile(eval_plot, tmp / eval_plot.name)
        card = render_checkpoint_card(
            run.record, model, repo_id=repo_id, license=license, fit=fit_obj,
            test_time_plot=plot.name if plot.is_file() else None,
            evaluation_plot=eval_plot.name if eval_plot.is_file() else None,
        )  # fmt: skip
        card.save(tmp / CARD_NAME)
        _check_output(tmp)
        if verify:
            metrics = verify_folder(tmp, run.record)
            print(f"[publish] verified: the folder's model scores {metrics['loss']:.6f} nats/token on the held-out "
                  f"blocks ({metrics['num_tokens']} tokens), as recorded", flush=True)  # fmt: skip
        follow_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would be kept once renamed into place
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def heldout_metrics_of_folder(
    folder: PathLike, record: dict[str, Any], batch_size: int = 8
) -> dict[str, float]:
    """Recompute the held-out loss and perplexity of a published folder from its own files.

    The held-out blocks are rebuilt from the run's recipe (``looped_hf.data.build_datasets``:
    same source, ``seq_len``, ``eval_blocks`` and split seed, the folder's tokenizer), and the
    shipped ``evaluate`` metric ``token_perplexity`` accumulates each batch's summed NLL and
    token count, so the result is token-weighted like the run record's ``loss``.
    """
    import evaluate
    import torch
    from transformers import AutoTokenizer

    from looped_hf.data import heldout_from_recipe
    from looped_hf.metrics import TOKEN_PERPLEXITY_PATH
    from looped_hf.model_types import load_causal_lm

    heldout = heldout_from_recipe(record.get("recipe") or {}, AutoTokenizer.from_pretrained(folder))
    model = load_causal_lm(folder).eval()
    metric = evaluate.load(TOKEN_PERPLEXITY_PATH)
    with torch.no_grad():
        for start in range(0, len(heldout), batch_size):
            ids = torch.as_tensor(heldout[start : start + batch_size]["input_ids"], dtype=torch.long)
            n = ids[:, 1:].numel()  # packed blocks: no padding, every shifted target counts
            loss = model(input_ids=ids, labels=ids).loss
            metric.add_batch(nll_sum=[float(loss) * n], num_tokens=[n])
    return metric.compute()


def verify_folder(folder: PathLike, record: dict[str, Any], tolerance: float = 1e-4) -> dict[str, float]:
    """Check that the folder's model reproduces the record's held-out loss (within ``tolerance``
    nats/token); raises ``PublishError`` with both numbers otherwise."""
    metrics = heldout_metrics_of_folder(folder, record)
    recorded = float(record["loss"])
    if not abs(metrics["loss"] - recorded) <= tolerance:
        raise PublishError(
            f"run_record.json loss={recorded:.6f} but the published model scores {metrics['loss']:.6f} nats/token "
            f"on the held-out blocks (tolerance {tolerance:g}): the weights, tokenizer or data differ from the run's"
        )
    return metrics


def _load_fit(fit: Any) -> Any:
    if fit is None or not isinstance(fit, (str, os.PathLike)):
        return fit
    from looped_hf.scaling import ScalingLawFit

    if not Path(fit).is_file():
        raise PublishError(f"--fit {fit}: no such file")
    try:
        return ScalingLawFit.from_json(fit)
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # a list, a number: not a fit
        raise PublishError(f"--fit {fit}: not a looped_hf fit ({err})") from err


def _check_output(folder: Path) -> None:
    """The folder must hold every file a Hub user needs (guards against transformers changes)."""
    config = json.loads((folder / "config.json").read_text())
    required = REQUIRED_OUTPUT + REQUIRED_BY_MODEL_TYPE.get(config.get("model_type"), ())
    missing = [name for name in required if not (folder / name).is_file()]
    if missing:
        raise PublishError(f"the published folder lacks {missing}: transformers' save_pretrained changed?")
    auto_map = config.get("auto_map") or {}
    if "AutoModelForCausalLM" not in auto_map:
        raise PublishError(
            f"{folder / 'config.json'}: no auto_map.AutoModelForCausalLM, remote code would not load"
        )


# --------------------------------------------------------------------------------------------
# Uploading
# --------------------------------------------------------------------------------------------
def push_folder(
    folder: PathLike,
    repo_id: str,
    *,
    private: bool = False,
    commit_message: str | None = None,
    api: Any = None,
) -> str:
    """Create ``repo_id`` (if needed) and upload every file of ``folder``; returns the commit URL.

    The token is left to huggingface_hub (``HF_TOKEN``, cached login). ``private=False`` leaves
    an existing repository's visibility (and the account's default for a new one) alone.
    """
    check_repo_id(repo_id)
    folder = Path(folder)
    leaked = scan_for_tokens(folder)
    if leaked:
        raise PublishError(
            f"refusing to upload: {[str(p) for p in leaked]} contain(s) something shaped like an access token"
        )
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        repo_type="model",
        commit_message=commit_message or "Upload looped model (looped_hf publish)",
    )
    return str(getattr(info, "commit_url", info))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf publish", description="Write a Hub-ready folder for one run; --push uploads it."
    )
    p.add_argument(
        "run_dir",
        help="a finished run directory (config.json, model.safetensors, tokenizer, run_record.json)",
    )
    p.add_argument(
        "--repo-id",
        default=None,
        metavar="ORG/NAME",
        help="Hub repository id: named in the card, and the --push target (needed with --push; without it "
        f"the card names the placeholder {PLACEHOLDER_OWNER}/<run folder name>)",
    )
    p.add_argument("--out", default=None, metavar="DIR", help=f"folder to write (default: RUN_DIR/{DEFAULT_OUT})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--fit", default=None, metavar="FIT_JSON", help="the sweep's fit: the card shows phi and N_eff"
    )
    p.add_argument(
        "--license", default="apache-2.0", help="license id for the card metadata (default apache-2.0)"
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="recompute the held-out loss from the folder (evaluate metric) and refuse a mismatch",
    )
    p.add_argument(
        "--push",
        action="store_true",
        help="upload the folder with huggingface_hub (an existing complete --out is uploaded as it is)",
    )
    p.add_argument(
        "--tokenizer", default=None, metavar="NAME",
        help="saved into the folder of a transformers looped class's checkpoint that has none (HRM-Text, "
        "Inkling2Loop: looped_hf.depth_tools)",
    )  # fmt: skip
    p.add_argument("--private", action="store_true", help="create the Hub repository as private")
    p.add_argument("--commit-message", default=None, help="commit message for --push")
    return p


def _folder_for(args: argparse.Namespace) -> Path:
    """Build the folder, or, for ``--push`` onto an existing complete folder without
    ``--overwrite``, reuse it as it is: you upload exactly the folder you inspected."""
    from looped_hf.depth_tools import build_native_folder, native_entry

    dest = Path(args.out) if args.out is not None else Path(args.run_dir) / DEFAULT_OUT
    if native_entry(args.run_dir) is not None:  # a looped class transformers ships: its files as they are
        for flag, value in (("--fit", args.fit), ("--verify", args.verify)):
            if value:
                name = native_entry(args.run_dir).name
                raise PublishError(f"{flag} applies to a run directory, not a transformers {name} folder")
        try:
            folder = build_native_folder(args.run_dir, args.repo_id or default_repo_id(args.run_dir), args.out,
                                         tokenizer=args.tokenizer, overwrite=args.overwrite, license=args.license)  # fmt: skip
        except ValueError as err:  # DepthToolError, CheckpointError: one line naming the value
            raise PublishError(str(err)) from None
        print(f"[publish] wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
        return folder
    if args.tokenizer is not None:
        raise PublishError(
            "--tokenizer applies to a transformers looped class's folder only (a run has its own)"
        )
    if args.push and dest.is_dir() and not args.overwrite:
        _check_output(dest)
        print(f"[publish] pushing the existing folder {dest} as it is (pass --overwrite to rebuild it first)")
        return dest
    folder = build_folder(
        args.run_dir,
        args.repo_id,
        args.out,
        fit=args.fit,
        overwrite=args.overwrite,
        license=args.license,
        verify=args.verify,
    )
    print(f"[publish] wrote {folder}: {', '.join(sorted(p.name for p in folder.iterdir()))}")
    return folder


def main(argv: list[str] | None = None) -> int:
    """``looped-hf publish``; returns 0, 2 on bad input (nothing written) or 1 if the upload failed."""
    args = _parser().parse_args(argv)
    try:
        if args.repo_id is not None:
            check_repo_id(args.repo_id)
        elif args.push:
            raise PublishError("--push needs --repo-id ORG/NAME: the Hub repository to upload to")
        folder = _folder_for(args)
    except (PublishError, CheckpointError, FileNotFoundError) as err:
        print(f"looped-hf publish: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a disk that fills or turns read-only midway: name the folder
        print(f"looped-hf publish: error: --out {args.out or Path(args.run_dir) / DEFAULT_OUT}: cannot be written "
              f"({err.strerror or err})", file=sys.stderr)  # fmt: skip
        return 2
    if not args.push:
        if args.repo_id is None:  # the card names a placeholder: rebuild it with the real id on upload
            print(f"[publish] upload it with: looped-hf publish {args.run_dir} --repo-id ORG/NAME --out {folder} "
                  "--overwrite --push")  # fmt: skip
        else:
            print(f"[publish] upload it with: looped-hf publish {args.run_dir} --repo-id {args.repo_id} --out {folder} "
                  "--push")  # fmt: skip
        return 0
    try:
        url = push_folder(folder, args.repo_id, private=args.private, commit_message=args.commit_message)
    except PublishError as err:
        print(f"looped-hf publish: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - network/auth errors: say what failed, keep the folder
        print(f"looped-hf publish: upload to {args.repo_id} failed ({type(err).__name__}: {err}); "
              f"the folder {folder} is complete, retry the push", file=sys.stderr)  # fmt: skip
        return 1
    print(f"[publish] pushed to https://huggingface.co/{args.repo_id} ({url})")
    return 0


__all__ = [
    "PublishError",
    "RunDir",
    "build_folder",
    "check_repo_id",
    "check_run_dir",
    "default_repo_id",
    "main",
    "push_folder",
    "scan_for_tokens",
    "verify_folder",
]


if __name__ == "__main__":
    sys.exit(main())
