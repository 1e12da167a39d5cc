"""Parameter and FLOP accounting of a looped model: the one place that counts them.

Training (``LoopedComputeCallback``), planning (``looped_hf.planner``), sweeps and model cards
all ask this module; ``LoopedForCausalLM.num_scaling_params`` / ``training_flops_per_token`` /
``inference_flops_per_token`` are thin methods over it for users. The counts follow the study
(kschwethelm/looped-lm-scaling, nanochat/gpt.py ``num_scaling_params``, ``effective_params`` and
``estimate_flops``): see docs/conventions.md for the derivation and the checks against it.

Shipped beside ``modeling_looped.py`` in every checkpoint (the model's methods import it), so it
imports only torch. The functions read the model's modules by name (``model.model.prelude_layers``
...), never its classes, so they work the same on a model loaded as remote code.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def parameter_groups(base: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters of a ``LoopedModel`` (the trunk) in the study's groups.

    ``recurrent`` (N_rec): the block and the injection adapter or hyperconnection gains.
    ``once`` (N_once): prelude + coda + the model-level norm scales, the recurrence norm INCLUDED
    although it runs r times (the study counts all three norm scales as run-once "scalars"), and
    the post-loop norm's when it has its own (a norm that shares the final norm's weight adds no
    parameter). Norms inside the layers (sandwich, output norms, QK-norm scales) and the q/k
    biases count with their layer: N_once in the prelude and coda, N_rec in the block.
    ``embedding``: the token embedding, apart (a lookup: no FLOPs), and Parcae's value-embedding tables.
    Ouro's exit gate (``exit_gate``), a d -> 1 matmul on every recurrence's state, is ``recurrent``:
    it runs r times per token, as the block does (unlike the norm scales, it is a matmul).
    """
    once = [*base.prelude_layers.parameters(), *base.coda_layers.parameters(), *base.norm.parameters()]
    # getattr: a model built by an older modeling file (remote code) has no post_loop_norm.
    # Parcae's prelude norm and C (a d x d matmul after the loop) run once (parcae_looped.py).
    for module in (base.embedding_norm, base.recurrence_norm, getattr(base, "post_loop_norm", None),
                   getattr(base, "prelude_norm", None), getattr(base, "post_loop_projection", None)):  # fmt: skip
        if module is not None:
            once += list(module.parameters())
    recurrent = list(base.recurrent_layers.parameters())
    # IQuest's loop-attention gates (``gate_projections``, loop_attention_looped.py) run at every
    # recurrence after the first: with the block, as the exit gate.
    loop_gates = getattr(base, "gate_projections", None)
    for module in (base.injection, base.hyperconnection, getattr(base, "exit_gate", None), loop_gates):
        if module is not None:
            recurrent += list(module.parameters())
    embedding = list(base.embed_tokens.parameters())
    # Parcae's value-embedding tables are lookups too (no FLOPs); their gates count with their layer.
    if getattr(base, "value_embeddings", None) is not None:
        embedding += list(base.value_embeddings.parameters())
    return {"once": once, "recurrent": recurrent, "embedding": embedding}


def num_scaling_params(model: nn.Module) -> dict[str, int]:
    """Parameters of a ``LoopedForCausalLM`` in the study's groups; the parts sum to the real count.

    ``once``, ``recurrent`` and ``embedding`` as ``parameter_groups``; ``lm_head`` apart (a tied
    head counts 0 here: its weights are the embedding's); ``loop_lora`` for a retrofit's per-loop
    LoRA; ``total``. The scaling law's N_once and N_rec are ``once`` and ``recurrent``. Raises
    ``RuntimeError`` if a parameter belongs to no group (a module added to the model without a place
    in the accounting).
    """
    base = model.model
    groups = {name: sum(p.numel() for p in params) for name, params in parameter_groups(base).items()}
    tied = model.lm_head.weight is base.embed_tokens.weight
    groups["lm_head"] = 0 if tied else model.lm_head.weight.numel()
    # A retrofit's per-loop LoRA (loop_lora_looped.py, the trunk's ``loop_lora``): loop t runs only
    # its own deltas, so they are neither run-once nor run r times: a group apart.
    lora = getattr(base, "loop_lora", None)
    if lora is not None:
        groups["loop_lora"] = sum(p.numel() for p in lora.parameters())
    groups["total"] = sum(groups.values())
    # Unique tensors only, so a shared or tied weight is never counted twice.
    real = sum(p.numel() for p in model.parameters())
    if groups["total"] != real:
        raise RuntimeError(f"parameter groups sum to {groups['total']} but the model has {real}")
    return groups


def head_passes(config: Any, num_recurrences: int, training: bool) -> int:
    """LM-head matmuls per token: one, or r when the exit gate reads every recurrence's logits
    (``exit_gate_output="weighted"``, or Ouro's loss ``exit_gate_entropy_beta`` in training). The
    threshold readout gathers each token's exit state first: one pass."""
    if not getattr(config, "exit_gate", False):
        return 1
    every_step = config.exit_gate_output == "weighted" or (
        training and config.exit_gate_entropy_beta is not None
    )
    return num_recurrences if every_step else 1


def _flops_terms(
    model: nn.Module, seq_len: int, num_recurrences: int | None, training: bool = False
) -> tuple[int, int, int, int, int]:
    """(r, r_grad, N_once + N_head, N_rec per recurrence, h * q): the terms both FLOP counts use;
    N_head counts every head pass (``head_passes``)."""
    config = model.config
    r = config.num_recurrences if num_recurrences is None else int(num_recurrences)
    if r < 1 or seq_len < 1:
        raise ValueError(f"num_recurrences={r}, seq_len={seq_len}: both must be >= 1")
    k = config.backprop_recurrences
    r_grad = r if k is None else min(k, r)
    params = num_scaling_params(model)
    # The head's matmul costs V*d per token whether or not its weights are tied; V counts the
    # padded rows (they are computed, then cropped), as the study's estimate_flops does.
    n_head = config.padded_vocab_size * config.hidden_size * head_passes(config, r, training)
    n_rec = params["recurrent"]
    lora = getattr(model.model, "loop_lora", None)
    if lora is not None:
        # Each recurrence also runs its own LoRA matrices: 2 * rank * (in + out) per token and
        # projection forward, the same for every loop, so one loop's matrices join N_rec. Its norm
        # and bias deltas are elementwise (left out, as the norms are).
        n_rec += sum(p.numel() for p in lora.steps[0].parameters() if p.ndim == 2)
    base = model.model
    hc = base.hyperconnection
    if hc is not None:
        # Lane mixing is no weight matmul: per step and token it reads N lanes, mixes N x N and
        # writes N gains, all of width d. The study (gpt.py estimate_flops) counts it as
        # (N^2 + 2N) d "equivalent params" per recurrence in place of the r (N^2 + 2N) scalars.
        n = hc.num_lanes
        n_rec += (n * n + 2 * n) * config.hidden_size - sum(p.numel() for p in hc.parameters())
    # The model-level norm scales (after the embedding, after each recurrence, after the loop,
    # before the head) are elementwise, not matmuls: the study's estimate_flops leaves them out; so
    # do we (and the embedding multiplier, elementwise too).
    norms = (base.embedding_norm, base.recurrence_norm, getattr(base, "post_loop_norm", None), base.norm)
    scalars = sum(p.numel() for m in norms if m is not None for p in m.parameters())
    # The exit gate reads every recurrence but the last (the last step takes the remainder of the
    # exit distribution whatever its gate says: recurrent_block_looped.exit_gate_probabilities), so it
    # runs r - 1 times, not r as N_rec does. The step it skips is the last, which always carries
    # gradient, so taking its parameters off the once-per-token term (6x in training, 2x in
    # inference) is exact. A FlopCounterMode check is in tests/test_probes.py.
    gate = getattr(base, "exit_gate", None)
    skipped = sum(p.numel() for p in gate.parameters()) if gate is not None else 0
    n_once_head = params["once"] - scalars - skipped + n_head
    return r, r_grad, n_once_head, n_rec, config.num_attention_heads * config.head_dim


def training_flops_per_token(model: nn.Module, seq_len: int, num_recurrences: int | None = None) -> float:
    """Training FLOPs per token (the study's count; PaLM's MFU formula for a looped model).

    A matmul with N weights costs 2N FLOPs per token forward and 4N backward (grads of the
    input and of the weights): 6N per token for a parameter used once with gradient. So:

        6 * (N_once + N_head)                          prelude, coda (their layer norms too, as
                                                       the study), lm_head (r times for an exit
                                                       gate's per-step loss or weighted
                                                       readout); not the model-level norm
                                                       scales (elementwise)
      + (6 * r_grad + 2 * r_nograd) * N_rec            the block + injection (hyperconnections:
                                                       (N^2 + 2N) d per step, as the study) + exit
                                                       gate (r - 1 times: it skips the last step);
                                                       with truncated backprop only
                                                       the last k = r_grad steps train; the
                                                       first r - k run forward only (2x)
      + 12 * h * q * T * (P + C + r_grad * K)          attention scores + weighted sum: 2*2*h*q*T
      +  4 * h * q * T * (r_nograd * K)                forward per application, x3 with grad
      + the loop attention's local read                (IQuest: `_local_read_flops`)

    with T the full sequence length (no causal halving, as in PaLM and the study), h heads of
    size q. The embedding lookup is free. Norm and elementwise FLOPs are ignored (O(d)).

    A model with frozen parameters (``requires_grad=False``: ``freeze_backbone``, peft LoRA) is
    counted by what its backward runs (`_frozen_training_flops`): 2N forward for every weight,
    2N for the gradient of its input only where a trainable parameter lies upstream of it, 2N for
    its own gradient only if it trains. With every parameter trainable both counts agree.
    """
    config = model.config
    r, r_grad, n_once_head, n_rec, hq = _flops_terms(model, seq_len, num_recurrences, training=True)
    if _counts_frozen(model):
        local = _local_read_flops(config, seq_len, r, r_grad, hq)
        return _frozen_training_flops(model, seq_len, r, r - r_grad, hq) + local
    r_nograd = r - r_grad
    K = config.num_recurrent_layers
    apps_grad = config.num_prelude_layers + config.num_coda_layers + r_grad * K
    apps_nograd = r_nograd * K
    dense = 6 * n_once_head + (6 * r_grad + 2 * r_nograd) * n_rec
    attention = 12 * hq * seq_len * apps_grad + 4 * hq * seq_len * apps_nograd
    return float(dense + attention + _local_read_flops(config, seq_len, r, r_grad, hq))


def _local_read_flops(config: Any, seq_len: int, r: int, r_grad: int, hq: int) -> int:
    """IQuest's loop attention (``loop_attention``): every recurrence after the first also reads
    its own K/V over the last ``loop_window_size`` positions (the local read, beside the global
    read counted at full T above): 4 h q W forward per block layer application, x3 with grad,
    W = min(window, T) as a windowed kernel reads it (vLLM's sliding window), not the masked full
    T of the eager reference path. Truncated backprop trains the last ``r_grad`` recurrences,
    so the untrained ones are first the first recurrence (no local read), then later ones. The
    frozen-parameter count adds the same term (its block input taken as needing gradient)."""
    if getattr(config, "loop_attention", None) is None or r < 2:
        return 0
    window = min(config.loop_window_size, seq_len)
    later_grad = min(r_grad, r - 1)
    later_nograd = r - 1 - later_grad
    return (12 * later_grad + 4 * later_nograd) * hq * window * config.num_recurrent_layers


# --- frozen parameters ----------------------------------------------------------------------------
# With every weight trainable the backward of each matmul computes the gradient of its input and of
# its weight: 6N per token in all. A frozen weight (``freeze_backbone``: all but the injection
# adapter; peft LoRA: every base weight) needs no weight gradient, and no matmul needs its input's
# gradient unless a trainable parameter lies upstream of that input: layers before the first
# trainable parameter run forward only. The walk below follows the forward's order in parts of a
# layer (input norm, q/k/v, q/k norms, o_proj and output norms, MLP input norm, gate/up, down_proj
# and output norms): a part's input needs gradient once an earlier part, or the layer's input,
# has something trainable, which is what autograd decides on for the modes above (a LoRA on the
# first layer's q/k/v makes everything after them need gradient; their input does not, nor does
# the frozen norm before them). Parameters within one part are taken as reading one input (a
# frozen q with a trained k is not told apart). Conventions as the all-trainable count: the study's, a layer's norm scales count as weights
# (2N each way), the model-level norms as nothing, the injection as one [e; h] matmul per recurrence,
# attention at full T (4 h q T forward, 8 h q T backward). peft's LoRA: A reads the projection's
# input, B reads A's output (its input needs gradient whenever A trains).


def _counts_frozen(model: nn.Module) -> bool:
    """Whether `training_flops_per_token` counts the model by its frozen parameters: some parameter
    is frozen and the design has none of the parts whose frozen count the walk does not model
    (hyperconnection lanes, Ouro's exit gate, a retrofit's per-loop LoRA); those keep the
    all-trainable count, an upper bound."""
    if all(p.requires_grad for p in model.parameters()):
        return False
    base = model.model
    unmodelled = (base.hyperconnection, getattr(base, "exit_gate", None), getattr(base, "loop_lora", None))
    return all(part is None for part in unmodelled)


#: A decoder layer's parameters in forward order (`_layer_part`): the attention's input norm,
#: q/k/v, their q/k norms, (the attention itself), o_proj and the attention's output norms, the
#: MLP's input norm, gate/up, down_proj and the MLP's output norms.
_PRE_NORMS = {  # norm placement -> (the attention's input norm, the MLP's input norm)
    "pre": ("input_layernorm.", "post_attention_layernorm."),
    "sandwich": ("input_layernorm.", "pre_feedforward_layernorm."),
    "pre_and_output": ("input_layernorm.", "pre_feedforward_layernorm."),
    "sublayer_output": (None, None),
}
_LAYER_PARTS = 7
_ATTENTION_AFTER_PART = 2  # the scores and weighted sum read q/k/v after their norms
_ATTENTION_OUTPUT_NORMS = ("post_attention_layernorm.", "post_attention_residual_layernorm.")


def _layer_part(name: str, placement: str) -> int:
    """Which of the `_LAYER_PARTS` a decoder layer's parameter (by its name in the layer) is in."""
    attn_norm, mlp_norm = _PRE_NORMS[placement]
    if attn_norm and name.startswith(attn_norm):
        return 0
    if name.startswith(("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")):
        return 1
    if name.startswith(("self_attn.q_norm.", "self_attn.k_norm.")):
        return 2
    if mlp_norm and name.startswith(mlp_norm):
        return 4
    if name.startswith("self_attn.") or name.startswith(_ATTENTION_OUTPUT_NORMS):
        return 3
    if name.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
        return 5
    return 6


def _input_grad(named: list[tuple[str, nn.Parameter]], input_needs_grad: bool) -> int:
    """Weights of one part whose input's gradient the backward computes: all of them when the
    part's input needs gradient; else only peft's LoRA B (it reads A's output), where A trains."""
    if input_needs_grad:
        return sum(p.numel() for _, p in named)
    trained_a = {name.split(".lora_A.")[0] for name, p in named if ".lora_A." in name and p.requires_grad}
    return sum(
        p.numel() for name, p in named if ".lora_B." in name and name.split(".lora_B.")[0] in trained_a
    )


def _layer_flops(
    layer: nn.Module, placement: str, hq: int, seq_len: int, needs_grad: bool
) -> tuple[float, bool]:
    """(training FLOPs per token of one layer application with gradient, whether its output needs
    gradient) given whether its input does. Each part's input needs gradient once any earlier part
    (or the layer's input) does; the residual adds keep that."""
    parts: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(_LAYER_PARTS)]
    for name, p in layer.named_parameters():
        parts[_layer_part(name, placement)].append((name, p))
    flops = 0.0
    for i, named in enumerate(parts):
        n = sum(p.numel() for _, p in named)
        trained = sum(p.numel() for _, p in named if p.requires_grad)
        flops += 2 * n + 2 * trained + 2 * _input_grad(named, needs_grad)
        needs_grad = needs_grad or trained > 0
        if i == _ATTENTION_AFTER_PART:  # scores and weighted sum: 4 h q T forward, 8 backward
            flops += (4 + (8 if needs_grad else 0)) * hq * seq_len
    return flops, needs_grad


def _forward_flops(layer: nn.Module, hq: int, seq_len: int) -> float:
    """Forward FLOPs per token of one layer application: 2N + 4 h q T."""
    return 2 * sum(p.numel() for p in layer.parameters()) + 4 * hq * seq_len


def _trains(module: nn.Module | None) -> bool:
    return module is not None and any(p.requires_grad for p in module.parameters())


def _frozen_training_flops(model: nn.Module, seq_len: int, r: int, r_nograd: int, hq: int) -> float:
    """Training FLOPs per token of a model with frozen parameters (see the section's comment):
    the forward's parts in order, each part's input needing gradient or not."""
    config, base = model.config, model.model
    placement = config.norm_placement

    def layers(stack: nn.ModuleList, needs_grad: bool) -> tuple[float, bool]:
        total = 0.0
        for layer in stack:
            flops, needs_grad = _layer_flops(layer, placement, hq, seq_len, needs_grad)
            total += flops
        return total, needs_grad

    needs_grad = _trains(base.embed_tokens) or _trains(base.embedding_norm)
    flops, e_grad = layers(base.prelude_layers, needs_grad)
    # The initial state: the prelude's output itself (state_init "embedding") or a fresh tensor.
    h_grad = e_grad if config.state_init not in ("zeros", "noise", "truncated_normal") else False
    injection = base.injection
    named_injection = list(injection.named_parameters(prefix="injection")) if injection is not None else []
    n_injection = sum(p.numel() for _, p in named_injection)
    trained_injection = sum(p.numel() for _, p in named_injection if p.requires_grad)
    for step in range(r):
        if step < r_nograd:  # truncated backprop: forward only, and the state leaves detached
            flops += 2 * n_injection + sum(
                _forward_flops(layer, hq, seq_len) for layer in base.recurrent_layers
            )
            continue
        mode = config.input_injection
        needs_grad = (e_grad or h_grad) if mode in ("linear", "add") else h_grad
        if mode == "linear":
            flops += 2 * n_injection + 2 * trained_injection + 2 * _input_grad(named_injection, needs_grad)
            needs_grad = needs_grad or trained_injection > 0
        block, needs_grad = layers(base.recurrent_layers, needs_grad)
        flops += block
        h_grad = needs_grad or _trains(base.recurrence_norm)
    needs_grad = h_grad or _trains(getattr(base, "post_loop_norm", None))
    coda, needs_grad = layers(base.coda_layers, needs_grad)
    needs_grad = needs_grad or _trains(base.norm)
    n_head = config.padded_vocab_size * config.hidden_size * head_passes(config, r, True)
    head_trains = model.lm_head.weight.requires_grad
    return float(flops + coda + n_head * (2 + 2 * needs_grad + 2 * head_trains))


def inference_flops_per_token(model: nn.Module, seq_len: int, num_recurrences: int | None = None) -> float:
    """Forward-only FLOPs per token at context ``seq_len``: 2 * (N_once + N_head + r * N_rec)
    + 4 * h * q * T per layer application (P + r*K + C applications); N_head r times for the
    exit gate's weighted readout."""
    r, _, n_once_head, n_rec, hq = _flops_terms(model, seq_len, num_recurrences)
    local = _local_read_flops(model.config, seq_len, r, 0, hq)  # forward only: r_grad = 0
    return float(2 * n_once_head + 2 * r * n_rec + 4 * hq * seq_len * model.config.num_layer_applications(r) + local)


def teacher_flops_per_token(teacher: nn.Module, seq_len: int) -> float:
    """Forward-only FLOPs per token of a dense transformers causal LM (a distillation teacher, run
    under no_grad): 2 * (N_body + V * d) + 4 * h * q * T per layer, the same count as
    `inference_flops_per_token` at r = 1. N_body is every parameter but the input embedding and
    an untied output head (its norms too, as the layers' norms above); the head's matmul is V * d
    whether or not it is tied. Reads shapes only (a meta-device model serves)."""
    config = teacher.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed = teacher.get_input_embeddings().weight
    head = teacher.get_output_embeddings()
    untied_head = head is not None and head.weight is not embed
    untied = head.weight.numel() if untied_head else 0
    n_body = sum(p.numel() for p in teacher.parameters()) - embed.numel() - untied
    vocab, width = int(embed.shape[0]), int(embed.shape[1])
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or width // heads)
    return float(2 * (n_body + vocab * width) + 4 * heads * head_dim * seq_len * int(text.num_hidden_layers))


__all__ = [
    "head_passes",
    "inference_flops_per_token",
    "num_scaling_params",
    "parameter_groups",
    "teacher_flops_per_token",
    "training_flops_per_token",
]
