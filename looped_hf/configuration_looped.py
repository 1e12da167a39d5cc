"""Configuration of a looped (depth-recurrent) decoder.

    tokens -> embed [-> norm] -> prelude (P layers, once) = e
           -> h_0 = init(e)
           -> r times: h = block(inject(h, e)) [-> norm]      (block: K layers, shared)
           -> coda (C layers, once) -> norm -> lm_head [-> soft-cap]

Defaults follow the iso-depth study ("How Much Is One Recurrence Worth?", Schwethelm et al.
2026, loop4 shape; its nanochat/gpt.py): squared-ReLU MLP, parameter-free QK-norm after RoPE,
logit soft-cap 15, RMSNorm after the embedding and at the end of every recurrence, linear input
injection W [e; h] with W = [I | 0]. ``init_scheme="study"`` gives the study's initialisation;
transformers' normal init stays the default. Setting prelude = coda = 0, r = 1,
``input_injection="none"``, ``hidden_act="silu"``, ``qk_norm="none"`` and the extra norms off gives
a plain Llama.

``looped_format`` versions the forward semantics, so every checkpoint loads with the logits it was
saved with: 1 = looped_hf 0.1.0 (linear injection W [h; e], additive injection from h_0 = e,
hyperconnection lanes updated with the block's residual delta then normed, QK-norm ``True`` meant
the learnable norm before RoPE); 2 = the study's conventions (this version). A config.json without
the key was written by 0.1.0 and loads as format 1.

This file is shipped with every checkpoint as remote code: it imports only transformers.
"""

import math
import os
from typing import Literal

from huggingface_hub.dataclasses import strict, validated_field
from transformers.configuration_utils import PreTrainedConfig

# The field rules live beside this file (shipped with it); their names stay importable from here.
from .config_rules_looped import (  # noqa: F401
    EXIT_GATE_THRESHOLD_RULE,
    KV_BUDGET_RULE,
    MAX_SCALE,
    MIN_RECURRENCES_RULE,
    R_RULE,
    SCALE_WHY,
    Interval,
    LoopedConfigError,
    _is_real,
    _one_line_errors,
    at_least,
    check_override,
    field_choices,
    interval,
    tensor_parallel_plan,
)

# "diagonal": Parcae's stable diagonal injection (parcae_looped.DiagonalInjection).
INPUT_INJECTIONS = ("linear", "add", "none", "hyperconnection", "diagonal")
# "after_rope": the study's parameter-free RMSNorm of q and k after RoPE (nanochat/gpt.py);
# "learnable_before_rope": per-head RMSNorm with a learnable scale before RoPE (Qwen3);
# "learnable_projection_before_rope": one RMSNorm over the whole q (and k) projection, all heads
# together, with a learnable scale, before the head split and RoPE (OLMo-2).
QK_NORMS = ("after_rope", "learnable_before_rope", "learnable_projection_before_rope", "none")
# Where a decoder layer's RMSNorms sit (n: a norm, each its own weight):
# "pre": x = x + attn(n1 x); x = x + mlp(n2 x)                       (Llama, the study)
# "sandwich": x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))          (Huginn)
# "sublayer_output": x = x + n1(attn x); x = x + n2(mlp x)           (OLMo-2)
# "pre_and_output": x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x))    (Ouro, Gemma-2)
NORM_PLACEMENTS = ("pre", "sandwich", "sublayer_output", "pre_and_output")
# Where a model-level norm takes its weight: "own" (its own scale) or "final" (the final norm's,
# one tensor: Huginn's ln_f after the loop, Ouro's model.norm at the end of every recurrence).
SHARED_NORM_WEIGHTS = ("own", "final")
# "hf": transformers' normal(0, initializer_range); "study": nanochat/gpt.py init_weights.
INIT_SCHEMES = ("hf", "study")
LOOPED_FORMAT = 2  # the forward semantics this file implements; see the module docstring
LOOPED_FORMATS = (1, LOOPED_FORMAT)
# The most recurrences a call may run, as a multiple of the trained r, unless ``max_recurrences``
# says otherwise: far past any test-time extrapolation that helps (the study and Huginn stay
# within a few x), and each recurrence costs K layer applications per token, so a typo such as
# r = 10**7 is refused with its cost instead of running for days.
RECURRENCE_CEILING_FACTOR = 64
# The most recurrences any config or call may name (``num_recurrences``, ``max_recurrences`` and the
# per-call ceiling above): far past every published looped model (Huginn tests up to 64, Ouro runs
# 4) and past any extrapolation that helps, so a config.json's r of 10**12 is refused in one line
# instead of a forward that never ends.
MAX_NUM_RECURRENCES = 4096
# The most parameters a config may describe (embedding, head and unique layers): 10**13, 20 TB in
# bf16, more than any machine allocates. A config.json with hidden_size 10**9 is refused in one line
# naming the field instead of failing inside torch's allocator.
MAX_PARAMETERS = 10**13
# The most unique layers (prelude + block + coda) a config may describe: each is a module of its own,
# so 10**8 of them would exhaust memory while building; the deepest published decoders have ~128.
MAX_UNIQUE_LAYERS = 4096
# "truncated_normal": Huginn's h_0, a normal at state_init_std truncated at +-3 std, times the
# embedding multiplier (seal-rg/recurrent-pretraining raven_modeling_minimal.py initialize_state).
# "like_init": Parcae's state_init="like-init", the same truncated normal drawn as Parcae draws it
# (a randn, then trunc_normal_ over it: the same RNG calls, so a seed gives Parcae's state bit for bit).
STATE_INITS = ("prelude", "zeros", "noise", "truncated_normal", "like_init")
# qk_norm_eps: "torch_default" is F.rms_norm's eps=None, finfo(dtype).eps of q and k (Parcae's QK norm).
QK_NORM_EPS_DEFAULTS = ("torch_default",)
ROPE_TABLE_DTYPES = ("bfloat16", "float16", "float32")
# How the shared block's attention reads the past at recurrences >= 2 (loop_attention_looped.py).
# "gated_global_local" (IQuest-Coder-V1-Loop): each block layer's query attends to recurrence 1's
# K/V of that layer over the whole prefix (global) and to its own recurrence's K/V within the last
# ``loop_window_size`` positions (local), mixed per head by g = sigmoid(q . W_h + b_h).
LOOP_ATTENTIONS = ("gated_global_local",)
# "relu2" is the study's non-gated squared ReLU; the others are gated (SwiGLU-style) as in Llama.
HIDDEN_ACTS = ("relu2", "silu", "gelu", "gelu_pytorch_tanh")
# Per-token adaptive exit (Huginn, seal-rg/recurrent-pretraining raven_modeling_minimal.py
# ``generate_with_adaptive_compute``): after each recurrence a token compares its new step with the
# previous one and stops once the change falls below the threshold. Each criterion's default
# threshold is Huginn's "auto" value (``cosine`` is ours: 1 - cos of successive states).
EXIT_CRITERIA = ("kl", "cosine", "latent_diff", "entropy_diff", "argmax_stability")
EXIT_DEFAULT_THRESHOLDS = {"kl": 5e-4, "cosine": 1e-3, "latent_diff": 0.03, "entropy_diff": 1e-3, "argmax_stability": 5}
# The thresholds a criterion can ever meet: a KL, an entropy change, a relative change are >= 0
# (and finite), a cosine distance lies in [0, 2], a stability count is a whole number of
# recurrences >= 0 (0: stop at min_recurrences). A threshold outside can never mean what was
# asked, so the user's intent would be lost without a word: refused instead. (low, high, integer),
# both ends allowed; 0 is "never" for the criteria that fire on value < threshold.
EXIT_THRESHOLD_RANGES = {
    "kl": (0.0, math.inf, False),
    "entropy_diff": (0.0, math.inf, False),
    "latent_diff": (0.0, math.inf, False),
    "cosine": (0.0, 2.0, False),
    "argmax_stability": (0, math.inf, True),
}
# What the logits of a model with an exit gate are (Ouro, ByteDance 2025, its modeling_ouro.py
# ``OuroForCausalLM.forward``): the last recurrence's; the recurrence where each token's exit CDF
# first reaches ``exit_gate_threshold``; or the expectation sum_t p_t logits_t.
EXIT_GATE_OUTPUTS = ("last", "threshold", "weighted")
# The adaptive-exit criterion of a model with an exit gate: a token stops at the first recurrence
# c >= min_recurrences whose exit CDF reaches the threshold (the step of the "threshold" readout),
# and really stops there (its later KV is its latest, as every criterion's). Its threshold is
# ``exit_threshold``, else the gate's ``exit_gate_threshold``.
EXIT_GATE_CRITERION = "gate"
# The Auto class -> model class pairs modeling_looped.py provides (written to every ``auto_map``).
AUTO_CLASSES = {
    "AutoModel": "LoopedModel",
    "AutoModelForCausalLM": "LoopedForCausalLM",
    "AutoModelForSequenceClassification": "LoopedForSequenceClassification",
    "AutoModelForTokenClassification": "LoopedForTokenClassification",
    "AutoModelForQuestionAnswering": "LoopedForQuestionAnswering",
}



@_one_line_errors
@strict
class LoopedConfig(PreTrainedConfig):
    r"""Configuration for [`LoopedForCausalLM`].

    Standard decoder fields mean what they mean in `LlamaConfig`. Loop fields:

    num_prelude_layers / num_recurrent_layers / num_coda_layers:
        Unique layers before, inside and after the loop.
    num_recurrences:
        r, the default number of passes through the recurrent block; ``forward`` and
        ``generate`` accept ``num_recurrences=`` to change it per call (test-time compute).
    input_injection:
        How the prelude output ``e`` re-enters each recurrence: ``"linear"`` (u = W [e; h], a
        d x 2d map initialised to [I | 0]: every recurrence of an untrained model reads e),
        ``"add"`` (u = h + e from h_0 = 0: the first block input is e), ``"none"`` (passthrough
        u = h: diverged in the study's ablation), or ``"hyperconnection"`` (``N`` lanes mixed at
        loop boundaries with per-step parameters; such a model is locked to its r).
    num_hyperconnection_lanes:
        Lanes for ``"hyperconnection"`` (the study uses 2).
    state_init:
        h_0: ``"prelude"`` (h_0 = e), ``"zeros"``, ``"noise"`` (Gaussian with std
        ``state_init_std``) or ``"truncated_normal"`` (Huginn's: a normal with std
        ``state_init_std`` truncated at +-3 std, times ``embedding_multiplier``; std 0 gives the
        deterministic zero state, Huginn's ``init_scale=0``). The random inits draw from the
        global RNG (``set_seed`` makes them reproducible). ``None`` (default) is the study's
        choice for the injection: h_0 = 0 for ``"add"`` (so the first block input is e, not 2e),
        h_0 = e otherwise (hyperconnection lanes all start as e).
    backprop_recurrences:
        ``None``: full backprop through the loop. ``k``: only the last k recurrences carry
        gradient; the first r - k run under ``no_grad`` (truncated backprop; the same gradients
        as the study's detach of the state). Refused with hyperconnections unless k = r, as the
        study's config does: the per-step gains of the detached steps would never train.
    recurrence_norm:
        RMSNorm (one shared weight) at the end of every recurrence; its output is the next
        recurrence's state.
    recurrence_norm_weight:
        Whose scale the recurrence norm uses: ``"own"`` (default: its own weight) or ``"final"``
        (the final norm's, one tensor: Ouro's ``model.norm`` closes every loop, and each loop's
        state feeds the LM head directly). With ``"final"`` and no coda, the loop's last norm IS
        the final norm, so it is not applied a second time. Needs ``recurrence_norm``.
    kv_budget:
        ``None`` (default): every recurrence keeps its own KV-cache slots (P + r*K + C slots).
        ``k``: only k recurrence slots, the study's engine (nanochat/gpt.py ``_get_kv_layer_idx``):
        recurrence i's block layer j uses slot P + (i mod k)*K + j, prelude and coda keep theirs,
        so the cache has P + min(k, r)*K + C slots. A slot holds the KV of its latest writer, so a
        later token attends, at recurrence i, to the past tokens' KV of the last recurrence
        congruent to i mod k (with k = 1: always the last recurrence's). The current tokens always
        attend to their own fresh KV. ``k >= r`` is exactly the default. ``forward`` and
        ``generate`` accept ``kv_budget=`` per call. Memory only: compute stays P + r*K + C.
    max_recurrences:
        The most recurrences one call may run (``num_recurrences=`` of ``forward`` / ``generate``).
        ``None`` (default): ``RECURRENCE_CEILING_FACTOR`` (64) x ``num_recurrences``. A call above
        it is refused with its cost (layer applications per token); set this to go further.
    exit_criterion, exit_threshold, min_recurrences:
        Per-token adaptive exit (Huginn's, per token instead of per sequence). ``None`` (default):
        every token runs all r recurrences. Otherwise, after recurrence c >= ``min_recurrences``
        a token whose criterion falls below ``exit_threshold`` (``argmax_stability``: reaches it)
        stops; r stays the cap. Criteria compare recurrence c with c - 1 (c = 1 with the state
        before the loop, or the uniform distribution): ``"kl"`` KL(p_(c-1) || p_c) of the
        next-token distributions (the state through coda, norm and head, as Huginn; needs the LM
        head), ``"entropy_diff"`` |H(p_c) - H(p_(c-1))|, ``"argmax_stability"`` recurrences the
        arg-max token has not changed, ``"cosine"`` 1 - cos(s_c, s_(c-1)) and ``"latent_diff"``
        ||s_c - s_(c-1)|| / ||s_c|| of the states (no head pass). ``exit_threshold=None`` is the
        criterion's default (``EXIT_DEFAULT_THRESHOLDS``); one outside the range the criterion's quantity can
        take (``EXIT_THRESHOLD_RANGES``: negative, NaN or infinite, a cosine distance over 2, a
        fractional stability count) is refused. An exited token's state is frozen and,
        at every later recurrence, it offers the KV of its last computed recurrence (Huginn's
        "latest" lookup), in the cache and to the tokens of the same call. ``forward`` and
        ``generate`` accept all three per call (``exit_criterion="none"`` turns a configured one
        off); outputs carry ``recurrences_used`` per token. Compute is saved when every token of
        a call has stopped (decoding at batch 1: each token's own exit); until then stopped tokens
        are computed and discarded, and under ``torch.compile`` every recurrence runs. With an
        exit gate the one criterion is ``"gate"`` (``EXIT_GATE_CRITERION``, see ``exit_gate``).
    exit_gate, exit_gate_output, exit_gate_threshold, exit_gate_entropy_beta:
        Ouro's learned exit (ByteDance's Ouro-1.4B / 2.6B). ``exit_gate=True`` adds a gate,
        Linear(hidden -> 1, with bias), read on each recurrence's state after the recurrence
        norm: lambda_t = sigmoid(g_t) is the chance to stop at step t given the token got there,
        so the exit distribution is p_t = lambda_t * prod_(j<t) (1 - lambda_j), the last step
        taking the remainder; outputs carry it as ``exit_probabilities`` (batch, tokens, r).
        ``exit_gate_output`` says which logits the model returns: ``"last"`` (default: the r-th
        recurrence's, as without a gate), ``"threshold"`` (per token, the first step whose CDF
        reaches ``exit_gate_threshold``, the last if none does; ``recurrences_used`` says which)
        or ``"weighted"`` (sum_t p_t logits_t). As in Ouro's own code every recurrence still runs
        for every token (a later token attends to an exited token's KV of every step), so the
        exit selects outputs and saves no compute. ``exit_gate_entropy_beta``: ``None`` (default)
        trains on the returned logits; a number beta gives Ouro's objective, per labelled token
        sum_t p_t L_t - beta H(p), L_t the cross-entropy of step t's logits and H the entropy of
        p. ``exit_criterion="gate"`` makes the gate stop tokens: a token stops at the first
        recurrence c >= ``min_recurrences`` whose exit CDF reaches ``exit_threshold`` (``None``:
        ``exit_gate_threshold``), the threshold readout's step, and from there on is an exited
        token of the adaptive exit above (frozen state, its latest KV for later recurrences and
        tokens), so it saves compute; its logits are its exit step's, and the other tokens'
        differ from the threshold readout's only through the KV they attend to. ``"weighted"``
        and the entropy loss read every step of every token, so they are refused with it; every
        other criterion is refused with a gate (the gate decides each token's exit);
        a readout other than the last recurrence's, or the entropy loss, needs step t's logits,
        so it is refused with coda layers (each step would need its own coda pass). ``forward``
        and ``generate`` accept ``exit_gate_output=`` and ``exit_gate_threshold=`` per call.
    loop_attention, loop_window_size:
        ``None`` (default): every recurrence's attention is the plain causal one over its own
        K/V. ``"gated_global_local"`` (IQuest-Coder-V1-Loop; ``loop_attention_looped.py``): the
        first recurrence is plain; at every later one, block layer j's query q (after RoPE)
        attends to the first recurrence's K/V of layer j over the whole prefix (global) and to
        its own recurrence's K/V within the last ``loop_window_size`` positions, itself included
        (local); the two outputs are mixed per head and position by g = sigmoid(q . W_h + b_h),
        ``model.gate_projections.j`` (weight (heads, head_dim), bias (heads)):
        g * global + (1 - g) * local. The cache keeps recurrence 1's slots in full and only the
        last ``loop_window_size`` - 1 positions of the later ones, so decoding gives the prefill's
        logits. Refused with ``kv_budget`` and adaptive exit; a QK-norm and value embeddings apply to
        every recurrence's q, k and v (the gate reads the normed q).
    qk_norm:
        ``"after_rope"`` (the study: parameter-free RMSNorm of q and k after RoPE),
        ``"learnable_before_rope"`` (Qwen3: a learnable per-head scale, before RoPE),
        ``"learnable_projection_before_rope"`` (OLMo-2: one RMSNorm over the whole q projection,
        all heads together, and one over k, learnable scales of width heads x head_dim, before
        the head split and RoPE) or ``"none"``. ``True`` / ``False`` are read as ``"after_rope"`` / ``"none"`` (in a format-1
        checkpoint ``True`` was the learnable form).
    init_scheme:
        ``"hf"`` (default: transformers' normal(0, ``initializer_range``)) or ``"study"``
        (nanochat/gpt.py ``init_weights``: embedding N(0, 1), lm_head N(0, 0.001), q/k/v/o and
        MLP-in uniform with std 1/sqrt(d), MLP-out uniform with std 1/sqrt(fan-in)). Both start
        the linear injection at [I | 0] and hyperconnections at the cyclic init.
    embedding_norm, logit_softcap:
        The study's extra stabilisers; off / ``None`` for a plain Llama.
    pad_vocab_size_to_multiple_of:
        The embedding and the head get ``padded_vocab_size`` rows, ``vocab_size`` rounded up to this
        multiple (the study: 64, for tensor-core-friendly shapes); the logits are cropped to
        ``vocab_size`` before the soft-cap, so the padded rows never receive probability or gradient.
        They are real matmul rows, so the FLOP and parameter accounting counts them, as the study's
        ``estimate_flops`` does. 1 (default): no padding.
    rope_table_dtype:
        ``None`` (default): the rotary cos/sin tables are used at full precision. ``"bfloat16"``: they
        are rounded to bf16 first, as the study's nanochat/gpt.py keeps them (its checkpoints were
        trained with those tables and reproduce their logits only with them).
    norm_placement:
        Where each decoder layer's RMSNorms sit (every norm its own weight): ``"pre"`` (default,
        Llama and the study: x = x + attn(n1 x); x = x + mlp(n2 x)), ``"sandwich"`` (Huginn: a
        norm after each residual add too, x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))),
        ``"sublayer_output"`` (OLMo-2: the norm on each sublayer's output before the add,
        x = x + n1(attn x); x = x + n2(mlp x)) or ``"pre_and_output"`` (Ouro, Gemma-2: both,
        x = x + n2(attn(n1 x)); x = x + n4(mlp(n3 x))). The extra norms are parameters of their
        layer, so N_once / N_rec count them where the layer sits.
    embedding_multiplier:
        The token embeddings (looked up or passed as ``inputs_embeds``) are multiplied by this
        before the embedding norm and the prelude. 1.0 (default): none; Huginn: sqrt(hidden_size).
        A tied head reads the unscaled table. Elementwise: no parameter, no FLOPs counted.
    post_loop_norm:
        An RMSNorm after the loop, before the coda (it also normalises the state the coda and the
        adaptive-exit criteria read). ``None`` (default): none; ``"own"``: its own weight;
        ``"final"``: the final norm's weight, one tensor (Huginn's ``ln_f``, applied after the
        loop and again after the coda).
    qk_bias:
        A learned bias added to q and k (``q_proj.bias`` / ``k_proj.bias``) right after their
        projections, before any QK-norm and RoPE (Huginn's ``qk_bias``); v and o stay without
        (``attention_bias`` gives all four a bias).
    qk_norm_eps:
        The eps of the parameter-free ``qk_norm="after_rope"``: ``None`` (default) ``rms_norm_eps``, a
        number, or ``"torch_default"`` (``F.rms_norm``'s own, finfo(dtype).eps of q and k: Parcae's).
    Parcae's design (Sandy Research, arXiv 2604.12946; the modules are ``parcae_looped.py``):
        ``input_injection="diagonal"``: the stable diagonal injection
        h <- exp(-softplus(dt_bias) exp(A_log)) * h + softplus(dt_bias) * (e B^T), whose decay lies in
        (0, 1) (parameters ``model.injection.{A_log, dt_bias, B}``, Parcae's init: A = 1, decay
        sqrt(1/5), B = I). ``state_init="like_init"``: Parcae's random h_0, N(0, ``state_init_std``)
        truncated at +-3 std drawn with Parcae's RNG calls (a seed reproduces its state bit for bit).
        ``prelude_norm``: an RMSNorm on the prelude's output (e is the normed output).
        ``post_loop_projection``: a d x d linear map ``C`` on the loop's last state, before the coda.
        ``mlp_activation_scale``: the squared-ReLU MLP computes down(s * relu(up x)^2) (Parcae: 0.5).
        ``recurrent_num_key_value_heads``: the block layers' own KV heads (Parcae's core is MHA while
        its prelude and coda may use GQA); ``None``: ``num_key_value_heads``.
        ``value_embedding_layers``: the unique layers (0-based: prelude, then block, then coda) whose
        values get a gated value embedding, v += 2 sigmoid(W x[..., :c]) * E_i[ids] (per KV head,
        x the layer's normed input, c = ``value_embedding_gate_channels``; the table
        ``model.value_embeddings.<i>``, the gate ``self_attn.value_gate``); a block layer's
        embedding is the same at every recurrence. It needs ``input_ids``.
    looped_format:
        The forward semantics version (see the module docstring); set by loading, not by users.

    Whole-stack looping (Ouro: the whole stack loops, no prelude, no coda, no re-injection, the
    embedding as h_0) needs no field of its own: ``num_prelude_layers=0``, ``num_coda_layers=0``,
    ``input_injection="none"``, ``state_init="prelude"`` (h_0 = e, the embedding: with no prelude
    and ``embedding_norm=False``, e is the looked-up embedding), ``recurrence_norm=True`` with
    ``recurrence_norm_weight="final"``.

    ``num_hidden_layers`` is derived: it equals the effective depth at the default r (layer
    applications per token), so ``generate()``'s cache has one slot per application and
    exporters see the flat stack a looped model unrolls into.
    """

    model_type = "looped"
    keys_to_ignore_at_inference = ["cache"]

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """Tensor parallelism (``from_pretrained(..., tp_plan="auto")``), see ``tensor_parallel_plan``.
        Derived on every read from the layer lists the config has and its MLP, so a config whose
        layer counts change after loading (``from_pretrained(..., num_coda_layers=0)``) still names
        only modules that exist. transformers reads it when it builds the model, never serialises it."""
        counts = {"prelude_layers": self.num_prelude_layers, "recurrent_layers": self.num_recurrent_layers,
                  "coda_layers": self.num_coda_layers}  # fmt: skip
        stacks = tuple(stack for stack, n in counts.items() if n > 0)
        return tensor_parallel_plan(gated=self.hidden_act != "relu2", stacks=stacks)

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict[str, str]) -> None:
        # transformers < 5.20 (vLLM's pinned range) writes the tied embedding's split here while
        # constructing a tied config; the plan is derived on every read, so nothing is stored.
        return None

    # Each field declares its type (checked by ``@strict``) and, where it has one, its range or its
    # choices (``at_least`` / ``interval`` / a ``Literal``): the one place a value's rule is written.
    # Rules that tie fields together are the ``validate_*`` methods below.
    vocab_size: int = at_least(1)(default=8192)
    hidden_size: int = at_least(1)(default=256)
    intermediate_size: int | None = at_least(1)(default=None)
    num_attention_heads: int = at_least(1)(default=4)
    num_key_value_heads: int | None = at_least(1)(default=None)
    head_dim: int | None = at_least(1)(default=None)
    hidden_act: Literal[HIDDEN_ACTS] = "relu2"
    max_position_embeddings: int = at_least(1)(default=2048)
    initializer_range: int | float = interval(0, None, why="a standard deviation")(default=0.02)
    rms_norm_eps: int | float = interval(0, None, low_open=True, why="a norm divides by sqrt(mean + eps)")(default=1e-6)
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: int | float = interval(0, 1, why="a probability")(default=0.0)
    mlp_bias: bool = False
    # True / False / None are read as "after_rope" / "none" (format 1: True was the learnable form).
    qk_norm: Literal[QK_NORMS] | bool | None = "after_rope"
    init_scheme: Literal[INIT_SCHEMES] = "hf"
    logit_softcap: int | float | None = interval(0, None, low_open=True)(default=15.0)
    embedding_norm: bool = True
    pad_vocab_size_to_multiple_of: int = at_least(1, why="1: no padding")(default=1)
    rope_table_dtype: Literal[ROPE_TABLE_DTYPES] | None = None
    norm_placement: Literal[NORM_PLACEMENTS] = "pre"
    embedding_multiplier: int | float = interval(0, MAX_SCALE, low_open=True, why=SCALE_WHY)(default=1.0)
    post_loop_norm: Literal[SHARED_NORM_WEIGHTS] | None = None
    recurrence_norm_weight: Literal[SHARED_NORM_WEIGHTS] = "own"
    qk_bias: bool = False
    num_prelude_layers: int = at_least(0)(default=2)
    num_recurrent_layers: int = at_least(0)(default=4)
    num_coda_layers: int = at_least(0)(default=2)
    num_recurrences: int = validated_field(R_RULE, default=4)
    input_injection: Literal[INPUT_INJECTIONS] = "linear"
    num_hyperconnection_lanes: int = at_least(1)(default=2)
    state_init: Literal[STATE_INITS] | None = None
    state_init_std: int | float = interval(0, MAX_SCALE, why="a standard deviation; " + SCALE_WHY)(default=1.0)
    backprop_recurrences: int | None = at_least(1, why="None: full backprop")(default=None)
    recurrence_norm: bool = True
    kv_budget: int | None = validated_field(KV_BUDGET_RULE, default=None)
    max_recurrences: int | None = validated_field(R_RULE, default=None)
    exit_criterion: Literal[EXIT_CRITERIA + (EXIT_GATE_CRITERION, "none")] | None = None
    exit_threshold: int | float | None = interval(None, None)(default=None)  # its range depends on the criterion
    min_recurrences: int = validated_field(MIN_RECURRENCES_RULE, default=1)
    exit_gate: bool = False
    exit_gate_output: Literal[EXIT_GATE_OUTPUTS] = "last"
    exit_gate_threshold: int | float = validated_field(EXIT_GATE_THRESHOLD_RULE, default=0.5)
    exit_gate_entropy_beta: int | float | None = interval(0, None, why="None: the loss of the logits")(default=None)
    # Parcae's design (parcae_looped.py): see the class docstring.
    qk_norm_eps: int | float | Literal[QK_NORM_EPS_DEFAULTS] | None = interval(
        0, None, low_open=True, why="None: rms_norm_eps; 'torch_default': finfo(dtype).eps")(default=None)
    mlp_activation_scale: int | float = interval(0, None, low_open=True)(default=1.0)
    prelude_norm: bool = False
    post_loop_projection: bool = False
    recurrent_num_key_value_heads: int | None = at_least(1, why="None: num_key_value_heads")(default=None)
    value_embedding_layers: list[int] | None = None
    value_embedding_gate_channels: int = at_least(1)(default=32)

    loop_attention: Literal[LOOP_ATTENTIONS] | None = None
    loop_window_size: int | None = at_least(1, why="the local window, in positions")(default=None)
    num_hidden_layers: int | None = None
    looped_format: Literal[LOOPED_FORMATS] = LOOPED_FORMAT

    def __post_init__(self, **kwargs):
        if self.qk_norm is True:
            self.qk_norm = "learnable_before_rope" if self.looped_format == 1 else "after_rope"
        elif self.qk_norm is False or self.qk_norm is None:
            self.qk_norm = "none"
        if self.state_init is None:
            self.state_init = "zeros" if self.input_injection == "add" else "prelude"
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.intermediate_size is None:
            # The study's block: 4d for the (non-gated) squared-ReLU MLP, so a layer has 12 d^2
            # weights; SwiGLU gets ~8/3 d (rounded up to 64) to keep the same count.
            d = self.hidden_size
            self.intermediate_size = 4 * d if self.hidden_act == "relu2" else 64 * math.ceil(8 * d / 3 / 64)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.num_hidden_layers = self.effective_num_layers
        super().__post_init__(**kwargs)

    # --- validation: the rules that tie fields together (``@strict`` runs every ``validate_*``
    # after ``__init__``, and ``validate()`` before ``save_pretrained``) ----------------------
    def _bad(self, field: str, why: str) -> ValueError:
        return ValueError(f"{type(self).__name__}.{field}={getattr(self, field)!r}: {why}")

    def validate_architecture(self) -> None:
        """Layers exist; heads split the width; RoPE rotates pairs."""
        if self.num_unique_layers == 0:
            raise self._bad("num_recurrent_layers", "the model has no layers at all")
        if self.hidden_size % self.num_attention_heads != 0 and self.head_dim * self.num_attention_heads != self.hidden_size:
            # An explicit head_dim may decouple the two (as in Llama), but then it must be given.
            raise self._bad("num_attention_heads", f"does not divide hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise self._bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2 != 0:
            raise self._bad("head_dim", "must be even for rotary embeddings")
        self._check_size()
        theta = self.rope_parameters.get("rope_theta") if isinstance(self.rope_parameters, dict) else None
        if theta is not None and not (_is_real(theta) and theta > 0):
            raise self._bad("rope_parameters", "rope_theta must be a finite number > 0")

    def _check_size(self) -> None:
        """Refuse a config whose weights no machine could allocate (``MAX_PARAMETERS``), naming the
        size field that contributes most (the one whose own default would shrink the count most)."""
        if self.num_unique_layers > MAX_UNIQUE_LAYERS:
            field = max(("num_prelude_layers", "num_recurrent_layers", "num_coda_layers"), key=lambda f: getattr(self, f))
            raise self._bad(field, f"the model would have {self.num_unique_layers} unique layers, over the bound of "
                                   f"{MAX_UNIQUE_LAYERS} (MAX_UNIQUE_LAYERS: each is a module of its own)")  # fmt: skip
        total = self.approx_num_parameters()
        if total <= MAX_PARAMETERS:
            return
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "num_prelude_layers", "num_recurrent_layers", "num_coda_layers")  # fmt: skip
        defaults = {"intermediate_size": 4 * 256, "num_key_value_heads": 4, "head_dim": 64}
        field = min(sizes, key=lambda f: self.approx_num_parameters(
            **{f: defaults.get(f, self.__dataclass_fields__[f].default)}))  # fmt: skip
        raise self._bad(field, f"the model would have ~{total:.3g} parameters, over the bound of "
                               f"{MAX_PARAMETERS:.0e} (MAX_PARAMETERS: no machine allocates them)")  # fmt: skip

    def approx_num_parameters(self, **sizes: int) -> int:
        """The weights' count from the size fields (``sizes`` overriding them): embedding, untied
        head, and per unique layer the attention and MLP matrices; Python ints, so a hostile size
        cannot overflow. An upper bound's worth of exactness for ``MAX_PARAMETERS`` only (the
        accounting is ``accounting_looped``)."""
        get = lambda name: sizes.get(name, getattr(self, name))  # noqa: E731
        d, heads, kv, hd = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads"), get("head_dim")
        vocab = get("vocab_size")
        attention = d * heads * hd * 2 + d * kv * hd * 2
        mlp = (2 if self.hidden_act == "relu2" else 3) * d * get("intermediate_size")
        layers = get("num_prelude_layers") + get("num_recurrent_layers") + get("num_coda_layers")
        return vocab * d * (1 if self.tie_word_embeddings else 2) + layers * (attention + mlp)

    def validate_loop(self) -> None:
        """The loop's settings against r: truncation, the hyperconnection lock, exit, the ceiling."""
        r = self.num_recurrences
        for field in ("num_recurrences", "max_recurrences"):
            if (getattr(self, field) or 0) > MAX_NUM_RECURRENCES:
                raise self._bad(field, f"exceeds MAX_NUM_RECURRENCES={MAX_NUM_RECURRENCES}, the most recurrences any "
                                       f"looped model may run (each costs {self.num_recurrent_layers} layer "
                                       "applications per token)")  # fmt: skip
        k = self.backprop_recurrences
        if k is not None and k > r:
            raise self._bad("backprop_recurrences", f"exceeds num_recurrences={r}")
        if self.input_injection == "hyperconnection" and k is not None and k < r:
            # The study's GPTConfig refuses this too: the per-step gains of the detached steps
            # would never receive a gradient. (A kv_budget is accepted: it only chooses which
            # recurrence's KV the past tokens offer; the lane parameters are untouched.)
            raise self._bad(
                "backprop_recurrences",
                f"hyperconnections need full backprop (None or {r}): the per-step "
                "lane parameters of the detached recurrences would never train",
            )
        try:
            rule = self.exit_settings()
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}.{err}") from None
        if rule is not None and rule[2] > r:
            raise self._bad("min_recurrences", f"exceeds num_recurrences={r}, the cap on recurrences per token")
        if self.recurrence_norm_weight == "final" and not self.recurrence_norm:
            raise self._bad("recurrence_norm_weight", "names the recurrence norm's weight, but recurrence_norm is False")
        if self.input_injection == "none" and self.state_init != "prelude":
            # Nothing re-injects the input and h_0 is not the prelude's output: the block and the
            # coda would never see the tokens (a model that trains to the uniform distribution).
            raise self._bad("state_init", "with input_injection='none' the loop would never read the input "
                                          "(h_0 is not the prelude's output and nothing re-injects it); use "
                                          "state_init='prelude' or an injection")  # fmt: skip
        if self.max_recurrences is not None and self.max_recurrences < r:
            raise self._bad("max_recurrences", f"must be None ({RECURRENCE_CEILING_FACTOR} x num_recurrences) or an "
                                               f"integer >= num_recurrences={r}")  # fmt: skip

    def validate_parcae_options(self) -> None:
        """Parcae's options (``parcae_looped.py``) against the fields they depend on."""
        if self.mlp_activation_scale != 1.0 and self.hidden_act != "relu2":
            raise self._bad("mlp_activation_scale", f"scales the squared-ReLU MLP; hidden_act={self.hidden_act!r} "
                                                    "is gated (use 1.0)")  # fmt: skip
        kv = self.recurrent_num_key_value_heads
        if kv is not None and self.num_attention_heads % kv != 0:
            raise self._bad("recurrent_num_key_value_heads", f"must divide num_attention_heads="
                                                             f"{self.num_attention_heads}")  # fmt: skip
        layers = self.value_embedding_layers
        if layers is not None:
            n = self.num_unique_layers
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in layers):
                raise self._bad("value_embedding_layers", f"must list unique-layer indices in [0, {n}) (prelude, "
                                                          "then block, then coda layers)")  # fmt: skip
            if len(set(layers)) != len(layers):
                raise self._bad("value_embedding_layers", "names a layer twice")
            if self.value_embedding_gate_channels > self.hidden_size:
                raise self._bad("value_embedding_gate_channels", f"exceeds hidden_size={self.hidden_size} (the gate "
                                                                 "reads the first channels of the layer's input)")  # fmt: skip

    def validate_exit_gate(self) -> None:
        """The gate's readout and loss against the loop: see ``exit_gate``."""
        if not self.exit_gate:
            for field, default in (("exit_gate_output", "last"), ("exit_gate_entropy_beta", None),
                                   ("exit_gate_threshold", 0.5)):  # fmt: skip
                if getattr(self, field) != default:
                    raise self._bad(field, "needs exit_gate=True (there is no gate to read)")
            return
        if self.exit_criterion not in (None, "none", EXIT_GATE_CRITERION):
            raise self._bad("exit_criterion", "refused with exit_gate=True: the gate decides each token's exit; "
                                              f"set exit_criterion={EXIT_GATE_CRITERION!r} (the gate stops the "
                                              "token) or exit_gate_output='threshold'")  # fmt: skip
        if self.exit_criterion == EXIT_GATE_CRITERION and self.exit_gate_output == "weighted":
            raise self._bad("exit_gate_output", f"'weighted' reads every recurrence of every token, which "
                                                f"exit_criterion={EXIT_GATE_CRITERION!r} stops")  # fmt: skip
        if self.num_coda_layers > 0 and (self.exit_gate_output != "last" or self.exit_gate_entropy_beta is not None):
            field = "exit_gate_output" if self.exit_gate_output != "last" else "exit_gate_entropy_beta"
            raise self._bad(field, f"needs every recurrence's logits, which num_coda_layers={self.num_coda_layers} "
                                   "would decode with a coda pass per step; use num_coda_layers=0")  # fmt: skip

    def validate_loop_attention(self) -> None:
        """IQuest's gated global + local loop attention (``loop_attention``): its window, and the
        settings its cache layout cannot serve."""
        if self.loop_attention is None:
            if self.loop_window_size is not None:
                raise self._bad("loop_window_size", "needs loop_attention='gated_global_local'")
            return
        if self.loop_window_size is None:
            raise self._bad("loop_attention", "needs loop_window_size (the local window, in positions)")
        # Recurrences >= 2 read recurrence 1's K/V of every past token and their own within the
        # window, so each recurrence keeps its own slots, and a token's KV is that of every step.
        refusals = (
            ("kv_budget", self.kv_budget is not None, "recurrence 1's KV is read by every later recurrence"),
            ("exit_criterion", self.exit_criterion not in (None, "none"),
             "an exited token would offer a stale recurrence's KV to the global and local reads"),
            ("looped_format", self.looped_format != LOOPED_FORMAT, f"needs looped_format={LOOPED_FORMAT}"),
        )  # fmt: skip
        for field, refused, why in refusals:
            if refused:
                raise self._bad(field, f"refused with loop_attention={self.loop_attention!r}: {why}")

    def validate_token_ids(self) -> None:
        # Stricter than transformers' (which only warns): a special token outside the vocabulary
        # has no embedding row (pad: its padding row), and generation could never emit or stop on it.
        for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, field)
            ids = value if isinstance(value, (list, tuple)) else [value]
            if any(i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size)
                   for i in ids):  # fmt: skip
                raise self._bad(field, f"must be None or a token id in [0, vocab_size={self.vocab_size})")

    # --- versioning ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        model_type = config_dict.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            # transformers only warns, then builds a looped model from another architecture's
            # fields (a gpt2 config.json has none of the loop's): weights that do not fit, or
            # defaults standing in for what the folder describes. A config without the key is
            # accepted (a hand-written dict, or looped_hf 0.1.0's).
            raise ValueError(
                f"model_type={model_type!r}: {cls.__name__} loads only model_type {cls.model_type!r} configs; "
                "load this checkpoint with its own class (AutoModelForCausalLM picks it)"
            )
        # A config.json without ``looped_format`` was written by looped_hf 0.1.0: keep its forward
        # semantics so its weights give the logits they were trained to give.
        if "looped_format" not in config_dict:
            config_dict = {**config_dict, "looped_format": 1}
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> "LoopedConfig":
        # The same refusal, naming the folder (or repository) it came from.
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except ValueError as err:
            if str(err).startswith("model_type="):
                raise ValueError(f"{pretrained_model_name_or_path}: config.json {err}") from None
            raise

    def to_dict(self) -> dict:
        # ``save_pretrained`` writes ``auto_map`` for the saved class only; every class lives in the
        # shipped modeling_looped.py, so list them all: a causal-LM checkpoint then loads as remote
        # code into any head (``AutoModelForSequenceClassification``, ...) and vice versa.
        out = super().to_dict()
        auto_map = out.get("auto_map")
        if isinstance(auto_map, dict):
            source = next((v for v in auto_map.values() if isinstance(v, str) and "modeling_looped." in v), None)
            if source is not None:
                prefix = source[: source.index("modeling_looped.")]
                out["auto_map"] = {**{auto: f"{prefix}modeling_looped.{cls}" for auto, cls in AUTO_CLASSES.items()},
                                   **auto_map}  # fmt: skip
        return out

    def to_diff_dict(self) -> dict:
        # Always written, even at its default: its absence means format 1.
        out = super().to_diff_dict()
        out["looped_format"] = self.looped_format
        return out

    # --- derived quantities -----------------------------------------------------------------
    def num_layer_applications(self, num_recurrences: int | None = None) -> int:
        """Layer applications per token, P + r*K + C, at ``num_recurrences`` (default: r)."""
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        return self.num_prelude_layers + r * self.num_recurrent_layers + self.num_coda_layers

    def num_kv_slots(self, num_recurrences: int | None = None, kv_budget: int | None = None) -> int:
        """KV-cache slots a call needs: P + min(k, r)*K + C, k the KV budget (default: the config's;
        none means every recurrence keeps its slots, k = r), each value checked by its field's rule
        (``LoopedConfigError`` naming it). The layout itself, slot by slot, is
        ``generation_looped.KVSlotPlan.for_call``: it lives with the cache code that uses it."""
        r = self.num_recurrences if num_recurrences is None else check_override("num_recurrences", num_recurrences, R_RULE)
        k = self.kv_budget if kv_budget is None else check_override("kv_budget", kv_budget, KV_BUDGET_RULE)
        k = r if k is None else min(k, r)
        return self.num_prelude_layers + k * self.num_recurrent_layers + self.num_coda_layers

    def resolve_num_recurrences(self, num_recurrences: int | None = None) -> int:
        """The r of a call: ``num_recurrences`` (default: the config's) as a Python int, checked.

        r must be a Python int (``torch.compile`` builds one graph per r); numpy and 0-d tensor
        integers convert. Raises ``ValueError`` naming the value: not an integer >= 1, or another r
        than the trained one for a hyperconnection model (its parameters are indexed by step)."""
        r = self.num_recurrences if num_recurrences is None else num_recurrences
        r = check_override("num_recurrences", r, R_RULE)
        if r > self.recurrence_ceiling:
            raise ValueError(
                f"num_recurrences={r}: exceeds this model's ceiling of {self.recurrence_ceiling} recurrences "
                f"({self._ceiling_source()}); it would run {self.num_layer_applications(r)} layer applications per "
                f"token, against {self.num_layer_applications()} at the trained num_recurrences={self.num_recurrences}"
                + (". Set config.max_recurrences to allow it" if self.recurrence_ceiling < MAX_NUM_RECURRENCES else "")
            )
        if self.is_recurrence_locked and r != self.num_recurrences:
            raise ValueError(
                f"num_recurrences={r}: this model uses input_injection='hyperconnection', whose parameters are "
                f"indexed by recurrence step, so it can only run at its trained num_recurrences={self.num_recurrences}"
            )
        return r

    def exit_settings(
        self, criterion: str | None = None, threshold: float | None = None, min_recurrences: int | None = None
    ) -> tuple[str, float, int] | None:
        """The adaptive-exit rule of a call, (criterion, threshold, min_recurrences), each argument
        overriding the config's; ``None`` when there is no criterion (every token runs r). Raises
        ``ValueError`` naming the field and the value."""
        criterion = self.exit_criterion if criterion is None else criterion
        threshold = self.exit_threshold if threshold is None else threshold
        minimum = self.min_recurrences
        if min_recurrences is not None:
            minimum = check_override("min_recurrences", min_recurrences, MIN_RECURRENCES_RULE)
        if criterion is None or criterion == "none":
            return None
        if criterion == EXIT_GATE_CRITERION:
            if not self.exit_gate:
                raise ValueError(f"exit_criterion={criterion!r}: this model has no exit gate (config.exit_gate="
                                 "False)")  # fmt: skip
            threshold = self.exit_gate_threshold if threshold is None else threshold
            threshold = check_override("exit_threshold", threshold, EXIT_GATE_THRESHOLD_RULE)
            return criterion, float(threshold), minimum
        if criterion not in EXIT_CRITERIA:
            raise ValueError(
                f"exit_criterion={criterion!r}: must be None or one of {EXIT_CRITERIA + (EXIT_GATE_CRITERION,)}"
            )
        if threshold is None:
            threshold = EXIT_DEFAULT_THRESHOLDS[criterion]
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise ValueError(
                f"exit_threshold={threshold!r}: must be a finite number (or None for the criterion's default), "
                f"for exit_criterion={criterion!r}"
            )
        low, high, integer = EXIT_THRESHOLD_RANGES[criterion]
        if not low <= threshold <= high or (integer and threshold != int(threshold)):
            what = f"a whole number of recurrences >= {low}" if integer else f"in [{low}, {high}]"
            raise ValueError(
                f"exit_threshold={threshold!r}: exit_criterion={criterion!r} compares a quantity that is {what}, "
                "so this threshold can never mean anything"
            )
        return criterion, float(threshold), minimum

    def exit_gate_settings(self, output: str | None = None, threshold: float | None = None) -> tuple[str, float] | None:
        """The exit gate's readout of a call, (output, threshold), each argument overriding the
        config's; ``None`` without a gate. Raises ``ValueError`` naming the field and the value."""
        if not self.exit_gate:
            given = [f"{name}={value!r}" for name, value in (("exit_gate_output", output),
                                                                ("exit_gate_threshold", threshold)) if value is not None]  # fmt: skip
            if given:
                raise ValueError(f"{given[0]}: this model has no exit gate (config.exit_gate=False)")
            return None
        output = self.exit_gate_output if output is None else output
        if threshold is None:
            threshold = self.exit_gate_threshold
        else:
            threshold = check_override("exit_gate_threshold", threshold, EXIT_GATE_THRESHOLD_RULE)
        if output not in EXIT_GATE_OUTPUTS:
            raise ValueError(f"exit_gate_output={output!r}: must be one of {EXIT_GATE_OUTPUTS}")
        if output != "last" and self.num_coda_layers > 0:
            raise ValueError(f"exit_gate_output={output!r}: needs every recurrence's logits, which "
                             f"num_coda_layers={self.num_coda_layers} would decode with a coda pass per step")  # fmt: skip
        return output, float(threshold)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the head: ``vocab_size`` rounded up to
        ``pad_vocab_size_to_multiple_of`` (the logits keep ``vocab_size`` columns)."""
        multiple = self.pad_vocab_size_to_multiple_of
        return -(-self.vocab_size // multiple) * multiple

    @property
    def effective_num_layers(self) -> int:
        """Effective depth at the default r: the one number FLOPs, cards and fits all read."""
        return self.num_layer_applications()

    @property
    def recurrence_ceiling(self) -> int:
        """The most recurrences a call may run: ``max_recurrences``, else
        ``RECURRENCE_CEILING_FACTOR`` x the trained ``num_recurrences``."""
        if self.max_recurrences is not None:
            return self.max_recurrences
        return min(RECURRENCE_CEILING_FACTOR * self.num_recurrences, MAX_NUM_RECURRENCES)

    def _ceiling_source(self) -> str:
        if self.max_recurrences is not None:
            return "config.max_recurrences"
        if RECURRENCE_CEILING_FACTOR * self.num_recurrences > MAX_NUM_RECURRENCES:
            return f"MAX_NUM_RECURRENCES={MAX_NUM_RECURRENCES}"
        return f"{RECURRENCE_CEILING_FACTOR} x the trained num_recurrences={self.num_recurrences}"

    @property
    def num_unique_layers(self) -> int:
        return self.num_prelude_layers + self.num_recurrent_layers + self.num_coda_layers

    @property
    def is_recurrence_locked(self) -> bool:
        """Hyperconnection parameters are indexed by recurrence step: no other r can run."""
        return self.input_injection == "hyperconnection"


__all__ = ["MAX_NUM_RECURRENCES", "MAX_PARAMETERS", "MAX_UNIQUE_LAYERS", "RECURRENCE_CEILING_FACTOR", "EXIT_CRITERIA", "EXIT_GATE_CRITERION", "EXIT_DEFAULT_THRESHOLDS", "EXIT_THRESHOLD_RANGES", "EXIT_GATE_OUTPUTS", "LOOPED_FORMAT", "LoopedConfig", "tensor_parallel_plan"]
