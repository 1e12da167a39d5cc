"""The loop of a looped decoder: its shared block run r times, for one forward.

``LoopedModel.forward`` (``modeling_looped.py``) runs embed -> prelude -> this -> coda -> norm;
``LoopedRecurrentBlock`` does the middle and only that: h_0 = init(e), r recurrences of
h = block(inject(h, e)) [-> recurrence norm] (or the hyperconnection lanes' read / write), with
truncated backprop (the first r - k recurrences under ``no_grad``: the study's detach of the
state), per-token adaptive exit, and the states after every recurrence. Which cache
slot each block layer application writes is the call's ``KVSlotPlan`` (``KVSlotPlan.for_call``),
the one layout generation and the vLLM model share.

The loop's modules live here too: ``build_loop_modules`` (injection, hyperconnection lanes, norms,
exit gate: the one builder of ``LoopedModel`` and the vLLM model), ``loop_norms`` / ``after_loop``
(the one rule for what runs after the loop: the forward, the logit lens, the exit criteria and
the vLLM model decode a state through it) and the exit gate's distribution and threshold readout.

Shipped beside ``modeling_looped.py`` in every checkpoint (remote code follows the relative
import), so it imports only torch, transformers and the looped modules it names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .configuration_looped import LoopedConfig
from .generation_looped import KVSlotPlan, _AdaptiveExit, _ExitKV
from .interface_looped import crop_slot
from .loop_attention_looped import loop_attention_kv
from .parcae_looped import (
    DiagonalInjection,
    diagonal_injection,
    like_init_initial_state,
    post_loop_projection,
)


class LoopedHyperConnection(nn.Module):
    """Hyperconnections at loop boundaries (the study's probe; Zhu et al. 2024 applied per layer).

    ``N`` lanes H, all starting as the prelude output e. At step i the block reads
    x = sum_j alpha[i, j] H_j and the lanes update as H <- M[i] H + beta[i] norm(block(x)), norm
    being the recurrence norm applied to the block's output, none on the lanes (the study's
    nanochat/gpt.py ``_hyperconnect_step``). Cyclic init (alpha_i = e_(i mod N), M = I, beta = 1)
    breaks the lane symmetry. The lanes are summed before the coda. Parameters are per step, so
    the model runs only at its trained r. (looped_format 1 wrote the residual delta block(x) - x
    and normed the lanes.)
    """

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        r, n = config.num_recurrences, config.num_hyperconnection_lanes
        self.num_lanes = n
        self.alpha = nn.Parameter(torch.empty(r, n))
        self.mixing = nn.Parameter(torch.empty(r, n, n))
        self.beta = nn.Parameter(torch.empty(r, n))

    def reset_parameters(self) -> None:
        r, n = self.alpha.shape
        alpha = torch.zeros(r, n)
        alpha[torch.arange(r), torch.arange(r) % n] = 1.0
        init.copy_(self.alpha, alpha)
        init.copy_(self.mixing, torch.eye(n).expand(r, n, n))
        init.ones_(self.beta)

    def read(self, lanes: torch.Tensor, step: int) -> torch.Tensor:
        return torch.einsum("n,n...->...", self.alpha[step].to(lanes.dtype), lanes)

    def write(self, lanes: torch.Tensor, step: int, update: torch.Tensor) -> torch.Tensor:
        """H <- M[step] H + beta[step] * update (one gain per lane)."""
        mixed = torch.einsum("mn,n...->m...", self.mixing[step].to(lanes.dtype), lanes)
        gain = self.beta[step].to(lanes.dtype).view(-1, *([1] * update.dim()))
        return mixed + gain * update.unsqueeze(0)


def exit_gate_step(gate: nn.Module, state: torch.Tensor, remaining: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One recurrence of Ouro's exit distribution: (p_t, the chance to get past step t), float32,
    from the state s_t and the chance ``remaining`` to have reached t (``None`` at t = 0: 1).
    lambda_t = sigmoid(gate(s_t)), p_t = lambda_t * remaining. The one owner of the gate's
    per-step rule: ``exit_gate_probabilities`` runs it over a forward's states, ``GateExit`` as
    the loop goes."""
    stop = torch.sigmoid(gate(state).squeeze(-1).float())
    if remaining is None:
        return stop, 1.0 - stop
    return stop * remaining, remaining * (1.0 - stop)


def exit_gate_probabilities(gate: nn.Module, states: list[torch.Tensor]) -> torch.Tensor:
    """Ouro's exit distribution over the r recurrences, (batch, tokens, r), in float32 (a bf16
    product of r survival terms would lose the small exit probabilities).

    ``gate`` is ``LoopedModel.exit_gate``, Linear(hidden -> 1, with bias), read on each
    recurrence's state s_t (after the recurrence norm): lambda_t = sigmoid(gate(s_t)) is the chance
    of stopping at step t having reached it, so p_t = lambda_t * prod_(j<t) (1 - lambda_j), the
    last step taking what is left (p sums to 1 whatever the last gate says). A plain function of
    the module, not a method of a subclass, so a LoRA-wrapped gate still runs its own forward."""
    remaining = None
    probabilities = []
    for t, state in enumerate(states):
        if t == len(states) - 1:
            probabilities.append(remaining if remaining is not None else torch.ones_like(state[..., 0], dtype=torch.float32))
            break
        p, remaining = exit_gate_step(gate, state, remaining)
        probabilities.append(p)
    return torch.stack(probabilities, dim=-1)


def threshold_reached(probabilities: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """Per token and step, whether the exit CDF (the running sum of ``probabilities``, (..., steps))
    has reached ``threshold`` by that step: Ouro's threshold exit, the one owner of its CDF rule."""
    return probabilities.cumsum(dim=-1) >= threshold


def threshold_exit_steps(probabilities: torch.Tensor, threshold: float | torch.Tensor) -> torch.LongTensor:
    """Per token, the 0-based step at which the exit CDF first reaches ``threshold`` (Ouro's
    threshold exit); the last step where it never does (the CDF rounds to just under 1). A tensor
    ``threshold`` of shape (..., tokens, 1) gives each token its own (the vLLM model's per-request
    thresholds)."""
    reached = threshold_reached(probabilities, threshold)
    first = reached.to(torch.uint8).argmax(dim=-1)  # argmax returns the first maximum
    return torch.where(reached.any(dim=-1), first, probabilities.shape[-1] - 1)


class GateExit:
    """The exit gate as an adaptive-exit criterion (``exit_criterion="gate"``): called with each
    recurrence's state, in order, it says which tokens' exit CDF has reached ``threshold`` by now,
    so ``_AdaptiveExit`` stops them at the step the threshold readout picks (same gate step, same
    CDF rule; ``threshold``: one number, or one per token as ``threshold_exit_steps``'). The steps'
    probabilities are kept (r - 1 small tensors) so the CDF is the readout's
    own running sum, not a second one rounding differently."""

    def __init__(self, gate: nn.Module, threshold: float | torch.Tensor) -> None:
        self.gate, self.threshold = gate, threshold
        self.remaining: torch.Tensor | None = None
        self.probabilities: list[torch.Tensor] = []

    def __call__(self, state: torch.Tensor) -> torch.Tensor:
        p, self.remaining = exit_gate_step(self.gate, state, self.remaining)
        self.probabilities.append(p)
        return threshold_reached(torch.stack(self.probabilities, dim=-1), self.threshold)[..., -1]


def threshold_readout(values: list[torch.Tensor], probabilities: torch.Tensor, threshold: float | torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.LongTensor]:  # fmt: skip
    """Ouro's threshold exit, per token: (the value at each token's exit step, that 0-based step).
    ``values`` holds one tensor per recurrence (states or logits; (..., tokens, width)), and
    ``probabilities`` the exit distribution (..., tokens, r); the step is ``threshold_exit_steps``'
    (``threshold``: one number, or one per token).
    The one readout of ``LoopedForCausalLM`` and the vLLM model."""
    steps = threshold_exit_steps(probabilities, threshold)
    stacked = torch.stack(values, dim=-2)
    index = steps[..., None, None].expand(*steps.shape, 1, stacked.shape[-1])
    return stacked.gather(-2, index).squeeze(-2), steps


def zeros_state(config: LoopedConfig, e: torch.Tensor) -> torch.Tensor:
    """``state_init="zeros"``: h_0 = 0."""
    return torch.zeros_like(e)


def prelude_state(config: LoopedConfig, e: torch.Tensor) -> torch.Tensor:
    """``state_init="prelude"``: h_0 = e, the prelude's output (the embedding without a prelude)."""
    return e


def noise_state(config: LoopedConfig, e: torch.Tensor) -> torch.Tensor:
    """``state_init="noise"``: h_0 ~ N(0, state_init_std), from the global RNG, which
    Trainer/set_seed seed."""
    return torch.randn_like(e) * config.state_init_std


#: erf(3 / sqrt 2) = 2 Phi(3) - 1: the truncated normal's cut at +-3 std, on erfinv's scale.
_ERF_CUT = math.erf(3 / math.sqrt(2))


def truncated_normal_state(config: LoopedConfig, e: torch.Tensor) -> torch.Tensor:
    """``state_init="truncated_normal"``, Huginn's initialize_state: N(0, std) truncated at +-3 std,
    times the embedding scale. std 0 is its deterministic zero state (init_scale=0), without drawing.

    Drawn by the inverse CDF, x = std sqrt(2) erfinv(u) with u uniform on (-erf(3/sqrt 2), erf(3/sqrt 2)),
    i.e. Phi^-1 of a uniform on (Phi(-3), Phi(3)): the same distribution as ``torch.nn.init.trunc_normal_``
    with one draw per element. torch's own draws by rejection (``if not mask.any()``), a data-dependent
    branch that ``torch.compile(fullgraph=True)`` cannot trace. In float32 whatever e's dtype (erfinv
    near the cut needs the digits); the clamp only catches rounding at the ends."""
    std = config.state_init_std
    if std == 0:
        return torch.zeros_like(e)
    u = (2 * torch.rand_like(e, dtype=torch.float32) - 1) * _ERF_CUT
    h = (torch.erfinv(u) * (std * math.sqrt(2))).clamp(-3 * std, 3 * std).to(e.dtype)
    multiplier = config.embedding_multiplier
    return h * multiplier if multiplier != 1.0 else h


#: ``LoopedConfig.state_init`` -> h_0 = f(config, e), picked once when the model is built.
INITIAL_STATES: dict[str, Callable[[LoopedConfig, torch.Tensor], torch.Tensor]] = {
    "zeros": zeros_state,
    "prelude": prelude_state,
    "noise": noise_state,
    "truncated_normal": truncated_normal_state,
    "like_init": like_init_initial_state,  # Parcae's (parcae_looped.py)
}


def linear_injection(block: LoopedRecurrentBlock, h: torch.Tensor, e: torch.Tensor,
                     split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """``input_injection="linear"``: u = W [e; h] (0.1.0's [h; e]), as W_e e + W_h h where the block
    split W (``LoopedRecurrentBlock.injection_split``)."""
    if split is not None:
        e_part, w_h = split
        return e_part + F.linear(h, w_h)
    return block.injection(torch.cat([h, e] if block.legacy else [e, h], dim=-1))


def additive_injection(block: LoopedRecurrentBlock, h: torch.Tensor, e: torch.Tensor,
                       split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """``input_injection="add"``: u = h + e."""
    return h + e


def no_injection(block: LoopedRecurrentBlock, h: torch.Tensor, e: torch.Tensor,
                 split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """``input_injection="none"`` (and ``"hyperconnection"``, whose lanes read e instead): u = h."""
    return h


#: ``LoopedConfig.input_injection`` -> u = f(block, h, e, split), picked once when the model is built.
INJECTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "linear": linear_injection,
    "add": additive_injection,
    "none": no_injection,
    "hyperconnection": no_injection,
    "diagonal": diagonal_injection,  # Parcae's (parcae_looped.py)
}


def build_loop_modules(
    model: nn.Module, config: LoopedConfig, norm: Callable[[], nn.Module], exit_gate: bool = True
) -> None:
    """Build the loop's modules on ``model`` under the names every checkpoint has: the linear
    injection adapter (``injection``), the hyperconnection lanes (``hyperconnection``), the
    recurrence and post-loop norms of their own, the final norm (``norm``) and Ouro's exit gate
    (``exit_gate``), each ``None`` where the config has none, and the loop's rules without parameters,
    h_0 (``initial_state_rule``, from ``INITIAL_STATES``) and u (``injection_rule``, ``INJECTIONS``). The one builder of ``LoopedModel``
    and the vLLM model: ``norm()`` makes an RMSNorm of width ``hidden_size`` (each its own
    kernel); ``exit_gate=False`` leaves a gated config's gate out (a head that never reads it). A
    norm whose weight is the final norm's (``"final"``) is no module of its own: one
    tensor, one checkpoint key (``model.norm.weight``); ``loop_norms`` hands out ``norm`` there."""
    d = config.hidden_size
    # A plain nn.Linear(2d -> d), so LoRA and tensor parallelism see it like any projection; its
    # weight keeps 0.1.0's key (``model.injection.weight``).
    model.injection = None
    if config.input_injection == "linear":
        model.injection = nn.Linear(2 * d, d, bias=False)
        model.injection.looped_study_init = "injection"  # [I | 0] at init, LoopedPreTrainedModel._init_weights
    elif config.input_injection == "diagonal":
        model.injection = DiagonalInjection(config)  # Parcae's (parcae_looped.py)
    model.hyperconnection = LoopedHyperConnection(config) if config.input_injection == "hyperconnection" else None
    own = config.recurrence_norm and config.recurrence_norm_weight == "own"
    model.recurrence_norm = norm() if own else None
    model.post_loop_norm = norm() if config.post_loop_norm == "own" else None
    model.norm = norm()
    # Ouro's exit gate (LoopedConfig.exit_gate): one logit per token on each recurrence's state.
    model.exit_gate = nn.Linear(d, 1, bias=True) if config.exit_gate and exit_gate else None
    # The rules without parameters, picked here once so the loop runs no string branch: plain
    # functions of the config (not closures over it), so a deep copy runs its own config.
    model.initial_state_rule = INITIAL_STATES[config.state_init]
    model.injection_rule = INJECTIONS[config.input_injection]


class LoopNorms(NamedTuple):
    """The model-level norms around the loop, each ``None`` where the config has none."""

    recurrence: nn.Module | None  # at the end of every recurrence
    post_loop: nn.Module | None  # once, after the loop, before the coda
    final: nn.Module | None  # after the coda, before the head


def loop_norms(model: nn.Module) -> LoopNorms:
    """The one rule for which norms run around the loop, read by name from ``model`` (``LoopedModel``
    or the vLLM model: ``config``, ``recurrence_norm``, ``post_loop_norm``, ``norm``).

    A norm whose weight is the final norm's (``recurrence_norm_weight`` / ``post_loop_norm``
    ``"final"``) is the final norm module itself. When the recurrence norm is the final norm and
    there is no coda, the loop's last norm already is the final norm, so none runs after the coda
    (Ouro: its ``model.norm`` closes every loop and the last loop's state feeds the head)."""
    config = model.config
    recurrence = model.recurrence_norm
    if config.recurrence_norm and config.recurrence_norm_weight == "final":
        recurrence = model.norm
    post_loop = model.norm if config.post_loop_norm == "final" else model.post_loop_norm
    final = None if recurrence is model.norm and config.num_coda_layers == 0 else model.norm
    return LoopNorms(recurrence, post_loop, final)


def after_loop(
    model: nn.Module, state: torch.Tensor, coda: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """What the model makes of a loop state before its head: [post-loop norm] -> ``coda`` -> [final
    norm] (``loop_norms``). The forward, the adaptive-exit criteria, the exit gate's per-step
    readouts, the logit lens and the vLLM model all decode a state through this one function;
    ``coda`` runs the coda layers as the caller's cache needs (``None``: no coda pass)."""
    _, post_loop, final = loop_norms(model)
    state = post_loop_projection(model, state)  # Parcae's C, where the model has one
    if post_loop is not None:
        state = post_loop(state)
    if coda is not None:
        state = coda(state)
    return final(state) if final is not None else state


class LoopedRecurrentBlock:
    """The shared block run r times on the prelude output e, for one forward (see the module
    docstring); ``__call__`` returns the state the coda reads.

    Not an ``nn.Module``: it owns no parameters. The layers, the injection adapter, the
    hyperconnection gains and the recurrence norm stay on ``LoopedModel`` under the names every
    checkpoint has (``model.recurrent_layers.*``, ``model.injection.weight``, ...); this object
    runs them. ``model`` is that ``LoopedModel`` (its modules are read by name).
    """

    def __init__(self, model: nn.Module, plan: KVSlotPlan, layer_kwargs: dict, num_new_tokens: int) -> None:
        self.config = model.config
        self.layers = model.recurrent_layers
        self.injection = model.injection
        self.hyperconnection = model.hyperconnection
        # Own, or the final norm itself (Ouro's one weight): ``loop_norms``, which reads the modules
        # by name, as everything here, so the vLLM model (its own ``norm``) runs this loop too.
        self.recurrence_norm = loop_norms(model).recurrence
        self.plan = plan
        self.layer_kwargs = layer_kwargs
        self.cache = layer_kwargs.get("cache")
        self.num_new_tokens = num_new_tokens
        self.legacy = self.config.looped_format == 1
        # A per-loop LoRA model's deltas (``loop_lora_looped.LoopLoRA``: ``steps[t][j]``), else None.
        self.loop_lora = getattr(model, "loop_lora", None)
        # Gated global + local loop attention (loop_attention_looped.py): None without the option.
        self.loop_attention = loop_attention_kv(model, plan)
        # The rules without parameters, chosen once by ``build_loop_modules`` (no string branch here).
        self.initial_state_rule, self.injection_rule = model.initial_state_rule, model.injection_rule

    def initial_state(self, e: torch.Tensor) -> torch.Tensor:
        """h_0 from the prelude output e: the config's ``state_init``, chosen when the model was
        built (``INITIAL_STATES``)."""
        return self.initial_state_rule(self.config, e)

    def injection_split(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W_e e, W_h) for the linear injection u = W [e; h] = W_e e + W_h h, or ``None``.

        e is the same at every recurrence, so W_e e is computed once per forward instead of a
        concat and a d x 2d matmul per recurrence (r + 1 d x d matmuls instead of 2r, forward and
        backward). Only for a plain ``nn.Linear``: a wrapped adapter (LoRA, quantisation, FSDP)
        must see its own forward called, and gets ``self.injection(cat)`` instead. Not for
        looped_format 1 (0.1.0) checkpoints either: their logits are pinned to 1e-6, and the split's
        two matmuls round differently from the one concatenated matmul they were saved with.
        """
        injection = self.injection  # None without a linear injection: no split
        if self.legacy or type(injection) is not nn.Linear or injection.bias is not None:
            return None
        d = self.config.hidden_size
        # The study's order is [e; h]: W = [I | 0] reads e.
        return F.linear(e, injection.weight[:, :d]), injection.weight[:, d:]

    def inject(self, h: torch.Tensor, e: torch.Tensor, split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The block's input u from the state h and the prelude output e: the config's
        ``input_injection``, chosen when the model was built (``INJECTIONS``)."""
        return self.injection_rule(self, h, e, split)

    def loop_deltas(self, step: int, j: int) -> nn.ModuleDict | None:
        """Loop ``step``'s deltas of block layer j (a per-loop LoRA model), else None: handed to the
        layer as an argument of its application, so the step is part of what activation
        checkpointing replays (the HF and the vLLM model alike)."""
        return self.loop_lora.steps[step][j] if self.loop_lora is not None else None

    def block_layer(self, layer: nn.Module, x: torch.Tensor, step: int, j: int) -> torch.Tensor:
        """Block layer j at recurrence ``step``, in its planned slot, with loop ``step``'s deltas
        (``loop_deltas``). The study writes a slot at every recurrence, so the slot ends up holding
        its last writer's KV, while each writer's own tokens attend to their fresh KV. Same here: an
        overwritten writer writes, attends, then crops its tokens back out."""
        slot = self.plan.block(step, j)
        kwargs = self.layer_kwargs
        if self.loop_attention is not None:
            kwargs = {**kwargs, "loop_attention": self.loop_attention.at(step, j)}
        deltas = self.loop_deltas(step, j)
        if deltas is not None:
            kwargs = {**kwargs, "loop_deltas": deltas}
        x = layer(x, cache_index=slot, **kwargs)[0]
        if self.cache is not None and self.plan.overwritten(step):
            crop_slot(self.cache.layers[slot], self.num_new_tokens)
        return x

    def recurrence(self, step: int, h: torch.Tensor, lanes: torch.Tensor | None, e: torch.Tensor,
                   split: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:  # fmt: skip
        """One pass through the block; returns (h, lanes)."""
        hc, norm = self.hyperconnection, self.recurrence_norm
        if hc is not None:
            x = hc.read(lanes, step)
            y = x
            for j, layer in enumerate(self.layers):
                y = self.block_layer(layer, y, step, j)
            if self.legacy:
                lanes = hc.write(lanes, step, y - x)
                if norm is not None:
                    lanes = norm(lanes)
            else:
                lanes = hc.write(lanes, step, norm(y) if norm is not None else y)
            return h, lanes
        h = self.inject(h, e, split)
        for j, layer in enumerate(self.layers):
            h = self.block_layer(layer, h, step, j)
        if norm is not None:
            h = norm(h)
        return h, lanes

    # The loop's driver: ``begin``, then ``recurrence`` once per step, then ``state_of``. ``__call__``
    # runs it for one r; the vLLM model's mixed-depth loop (``run_mixed``) runs the same three over
    # groups of requests, owning only the grouping.
    def begin(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """What every loop starts from: h_0 (``initial_state``), the hyperconnection lanes (each h_0,
        or None) and the linear injection's split (``injection_split``, or None)."""
        h = self.initial_state(e)
        hc = self.hyperconnection
        lanes = h.unsqueeze(0).expand(hc.num_lanes, *h.shape) if hc is not None else None
        return h, lanes, self.injection_split(e)

    @staticmethod
    def state_of(h: torch.Tensor, lanes: torch.Tensor | None) -> torch.Tensor:
        """The loop's state as a reader sees it (exit criteria, recurrent states, the coda): h, or
        the lanes' sum under hyperconnections."""
        return lanes.sum(0) if lanes is not None else h

    def __call__(
        self, e: torch.Tensor, exit_rule: tuple[str, float, int] | None,
        predict: Callable[[torch.Tensor], torch.Tensor] | None, output_recurrent_states: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.LongTensor | None]:
        """(the state the coda reads, the states after every recurrence if asked, the recurrences
        each token ran under adaptive exit)."""
        r = self.plan.num_recurrences
        h, lanes, split = self.begin(e)
        # Truncated backprop: without truncation no grad-mode switch is entered at all.
        k = self.config.backprop_recurrences
        no_grad_steps = r - k if k is not None and k < r and torch.is_grad_enabled() else 0
        recurrent_states: list[torch.Tensor] = []
        state = None  # the state after the last recurrence run; exit's criterion starts from h_0
        exit_ = None
        keep_states = exit_rule is not None or output_recurrent_states
        if exit_rule is not None and self.loop_attention is not None:
            raise ValueError(f"exit_criterion={exit_rule[0]!r}: refused with loop_attention (recurrences >= 2 read "
                             "recurrence 1's KV of every token)")  # fmt: skip
        if exit_rule is not None:
            # Adaptive exit gives the block its own view of the cache (stopped tokens' latest KV).
            exit_kv = _ExitKV(self.cache, self.plan)
            self.layer_kwargs = {**self.layer_kwargs, "cache": exit_kv}
            state = self.state_of(h, lanes)
            exit_ = _AdaptiveExit(exit_rule, r, state, exit_kv, predict)
        for step in range(r):
            if exit_ is not None and exit_.all_exited:
                # Every token has stopped: nothing runs; later tokens will read the latest KV.
                if not self.plan.overwritten(step):
                    exit_kv.refill_recurrence(step)
            else:
                old = (h, lanes, state)
                if step < no_grad_steps:
                    with torch.no_grad():
                        h, lanes = self.recurrence(step, h, lanes, e, split)
                else:
                    h, lanes = self.recurrence(step, h, lanes, e, split)
                if keep_states:
                    # The state after this recurrence (the lanes' sum under hyperconnections):
                    # formed only when exit or the caller reads it.
                    state = self.state_of(h, lanes)
                if exit_ is not None:
                    h, lanes, state = exit_.step(step + 1, old, (h, lanes, state))
            if output_recurrent_states:
                recurrent_states.append(state)
        return self.state_of(h, lanes), recurrent_states, exit_.used if exit_ is not None else None


__all__ = [
    "INITIAL_STATES",
    "INJECTIONS",
    "GateExit",
    "LoopNorms",
    "LoopedHyperConnection",
    "LoopedRecurrentBlock",
    "after_loop",
    "build_loop_modules",
    "exit_gate_probabilities",
    "exit_gate_step",
    "loop_norms",
    "threshold_exit_steps",
    "threshold_reached",
    "threshold_readout",
]
