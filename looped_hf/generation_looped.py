"""Test-time compute for the looped decoder: adaptive exit, KV-budget cache views, self-drafting.

``modeling_looped.py`` is the architecture; this module holds what a call of it may add at test
time, and is shipped beside it in every checkpoint (transformers' remote-code loader follows the
relative import), so it imports only torch, transformers and ``.configuration_looped``.

- Adaptive exit, per token (``config.exit_criterion`` or ``exit_criterion=`` per call): each token
  stops recurring once its criterion fires; its state freezes and, at later recurrences, it offers
  the KV of its last computed one (``_ExitKV``, Huginn's "latest"). ``_AdaptiveExit`` holds the
  criterion's memory and who stopped when; ``resolve_exit_rule`` checks a call's rule. On a model
  with an exit gate the criterion is the gate (``exit_criterion="gate"``): a token stops where
  its exit CDF reaches the threshold, the step of the gate's threshold readout.
- The cache a call needs: one slot per layer application (``_grow_cache``; a cache is filled at
  one r and one budget, ``_check_cache_recurrences``). A KV budget k (``config.kv_budget`` or
  ``kv_budget=`` per call, the study's engine) keeps only k recurrence slots; which slot each
  layer application uses is the call's ``KVSlotPlan`` (``KVSlotPlan.for_call``, the one
  formula); a slot keeps the KV of the last recurrence that wrote it (see
  ``LoopedConfig.kv_budget``); the model's forward does the writes and crops.
- ``generate(..., draft_num_recurrences=k)`` decodes self-speculatively: the same weights at k
  recurrences draft, r verifies, through transformers' assisted decoding
  (``RecurrenceDraftCandidateGenerator``), plus ``recurrences_used`` per new token. Both come from
  two ``generate`` hooks in ``LoopedGenerationMixin``; there is no decoding loop of our own.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, GenerationMixin
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.utils import GENERATION_CONFIG_NAME, cached_file

from .configuration_looped import EXIT_GATE_CRITERION, KV_BUDGET_RULE, R_RULE, LoopedConfig, check_override
from .interface_looped import (
    CACHE_RENAMED,
    KEEPS_UNWRITTEN_SLOTS,
    cache_output_alias,
    create_causal_mask,
    crop_slot,
    slot_croppable,
    warn_past_positions,
)

# ---------------------------------------------------------------------------------------------
# Adaptive exit (test-time compute): which tokens stop, and the KV they offer once stopped
# ---------------------------------------------------------------------------------------------

# Criteria that read the next-token distribution, so need the coda, final norm and LM head.
_HEAD_CRITERIA = ("kl", "entropy_diff", "argmax_stability")


class _ExitKV:
    """The block layers' view of the cache under adaptive exit.

    A token that exited at recurrence s offers, at every later recurrence, the KV its block
    layers computed at s (Huginn's "latest" cache lookup), both to the other tokens of the same
    call and, through the cache, to later tokens. ``update`` is the cache's: the block's
    attention calls it with its fresh KV, and the exited positions are swapped for their latest.
    """

    def __init__(self, cache: Cache | None, plan: KVSlotPlan) -> None:
        self.cache = cache
        self.plan = plan
        self.exited: torch.Tensor | None = None  # (batch, tokens) bool, None while no token exited
        self.latest: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * plan.num_recurrent

    def update(self, key: torch.Tensor, value: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.plan.layer_of_slot(slot)
        if self.exited is not None:
            stopped = self.exited[:, None, :, None]  # key/value: (batch, kv heads, tokens, head_dim)
            key = torch.where(stopped, self.latest[j][0], key)
            value = torch.where(stopped, self.latest[j][1], value)
        self.latest[j] = (key, value)
        return (key, value) if self.cache is None else self.cache.update(key, value, slot)

    def refill_recurrence(self, step: int) -> None:
        """Write the latest KV into the block's slots of recurrence ``step`` (0-based), which no
        token of the call runs because all have stopped."""
        if self.cache is not None:
            for j in range(self.plan.num_recurrent):
                self.cache.update(*self.latest[j], self.plan.block(step, j))


class _AdaptiveExit:
    """Per-token exit decisions for one forward: the criterion's memory, who stopped, and when.

    After recurrence c (1-based), ``step`` freezes the tokens that stopped earlier (their state
    keeps its value, their KV its latest, see ``_ExitKV``) and stops the running tokens whose
    criterion fires, from c = ``min_recurrences`` on. Distribution criteria decode the state
    (``predict``: coda, norm, head) from c = min_recurrences - 1 on, so their memory is ready; the
    gate criterion reads every state (``predict``: ``recurrent_block_looped.GateExit``).
    """

    def __init__(
        self, rule: tuple[str, float, int], num_recurrences: int, state0: torch.Tensor,
        kv: _ExitKV, predict: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> None:
        self.criterion, self.threshold, self.minimum = rule
        self.kv = kv
        self.predict = predict
        batch_shape, device = state0.shape[:-1], state0.device
        self.exited = torch.zeros(batch_shape, dtype=torch.bool, device=device)
        self.used = torch.full(batch_shape, num_recurrences, dtype=torch.long, device=device)
        self.prev_state = state0
        self.prev_logp: torch.Tensor | None = None  # None: the uniform distribution (Huginn's start)
        self.prev_entropy: torch.Tensor | None = None
        self.prev_argmax: torch.Tensor | None = None
        self.stable = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.any_exited = self.all_exited = False  # Python bools, refreshed only when a token stops

    def _record(self, c: int, fires: torch.Tensor) -> None:
        """Stop the running tokens in ``fires`` at recurrence c. One host sync (``any``) per
        recurrence, as Huginn's loop; under torch.compile there is none (every recurrence runs,
        stopped tokens stay frozen), so the graph has no data-dependent branch."""
        stops = fires & ~self.exited if self.any_exited else fires
        compiling = torch.compiler.is_compiling()
        if not compiling and not bool(stops.any()):
            return
        self.used = self.used.masked_fill(stops, c)
        self.exited = self.exited | stops
        self.kv.exited = self.exited
        self.any_exited = True
        self.all_exited = not compiling and bool(self.exited.all())

    def _fires(self, c: int, state: torch.Tensor) -> torch.Tensor | None:
        """Update the criterion's memory with recurrence c's state; which tokens may stop now."""
        if self.criterion in ("cosine", "latent_diff"):
            prev, self.prev_state = self.prev_state.float(), state
            cur = state.float()
            if self.criterion == "cosine":
                value = (1 - F.cosine_similarity(cur, prev, dim=-1, eps=1e-12)).clamp_min(0)
            else:
                value = (cur - prev).norm(dim=-1) / cur.norm(dim=-1).clamp_min(torch.finfo(cur.dtype).tiny)
            return value < self.threshold if c >= self.minimum else None
        if self.criterion == EXIT_GATE_CRITERION:
            # predict: recurrent_block_looped.GateExit, whose CDF must see every recurrence.
            reached = self.predict(state)
            return reached if c >= self.minimum else None
        if c < self.minimum - 1:
            return None
        logp = F.log_softmax(self.predict(state).float(), dim=-1)
        vocab = logp.shape[-1]
        if self.criterion == "kl":
            # KL(p_(c-1) || p_c), Huginn's F.kl_div(log p_c, log p_(c-1), log_target=True).
            prev = torch.full_like(logp, -math.log(vocab)) if self.prev_logp is None else self.prev_logp
            value = (prev.exp() * (prev - logp)).sum(-1).clamp_min(0)
            self.prev_logp = logp
        elif self.criterion == "entropy_diff":
            entropy = -(logp.exp() * logp).sum(-1)
            prev = torch.full_like(entropy, math.log(vocab)) if self.prev_entropy is None else self.prev_entropy
            value = (entropy - prev).abs()
            self.prev_entropy = entropy
        else:  # argmax_stability: recurrences in a row with the same arg-max token
            argmax = logp.argmax(-1)
            same = argmax == self.prev_argmax if self.prev_argmax is not None else torch.zeros_like(self.exited)
            self.stable = torch.where(same, self.stable + 1, torch.zeros_like(self.stable))
            self.prev_argmax = argmax
            return self.stable >= self.threshold if c >= self.minimum else None
        return value < self.threshold if c >= self.minimum else None

    def step(self, c: int, old: tuple, new: tuple) -> tuple:
        """(h, lanes, state) after recurrence c: frozen where a token had stopped before it."""
        if self.any_exited:
            keep = self.exited[..., None]
            new = tuple(None if n is None else torch.where(keep, o, n) for o, n in zip(old, new))
        with torch.no_grad():  # exit decisions are not differentiable; no graph for them
            fires = self._fires(c, new[2])
        if fires is not None:
            self._record(c, fires)
        return new


def resolve_exit_rule(
    model: nn.Module, criterion: str | None, threshold: float | None, min_recurrences: int | None, r: int,
    head: Callable | None, cache: Cache | None, kwargs: dict,
) -> tuple[str, float, int] | None:
    """The call's adaptive-exit rule (``LoopedConfig.exit_settings``), checked against the call."""
    rule = model.config.exit_settings(criterion, threshold, min_recurrences)
    if rule is None:
        return None
    name, _, minimum = rule
    gate = getattr(model, "exit_gate", None)
    if (name == EXIT_GATE_CRITERION) != (gate is not None):
        raise ValueError(
            f"exit_criterion={name!r}: this model has no exit gate (a head built without it)" if gate is None else
            f"exit_criterion={name!r}: refused with exit_gate=True (the gate decides each token's exit; use "
            f"exit_criterion={EXIT_GATE_CRITERION!r} or exit_gate_output='threshold')"
        )  # fmt: skip
    if minimum > r:
        raise ValueError(f"min_recurrences={minimum}: exceeds num_recurrences={r}, the cap on recurrences per token")
    if name in _HEAD_CRITERIA and head is None:
        raise ValueError(
            f"exit_criterion={name!r} reads the next-token distribution, so it needs the LM head: call "
            f"LoopedForCausalLM (or pass exit_head=), or use a state criterion ('cosine', 'latent_diff')"
        )
    if model.gradient_checkpointing and model.training and torch.is_grad_enabled():
        # Checkpointed layers drop the cache argument, which carries the stopped tokens' KV, and
        # their replay in backward would see the final exit mask instead of the step's.
        raise ValueError(f"exit_criterion={name!r} cannot be used while training with gradient checkpointing")
    if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        # Recurrences no token runs record nothing, and the criterion's coda passes would record.
        raise ValueError(
            f"exit_criterion={name!r} cannot be combined with output_hidden_states / output_attentions: use "
            "output_recurrent_states=True (one frozen state per recurrence) and recurrences_used"
        )
    if cache is not None and name in _HEAD_CRITERIA and not _croppable(cache):
        raise ValueError(
            f"exit_criterion={name!r} decodes intermediate states through the coda and crops its KV back out, "
            f"so it needs a cache whose layers can be cropped (DynamicCache or StaticCache); got {type(cache).__name__}"
        )
    return rule


def coda_predictor(
    model: nn.Module, head: Callable[[torch.Tensor], torch.Tensor], coda_start: int, layer_kwargs: dict,
    num_new_tokens: int,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The distribution criteria's decoder: a state's next-token logits as the forward would make
    them had the loop stopped there (``LoopedModel.step_output``: the norms after the loop and the
    coda; Huginn's),
    then the head, leaving the cache's coda slots as they were (written, then cropped back out).
    ``model`` is the ``LoopedModel``."""
    cache = layer_kwargs.get("cache")

    def coda(x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(model.coda_layers):
            x = layer(x, cache_index=coda_start + i, **layer_kwargs)[0]
            if cache is not None:
                crop_slot(cache.layers[coda_start + i], num_new_tokens)
        return x

    return lambda state: head(model.step_output(state, coda))


# ---------------------------------------------------------------------------------------------
# The cache a call needs: one slot per layer application (or per budgeted one), filled at one r
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVSlotPlan:
    """Which KV-cache slot each layer application of one forward writes and reads.

    The one place that owns the looped cache layout, shared by ``modeling_looped`` (transformers'
    ``Cache``) and the vLLM model (one ``Attention`` per slot): prelude layer j -> slot j; block
    layer j at recurrence i (0-based) -> slot P + (i mod k)*K + j (the study's nanochat/gpt.py
    ``_get_kv_layer_idx``); coda layer j -> slot P + k*K + j. k = min(kv_budget, r), so with no
    budget every layer application owns a slot (P + r*K + C in all).
    """

    num_prelude: int
    num_recurrent: int
    num_coda: int
    num_recurrences: int
    kv_budget: int  # effective: min(k, r)

    @classmethod
    def for_call(cls, config: LoopedConfig, num_recurrences: int | None = None, kv_budget: int | None = None,
                 ) -> KVSlotPlan:  # fmt: skip
        """``config``'s layout at ``num_recurrences`` (default: r) with ``kv_budget`` (default: the
        config's; none: every recurrence keeps its slots), each checked by its config field's rule
        (every user of a layout calls this). Raises ``LoopedConfigError`` naming the value."""
        r = config.num_recurrences
        if num_recurrences is not None:
            r = check_override("num_recurrences", num_recurrences, R_RULE)
        k = config.kv_budget if kv_budget is None else check_override("kv_budget", kv_budget, KV_BUDGET_RULE)
        if k is None:
            k = r
        return cls(config.num_prelude_layers, config.num_recurrent_layers, config.num_coda_layers, r, min(k, r))

    @property
    def num_slots(self) -> int:
        return self.num_prelude + self.kv_budget * self.num_recurrent + self.num_coda

    @property
    def shares_slots(self) -> bool:
        """True when a later recurrence overwrites an earlier one's slot (kv_budget < r)."""
        return self.kv_budget < self.num_recurrences

    def prelude(self, j: int) -> int:
        return j

    def block(self, step: int, j: int) -> int:
        return self.num_prelude + (step % self.kv_budget) * self.num_recurrent + j

    def coda(self, j: int) -> int:
        return self.num_prelude + self.kv_budget * self.num_recurrent + j

    def overwritten(self, step: int) -> bool:
        """Whether a later recurrence of the same forward writes recurrence ``step``'s slots again
        (step < r - k): its KV serves its own tokens only and is cropped back out of the cache."""
        return step < self.num_recurrences - self.kv_budget

    def layer_of_slot(self, slot: int) -> int:
        """The block layer j that writes ``slot`` (a block slot: P <= slot < P + k*K)."""
        return (slot - self.num_prelude) % self.num_recurrent

    def applications(self) -> Iterator[tuple[str, int, int, int]]:
        """Every layer application in forward order: (stack, recurrence step or 0, layer j, slot)."""
        for j in range(self.num_prelude):
            yield "prelude", 0, j, self.prelude(j)
        for step in range(self.num_recurrences):
            for j in range(self.num_recurrent):
                yield "recurrent", step, j, self.block(step, j)
        for j in range(self.num_coda):
            yield "coda", 0, j, self.coda(j)



def _grow_cache(cache: Cache, num_slots: int, shrink: bool = False) -> None:
    """``generate()`` sizes its cache from ``num_hidden_layers`` (the default r); more recurrences
    per call need more slots. Dynamic caches grow; fixed-size ones must be built big enough.

    ``shrink`` (a KV budget is in force, or transformers < 5.20: ``KEEPS_UNWRITTEN_SLOTS``):
    trailing slots that were never written are dropped, so the cache has exactly the slots of this
    call's plan (P + k*K + C under a budget). A static layer allocates its
    buffers on its first write, so a dropped one never held memory."""
    if shrink and len(cache.layers) > num_slots:
        if not any(getattr(layer, "is_initialized", True) for layer in cache.layers[num_slots:]):
            del cache.layers[num_slots:]
    if len(cache.layers) >= num_slots:
        return
    if not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        raise ValueError(
            f"the cache has {len(cache.layers)} slots but this call needs {num_slots} (one per layer "
            "application); build the static cache from a config whose num_recurrences is the largest r you use"
        )
    while len(cache.layers) < num_slots:
        cache.layers.append(DynamicLayer())


def _croppable(cache: Cache) -> bool:
    """Whether every slot can take a write and then drop it again (a KV budget's overwritten
    recurrences, an exit criterion's coda passes): dynamic and static layers can, quantised ones
    cannot."""
    return all(slot_croppable(layer) for layer in cache.layers)


def _check_cache_recurrences(cache: Cache, r: int, kv_budget: int | None = None) -> None:
    """Refuse a cache filled at another r or KV budget: slot a holds application a, and which layer
    (and which recurrence) application a is depends on r, so mixing two r's attends to the wrong
    keys. ``kv_budget`` is the call's effective budget, min(k, r) (``None``: r, no budget); it
    maps recurrences to slots, so it must stay fixed for the life of a cache too.

    The r a cache was filled at is a Python attribute on the cache, so at a fixed r this is a
    constant check that ``torch.compile`` guards on, never a read of the cache's length. Only
    when r changes is the length read, so that an emptied cache (``reset()``, as ``generate``
    does before reusing its static cache) can be reused at a new r.
    """
    k = r if kv_budget is None else kv_budget
    filled_r = getattr(cache, "looped_num_recurrences", None)
    # A cache recorded before KV budgets existed was filled with one slot set per recurrence.
    filled_k = getattr(cache, "looped_kv_budget", filled_r)
    if filled_r == r and filled_k == k:
        return
    if filled_r is not None and (torch.compiler.is_compiling() or cache.get_seq_length() > 0):
        if filled_r != r:
            raise ValueError(
                f"num_recurrences={r}, but this cache was filled at num_recurrences={filled_r}: every "
                "recurrence has its own cache slot, so r must stay fixed for the life of a cache"
            )
        raise ValueError(
            f"kv_budget={k}, but this cache was filled at kv_budget={filled_k} (num_recurrences={r}): the "
            "budget maps recurrences to cache slots, so it must stay fixed for the life of a cache"
        )
    cache.looped_num_recurrences = r
    cache.looped_kv_budget = k


# ---------------------------------------------------------------------------------------------
# generate(): what a looped model adds (recurrences per token, self-speculative drafting)
# ---------------------------------------------------------------------------------------------


def prepare_cache(cache: Cache, plan: KVSlotPlan) -> None:
    """Make ``cache`` ready for a call laid out by ``plan`` (its r and effective KV budget): grow it
    (or refuse) first, so a refused call leaves the cache's recorded r unchanged; then check it
    was filled at this r and budget."""
    r, kv_budget = plan.num_recurrences, plan.kv_budget
    _grow_cache(cache, plan.num_slots, shrink=plan.shares_slots or not KEEPS_UNWRITTEN_SLOTS)
    _check_cache_recurrences(cache, r, kv_budget)
    if plan.shares_slots and not _croppable(cache):
        # An overwritten slot is written then cropped back; a cache layer that cannot crop
        # (quantised) cannot take a second write of the same positions.
        raise ValueError(
            f"kv_budget={kv_budget} < num_recurrences={r} needs a cache whose layers can be cropped "
            f"(DynamicCache or StaticCache); got {type(cache).__name__}"
        )


@cache_output_alias
@dataclass
class LoopedGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)`` with the looped extras.

    ``recurrences_used``: (batch, new tokens), with adaptive exit, the recurrences run by the
    position whose logits chose each new token. ``num_draft_tokens`` /
    ``num_accepted_draft_tokens``: with ``draft_num_recurrences``, the tokens drafted and the
    tokens of them the model at r accepted (their ratio is the acceptance rate).
    """

    recurrences_used: torch.LongTensor | None = None
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None


class RecurrenceDraftCandidateGenerator(AssistedCandidateGenerator):
    """Self-speculative decoding: the same weights at k recurrences draft, the model at r verifies.

    This is transformers' assisted decoding with the model as its own assistant, run at
    ``num_recurrences=k``: the draft proposes up to ``num_assistant_tokens`` tokens, the model at r
    scores them in one forward, greedy keeps the longest prefix it would itself have chosen (so the
    output is plain greedy at r) and sampling keeps r's distribution (speculative sampling). No
    weights are copied; the draft has its own cache, since a cache is filled at one r.
    """

    def __init__(
        self, model: GenerationMixin, draft_num_recurrences: int, generation_config: GenerationConfig, **kwargs
    ) -> None:
        super().__init__(assistant_model=model, generation_config=generation_config, **kwargs)
        self.assistant_kwargs["num_recurrences"] = draft_num_recurrences
        # The assistant's settings come from the assistant model's generation config; the assistant
        # is this model, so the call's own (num_assistant_tokens=, ... passed to generate) apply.
        self.num_assistant_tokens = generation_config.num_assistant_tokens
        self.assistant_generation_config.num_assistant_tokens_schedule = generation_config.num_assistant_tokens_schedule
        threshold = generation_config.assistant_confidence_threshold
        self.assistant_confidence_threshold = self.generation_config.assistant_confidence_threshold = threshold
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.generation_config.use_cache = self.assistant_kwargs.pop("use_cache", True)

    def _prepare_generation_args(self, input_ids: torch.LongTensor, min_new_tokens: int, max_new_tokens: int) -> dict:
        # The draft's lengths go into (a shallow copy of) its generation config rather than beside
        # it: generate() deprecates mixing the two.
        config = copy.copy(self.generation_config)
        config.min_new_tokens, config.max_new_tokens = min_new_tokens, max_new_tokens
        return {self.input_ids_key: input_ids, "generation_config": config, "logits_processor": self.logits_processor}

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        super().update_candidate_strategy(input_ids, scores, num_matches)
        self.num_draft_tokens += scores.shape[1] - 1  # scores: the candidates + the bonus position
        self.num_accepted_draft_tokens += int(num_matches)


_SELF_DRAFT_DEFAULTS = {"num_assistant_tokens": 4, "assistant_confidence_threshold": 0.0}

#: The depth settings of a generation: a keyword of ``generate()``, else a field of its generation
#: config (``model.generation_config``, a passed ``GenerationConfig``, ``generation_config.json``),
#: else the model config's (``generation_depth``).
DEPTH_SETTINGS = ("num_recurrences", "draft_num_recurrences", "kv_budget")


def saved_generation_depth(path: str | os.PathLike) -> dict[str, int]:
    """The depth settings (``DEPTH_SETTINGS``) that a ``generation_config.json`` sets, not None; ``path``:
    the file or its checkpoint folder ({} without one). Read from the JSON itself: transformers'
    ``GenerationConfig`` drops a file's own fields when it says ``"_from_model_config": true``, which
    ``save_pretrained`` writes for a generation config that started from the model's."""
    path = os.path.join(path, GENERATION_CONFIG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    return {key: saved[key] for key in DEPTH_SETTINGS if isinstance(saved, dict) and saved.get(key) is not None}


def generation_depth(config: LoopedConfig, *generation_configs: GenerationConfig | None,
                     **call: int | None) -> dict[str, int | None]:  # fmt: skip
    """The depth a generation runs at, the one rule of ``generate()``, the pipeline, ``test-time``,
    ``eval`` and serving: each of ``DEPTH_SETTINGS`` from ``call`` where it is given (not None), else
    from the first of ``generation_configs`` that sets it (a passed config before the model's), else
    the model config's: ``num_recurrences`` (resolved, an int), ``kv_budget`` (``config.kv_budget``,
    None for none), ``draft_num_recurrences`` (None: no drafting). A generation config's value that
    the model cannot run is refused in one line naming it (``generation_config.num_recurrences=0:
    ...``); the call's own values are checked where they are used, as before."""
    depth: dict[str, int | None] = {}
    for key in DEPTH_SETTINGS:
        value = call.get(key)
        for generation_config in generation_configs if value is None else ():
            value = getattr(generation_config, key, None) if generation_config is not None else None
            if value is not None:
                try:  # the model config's own rules, under the name the value came from
                    if key == "num_recurrences":
                        config.resolve_num_recurrences(value)
                    elif key == "kv_budget":
                        check_override(key, value, KV_BUDGET_RULE)
                    else:
                        check_override(key, value, R_RULE)
                except ValueError as err:
                    raise ValueError(f"generation_config.{err}") from None
                break
        depth[key] = value
    if depth["num_recurrences"] is None:
        depth["num_recurrences"] = config.resolve_num_recurrences()
    if depth["kv_budget"] is None:
        depth["kv_budget"] = config.kv_budget
    return depth


@dataclass
class _GenerationRun:
    """What one ``generate`` call collects besides tokens (calls nest: the draft calls generate)."""

    draft_num_recurrences: int | None = None
    recurrences_used: list[torch.Tensor] = field(default_factory=list)
    drafter: RecurrenceDraftCandidateGenerator | None = None


class LoopedGenerationMixin(GenerationMixin):
    """transformers' ``GenerationMixin`` with the looped model's test-time compute (see the module
    docstring) and its logit lens. ``LoopedForCausalLM`` inherits it; nothing here touches the
    architecture."""

    def logit_lens(self, recurrent_states: tuple[torch.Tensor, ...], through_coda: bool = True) -> list[torch.Tensor]:
        """Decode each intermediate recurrence state to logits (for logit-lens analysis).

        Each state is decoded as the forward decodes the last one (``LoopedModel.step_output``, the
        modules after the loop: the post-loop
        norm, the coda with ``through_coda`` (Huginn's convention), the final norm unless the loop
        already closed with it, as Ouro's does), then the head; so the lens of the last state is the
        model's own logits, for every design. ``through_coda=False`` skips only the coda. No cache
        is used; pass states from a call without one or of the whole sequence.
        """
        base = self.model

        def coda(h: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
            pe = base.rotary_emb(h, pos)
            for layer in base.coda_layers:
                h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)[0]
            return h

        use_coda = coda if through_coda and len(base.coda_layers) else None
        return [self.logits_from_hidden(base.step_output(state, use_coda)) for state in recurrent_states]

    # -----------------------------------------------------------------------------------------
    # generate(): transformers' loop, with two hooks (no second decoding loop)
    # -----------------------------------------------------------------------------------------
    def generate(self, *args, draft_num_recurrences: int | None = None, **kwargs):
        """transformers' ``generate``, plus the looped model's test-time compute.

        Model keywords go to every forward, as for any model: ``num_recurrences``, ``kv_budget``,
        ``exit_criterion`` / ``exit_threshold`` / ``min_recurrences``. With
        ``return_dict_in_generate=True`` the output is a ``LoopedGenerateOutput``, whose
        ``recurrences_used`` says how many recurrences chose each new token under adaptive exit.
        ``draft_num_recurrences=k`` decodes self-speculatively (``RecurrenceDraftCandidateGenerator``):
        the same model at k recurrences drafts ``num_assistant_tokens`` tokens per round (default 4,
        with ``assistant_confidence_threshold`` 0: no early stop), the model at r verifies them;
        greedy output is the greedy output at r. It needs batch size 1 (as
        assisted decoding), and is refused with adaptive exit or a KV budget below r, whose
        multi-token verification would not reproduce token-by-token decoding.

        The guarantee, exactly: every token a self-drafted greedy run emits is an argmax of the
        model at r given the tokens before it, computed by a verification forward of up to
        ``num_assistant_tokens + 1`` tokens instead of plain decoding's one. In fp32 the two agree
        (their logits differ by summation order, ~1e-6). In bf16 they round differently (other
        matmul shapes, a chunk's mask), so at a near-tie (the top two logits within bf16 rounding
        of each other, common with random weights, whose logits are all close) they may pick
        different tokens and the sequences continue from different prefixes. ``greedy_gaps``
        checks the guarantee on any output: each emitted token's logit is within rounding of
        the maximum.
        """
        if not CACHE_RENAMED and "cache" in kwargs:
            # transformers < 5.20's generate() takes a cache as past_key_values (interface_looped).
            if kwargs.get("past_key_values") is not None:
                raise ValueError("past_key_values and cache are the same argument (the KV cache): pass only cache")
            kwargs["past_key_values"] = kwargs.pop("cache")
        outer = self.__dict__.get("_looped_generation")
        # The depth: the keywords, else the passed generation config's fields, else the model's
        # generation config's (generation_config.json), else the model config's (generation_depth).
        # Passed on as keywords of their own (``_prepare_generation_config``): transformers'
        # GenerationConfig.update would take a keyword that names one of its fields, and the forward
        # would run at config.num_recurrences. A drafting run's own draft calls (``outer``) never draft.
        passed = args[1] if len(args) > 1 else kwargs.get("generation_config")
        call = {"num_recurrences": kwargs.get("num_recurrences"), "kv_budget": kwargs.get("kv_budget"),
                "draft_num_recurrences": draft_num_recurrences if outer is None else None}  # fmt: skip
        depth = generation_depth(self.config, passed, self.generation_config, **call)
        kwargs["num_recurrences"], kwargs["kv_budget"] = depth["num_recurrences"], depth["kv_budget"]
        from_config = draft_num_recurrences is None and outer is None and depth["draft_num_recurrences"] is not None
        if from_config and kwargs.get("assistant_model") is not None:
            from_config = False  # a drafter passed to the call wins over the configured self-drafting
        elif outer is None:
            draft_num_recurrences = depth["draft_num_recurrences"]
        run = _GenerationRun(draft_num_recurrences=draft_num_recurrences)
        if draft_num_recurrences is not None:
            try:
                self._check_draft(draft_num_recurrences, kwargs)
            except ValueError as err:
                if from_config:  # name where the value came from
                    raise ValueError(f"generation_config.{err}") from None
                raise
            kwargs["assistant_model"] = self
            # transformers' assistant defaults (20 tokens, stop below 0.4 confidence) suit a small
            # separate model; a k-recurrence draft of the model itself is cheap and usually right,
            # and 4 tokens without the confidence stop was faster in every setting of
            # benchmarks/bench_test_time.py. Used unless the call or the model's config sets them.
            defaults = {key: value for key, value in _SELF_DRAFT_DEFAULTS.items()
                        if kwargs.get(key) is None and getattr(self.generation_config, key, None) is None}  # fmt: skip
            if len(args) > 1 or kwargs.get("generation_config") is not None:
                # A GenerationConfig passed in: fill its unset fields on a copy (generate() warns
                # when one is mixed with generation keywords).
                args = list(args)
                passed = copy.copy(args[1] if len(args) > 1 else kwargs["generation_config"])
                for key, value in defaults.items():
                    if getattr(passed, key, None) is None:
                        setattr(passed, key, value)
                if len(args) > 1:
                    args[1] = passed
                else:
                    kwargs["generation_config"] = passed
            else:
                kwargs.update(defaults)
        self.__dict__["_looped_generation"] = run
        try:
            out = super().generate(*args, **kwargs)
        finally:
            self.__dict__["_looped_generation"] = outer
        if isinstance(out, GenerateDecoderOnlyOutput) and (run.recurrences_used or run.drafter is not None):
            extras = {}
            if run.recurrences_used:
                # One column per forward of the loop, so one per new token; trim any step the loop
                # ran past a stop and undid. (From inputs_embeds, sequences hold only new tokens.)
                prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
                num_new = out.sequences.shape[1] - (prompt.shape[1] if isinstance(prompt, torch.Tensor) else 0)
                extras["recurrences_used"] = torch.cat(run.recurrences_used, dim=1)[:, :num_new]
            if run.drafter is not None:
                extras["num_draft_tokens"] = run.drafter.num_draft_tokens
                extras["num_accepted_draft_tokens"] = run.drafter.num_accepted_draft_tokens
            out = LoopedGenerateOutput(**out, **extras)
        return out

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                             *args, **kwargs) -> None:  # fmt: skip
        # Hook: from_pretrained loads generation_config.json here. transformers keeps a file's own
        # fields only when it lacks "_from_model_config": true, which save_pretrained writes for a
        # generation config that started from the model's: a saved num_recurrences would be dropped.
        super().adjust_generation_fn(generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path,
                                     *args, **kwargs)  # fmt: skip
        if generation_config is not None or pretrained_model_name_or_path is None:
            return
        names = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        download = {key: kwargs[key] for key in names if kwargs.get(key) is not None}
        try:
            path = cached_file(pretrained_model_name_or_path, GENERATION_CONFIG_NAME,
                               _raise_exceptions_for_missing_entries=False, **download)  # fmt: skip
        except OSError:
            return
        for key, value in (saved_generation_depth(path) if path is not None else {}).items():
            if getattr(self.generation_config, key, None) is None:
                setattr(self.generation_config, key, value)

    def _prepare_generation_config(self, generation_config: GenerationConfig | None, **kwargs) -> tuple:
        # Hook: transformers moves every keyword that names a field of the generation config into it
        # (GenerationConfig.update), and a generation_config.json with num_recurrences makes it one:
        # the depth would never reach the forward. generate() resolved it; it goes to the model as is.
        depth = {key: kwargs.pop(key) for key in ("num_recurrences", "kv_budget") if key in kwargs}
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        model_kwargs.update({key: value for key, value in depth.items() if value is not None})
        return generation_config, model_kwargs

    def _validate_generated_length(self, generation_config: GenerationConfig, input_ids_length: int,
                                   has_default_max_length: bool) -> None:  # fmt: skip
        # Hook: generate() calls it once the final max_length (prompt + new tokens) is known, before
        # the prefill. A run past the positions goes on as Llama's does (RoPE computes any
        # position); it is said once here, since the steps pass position_ids, which forward does
        # not read back from the device. (transformers caps a default max_length at the positions.)
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        warn_past_positions(self.config, generation_config.max_length, 0)

    @torch.no_grad()
    def greedy_gaps(self, sequences: torch.Tensor, prompt_length: int, **forward_kwargs) -> torch.Tensor:
        """How far each generated token is from the greedy choice: (max logit - the token's logit)
        at every new position of ``sequences`` (batch, prompt_length + new), from one forward of
        the whole sequence without a cache (``forward_kwargs``: ``num_recurrences`` etc., as given
        to ``generate``). Plain greedy gives 0 up to rounding; so does self-drafted greedy (see
        ``generate``), which is how a bf16 run that differs from plain greedy is told apart from a
        wrong one. Shape (batch, new)."""
        if not 0 < prompt_length < sequences.shape[1]:
            raise ValueError(
                f"prompt_length={prompt_length}: must be in [1, {sequences.shape[1] - 1}] for sequences of "
                f"length {sequences.shape[1]}"
            )
        logits = self(input_ids=sequences, use_cache=False, **forward_kwargs).logits.float()
        scores = logits[:, prompt_length - 1 : -1]  # position t predicts token t + 1
        chosen = scores.gather(-1, sequences[:, prompt_length:, None]).squeeze(-1)
        return scores.max(dim=-1).values - chosen

    def _check_draft(self, k: int, kwargs: dict) -> None:
        """Refuse a ``draft_num_recurrences`` that cannot give the model's own output at r."""
        config = self.config
        r = kwargs.get("num_recurrences")
        r = config.num_recurrences if r is None else r
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= r:
            raise ValueError(f"draft_num_recurrences={k!r}: must be an integer in [1, num_recurrences={r}]")
        if kwargs.get("assistant_model") is not None:
            raise ValueError("draft_num_recurrences drafts with the model itself; do not pass assistant_model too")
        if config.is_recurrence_locked and k != r:
            raise ValueError(
                f"draft_num_recurrences={k}: a hyperconnection model runs only at its trained num_recurrences={r}"
            )
        budget = kwargs.get("kv_budget", config.kv_budget)
        if budget is not None and budget < r:
            raise ValueError(
                f"draft_num_recurrences={k} with kv_budget={budget} < num_recurrences={r}: verifying several drafted "
                "tokens in one forward lets them read each other's fresh KV, which token-by-token decoding under a KV "
                "budget does not, so the output would not be the model's own"
            )
        rule = config.exit_settings(kwargs.get("exit_criterion"), kwargs.get("exit_threshold"), kwargs.get("min_recurrences"))
        if rule is not None:
            raise ValueError(
                f"draft_num_recurrences={k} with exit_criterion={rule[0]!r}: a token's exit depends on whether it is "
                "decoded alone or verified with others, so drafting would change the output; use one or the other"
            )

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        # Hook: transformers' assisted decoding asks for its drafter here.
        run = self.__dict__.get("_looped_generation")
        if run is None or run.draft_num_recurrences is None or assistant_model is not self:
            return super()._get_candidate_generator(
                generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model=assistant_model, target_tokenizer=target_tokenizer,
                assistant_tokenizer=assistant_tokenizer,
            )
        run.drafter = RecurrenceDraftCandidateGenerator(
            self, run.draft_num_recurrences, input_ids=input_ids, generation_config=generation_config,
            model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
        )
        return run.drafter

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs: dict, is_encoder_decoder: bool = False,
                                            num_new_tokens: int = 1) -> dict:  # fmt: skip
        # Hook: called after every forward of the decoding loop; records the recurrences run by the
        # positions whose logits choose the new tokens.
        run = self.__dict__.get("_looped_generation")
        used = getattr(outputs, "recurrences_used", None)
        if run is not None and used is not None:
            run.recurrences_used.append(used[:, -num_new_tokens:])
        return super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
