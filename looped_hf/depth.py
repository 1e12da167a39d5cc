"""Depth registry: which config fields are the depth of a looped class, and ``at_depth``.

    import looped_hf
    with looped_hf.at_depth(model, 4):          # HRM-Text: H_cycles=4 (L_cycles as trained)
        logits = model(ids).logits
    with looped_hf.at_depth(model, (3, 2)):     # HRM-Text: H_cycles=3, L_cycles=2
        out = model.generate(ids, max_new_tokens=8)
    # the model runs at its own depth again here, also after an exception inside the block

transformers ships looped classes of its own (``HrmTextForCausalLM``, ``Inkling2LoopForCausalLM``);
looped_hf does not convert them (transformers owns them), it drives them: each keeps its depth in
config fields its forward reads at every call, so a depth is set on the shared config for the
block and put back after it. ``LoopedForCausalLM`` takes its r per call, so there the block adds
``num_recurrences=r`` to each call instead and the config is never touched.

One `DepthEntry` per class says which fields are the depth, their valid range, how a depth is set
and restored, and what the KV cache needs at another depth. Adding a class is one entry in
`REGISTRY` and a test against that class's own forward built with the depth in its config.

This module imports neither torch nor transformers (the classes are matched by name): it imports
under a transformers that lacks them (5.19 in the serving venv), where those entries simply match
no model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# A depth: r, or for a class with a second axis (HRM-Text's L_cycles) a tuple (r, second).
Depth = int | tuple[int, ...]


class DepthError(ValueError):
    """A depth a class cannot run, or a class with no registry entry: the message names it."""


@dataclass(frozen=True)
class DepthEntry:
    """How one looped class's depth is read, set and restored.

    ``fields``: the config fields of the depth, r first (a second one is a second axis).
    ``minimum``: the least valid value of each field (no upper bound unless ``ceiling`` gives one).
    ``setting``: ``"config"`` (the fields, and ``derived``, are set on the model's config for the
    block and restored after it) or ``"call"`` (the class takes r per call: ``call_kwarg`` is added
    to every call in the block; the config is left alone).
    ``cache``: what the KV cache needs at another depth, in one line (shown in errors and docs).
    ``cache_slots``: cache layers a forward at this config's depth uses; a caller's cache filled at
    another depth is refused in one line, an empty fixed-size one too small is grown
    (``grow_cache``). None: the class sizes its cache itself at every call.
    ``layer_applications``: decoder-layer applications per token at the config's depth (the
    compute a depth costs, relative across depths).
    ``vllm_model``: the module of vLLM's own model of the class (``vllm/model_executor/models/``),
    which `looped_hf.serving.native` serves; None: vLLM has none (``looped-hf serve`` refuses).
    """

    class_names: tuple[str, ...]
    model_types: tuple[str, ...]
    fields: tuple[str, ...]
    minimum: tuple[int, ...]
    setting: str
    cache: str
    meaning: str
    layer_applications: Callable[[Any], int]
    derived: Callable[[Any], dict[str, int]] | None = None
    cache_slots: Callable[[Any], int] | None = None
    grow_cache: bool = False
    call_kwarg: str | None = None
    ceiling: Callable[[Any], int] | None = None
    vllm_model: str | None = None

    @property
    def name(self) -> str:
        return self.class_names[0]

    def trained(self, config: Any) -> tuple[int, ...]:
        """The depth the config holds (r first)."""
        return tuple(int(getattr(config, field)) for field in self.fields)

    def resolve(self, config: Any, depth: Depth) -> tuple[int, ...]:
        """``depth`` as one value per field (an int sets r and keeps the other axes as configured),
        checked against the range; a `DepthError` names the field and the value."""
        values = (depth,) if not isinstance(depth, tuple | list) else tuple(depth)
        if not values or len(values) > len(self.fields):
            axes = " or ".join(["r", f"({', '.join(self.fields)})"] if len(self.fields) > 1 else ["r"])
            raise DepthError(f"{self.name}: depth={depth!r}: give {axes}")
        values = values + self.trained(config)[len(values) :]
        for field, value, low in zip(self.fields, values, self.minimum):
            if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
                raise DepthError(f"{self.name}: {field}={value!r}: must be an integer >= {low}")
            if int(value) < low:
                raise DepthError(f"{self.name}: {field}={int(value)}: must be >= {low}")
        values = tuple(int(v) for v in values)
        if self.ceiling is not None and values[0] > self.ceiling(config):
            raise DepthError(f"{self.name}: {self.fields[0]}={values[0]}: exceeds this model's ceiling of "
                             f"{self.ceiling(config)}")  # fmt: skip
        return values


def _hrm_slots(config: Any) -> int:
    # transformers' HrmTextConfig keeps num_hidden_layers = num_layers_per_stack * H * (L + 1), one
    # cache slot per stack invocation, but only computes it on first construction: a depth changed
    # afterwards (or a from_pretrained override) leaves the old count, and a cached forward at more
    # cycles indexes past the cache (IndexError). at_depth rewrites it with the cycles.
    return int(config.num_layers_per_stack) * int(config.H_cycles) * (int(config.L_cycles) + 1)


def _inkling_applications(config: Any) -> int:
    return int(config.total_num_hidden_layers)


def _looped_applications(config: Any) -> int:
    return int(config.num_layer_applications())


REGISTRY: tuple[DepthEntry, ...] = (
    DepthEntry(
        class_names=("LoopedForCausalLM", "LoopedModel"),
        model_types=("looped", "looped_loop_lora"),
        fields=("num_recurrences",),
        minimum=(1,),
        setting="call",
        call_kwarg="num_recurrences",
        cache="grown per call by the model's slot plan (KVSlotPlan); nothing to do",
        meaning="r = recurrences of the shared block between prelude and coda",
        layer_applications=_looped_applications,
        ceiling=lambda config: int(config.recurrence_ceiling),
    ),
    DepthEntry(
        class_names=("HrmTextForCausalLM", "HrmTextModel"),
        model_types=("hrm_text",),
        fields=("H_cycles", "L_cycles"),
        minimum=(1, 1),
        setting="config",
        derived=lambda config: {"num_hidden_layers": _hrm_slots(config)},
        cache_slots=_hrm_slots,
        grow_cache=True,
        cache="resized: num_hidden_layers = num_layers_per_stack * H_cycles * (L_cycles + 1) slots; "
        "a cache filled at another depth is refused",
        meaning="r = H_cycles (high-level cycles); L_cycles (low-level steps per H cycle) is a second axis",
        layer_applications=_hrm_slots,
        vllm_model="hrm_text",
    ),
    DepthEntry(
        class_names=("Inkling2LoopForCausalLM", "Inkling2LoopTextModel"),
        model_types=("inkling2_loop_text",),
        fields=("loop_num_passes",),
        minimum=(1,),
        setting="config",
        cache_slots=_inkling_applications,
        cache="sized by the model at its first forward (loop layers copied per pass); "
        "a cache filled at another depth is refused",
        meaning="r = loop_num_passes over layers loop_layer_index_start .. loop_layer_index_end - 1",
        layer_applications=_inkling_applications,
    ),
)


def registered_names() -> list[str]:
    return [entry.name for entry in REGISTRY]


def entry_for_model_type(model_type: str | None) -> DepthEntry | None:
    """The entry of a config.json ``model_type`` (read without loading anything), or None."""
    return next((entry for entry in REGISTRY if model_type in entry.model_types), None)


def entry_for(model: Any) -> DepthEntry:
    """The entry of a model (its class or the nearest registered base class, by name); any other is
    a `DepthError` naming the class and the registered ones."""
    for cls in type(model).__mro__:
        for entry in REGISTRY:
            if cls.__name__ in entry.class_names:
                return entry
    raise DepthError(
        f"{type(model).__name__} has no depth registry entry; registered: {', '.join(registered_names())}"
    )


def _cache_of(kwargs: dict[str, Any]) -> Any:
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _check_cache(entry: DepthEntry, config: Any, kwargs: dict[str, Any], depth: tuple[int, ...]) -> None:
    """A caller's cache at this depth: one filled at another depth is refused (its slots hold other
    cycles' keys), an empty fixed-size one with too few slots is grown where the class's slots are
    plain layers (HRM-Text); the class's own caches (generate's, use_cache=True) are sized right."""
    cache = _cache_of(kwargs)
    if cache is None or entry.cache_slots is None or not hasattr(cache, "layers"):
        return
    need, have = entry.cache_slots(config), len(cache.layers)
    if cache.get_seq_length() == 0:
        if entry.grow_cache and have < need:
            from transformers.cache_utils import DynamicLayer

            cache.layers.extend(DynamicLayer() for _ in range(need - have))
        return
    # Filled at this depth: exactly the first `need` slots hold keys (a fixed-size cache made from the
    # trained config may have more, unused). Another depth filled fewer or more of them.
    filled = [layer.get_seq_length() > 0 for layer in cache.layers]
    if have < need or not all(filled[:need]) or any(filled[need:]):
        at = depth_label(entry, depth)
        raise DepthError(f"{entry.name}: the cache has {have} layers filled at another depth; {at} needs "
                         f"{need}: start a new cache at this depth")  # fmt: skip


_UNSET = object()


@contextlib.contextmanager
def at_depth(model: Any, depth: Depth) -> Iterator[Any]:
    """Run ``model(...)`` and ``model.generate(...)`` at ``depth`` inside the block; the model's own
    depth is restored after it, also when the block raises.

    ``depth``: r (an int), or for HRM-Text ``(H_cycles, L_cycles)``. Inside the block the logits
    equal those of the class built with that depth in its config. The config is shared by the
    model's modules, so a block changes the depth for every user of the model object until it
    exits (not thread-safe). Yields the model. Raises `DepthError` (one line) for an unregistered
    class or a depth out of range, before anything is changed.
    """
    entry = entry_for(model)
    config = model.config
    values = entry.resolve(config, depth)
    handles = []
    saved: dict[str, Any] = {}
    saved_generation: tuple[Any, Any] | None = None
    try:
        if entry.setting == "config":
            updates = dict(zip(entry.fields, values))
            saved = {name: getattr(config, name) for name in updates}
            for name, value in updates.items():
                setattr(config, name, value)
            for name, value in (entry.derived(config) if entry.derived else {}).items():
                saved.setdefault(name, getattr(config, name))
                setattr(config, name, value)

            def check(_module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
                _check_cache(entry, config, kwargs, values)

            handles.append(model.register_forward_pre_hook(check, with_kwargs=True))
        else:
            key, r = entry.call_kwarg, values[0]

            def add_r(_module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
                given = kwargs.get(key)
                if given is not None and given != r:
                    raise DepthError(
                        f"{entry.name}: {key}={given!r} inside at_depth(model, {r}): give one depth"
                    )
                return args, {**kwargs, key: r}

            handles.append(model.register_forward_pre_hook(add_r, with_kwargs=True))
            # generate() resolves the depth itself (a keyword, else generation_config's, else the
            # config's: generation_looped.generation_depth) and passes it to every forward, so the
            # block's r is set where generate() reads its default; a keyword naming another r is
            # still refused by the hook above.
            generation_config = getattr(model, "generation_config", None)
            if generation_config is not None:
                saved_generation = (generation_config, generation_config.__dict__.get(key, _UNSET))
                setattr(generation_config, key, r)
        yield model
    finally:
        for handle in handles:
            handle.remove()
        if saved_generation is not None:
            generation_config, old = saved_generation
            if old is _UNSET:
                generation_config.__dict__.pop(key, None)
            else:
                setattr(generation_config, key, old)
        # In the reverse order of setting: the derived fields (HRM-Text's slots) first, then the depth.
        for name, value in reversed(list(saved.items())):
            setattr(config, name, value)


def depth_label(entry: DepthEntry, values: tuple[int, ...]) -> str:
    """``H_cycles=3, L_cycles=2`` / ``loop_num_passes=4``."""
    return ", ".join(f"{field}={value}" for field, value in zip(entry.fields, values))


__all__ = [
    "REGISTRY",
    "Depth",
    "DepthEntry",
    "DepthError",
    "at_depth",
    "depth_label",
    "entry_for",
    "entry_for_model_type",
    "registered_names",
]
