"""A looped (depth-recurrent) decoder for transformers 5.x.

    tokens -> embed [-> norm] -> prelude (P layers) = e -> h_0 = init(e)
           -> r times: h = block(inject(h, e)) [-> norm]     block: K shared layers
           -> coda (C layers) -> norm -> lm_head [-> soft-cap]

Top to bottom: the rotary table and the logit soft-cap, the models, the standard heads. The
decoder layers (Llama's, with the study's switches: squared-ReLU MLP, QK-norm; one class per norm
placement) are ``decoder_layers_looped.py``; the loop itself, its modules (injection,
hyperconnection lanes, norms, exit gate) and what runs after it are ``recurrent_block_looped.py``
(``LoopedRecurrentBlock``, which ``LoopedModel.forward`` runs between the prelude and the coda). Where the study's code (kschwethelm/looped-lm-scaling,
nanochat/gpt.py) fixes a convention, this file follows it and says so; ``config.looped_format ==
1`` keeps looped_hf 0.1.0's forward for its checkpoints. Every layer *application* (P + r*K + C
per token) owns a KV-cache slot, placed by the call's ``KVSlotPlan`` (``KVSlotPlan.for_call``).

It behaves like transformers 5.24's Llama wherever a looped model can (``cache=``, tuples with
``return_dict=False``, per-application hidden states and attentions, ``torch.compile(fullgraph=
True)`` at a fixed r); an unknown keyword raises ``TypeError``. Beside it, shipped with every
checkpoint as remote code: ``decoder_layers_looped.py`` (the layers), ``recurrent_block_looped.py``
(the loop), ``interface_looped.py``
(outputs, keywords, the attention mask), ``generation_looped.py`` (KV budget, adaptive exit,
self-drafting), ``accounting_looped.py`` (parameters and FLOPs) and ``loop_attention_looped.py``
(IQuest's gated loop attention, ``config.loop_attention``). It imports only torch,
transformers and those modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils.generic import TransformersKwargs, can_return_tuple, merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .accounting_looped import inference_flops_per_token, num_scaling_params, training_flops_per_token
from .configuration_looped import EXIT_GATE_CRITERION, LoopedConfig

# The layers and the loop's modules live beside this file; the names below stay importable from
# here (the vLLM model, tests and older callers import them from modeling_looped).
from .decoder_layers_looped import DECODER_LAYERS as DECODER_LAYERS
from .decoder_layers_looped import LoopedAttention, LoopedDecoderLayer, LoopedRMSNorm
from .decoder_layers_looped import apply_rotary_pos_emb as apply_rotary_pos_emb
from .generation_looped import (
    KVSlotPlan,
    LoopedGenerateOutput,
    LoopedGenerationMixin,
    RecurrenceDraftCandidateGenerator,
    coda_predictor,
    prepare_cache,
    resolve_exit_rule,
)
from .interface_looped import (
    _LOSS_KWARGS,
    LoopedCausalLMOutputWithPast,
    LoopedModelOutputWithPast,
    _checked_kwargs,
    _select_hidden_states_at_r,
    accepts_past_key_values,
    causal_attention_mask,
    check_token_ids,
    warn_past_positions,
)
from .loop_attention_looped import build_loop_attention
from .parcae_looped import DiagonalInjection, build_parcae_modules, value_embedding_lookup
from .recurrent_block_looped import (
    GateExit,
    LoopedHyperConnection,
    LoopedRecurrentBlock,
    LoopNorms,
    after_loop,
    build_loop_modules,
    exit_gate_probabilities,
    loop_norms,
    threshold_readout,
)
from .recurrent_block_looped import threshold_exit_steps as threshold_exit_steps

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5.20 (vLLM's pinned range) slices inline, as its Llama does

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Building blocks (Llama's, with the study's switches)
# ---------------------------------------------------------------------------------------------


class LoopedRotaryEmbedding(nn.Module):
    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: LoopedConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        if self.config.rope_table_dtype is not None:
            # The study keeps its tables in bf16 (nanochat/gpt.py): its weights expect those values.
            table = getattr(torch, self.config.rope_table_dtype)
            cos, sin = cos.to(table), sin.to(table)
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _SoftCap(torch.autograd.Function):
    """cap * tanh(x / cap) in fp32 (the study's soft-cap), with a one-kernel backward.

    The forward is the study's three ops, so logits are bit-identical. Autograd's own backward
    of them is three passes over the (batch, seq, vocab) logits (x cap, tanh', / cap), the
    largest tensors of a training step; the derivative is 1 - tanh^2(x / cap), one
    ``tanh_backward`` from the saved tanh. The gradient equals
    autograd's up to the rounding of the x cap / cap pair it skips (1 ulp).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, cap: float) -> torch.Tensor:
        t = torch.tanh(logits.float() / cap)
        ctx.save_for_backward(t)
        ctx.input_dtype = logits.dtype
        return cap * t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (t,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, t).to(ctx.input_dtype), None


def exit_gate_loss(
    step_logits: list[torch.Tensor], probabilities: torch.Tensor, labels: torch.LongTensor | None, beta: float,
    ignore_index: int = -100, shift_labels: torch.LongTensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Ouro's training objective, per labelled token sum_t p_t L_t - beta H(p), averaged over the
    labelled tokens (or divided by ``num_items_in_batch``, as transformers' loss is under gradient
    accumulation). L_t is the cross-entropy of step t's logits, H(p) = -sum_t p_t log p_t. The
    entropy term keeps the gate from collapsing onto one step early in training (the Ouro paper's
    uniform-prior regulariser); labels shift as ``ForCausalLMLoss``'s do."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(probabilities.device)
    losses = torch.stack([
        F.cross_entropy(logits.float().flatten(0, -2), shift_labels.flatten(), ignore_index=ignore_index,
                        reduction="none").view(shift_labels.shape)
        for logits in step_logits
    ], dim=-1)  # fmt: skip
    entropy = -(probabilities * probabilities.clamp_min(torch.finfo(probabilities.dtype).tiny).log()).sum(-1)
    per_token = (probabilities * losses).sum(-1) - beta * entropy
    labelled = shift_labels != ignore_index
    total = per_token.masked_fill(~labelled, 0.0).sum()
    count = labelled.sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    return total / count


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class LoopedPreTrainedModel(PreTrainedModel):
    config: LoopedConfig
    config_class = LoopedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = [cls.__name__ for cls in DECODER_LAYERS.values()]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # r is a Python int: each r is its own graph (recompiled once), the forward has no data-dependent
    # branch at a fixed r.
    _can_compile_fullgraph = True
    # One record per *application* of a layer: a shared layer's hook fires every time it runs, so
    # the hidden states and attentions are in execution order (see the module docstring).
    _can_record_outputs = {
        "hidden_states": OutputRecorder(LoopedDecoderLayer, index=0),
        "attentions": OutputRecorder(LoopedAttention, index=1),
    }

    def __init__(self, config: LoopedConfig, *inputs: object, **kwargs: object) -> None:
        super().__init__(config, *inputs, **kwargs)
        if config.state_init == "like_init":
            # Parcae's h_0 is drawn by torch's own trunc_normal_ (Parcae's RNG calls, for its state bit
            # for bit), whose rejection loop is a data-dependent branch: a graph break, so not fullgraph.
            self._can_compile_fullgraph = False

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init (``init_scheme="hf"``) or the study's (``"study"``, nanochat/gpt.py
        ``init_weights``). Roles are tagged on the leaf modules when they are built
        (``looped_study_init``), so this works leaf by leaf, as transformers applies it, and under
        remote code. Both schemes start the injection at [I | 0] and hyperconnections cyclic."""
        study = self.config.init_scheme == "study"
        role = getattr(module, "looped_study_init", None)
        if role == "zeros":  # a per-loop LoRA delta (loop_lora_looped.py): zero until a retrofit writes it
            for param in module.parameters(recurse=False):
                init.zeros_(param)
        elif role == "injection":
            # u = W [e; h] with W = [I | 0]: every recurrence reads e at init (the study). 0.1.0
            # checkpoints concatenated [h; e]; they are loaded, never initialised, so one form.
            d = module.weight.shape[0]
            init.copy_(module.weight, torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1))
        elif study and role is not None:
            kind, std = role
            if kind == "uniform":
                # Uniform with bound sqrt(3) std has that std and no outliers (the study's choice).
                bound = 3**0.5 * std
                init.uniform_(module.weight, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif study and isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=1.0)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, (LoopedHyperConnection, DiagonalInjection)):
            module.reset_parameters()
        else:
            super()._init_weights(module)


class LoopedModel(LoopedPreTrainedModel):
    def __init__(self, config: LoopedConfig, exit_gate: bool = True) -> None:
        """``exit_gate=False`` leaves out the exit gate of a gated config (``config.exit_gate``): the
        sequence, token and span heads read the last recurrence's final state, never the gate's
        readout, so a gate there would be a parameter that never trains."""
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size, self.padding_idx)
        self.embedding_norm = LoopedRMSNorm(config.hidden_size, config.rms_norm_eps) if config.embedding_norm else None
        layer = DECODER_LAYERS[config.norm_placement]
        self.prelude_layers = nn.ModuleList(layer(config) for _ in range(config.num_prelude_layers))
        self.recurrent_layers = nn.ModuleList(layer(config, config.recurrent_num_key_value_heads)
                                              for _ in range(config.num_recurrent_layers))  # fmt: skip
        self.coda_layers = nn.ModuleList(layer(config) for _ in range(config.num_coda_layers))
        build_loop_attention(self, config)  # IQuest's gated loop attention, or nothing
        norm = lambda: LoopedRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # noqa: E731
        build_loop_modules(self, config, norm, exit_gate=exit_gate)
        build_parcae_modules(self, config, norm)  # prelude norm, C, value embeddings: each None unless set
        self.rotary_emb = LoopedRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def loop_norms(self) -> LoopNorms:
        """(the recurrence norm, the post-loop norm, the norm after the coda): ``loop_norms``."""
        return loop_norms(self)

    @accepts_past_key_values
    @_select_hidden_states_at_r
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        num_recurrences: int | None = None,
        output_recurrent_states: bool = False,
        kv_budget: int | None = None,
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_recurrences: int | None = None,
        exit_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LoopedModelOutputWithPast:
        r"""The decoder. ``num_recurrences`` overrides r for this call; ``output_recurrent_states``
        returns the state after every recurrence; ``kv_budget`` overrides ``config.kv_budget`` (the
        KV-cache slots kept per block layer, see ``LoopedConfig.kv_budget``). ``exit_criterion``,
        ``exit_threshold`` and ``min_recurrences`` override the config's adaptive exit (see
        ``LoopedConfig``); ``exit_head`` maps a final-normed state to logits for the criteria that
        read the next-token distribution (``LoopedForCausalLM`` passes its head).
        ``output_hidden_states`` / ``output_attentions`` are collected per layer application (see
        the module docstring); ``return_dict=False`` returns a tuple. Unknown keywords raise
        ``TypeError``."""
        config = self.config
        kwargs = _checked_kwargs(self, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        r = config.resolve_num_recurrences(num_recurrences)
        plan = KVSlotPlan.for_call(config, r, kv_budget)
        exit_rule = resolve_exit_rule(self, exit_criterion, exit_threshold, min_recurrences, r, exit_head, cache, kwargs)

        if inputs_embeds is None:
            check_token_ids(config, input_ids, self.training and torch.is_grad_enabled())
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            prepare_cache(cache, plan)

        positions_given = position_ids is not None
        past_seen_tokens = None
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        warn_past_positions(config, inputs_embeds.shape[1], past_seen_tokens,
                            "input_ids" if input_ids is not None else "inputs_embeds")  # fmt: skip
        causal_mask = causal_attention_mask(
            config, inputs_embeds, attention_mask, cache, position_ids if positions_given else None
        )
        # What every layer application gets, as Llama's layers do. position_ids only when the caller
        # gave them: the varlen / packed-sequence attention backends read them, and positions this
        # forward made itself are one plain sequence per row (nothing for a backend to look for).
        layer_kwargs = dict(
            attention_mask=causal_mask, position_embeddings=self.rotary_emb(inputs_embeds, position_ids),
            cache=cache, **kwargs,
        )
        if positions_given:
            layer_kwargs["position_ids"] = position_ids
        if self.value_embeddings is not None:
            layer_kwargs["value_embeddings"] = value_embedding_lookup(self, input_ids)

        h = inputs_embeds
        if config.embedding_multiplier != 1.0:
            h = h * config.embedding_multiplier  # Huginn: sqrt(d); the tied head reads the table unscaled
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        for j, layer in enumerate(self.prelude_layers):
            h = layer(h, cache_index=plan.prelude(j), **layer_kwargs)[0]
        if self.prelude_norm is not None:
            h = self.prelude_norm(h)  # Parcae's ln_prelude: e is the normed prelude output
        num_new_tokens = inputs_embeds.shape[1]
        predict = None  # the distribution exit criteria's decoder: after_loop (coda cropped back), head
        if exit_rule is not None and exit_rule[0] == EXIT_GATE_CRITERION:
            predict = GateExit(self.exit_gate, exit_rule[1])
        elif exit_rule is not None and exit_head is not None:
            predict = coda_predictor(self, exit_head, plan.coda(0), layer_kwargs, num_new_tokens)
        loop = LoopedRecurrentBlock(self, plan, layer_kwargs, num_new_tokens)
        # The gate reads every recurrence's state, so the loop keeps them when there is one.
        h, recurrent_states, used = loop(h, exit_rule, predict, output_recurrent_states or self.exit_gate is not None)
        exit_probabilities = None
        if self.exit_gate is not None:
            exit_probabilities = exit_gate_probabilities(self.exit_gate, recurrent_states)

        def coda(x: torch.Tensor) -> torch.Tensor:
            for j, layer in enumerate(self.coda_layers):
                x = layer(x, cache_index=plan.coda(j), **layer_kwargs)[0]
            return x

        h = after_loop(self, h, coda)

        return LoopedModelOutputWithPast(
            last_hidden_state=h,
            cache=cache if use_cache else None,
            recurrent_states=tuple(recurrent_states) if output_recurrent_states else None,
            recurrences_used=used,
            exit_probabilities=exit_probabilities,
        )

    def step_output(
        self, state: torch.Tensor, coda: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """What ``last_hidden_state`` would be if the loop stopped at ``state`` (a recurrence's
        state): the modules after the loop (``recurrent_block_looped.after_loop``), with ``coda``
        running the coda layers as the caller's cache needs (``None``: no coda pass; the exit gate's
        readouts, refused with coda layers). The logit lens and the exit criteria decode through it."""
        return after_loop(self, state, coda)


class LoopedForCausalLM(LoopedPreTrainedModel, LoopedGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Tensor parallelism as Llama: the head's output columns are sharded then gathered (the
    # soft-cap is elementwise, so it runs on the gathered logits). No pipeline plan: transformers'
    # pipeline parallelism splits ``base_model.layers`` into stages, and a looped model's shared
    # block runs r times in one place, so there is no flat stack to cut.
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__(config)
        self.model = self.trunk_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        if not config.tie_word_embeddings:
            self.lm_head.looped_study_init = ("normal", 0.001)  # the study: small logits at init
        self.post_init()
        gate = self.model.exit_gate
        if gate is not None and config.exit_gate_entropy_beta is None and config.exit_gate_output != "weighted":
            # No loss term reads the gate (the last recurrence's or a gathered step's logits), so it
            # would be a parameter that never trains: frozen, and said once.
            gate.requires_grad_(False)
            logger.info(f"exit_gate frozen: no loss term trains it (exit_gate_output={config.exit_gate_output!r}, "
                        "exit_gate_entropy_beta=None); set exit_gate_entropy_beta (Ouro's loss) or "
                        "exit_gate_output='weighted' to train it")  # fmt: skip

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def logits_from_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """lm_head, cropped to ``vocab_size`` (padded rows never get probability), then the study's
        soft-cap (tanh, in fp32), cap * tanh(logits / cap)."""
        logits = self.lm_head(hidden_states)
        if logits.shape[-1] != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        cap = self.config.logit_softcap
        if cap is not None:
            logits = _SoftCap.apply(logits, cap)
        return logits

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        num_recurrences: int | None = None,
        output_recurrent_states: bool = False,
        kv_budget: int | None = None,
        exit_criterion: str | None = None,
        exit_threshold: float | None = None,
        min_recurrences: int | None = None,
        exit_gate_output: str | None = None,
        exit_gate_threshold: float | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LoopedCausalLMOutputWithPast:
        r"""Causal-LM forward. ``num_recurrences`` overrides r for this call (``generate`` passes it
        through, as it does ``kv_budget``, the KV-cache budget of ``LoopedConfig.kv_budget``);
        ``output_recurrent_states`` returns the state after every recurrence; ``exit_criterion``,
        ``exit_threshold`` and ``min_recurrences`` set per-token adaptive exit (``LoopedConfig``;
        ``recurrences_used`` in the output says how many recurrences each token ran); ``labels`` are NOT
        shifted by the caller (the loss shifts them; -100 is ignored). ``ignore_index`` and
        ``shift_labels`` go to the loss (a loss is computed when either labels or shift_labels is
        given), ``return_dict=False`` returns a tuple, and an unknown keyword raises ``TypeError``.
        With an exit gate (``LoopedConfig.exit_gate``), ``exit_gate_output`` and
        ``exit_gate_threshold`` override the config's readout for this call, and the output carries
        ``exit_probabilities``; ``exit_criterion="gate"`` makes the gate stop each token at its
        threshold step (``LoopedConfig.exit_gate``; ``exit_gate_threshold`` is then its threshold
        unless ``exit_threshold`` is given)."""
        loss_kwargs = {key: kwargs.pop(key) for key in _LOSS_KWARGS if key in kwargs}
        kwargs = _checked_kwargs(self, kwargs)  # so an error names the class the caller called
        readout = self.config.exit_gate_settings(exit_gate_output, exit_gate_threshold)  # None: no gate
        wants_loss = labels is not None or loss_kwargs.get("shift_labels") is not None
        beta = self.config.exit_gate_entropy_beta if readout is not None and wants_loss else None
        criterion = self.config.exit_criterion if exit_criterion is None else exit_criterion
        gate_stops = readout is not None and criterion == EXIT_GATE_CRITERION
        if gate_stops:
            exit_threshold = self._gate_exit_threshold(readout[0], beta, exit_threshold, exit_gate_threshold)
        # Only a gate readout other than the last step, or Ouro's loss, reads every step's state;
        # under the gate's exit a token's last state is its exit step's, the threshold readout.
        per_step = readout is not None and not gate_stops and (readout[0] != "last" or beta is not None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            num_recurrences=num_recurrences,
            output_recurrent_states=output_recurrent_states or per_step,
            kv_budget=kv_budget,
            exit_criterion=exit_criterion,
            exit_threshold=exit_threshold,
            min_recurrences=min_recurrences,
            exit_head=self.logits_from_hidden,
            return_dict=True,  # the tuple, if asked for, is made here (config.return_dict=False too)
            **kwargs,
        )
        used = outputs.recurrences_used
        loss = None
        if per_step:
            logits, used, loss = self._exit_gate_readout(outputs, readout, beta, labels, logits_to_keep, loss_kwargs,
                                                         kwargs.get("num_items_in_batch"))  # fmt: skip
        else:
            hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
            logits = self.logits_from_hidden(hidden_states)
        if loss is None and wants_loss:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                num_items_in_batch=kwargs.get("num_items_in_batch"), **loss_kwargs,
            )
        return LoopedCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            recurrent_states=outputs.recurrent_states if output_recurrent_states else None,
            recurrences_used=used,
            exit_probabilities=outputs.exit_probabilities,
        )

    @staticmethod
    def _gate_exit_threshold(
        output: str, beta: float | None, exit_threshold: float | None, exit_gate_threshold: float | None
    ) -> float | None:
        """The call's ``exit_threshold`` under ``exit_criterion="gate"``: a per-call
        ``exit_gate_threshold`` is the gate's threshold too (``LoopedConfig.exit_settings`` falls
        back to the config's). Refuses the readouts and loss that need every token at every step."""
        if output == "weighted":
            raise ValueError(f"exit_gate_output='weighted': reads every recurrence of every token, which "
                             f"exit_criterion={EXIT_GATE_CRITERION!r} stops; use 'last' or 'threshold'")  # fmt: skip
        if beta is not None:
            raise ValueError(f"exit_gate_entropy_beta={beta!r}: Ouro's loss reads every recurrence of every token, "
                             f"which exit_criterion={EXIT_GATE_CRITERION!r} stops")  # fmt: skip
        if exit_gate_threshold is None:
            return exit_threshold
        if exit_threshold is not None and exit_threshold != exit_gate_threshold:
            raise ValueError(f"exit_gate_threshold={exit_gate_threshold!r}: differs from exit_threshold="
                             f"{exit_threshold!r}, and exit_criterion={EXIT_GATE_CRITERION!r} has one threshold")  # fmt: skip
        return exit_gate_threshold

    def _exit_gate_readout(
        self, outputs: LoopedModelOutputWithPast, readout: tuple[str, float], beta: float | None,
        labels: torch.LongTensor | None, logits_to_keep: int | torch.Tensor, loss_kwargs: dict,
        num_items_in_batch: torch.Tensor | int | None,
    ) -> tuple[torch.Tensor, torch.LongTensor | None, torch.Tensor | None]:
        """(logits, recurrences_used, loss) from every recurrence's state: the gate's threshold
        or weighted readout (``LoopedConfig.exit_gate_output``) and, with ``beta``, Ouro's loss."""
        output, threshold = readout
        states = [self.model.step_output(slice_logits_to_keep(s, logits_to_keep)) for s in outputs.recurrent_states]
        probabilities = slice_logits_to_keep(outputs.exit_probabilities, logits_to_keep)
        step_logits = None
        if output == "weighted" or beta is not None:
            step_logits = [self.logits_from_hidden(state) for state in states]
        used = None
        if output == "threshold":
            # Each token's state (or, when every step's logits exist anyway, its logits) at its
            # exit step: one head pass, not one per step.
            picked, steps = threshold_readout(step_logits if step_logits is not None else states, probabilities,
                                              threshold)  # fmt: skip
            logits = picked if step_logits is not None else self.logits_from_hidden(picked)
            used = steps + 1
        elif output == "weighted":
            # sum_t p_t logits_t, accumulated in step order (as Ouro's code does).
            logits = step_logits[0] * probabilities[..., 0:1].to(step_logits[0].dtype)
            for t in range(1, len(step_logits)):
                logits = logits + step_logits[t] * probabilities[..., t : t + 1].to(step_logits[t].dtype)
        else:
            logits = step_logits[-1]
        loss = None
        if beta is not None:
            loss = exit_gate_loss(step_logits, probabilities, labels, beta, num_items_in_batch=num_items_in_batch,
                                  **loss_kwargs)  # fmt: skip
        return logits, used, loss

    # The study's accounting, for users; accounting_looped.py owns it (training, planning and cards call it).
    def num_scaling_params(self) -> dict[str, int]:
        """Parameters in the study's groups: ``once``, ``recurrent``, ``embedding``, ``lm_head``,
        ``total`` (``accounting_looped.num_scaling_params``)."""
        return num_scaling_params(self)

    def training_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Training FLOPs per token at ``seq_len`` and r (``accounting_looped.training_flops_per_token``)."""
        return training_flops_per_token(self, seq_len, num_recurrences)

    def inference_flops_per_token(self, seq_len: int, num_recurrences: int | None = None) -> float:
        """Forward FLOPs per token at context ``seq_len`` and r (``accounting_looped.inference_flops_per_token``)."""
        return inference_flops_per_token(self, seq_len, num_recurrences)


# ---------------------------------------------------------------------------------------------
# The standard heads: transformers' generic ones on the looped trunk (as Llama's in 5.24)
# ---------------------------------------------------------------------------------------------


# The trunk every model class here builds (``trunk_class``): the per-loop LoRA classes
# (loop_lora_looped.py) are these classes on their own trunk.
LoopedPreTrainedModel.trunk_class = LoopedModel

# The generic heads build their trunk with ``AutoModel.from_config``, which cannot resolve the looped
# trunk as remote code without looped_hf installed; so each builds ``LoopedModel`` itself, without
# a gated config's exit gate: they read the last recurrence's final state, so a gate would be a
# parameter that never trains (a causal-LM checkpoint's gate weights load as unused keys).


class LoopedForSequenceClassification(GenericForSequenceClassification, LoopedPreTrainedModel):
    """A linear ``score`` head on the last non-pad token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = self.trunk_class(config, exit_gate=False)  # no gate readout here: no gate
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class LoopedForTokenClassification(GenericForTokenClassification, LoopedPreTrainedModel):
    """A linear ``score`` head on every token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = self.trunk_class(config, exit_gate=False)  # no gate readout here: no gate
        # The generic head's dropout: classifier_dropout, else hidden_dropout, else 0.1.
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=getattr(config, "token_classification_bias", True))
        self.post_init()


class LoopedForQuestionAnswering(GenericForQuestionAnswering, LoopedPreTrainedModel):
    """Start / end span logits from every token's final state (transformers' generic)."""

    def __init__(self, config: LoopedConfig) -> None:
        LoopedPreTrainedModel.__init__(self, config)
        self.model = self.trunk_class(config, exit_gate=False)  # no gate readout here: no gate
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()


__all__ = [
    "LoopedPreTrainedModel",
    "LoopedModel",
    "LoopedForCausalLM",
    "LoopedGenerateOutput",
    "RecurrenceDraftCandidateGenerator",
    "LoopedForSequenceClassification",
    "LoopedForTokenClassification",
    "LoopedForQuestionAnswering",
]
