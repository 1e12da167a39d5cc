"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls ``register()`` in each of its
processes before it reads a model's config.

It makes four things known to vLLM, the first three through vLLM's public registration:

- ``LoopedConfig`` to transformers' ``AutoConfig`` under model_type ``looped``, so vLLM builds a
  looped folder's config from the installed looped_hf, with no ``--trust-remote-code`` (a folder's
  ``auto_map`` names remote code, which transformers prefers only when the type is unknown);
- architecture ``LoopedForCausalLM`` -> ``looped_hf.serving.vllm_model`` (``ModelRegistry.register_model``;
  imported lazily, in the process that builds the model), and so ``LoopLoRAForCausalLM``, a per-loop
  LoRA retrofit's (the same class applies its deltas, ``loop_lora_vllm``), whose ``LoopLoRAConfig``
  is registered too;
- on CPU, vLLM's CPU RMSNorm kernels as an implementation of its IR ops (``cpu_norm``);
- the looped architectures' check of an engine's config (``engine.check_engine_config``), which vLLM
  runs while it builds the config, before any engine process starts: ``vllm serve FOLDER`` or
  ``vllm.LLM(FOLDER)`` without ``engine.engine_args``' settings stops there in one line naming
  ``looped-hf serve`` and ``engine_args(FOLDER)``. vLLM has no public hook for this; it is the one
  entry the plugin writes into vLLM's tables (``MODELS_CONFIG_MAP``, through ``vllm_compat``), and it
  only refuses: it changes no setting.

The engine settings a looped folder needs (prefix caching and chunked prefill off where requests'
depths need it, the CPU worker that hands each request's depth to the model, the request guard
below) are ``engine.engine_args``, passed by the user or by ``looped-hf serve``; vLLM has no public
per-model hook that could set them, and an engine built without them is refused before it starts
(and, should a config be built some other way, by the model when it is built).

Each request runs at its own depth (``depth.ServedDepth``: num_recurrences, kv_budget,
exit_threshold, within the server's bounds), and one outside them is refused, never served at
another depth in silence. Two guards do it:

- ``RequestGuard``, an ASGI middleware that ``looped-hf serve`` adds to vLLM's server
  (``--middleware looped_hf.serving.plugin.RequestGuard``): it reads each POST body before vLLM
  does, moves the depth fields at its top level (where the OpenAI client's ``extra_body`` lands and
  vLLM would drop them) into ``vllm_xargs``, and answers HTTP 400 naming the field and the allowed
  range for a value out of bounds, or for such a field anywhere else (a nested object). Keys inside
  the user's data (prompts, messages, JSON schemas, tool definitions) are not options and are not read.
- a logits processor whose ``validate_params`` runs ``ServedDepth.resolve`` at admission on
  ``SamplingParams.extra_args`` (``vllm_xargs``; the offline ``vllm.LLM``). Its ``apply`` changes
  nothing. vLLM loads a logits processor by name in each process, so each server's guard is a
  class named for a digest of its bounds (``guard_name``), made on demand by this module's
  ``__getattr__``; the bounds themselves are data (``ServedDepth``), kept by name (``remember``) from
  the served config when vLLM builds the engine's config (``engine.check_engine_config``), and by
  ``engine.engine_args``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Iterator
from typing import Any

from . import VLLM_ARCHITECTURES, VLLM_MODEL_CLASS
from .depth import REQUEST_KEYS, DepthError, ServedDepth, misspelt_key

_GUARD_PREFIX = "DepthGuard_"
#: Each guard's bounds by its name, in this process (``remember``).
_SERVED: dict[str, ServedDepth] = {}


def guard_name(served: ServedDepth) -> str:
    """The request guard's class name for a server's depths: a digest of ``served`` (the same bounds, the
    same name, in every process), no dot (vLLM reads one as an attribute path). The name identifies the
    guard; its bounds are ``served`` itself, kept by ``remember``."""
    data = json.dumps(dataclasses.asdict(served), sort_keys=True)
    return _GUARD_PREFIX + hashlib.sha256(data.encode()).hexdigest()[:16]


def remember(served: ServedDepth) -> str:
    """Keep ``served`` as the bounds of its guard (``guard_name``) in this process; return the name."""
    name = guard_name(served)
    _SERVED[name] = served
    return name


def served_by_guard(name: str) -> ServedDepth:
    """The bounds of the guard ``name`` (``remember``). A ``LookupError`` when this process has not seen
    them: vLLM built the engine's config elsewhere, without the looped check (``engine.check_engine_config``)."""
    served = _SERVED.get(name)
    if served is None:
        raise LookupError(
            f"logits processor {name!r}: no looped server's depths in this process have this guard; build the "
            "engine with looped_hf.serving.engine_args(FOLDER) or serve it with `looped-hf serve`"
        )
    return served


# Fields whose keys are the user's data, not options: a JSON schema may well have a property named
# num_recurrences, and a message's content is text.
DATA_FIELDS = frozenset(
    {"prompt", "messages", "input", "suffix", "response_format", "structured_outputs", "guided_json", "tools",
     "tool_choice", "logit_bias", "chat_template", "documents"}
)  # fmt: skip


def named_settings(body: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(path, value)`` in a JSON request body whose key is one of ``REQUEST_KEYS``, at any depth
    (``vllm_xargs.num_recurrences``, ``extra_body.kv_budget``, ...), outside ``DATA_FIELDS``."""
    if isinstance(body, dict):
        for key, value in body.items():
            path = f"{where}.{key}" if where else str(key)
            if key in REQUEST_KEYS:
                yield path, value
            elif key not in DATA_FIELDS:
                yield from named_settings(value, path)
    elif isinstance(body, list):
        for i, value in enumerate(body):
            yield from named_settings(value, f"{where}[{i}]")


def map_body(parsed: Any, served: ServedDepth) -> tuple[Any, tuple[str, str] | None]:
    """(the body with its top-level depth fields moved into ``vllm_xargs``, where vLLM hands them to the
    engine; ``(field, why)`` when a field is refused, else None). A field anywhere else (nested in
    another object) is refused: vLLM would drop it and serve the default depth in silence."""
    if not isinstance(parsed, dict):
        return parsed, None
    xargs = parsed.get("vllm_xargs")
    xargs = dict(xargs) if isinstance(xargs, dict) else None
    for path, value in named_settings(parsed):
        key = path.rsplit(".", 1)[-1]
        if path == key or (path == f"vllm_xargs.{key}" and xargs is not None):
            continue
        return parsed, (
            path,
            f"{path}={value!r}: not read there; set {key} at the top of the body or in vllm_xargs",
        )
    for key, value in parsed.items():  # a near miss at the top would be dropped by vLLM in silence
        meant = misspelt_key(key)
        if meant is not None:
            return parsed, (key, f"{key}={value!r}: not a depth field; did you mean {meant!r}?")
    top = {key: parsed[key] for key in REQUEST_KEYS if key in parsed}
    for key, value in top.items():
        if xargs is not None and key in xargs and xargs[key] != value:
            return parsed, (key, f"{key}={value!r} and vllm_xargs.{key}={xargs[key]!r}: set it once")
    try:
        served.resolve(top)
        served.resolve(xargs, where="vllm_xargs.")
    except DepthError as err:
        return parsed, (err.field, str(err))
    if not top:
        return parsed, None
    body = {key: value for key, value in parsed.items() if key not in top}
    body["vllm_xargs"] = {**(xargs or {}), **{key: value for key, value in top.items() if value is not None}}
    return body, None


class RequestGuard:
    """ASGI middleware for vLLM's OpenAI server (``--middleware looped_hf.serving.plugin.RequestGuard``):
    a POST whose JSON body sets ``num_recurrences``, ``kv_budget`` or ``exit_threshold`` at its top
    level has them moved into ``vllm_xargs`` (vLLM itself drops unknown top-level fields with a debug
    line, so a request for r = 8 would be served at the default); a value the server cannot honour
    (``ServedDepth.resolve``), or such a field anywhere else, is answered HTTP 400 in vLLM's error
    format, naming the field, the value and the allowed range.

    The server's depths are read from the served config (``app.state.vllm_config``, set by vLLM
    before it serves requests), so the middleware takes no arguments and works under any vLLM
    server start-up."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def _served(self, scope: dict) -> ServedDepth | None:
        vllm_config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
        config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        if config is None or not hasattr(config, "num_recurrences"):
            return None
        # Per-request depth runs on vLLM's CPU runner only; elsewhere requests are held to the default.
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
        return ServedDepth.from_config(config, per_request=device == "cpu")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        served = self._served(scope) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if served is None:
            await self.app(scope, receive, send)
            return
        # The whole body is read here, then replayed to vLLM (rewritten when fields moved).
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        try:
            parsed = json.loads(body)
        except ValueError:  # not JSON: vLLM answers that itself
            parsed = None
        mapped, refused = map_body(parsed, served)
        if refused is not None:
            field, why = refused
            payload = json.dumps(
                {"error": {"message": why, "type": "BadRequestError", "param": field, "code": 400}}
            )
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": payload.encode()})
            return
        if mapped is not parsed:
            body = json.dumps(mapped).encode()
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
            messages = [{"type": "http.request", "body": body, "more_body": False}]
        pending = iter(messages)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)


@functools.cache
def _make_guard(name: str) -> type:
    """The guard class called ``name``, made once per process (vLLM resolves it by name)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class DepthGuard(LogitsProcessor):
        @classmethod
        def validate_params(cls, sampling_params) -> None:
            served_by_guard(name).resolve(sampling_params.extra_args)

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            pass  # the engine runs no admission check: the config's check (frontend) remembered the bounds

        def apply(self, logits):
            return logits

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            return None

    DepthGuard.__name__ = DepthGuard.__qualname__ = name
    DepthGuard.__module__ = __name__
    return DepthGuard


def __getattr__(name: str) -> type:
    # vLLM loads logits processors by "module:name" in each process (``guard_name``).
    if name.startswith(_GUARD_PREFIX) and len(name) == len(_GUARD_PREFIX) + 16:
        return _make_guard(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the looped config and model with vLLM, on CPU vLLM's CPU RMSNorm kernels as an IR
    implementation (``cpu_norm``; used only where an engine's ``ir_op_priority`` names it), and the check
    of an engine's config (``engine.check_engine_config``, through ``vllm_compat``). Idempotent. The
    engine settings a looped folder needs are ``engine.engine_args``."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ..configuration_looped import LoopedConfig
    from ..retrofit.loop_lora import LoopLoRAConfig
    from . import vllm_compat
    from .cpu_norm import register as register_cpu_norm
    from .engine import check_engine_config

    for config in (LoopedConfig, LoopLoRAConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)
    for architecture in VLLM_ARCHITECTURES:  # one model class serves them all
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, VLLM_MODEL_CLASS)
    register_cpu_norm()
    vllm_compat.check_config_on_build(VLLM_ARCHITECTURES, check_engine_config)
