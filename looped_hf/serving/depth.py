"""Per-request depth: what a request may ask of a served looped model, and the one check of it.

A request names its own ``num_recurrences`` (r), ``kv_budget`` (k) and, for a gated model with the
threshold readout, ``exit_threshold``: in ``SamplingParams.extra_args`` (``vllm_xargs`` in an OpenAI
body; ``looped-hf serve`` moves the same fields from the top level of the body there). A field left
out is the server's. The server's bounds (``ServedDepth``) come from the served config:

- r: 1 .. ``max_num_recurrences`` (``looped-hf serve --max-num-recurrences``, an ``hf_overrides`` key;
  default: the served r), within the model's own ceiling (``LoopedConfig.resolve_num_recurrences``);
  a hyperconnection model runs its trained r only.
- k: 1 .. the server's ``kv_budget`` (``--kv-budget``), which sizes the KV slots; a server without a
  budget keeps every recurrence's KV and takes no per-request budget, because a budget below r
  needs prompts prefilled whole (``engine.engine_args``), which only a budget server promises.
- exit_threshold: a number in [0, 1], for a model whose exit gate reads out at a threshold.
- exit_criterion: ``"gate"`` (or absent), for the same model: the gate stops each token at its
  threshold step and the token runs no later recurrence, as ``generate(exit_criterion="gate")``.

Per-request depth runs where vLLM's runner hands each request's depth to the model: on CPU, through
``worker.LoopedCPUWorker``. Elsewhere (a GPU, until the Model Runner V2 path of docs/serving.md is
built) every request runs the default depth, so a request that names another is refused, not served
at the default in silence (``ServedDepth.per_request``).

``ServedDepth.resolve`` is the one rule: the engine's admission check (``plugin``'s logits-processor
guard), the HTTP middleware's 400 and the model runner (``worker``) all call it. Nothing here imports
vLLM or torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The fields a request sets, in ``extra_args`` / ``vllm_xargs`` or at the top of an OpenAI body.
REQUEST_KEYS = ("num_recurrences", "kv_budget", "exit_threshold", "exit_criterion")
#: A request key whose ``RequestDepth`` field has another name (the rest share theirs).
_DEPTH_FIELD = {"exit_criterion": "gate_exit"}
#: The ``hf_overrides`` key that carries ``looped-hf serve --max-num-recurrences`` to the engine.
MAX_KEY = "max_num_recurrences"


def misspelt_key(key: Any) -> str | None:
    """The ``REQUEST_KEYS`` name that ``key`` is a near miss of (``num_recurrence``, ``kv-budget``,
    ``NUM_RECURRENCES``), else None: such a key would be dropped and the request served at the
    default depth with HTTP 200, so it is refused instead."""
    import difflib

    if not isinstance(key, str) or key in REQUEST_KEYS:
        return None
    folded = key.lower().replace("-", "_")
    if folded in REQUEST_KEYS:
        return folded
    close = difflib.get_close_matches(folded, REQUEST_KEYS, n=1, cutoff=0.8)
    return close[0] if close else None


class DepthError(ValueError):
    """A request's depth field the server cannot honour; ``field`` names it (e.g. ``kv_budget``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class RequestDepth:
    """One request's depth: r, its effective KV budget min(k, r), its exit threshold (None: the
    model has no threshold readout) and whether the gate stops its tokens (``exit_criterion="gate"``)."""

    num_recurrences: int
    kv_budget: int
    exit_threshold: float | None
    gate_exit: bool = False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ServedDepth:
    """The depths a server runs: defaults and ceilings, read from its config (``from_config``)."""

    num_recurrences: int  # a request's default r
    max_num_recurrences: int  # the deepest r a request may ask; the engine's KV slots are planned for it
    kv_budget: int | None  # the server's budget: a request's default and ceiling (None: every slot, no budgets)
    exit_threshold: float | None  # the threshold readout's default (None: no gate with that readout)
    locked: bool  # hyperconnection: the trained r only
    per_request: bool = True  # False: the platform runs every request at the default (no depth worker)

    @classmethod
    def from_config(cls, config: Any, per_request: bool = True) -> ServedDepth:
        """The served config's depths (``config.max_num_recurrences``, when set by ``hf_overrides``, is
        the ceiling; else the served r). ``per_request``: whether the platform runs each request's own
        depth (vLLM's CPU runner with the looped worker). Raises ``ValueError`` naming a ceiling the
        model refuses."""
        r = config.resolve_num_recurrences()
        ceiling = getattr(config, MAX_KEY, None)
        if ceiling is None:
            ceiling = r
        else:
            ceiling = config.resolve_num_recurrences(ceiling)
            if ceiling < r:
                raise ValueError(f"{MAX_KEY}={ceiling}: below the served num_recurrences={r}")
        config.num_kv_slots(ceiling)  # checks the server's kv_budget
        threshold = None
        if getattr(config, "exit_gate", False) and config.exit_gate_output == "threshold":
            threshold = float(config.exit_gate_threshold)
        return cls(r, ceiling, config.kv_budget, threshold, bool(config.is_recurrence_locked), per_request)

    @property
    def single_depth(self) -> bool:
        """Whether every request runs the same depth (a hyperconnection model or a ceiling of 1, no budget, no
        threshold readout): then a cached prefix is every request's (``engine.engine_args`` keeps prefix
        caching on)."""
        return (self.locked or self.max_num_recurrences == 1) and self.kv_budget is None and self.exit_threshold is None

    @functools.cached_property
    def default(self) -> RequestDepth:
        """The depth of a request that names none; a step whose requests all run it passes the forward no
        depth tensors (``worker``), and the forward then runs this depth (compiled, when vLLM compiles).
        Resolved once: the runner compares every step's requests with it."""
        return self.resolve(None)

    def num_slots(self, config: Any) -> int:
        """The engine's KV-cache slots: the deepest request's at the server's budget."""
        return config.num_kv_slots(self.max_num_recurrences, self.kv_budget)

    def plan(self, config: Any):
        """The engine's ``KVSlotPlan``: the deepest request's slots at the server's budget. A request
        at r with budget k uses its block slots P + (i mod min(k, r))*K + j and the coda's here."""
        from ..generation_looped import KVSlotPlan  # torch: only where an engine is built

        return KVSlotPlan.for_call(config, self.max_num_recurrences, self.kv_budget)

    def default_plan(self, config: Any):
        """The ``KVSlotPlan`` of a request at the default depth (``default``): its block slots within the
        engine's (``plan``; the coda's are the engine plan's)."""
        from ..generation_looped import KVSlotPlan

        depth = self.default
        return KVSlotPlan.for_call(config, depth.num_recurrences, depth.kv_budget)

    def _ranges(self) -> dict[str, str]:
        r = (
            f"{self.num_recurrences} (a hyperconnection model runs its trained r only)"
            if self.locked
            else f"an integer from 1 to {self.max_num_recurrences} (this server's --max-num-recurrences)"
        )
        k = (
            "null: this server keeps every recurrence's KV cache (start it with --kv-budget K to serve budgets 1 .. K)"
            if self.kv_budget is None
            else f"an integer from 1 to {self.kv_budget} (this server's --kv-budget) or null"
        )
        t = (
            "a number from 0 to 1 (a cumulative exit probability)"
            if self.exit_threshold is not None
            else "absent: this model has no exit gate with the threshold readout"
        )
        c = (
            "'gate' (the exit gate stops each token at its threshold step) or absent"
            if self.exit_threshold is not None
            else "absent: this model has no exit gate with the threshold readout"
        )
        return {"num_recurrences": r, "kv_budget": k, "exit_threshold": t, "exit_criterion": c}

    def resolve(self, args: Mapping[str, Any] | None, where: str = "") -> RequestDepth:
        """A request's depth from its ``extra_args`` (absent fields: the server's). ``where`` prefixes the
        field in the message (``vllm_xargs.``). Raises ``DepthError`` naming the field, the value and the
        allowed range."""
        args = args or {}
        for key in args:
            meant = misspelt_key(key)
            if meant is not None:
                raise DepthError(f"{where}{key}", f"{where}{key}={args[key]!r}: not a depth field; did you mean "
                                                  f"{meant!r}? (the fields are {list(REQUEST_KEYS)})")  # fmt: skip
        ranges = self._ranges()

        def bad(key: str) -> DepthError:
            return DepthError(f"{where}{key}", f"{where}{key}={args[key]!r}: must be {ranges[key]}")

        r = args.get("num_recurrences")
        if r is None:
            r = self.num_recurrences
        elif not _is_int(r) or not 1 <= r <= self.max_num_recurrences or (self.locked and r != self.num_recurrences):
            raise bad("num_recurrences")
        k = args.get("kv_budget")
        if k is None:
            k = self.kv_budget or r
        elif self.kv_budget is None or not _is_int(k) or not 1 <= k <= self.kv_budget:
            raise bad("kv_budget")
        threshold = args.get("exit_threshold")
        if threshold is None:
            threshold = self.exit_threshold
        elif (
            self.exit_threshold is None
            or isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not math.isfinite(threshold)
            or not 0 <= threshold <= 1
        ):
            raise bad("exit_threshold")
        criterion = args.get("exit_criterion")
        if criterion is not None and (self.exit_threshold is None or criterion != "gate"):
            raise bad("exit_criterion")
        threshold = None if threshold is None else float(threshold)
        depth = RequestDepth(r, min(k, r), threshold, criterion is not None)
        if not self.per_request and args:
            self._check_default(depth, args, where)
        return depth

    def _check_default(self, depth: RequestDepth, args: Mapping[str, Any], where: str) -> None:
        """On a platform without per-request depth, a request may only name the default depth."""
        default = self.default
        for key in REQUEST_KEYS:
            field = _DEPTH_FIELD.get(key, key)  # the RequestDepth field a request key resolves to
            if args.get(key) is not None and getattr(depth, field) != getattr(default, field):
                raise DepthError(
                    f"{where}{key}",
                    f"{where}{key}={args[key]!r}: this server runs every request at its default depth "
                    f"(num_recurrences={default.num_recurrences}, kv_budget={default.kv_budget}"
                    + (f", exit_threshold={default.exit_threshold}" if default.exit_threshold is not None else "")
                    + "): per-request depth runs on vLLM's CPU runner only (GPU: docs/serving.md, 'On GPU')",
                )


__all__ = ["MAX_KEY", "REQUEST_KEYS", "DepthError", "RequestDepth", "ServedDepth", "misspelt_key"]
