"""The ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls ``register()`` in each of its
processes before it reads a model's config.

It makes three things known to vLLM:

- ``LoopedConfig`` to transformers' ``AutoConfig`` under model_type ``looped``, so vLLM builds a
  looped folder's config from the installed looped_hf, with no ``--trust-remote-code`` (a folder's
  ``auto_map`` names remote code, which transformers prefers only when the type is unknown);
- architecture ``LoopedForCausalLM`` -> ``looped_hf.serving.vllm_model`` (imported lazily, in the
  process that builds the model);
- a config hook (vLLM's ``MODELS_CONFIG_MAP``, run when the engine's config is made, in the process
  the user started) that refuses what cannot be served with one clear line, and, for a
  ``kv_budget`` below r, turns off the two scheduler features that would split tokens into forward
  calls differently from ``generate()`` (see ``vllm_model``'s docstring): prefix caching and
  chunked prefill.
"""

from __future__ import annotations

import logging

from . import VLLM_ARCHITECTURE, VLLM_MODEL_CLASS, check_servable

logger = logging.getLogger(__name__)


def _budget_settings(vllm_config) -> None:
    """With kv_budget < r a token's KV at a shared slot depends on which tokens shared its forward
    call, so prompts must be prefilled whole, and never from another request's cached prefix."""
    config = vllm_config.model_config.hf_config
    plan = config.slot_plan()
    if not plan.shares_slots:
        return
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

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None


def register() -> None:
    """Register the looped config, model and config hook with vLLM (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from ..configuration_looped import LoopedConfig

    AutoConfig.register(LoopedConfig.model_type, LoopedConfig, exist_ok=True)
    if VLLM_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(VLLM_ARCHITECTURE, VLLM_MODEL_CLASS)
    MODELS_CONFIG_MAP[VLLM_ARCHITECTURE] = LoopedConfigHook
