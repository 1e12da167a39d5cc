"""What a looped forward takes and returns: its output classes, the keywords ``**kwargs`` may carry
(anything else raises instead of vanishing), ``output_hidden_states=[...]`` at the call's r, and
the attention mask every layer application gets (``causal_attention_mask``: ``None``, the
backend's own causal mode, wherever that is the same thing).

Hidden states, ``output_hidden_states=True``: P + r*K + C + 1 tensors, one per layer
*application* in execution order. Index 0 is the input of the first application (with P > 0 the
embedding, after the embedding norm when there is one; with P = 0 the first block input, the
injected state); index i >= 1 is the output of application i - 1: prelude layer p (0-based) is
p + 1, recurrence s and block layer j (0-based) are P + s*K + j + 1, coda layer c is
P + r*K + c + 1, and the last entry is the final normed state (``last_hidden_state``), as for
Llama. A block layer's output is recorded before the recurrence norm and the next injection (the
normed state after every recurrence is ``recurrent_states``). ``output_hidden_states=[i, ...]``
selects by these indices, negative ones counted from the end at the call's r. Attentions (eager
attention only) have the same order without the leading input: ``attentions[a]`` is application
a, the one that also owns cache slot a (without a KV budget).

Shipped beside ``modeling_looped.py`` in every checkpoint (remote code follows the relative
import), so it imports only torch and transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask, sdpa_mask
from transformers.masking_utils import create_causal_mask as _create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import TransformersKwargs
from transformers.utils.import_utils import is_tracing
from transformers.utils.logging import get_logger

logger = get_logger(__name__)

# ---------------------------------------------------------------------------------------------
# transformers < 5.20: the KV cache was called ``past_key_values``
# ---------------------------------------------------------------------------------------------
# transformers 5.20 renamed the KV cache ``past_key_values`` -> ``cache`` everywhere a looped
# model meets it: the forward keyword ``generate()`` passes (and ``prepare_inputs_for_generation``
# builds), the ``ModelOutput`` field ``generate()`` reads back (``BaseModelOutputWithPast``,
# ``CausalLMOutputWithPast``, ``GenerateDecoderOnlyOutput``), ``create_causal_mask``'s argument,
# and the keyword ``GradientCheckpointingLayer`` nulls. looped_hf says ``cache`` throughout; on an
# older transformers (the project supports >= 5.16.1, vLLM 0.32 pins < 5.20) the shims below
# translate at those boundaries, so the model files stay written against the new name. The name
# is feature-detected from the output dataclass, never from the version string.
# The transformers versions these shims are written and tested for: pyproject.toml declares the
# same range (a test keeps the two equal), and checkpoint cards quote it for remote code.
SUPPORTED_TRANSFORMERS = ">=5.16.1,<5.26"
CACHE_KEYWORD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
CACHE_RENAMED = CACHE_KEYWORD == "cache"

if "cache" in inspect.signature(_create_causal_mask).parameters:
    create_causal_mask = _create_causal_mask
else:

    def create_causal_mask(*, cache: Cache | None = None, **kwargs) -> torch.Tensor | None:
        """transformers < 5.20's ``create_causal_mask``, called with 5.20's ``cache=`` keyword."""
        return _create_causal_mask(past_key_values=cache, **kwargs)


def accepts_past_key_values(forward: Callable) -> Callable:
    """Let ``forward(cache=...)`` also be called as ``forward(past_key_values=...)``.

    From transformers 5.20 that is the old name, renamed with transformers' deprecation warning.
    Before 5.20 it is the name ``generate()`` passes every step, so it is renamed silently (a
    warning there would blame the caller for transformers' own call)."""
    if CACHE_RENAMED:
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @wraps(forward)
    def wrapper(*args, **kwargs):
        if "past_key_values" in kwargs:
            old = kwargs.pop("past_key_values")
            if kwargs.get("cache") is not None and old is not None and old is not kwargs["cache"]:
                raise ValueError("past_key_values and cache are the same argument (the KV cache): pass only cache")
            if kwargs.get("cache") is None:
                kwargs["cache"] = old
        return forward(*args, **kwargs)

    return wrapper


def cache_output_alias(cls: type) -> type:
    """On transformers < 5.20, give a ``ModelOutput`` whose field is ``past_key_values`` the 5.20
    spelling too: ``cls(cache=...)`` and ``out.cache`` (read and set) mean ``past_key_values``, so
    the model builds and reads its outputs one way. The field keeps its old name (and its place in
    ``to_tuple()``), which is the key ``generate()`` reads back. A no-op from 5.20 on."""
    if "cache" in cls.__dataclass_fields__ or "past_key_values" not in cls.__dataclass_fields__:
        return cls
    init = cls.__init__

    @wraps(init)
    def __init__(self, *args, **kwargs):
        if "cache" in kwargs:
            if kwargs.get("past_key_values") is not None:
                raise ValueError(f"{cls.__name__}: pass the KV cache as cache or past_key_values, not both")
            kwargs["past_key_values"] = kwargs.pop("cache")
        init(self, *args, **kwargs)

    def _get(self) -> Cache | None:
        return self.past_key_values

    def _set(self, value: Cache | None) -> None:
        self.past_key_values = value

    cls.__init__ = __init__
    cls.cache = property(_get, _set, doc="The KV cache (transformers < 5.20 names the field past_key_values).")
    return cls


# Which cache slots can be cropped moved over releases: transformers 5.17 added the
# ``is_croppable`` flag (before, a plain dynamic slot crops but says nothing); 5.20 gave
# ``StaticLayer`` ``crop`` (it steps the write position back; the stale KV past it is masked and
# then overwritten) and taught ``DynamicLayer.crop`` to skip a slot never written (before, it
# slices ``None``; assisted decoding crops every slot of the draft's cache).


def slot_croppable(layer: object) -> bool:
    """Whether one cache slot can take a write and then drop it again."""
    if getattr(layer, "is_croppable", False):
        return True
    # transformers < 5.20: a plain static slot, cropped by ``crop_slot`` as 5.20 does.
    if type(layer) is StaticLayer and not hasattr(layer, "crop"):
        return True
    # transformers < 5.17 has no ``is_croppable`` flag; its plain dynamic slot crops as later ones do.
    return not hasattr(layer, "is_croppable") and type(layer) is DynamicLayer


def crop_slot(layer: object, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` tokens written to one cache slot (see ``slot_croppable``)."""
    if hasattr(layer, "crop"):
        layer.crop(-num_tokens)
    else:  # transformers < 5.20's StaticLayer: 5.20's StaticLayer.crop, in place (a static address)
        layer.cumulative_length.sub_(num_tokens)


# Whether a cache keeps slots no call of its r writes: from 5.20 they are harmless; before, the
# whole-cache ``crop`` of assisted decoding fails on them, so a call drops them (generation_looped).
KEEPS_UNWRITTEN_SLOTS = CACHE_RENAMED


if CACHE_RENAMED:
    CheckpointingLayer = GradientCheckpointingLayer
else:

    class CheckpointingLayer(GradientCheckpointingLayer):
        """transformers < 5.20's ``GradientCheckpointingLayer`` nulls a ``past_key_values`` keyword
        under gradient checkpointing (its backward replay would write the KV a second time) but
        not 5.20's ``cache``, which the looped layers take; this nulls ``cache`` as 5.20 does."""

        def __call__(self, *args, **kwargs):
            if (
                self.gradient_checkpointing and self.training and torch.is_grad_enabled()
                and not self._can_checkpoint_with_cache and kwargs.get("cache") is not None
            ):
                kwargs["cache"] = None
                logger.warning_once(
                    f"Caching is incompatible with gradient checkpointing in {type(self).__name__}. Setting `cache=None`."
                )
            return super().__call__(*args, **kwargs)

# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


@cache_output_alias
@dataclass
class LoopedModelOutputWithPast(BaseModelOutputWithPast):
    """``recurrent_states[i]``: the state after recurrence i+1 (before the coda), for logit lens.
    ``recurrences_used``: (batch, tokens) recurrences each token ran, with adaptive exit only.
    ``exit_probabilities``: (batch, tokens, r) the exit gate's distribution over the recurrences
    (``LoopedConfig.exit_gate``), float32."""

    recurrent_states: tuple[torch.Tensor, ...] | None = None
    recurrences_used: torch.LongTensor | None = None
    exit_probabilities: torch.Tensor | None = None


@cache_output_alias
@dataclass
class LoopedCausalLMOutputWithPast(CausalLMOutputWithPast):
    """``recurrences_used``: (batch, tokens) the recurrence each token's logits come from, under
    adaptive exit or the exit gate's threshold readout; ``exit_probabilities`` as
    ``LoopedModelOutputWithPast``'s."""

    recurrent_states: tuple[torch.Tensor, ...] | None = None
    recurrences_used: torch.LongTensor | None = None
    exit_probabilities: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------
# Keyword arguments: what ``**kwargs`` may carry, and what it must not swallow
# ---------------------------------------------------------------------------------------------

# The keywords transformers 5.24 threads through a decoder's ``**kwargs`` (``TransformersKwargs``):
# the output flags (read by ``capture_outputs``), ``num_items_in_batch`` (the loss, from Trainer)
# and the packed-sequence / attention-backend ones the attention functions read. Anything else
# would vanish into ``**kwargs`` with no effect, so it is refused (a ``None`` value asks for
# nothing and is dropped). ``output_router_logits`` is left out: there is no router here.
_FORWARD_KWARGS = frozenset(TransformersKwargs.__annotations__) - {"output_router_logits", "position_ids"}
# Loss keywords ``ForCausalLMLoss`` reads besides logits / labels / vocab_size / num_items_in_batch.
_LOSS_KWARGS = ("ignore_index", "shift_labels")
# Why a keyword that v4-era code (or another architecture) passes is refused.
_REFUSED_KWARG_HINTS = {
    "cache_position": "transformers 5 removed it; positions come from position_ids, or from the cache's length "
    "when position_ids is None",
    "num_logits_to_keep": "it is called logits_to_keep",
    "head_mask": "transformers 5 removed head masking",
    "token_type_ids": "a decoder-only model has no token types (looped_hf's tokenizers do not return them); "
    "drop the key",
    "output_router_logits": "this model has no router (it is not a mixture of experts)",
    "labels": "LoopedModel computes no loss; use LoopedForCausalLM (or a head class) for a loss",
    "layer_past": "the cache keyword is cache",
    "encoder_hidden_states": "this is a decoder-only model: there is no cross-attention",
}


def _checked_kwargs(owner: nn.Module, kwargs: dict, accepted: frozenset[str] = _FORWARD_KWARGS) -> dict:
    """``kwargs`` without ``None`` values of unknown keys; ``TypeError`` naming any other unknown key.

    A keyword that ``**kwargs`` swallows silently is a wrong result with no error (the v4
    ``past_key_values=`` restarted positions at 0); this makes every such keyword loud.
    """
    out = {}
    for key, value in kwargs.items():
        if key in accepted:
            out[key] = value
        elif value is not None:
            hint = _REFUSED_KWARG_HINTS.get(key, f"{type(owner).__name__} does not use it")
            shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)[:80]
            raise TypeError(f"{type(owner).__name__}.forward() got an unexpected keyword argument {key}={shown}: {hint}")
    return out


# ---------------------------------------------------------------------------------------------
# Inputs the model cannot read: refused with the name of the argument
# ---------------------------------------------------------------------------------------------


def warn_past_positions(config: PreTrainedConfig, num_new: int, past: int | None, what: str = "input_ids") -> None:
    """Warn once when ``past`` cached + ``num_new`` tokens reach past ``config.max_position_embeddings``.

    Not an error: RoPE computes any position, so such inputs run as they do on Llama (rope
    scaling exists for exactly this), only the model was not trained there. Only Python ints are
    compared, so it is free: with ``past=None`` (the caller gave position ids, whose values would
    have to be read from the device; packed rows restart them, so the token count says nothing)
    or a tensor (a static cache's length under ``torch.compile``) nothing is checked. Silent with
    ``rope_type="dynamic"``, which rescales itself past that length. The message carries no
    count, so a decoding loop warns once, not once per step."""
    rope = getattr(config, "rope_parameters", None) or {}
    if past is None or not isinstance(past, int) or rope.get("rope_type") == "dynamic":
        return
    limit = config.max_position_embeddings
    if num_new + past > limit:
        logger.warning_once(
            f"{what}: positions past max_position_embeddings={limit}, the positions this model was trained "
            "for; they run (RoPE computes any position), but the model was not trained there"
        )


def check_token_ids(config: PreTrainedConfig, input_ids: torch.Tensor, training: bool) -> None:
    """``ValueError`` naming ``input_ids`` when an id lies outside [0, vocab_size) (the embedding
    would raise a bare IndexError on a CPU, a device-side assert on a GPU, or read a padded row).

    Reading the min and max waits for the device, so it is skipped where that costs: while
    tracing (``torch.compile``, whose graphs must not branch on data) and in a training step on
    an accelerator (a host sync per micro-batch; training ids come from the tokenizer through
    ``TokenBlocks``). A CPU tensor is checked always, and so is every eval / generation forward,
    whose decoding loop waits for the device each step anyway."""
    if is_tracing(input_ids) or input_ids.numel() == 0 or (training and input_ids.device.type != "cpu"):
        return
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= config.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, vocab_size={config.vocab_size})")


def _select_hidden_states_at_r(forward: Callable) -> Callable:
    """Make ``output_hidden_states=[i, ...]`` select by the indices of the call's r.

    transformers' ``capture_outputs`` resolves (and bounds) the indices with
    ``config.num_hidden_layers``, the applications at the *default* r; a call at another r has
    P + r*K + C + 1 hidden states. For such a call (``num_recurrences=`` given as a keyword and
    different from the default) every state is collected and the unselected ones are replaced by
    ``None`` afterwards, as ``capture_outputs`` would. Applied outside ``capture_outputs``.
    """

    @wraps(forward)
    def wrapper(self, *args, **kwargs):
        selection = kwargs.get("output_hidden_states")
        r = kwargs.get("num_recurrences")
        if selection is None or isinstance(selection, bool) or r is None or r == self.config.num_recurrences:
            return forward(self, *args, **kwargs)
        n = self.config.num_layer_applications(int(r)) + 1
        indices = [selection] if isinstance(selection, int) else list(selection)
        keep = {i % n for i in indices if -n <= i < n}
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        out = forward(self, *args, **{**kwargs, "output_hidden_states": True, "return_dict": True})
        out.hidden_states = tuple(h if i in keep else None for i, h in enumerate(out.hidden_states))
        return out if return_dict else out.to_tuple()

    return wrapper


# ---------------------------------------------------------------------------------------------
# The attention mask
# ---------------------------------------------------------------------------------------------

# Mask builders whose attention function applies a plain causal mask itself when it gets none
# (SDPA's ``is_causal``, flash-attention's ``causal``). Keyed by the builder, not by the name, so a
# hub kernel or a registered alias that reuses one of them is covered too.
_CAUSAL_BY_ITSELF = (sdpa_mask, flash_attention_mask)


def _plain_causal(attention_mask: torch.Tensor | None, cache: Cache | None, q_length: int) -> bool:
    """Whether attention over these inputs is exactly the causal triangle over the new tokens:
    no padding (no mask, or a 2-D mask that is all ones, read only outside tracing), and no
    earlier tokens in the cache (the keys are the queries' own tokens, so the square is causal)."""
    # The cache first: it is host-side bookkeeping, while reading the mask's values waits for the device.
    if cache is not None:
        if getattr(cache, "is_compileable", False):
            return False  # a static cache attends over all max_cache_len slots: it needs its mask
        if cache.get_seq_length() != 0 or cache.get_mask_sizes(q_length, 0)[0] != q_length:
            return False
    if attention_mask is None:
        return True
    return attention_mask.ndim == 2 and not is_tracing(attention_mask) and bool(attention_mask.all())


def causal_attention_mask(
    config: PreTrainedConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask every layer application gets, or ``None`` where the attention function's own causal
    mode is the same thing.

    Why not always ``create_causal_mask``: under ``torch.compile`` it cannot read tensors, so it
    assumes the worst (position ids might be packed documents, a mask might have padding) and
    materialises a (batch, 1, T, T) mask even for unpadded training rows. SDPA then cannot take
    its causal fast path (the flash kernel skips the upper triangle only with ``is_causal``) and
    reads the mask in backward too (docs/gpu.md, "Attention without a mask"). So when the call is
    plain causal (``_plain_causal``), ``position_ids`` were not given (this forward's own
    positions are one sequence per row, never packed) and the backend masks causally by itself,
    the answer is ``None`` — in eager mode and compiled alike. Everything else (padding, decode
    steps and chunked prefill over a cache, static caches, packed ``position_ids``, eager / flex
    attention, which need their mask) goes to ``create_causal_mask``, which gives packed rows
    (``position_ids`` restarting per document, no ``attention_mask``) a block-diagonal mask, as
    for Llama; here also when the call brings an empty cache.
    """
    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(config._attn_implementation)
    if (
        position_ids is None
        and builder in _CAUSAL_BY_ITSELF
        and _plain_causal(attention_mask, cache, inputs_embeds.shape[1])
    ):
        return None
    if (
        position_ids is not None and attention_mask is None and cache is not None
        and not is_tracing(position_ids) and _plain_causal(None, cache, inputs_embeds.shape[1])
    ):
        # transformers reads packed documents (position_ids that restart) only without a cache,
        # but ``use_cache`` defaults to True, so a plain forward of packed rows brings an empty
        # one; left in, every document would attend to the ones before it in the row. An empty
        # dynamic cache adds no keys, so without it the mask is the same one, packing included.
        cache = None
    return create_causal_mask(
        config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
        position_ids=position_ids,
    )
