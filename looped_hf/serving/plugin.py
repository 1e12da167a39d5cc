"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls ``register()`` in each of its
processes before it reads a model's config.

It makes three things known to vLLM:

- ``LoopedConfig`` to transformers' ``AutoConfig`` under model_type ``looped``, so vLLM builds a
  looped folder's config from the installed looped_hf, with no ``--trust-remote-code`` (a folder's
  ``auto_map`` names remote code, which transformers prefers only when the type is unknown);
- architecture ``LoopedForCausalLM`` -> ``looped_hf.serving.vllm_model`` (imported lazily, in the
  process that builds the model);
- a config hook (run when the engine's config is made, in the process the user started) that
  refuses what cannot be served with one clear line, and, for a ``kv_budget`` below r, turns off
  the two scheduler features that would split tokens into forward calls differently from
  ``generate()`` (see ``vllm_model``'s docstring): prefix caching and chunked prefill. It also adds
  the engine's request guard (below) to its logits processors. vLLM has no public way to register
  such a hook (``_register_config_hook`` says why it is still needed, and where it goes).

r and kv_budget are per engine, and a request that asks for another is refused, never served at the
engine's r in silence. Two guards do it:

- ``RequestGuard``, an ASGI middleware that ``looped-hf serve`` adds to vLLM's server
  (``--middleware looped_hf.serving.plugin.RequestGuard``): it reads each POST body before vLLM
  does and answers HTTP 400 when ``num_recurrences`` or ``kv_budget`` appears anywhere in it (the
  top level, where the OpenAI client's ``extra_body`` lands and vLLM would ignore it; ``vllm_xargs``;
  any nested object) with a value other than the engine's. Keys inside the user's data (prompts,
  messages, JSON schemas, tool definitions) are not options and are not read.
- a logits processor whose ``validate_params`` runs at admission, for the one per-request channel
  that reaches the engine, ``SamplingParams.extra_args`` (``vllm_xargs`` in an OpenAI body; the
  offline ``vllm.LLM``): the CPU model runner never hands it to the model's forward, so it cannot
  change r. Its ``apply`` changes nothing. The engine's values are in the guard's name
  (``RecurrenceGuard_r3_k2``; k 0: no budget), made on demand by this module's ``__getattr__``, so
  vLLM can load it by name in every process.

A value equal to the engine's is accepted by both.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

from . import VLLM_ARCHITECTURE, VLLM_MODEL_CLASS, check_servable

logger = logging.getLogger(__name__)


def budget_setting_problems(vllm_config) -> list[str]:
    """The engine settings that would serve a ``kv_budget`` below r other than ``generate()`` does,
    one line each naming the setting and its fix (empty: none, or every slot its own). With kv_budget
    < r a token's KV at a shared slot depends on which tokens shared its forward call, so prompts
    must be prefilled whole, and never from another request's cached prefix. The config hook turns
    these off; the model refuses an engine that still has them (a vLLM that did not run the hook)."""
    from ..generation_looped import KVSlotPlan  # torch: only where an engine is configured

    config = vllm_config.model_config.hf_config
    if not KVSlotPlan.for_call(config).shares_slots:
        return []
    why = f"with kv_budget={config.kv_budget} < num_recurrences={config.num_recurrences} prompts are prefilled whole"
    settings = {
        "enable_prefix_caching": vllm_config.cache_config.enable_prefix_caching,
        "enable_chunked_prefill": vllm_config.scheduler_config.enable_chunked_prefill,
    }
    return [
        f"{name}=True: {why}, as generate() does; pass {name}=False (--no-{name.replace('_', '-')})"
        for name, on in settings.items()
        if on
    ]


def _budget_settings(vllm_config) -> None:
    """Turn off what ``budget_setting_problems`` names, and let a whole prompt fit one call."""
    if not budget_setting_problems(vllm_config):
        return
    config = vllm_config.model_config.hf_config
    why = f"kv_budget={config.kv_budget} < num_recurrences={config.num_recurrences}"
    cache_config, scheduler_config = vllm_config.cache_config, vllm_config.scheduler_config
    if cache_config.enable_prefix_caching:
        logger.info("looped_hf: %s, turning prefix caching off", why)
        cache_config.enable_prefix_caching = False
    if scheduler_config.enable_chunked_prefill:
        logger.info("looped_hf: %s, turning chunked prefill off", why)
        scheduler_config.enable_chunked_prefill = False
        scheduler_config.long_prefill_token_threshold = 0
    max_len = vllm_config.model_config.max_model_len
    if scheduler_config.max_num_batched_tokens < max_len:
        scheduler_config.max_num_batched_tokens = max_len


REQUEST_KEYS = ("num_recurrences", "kv_budget")
_GUARD_NAME = re.compile(r"RecurrenceGuard_r(\d+)_k(\d+)")


def guard_name(num_recurrences: int, kv_budget: int | None) -> str:
    """The request guard's class name for an engine at r with kv_budget (None: every slot its own)."""
    return f"RecurrenceGuard_r{num_recurrences}_k{kv_budget or 0}"


def refusal(field: str, value: Any, num_recurrences: int, kv_budget: int | None) -> str | None:
    """Why a request that sets ``field`` (where it sits in the request, e.g. ``vllm_xargs.kv_budget``)
    to ``value`` is refused by an engine at ``num_recurrences`` / ``kv_budget``; None when ``value``
    is the engine's own (an integer equal to it, or null for an engine without a budget)."""
    engine = {"num_recurrences": num_recurrences, "kv_budget": kv_budget}[field.rsplit(".", 1)[-1]]
    same = value is None if engine is None else type(value) is int and value == engine
    if same:
        return None
    return (
        f"{field}={value!r}: this engine serves num_recurrences={num_recurrences}, kv_budget={kv_budget}; both "
        "are set per engine (hf_overrides, looped-hf serve --num-recurrences / --kv-budget), not per request"
    )


def check_request(extra_args: dict | None, num_recurrences: int, kv_budget: int | None) -> None:
    """Raise ``ValueError`` when a request's ``extra_args`` ask for an r or kv_budget other than the
    engine's (a value equal to the engine's is accepted)."""
    for key in REQUEST_KEYS:
        if extra_args and key in extra_args:
            why = refusal(key, extra_args[key], num_recurrences, kv_budget)
            if why:
                raise ValueError(why)


# Fields whose keys are the user's data, not options: a JSON schema may well have a property named
# num_recurrences, and a message's content is text.
DATA_FIELDS = frozenset(
    {"prompt", "messages", "input", "suffix", "response_format", "structured_outputs", "guided_json", "tools",
     "tool_choice", "logit_bias", "chat_template", "documents"}
)  # fmt: skip


def named_settings(body: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``(path, value)`` in a JSON request body whose key is ``num_recurrences`` or
    ``kv_budget``, at any depth (``vllm_xargs.num_recurrences``, ``extra_body.kv_budget``, ...),
    outside ``DATA_FIELDS``."""
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


def body_refusal(body: bytes, num_recurrences: int, kv_budget: int | None) -> tuple[str, str] | None:
    """``(field, why)`` for the first setting in a request body that the engine cannot honour,
    else None (also for a body that is not JSON: vLLM answers that itself)."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    for path, value in named_settings(parsed):
        why = refusal(path, value, num_recurrences, kv_budget)
        if why:
            return path, why
    return None


class RequestGuard:
    """ASGI middleware for vLLM's OpenAI server (``--middleware looped_hf.serving.plugin.RequestGuard``):
    a POST whose JSON body names ``num_recurrences`` or ``kv_budget`` with a value other than the
    engine's is answered HTTP 400 in vLLM's error format, naming the field and the value. vLLM
    itself drops unknown top-level fields with a debug log line, so without this a request for
    r = 8 would be served at the engine's r.

    The engine's r and kv_budget are read from the served config (``app.state.vllm_config``, set by
    vLLM before it serves requests), so the middleware takes no arguments and works under any
    vLLM server start-up."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def _engine(self, scope: dict) -> tuple[int, int | None] | None:
        vllm_config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
        config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        if config is None or not hasattr(config, "num_recurrences"):
            return None
        return config.num_recurrences, config.kv_budget

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        engine = self._engine(scope) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if engine is None:
            await self.app(scope, receive, send)
            return
        # The whole body is read here, then replayed to vLLM message by message.
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        refused = body_refusal(body, *engine)
        if refused is not None:
            field, why = refused
            payload = json.dumps({"error": {"message": why, "type": "BadRequestError", "param": field, "code": 400}})
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": payload.encode()})
            return
        pending = iter(messages)

        async def replay() -> dict:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)


@functools.cache
def _make_guard(name: str) -> type:
    """The guard class called ``name``, made once per process (vLLM resolves it by name)."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    match = _GUARD_NAME.fullmatch(name)
    r, k = int(match.group(1)), int(match.group(2)) or None

    class RecurrenceGuard(LogitsProcessor):
        @classmethod
        def validate_params(cls, sampling_params) -> None:
            check_request(sampling_params.extra_args, r, k)

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            pass

        def apply(self, logits):
            return logits

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update) -> None:
            return None

    RecurrenceGuard.__name__ = RecurrenceGuard.__qualname__ = name
    RecurrenceGuard.__module__ = __name__
    return RecurrenceGuard


def __getattr__(name: str) -> type:
    # vLLM loads logits processors by "module:name" in each process; the name carries r and k.
    if _GUARD_NAME.fullmatch(name):
        return _make_guard(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _add_request_guard(vllm_config) -> None:
    config = vllm_config.model_config.hf_config
    guard = f"{__name__}:{guard_name(config.num_recurrences, config.kv_budget)}"
    model_config = vllm_config.model_config
    processors = list(model_config.logits_processors or [])
    if guard not in processors:
        model_config.logits_processors = [*processors, guard]


class LoopedConfigHook:
    """vLLM's per-architecture config hook (the interface of ``VerifyAndUpdateConfig``)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from vllm.platforms import current_platform

        parallel = vllm_config.parallel_config
        check_servable(
            vllm_config.model_config.hf_config,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            tensor_parallel_size=parallel.tensor_parallel_size,
            device="cpu" if current_platform.is_cpu() else None,
        )
        _budget_settings(vllm_config)
        _add_request_guard(vllm_config)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None


def _register_config_hook() -> None:
    """Add ``LoopedConfigHook`` to the per-architecture config hooks vLLM runs when it makes an
    engine's config (idempotent).

    vLLM (0.32) has no public way to do this: its own models' hooks live in the table
    ``vllm.model_executor.models.config.MODELS_CONFIG_MAP``, read once per engine in the user's
    process, and there is no function to register one (``ModelRegistry.register_model`` takes the
    model class only, and vLLM reads no engine setting from a model class or its config). The hook
    is still needed, because two of its three jobs have no other place:

    - turning prefix caching and chunked prefill off for an engine with kv_budget < r must happen
      before the scheduler is made, and only the engine's config reaches it. Without the hook,
      ``vllm.LLM(FOLDER, hf_overrides={"kv_budget": 2})`` could only be refused and the flags asked
      for (the model does exactly that when the hook did not run: ``budget_setting_problems``);
    - the request guard is a logits processor whose name carries the engine's r and kv_budget, so it
      must be added per engine; vLLM's public ``vllm.logits_processors`` entry point applies one
      class to every engine and model, and its ``validate_params`` sees the request only;
    - the servability check needs no hook: the model checks again when it is built (in the engine
      process), the hook only gives the refusal before vLLM starts its workers.

    So the one entry is written there, by ``setdefault`` (an entry vLLM itself might add one day
    wins), and a vLLM without the table gets no hook rather than a plugin that fails to load."""
    try:
        from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    except ImportError:
        logger.warning("looped_hf: this vLLM has no MODELS_CONFIG_MAP; a kv_budget < r needs prefix caching and "
                       "chunked prefill turned off by hand")  # fmt: skip
        return
    MODELS_CONFIG_MAP.setdefault(VLLM_ARCHITECTURE, LoopedConfigHook)


def register() -> None:
    """Register the looped config, model and config hook with vLLM (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from ..configuration_looped import LoopedConfig

    AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
    if VLLM_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VLLM_ARCHITECTURE, VLLM_MODEL_CLASS)
    _register_config_hook()
