"""What the native vLLM model serves: its architecture names, the CPU kernels' names, and
``servable_problems`` / ``check_servable`` (read from the config only: no vLLM, no torch).

A leaf of the serving package: ``engine``, ``plugin``, ``cpu_norm`` and ``vllm_model`` import these
names from here, and the package's ``__init__`` re-exports them, so no module of the package
imports the package itself (no import circle, lazy imports included).
"""

from __future__ import annotations

from typing import Any

VLLM_ARCHITECTURE = "LoopedForCausalLM"
VLLM_MODEL_CLASS = "looped_hf.serving.vllm_model:LoopedForCausalLM"
# Every architecture that class serves: the looped LM's and a per-loop LoRA retrofit's (loop_lora_vllm).
VLLM_ARCHITECTURES = (VLLM_ARCHITECTURE, "LoopLoRAForCausalLM")
# vLLM's CPU attention backend runs these head sizes only (CPUAttentionBackend.get_supported_head_sizes);
# the vLLM model pads any smaller head_dim to the next of them (vllm_model.attention_head_size).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Rotary variants whose tables depend on the length of the current call (transformers'
# dynamic_rope_update): vLLM's calls are not generate()'s, so their positions would rotate differently.
CALL_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
#: The vLLM IR provider name of the CPU build's RMSNorm kernels (``cpu_norm``), and the IR ops it implements.
CPU_NORM_PROVIDER = "looped_hf_cpu_c"
CPU_NORM_OPS = ("rms_norm", "fused_add_rms_norm")


def servable_problems(
    config: Any, *, pipeline_parallel_size: int = 1, tensor_parallel_size: int = 1, device: str | None = None
) -> list[str]:
    """Every reason the native vLLM model cannot serve ``config`` exactly as ``generate()`` computes
    it, one line each naming the field and the value (empty: servable). Everything else that
    ``LoopedConfig`` accepts is served: prelude / block / coda, every injection mode, each QK-norm,
    each norm placement, q/k bias, the embedding multiplier, the post-loop norm, the recurrence norm
    (own or the final norm's weight), the exit gate's "last" and "threshold" readouts (every recurrence
    runs; each token reads its exit step's state), the soft-cap, the embedding norm, tied or untied
    heads, GQA, padded vocabularies, both looped formats, every hidden_act, rope_table_dtype,
    kv_budget, r from hf_overrides, the deterministic truncated-normal state (std 0), and on CPU every
    head_dim up to the largest head size vLLM's CPU attention runs (padded to one it runs)."""
    from .parcae_vllm import parcae_servable_problems

    problems = parcae_servable_problems(config, tensor_parallel_size)
    if config.state_init == "noise":
        problems.append(
            "state_init='noise': h_0 is drawn from the global RNG on every forward, so vLLM's forward calls "
            "cannot reproduce generate(); serve a checkpoint with state_init 'prelude' or 'zeros'"
        )
    std = getattr(config, "state_init_std", 0)
    if config.state_init == "truncated_normal" and std > 0:
        problems.append(
            f"state_init='truncated_normal' with state_init_std={std!r}: h_0 is drawn from the global RNG on every "
            "forward, so vLLM's forward calls cannot reproduce generate(); convert with the deterministic zero "
            "state (state_init 'zeros')"
        )
    if getattr(config, "exit_gate", False) and config.exit_gate_output == "weighted":
        problems.append(
            "exit_gate_output='weighted': the expected logits over every recurrence are not served by vLLM (its "
            "head reads one state per token); serve exit_gate_output 'last' or 'threshold' at a fixed r"
        )
    if config.exit_criterion is not None:
        problems.append(
            f"exit_criterion={config.exit_criterion!r}: per-token adaptive exit is not served by vLLM (every token of "
            "a batch runs its request's r); save the config with exit_criterion=None to serve at a fixed r"
            + (
                "; a request asks for the gate's exit itself (exit_criterion='gate')"
                if config.exit_gate
                else ""
            )
        )
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type in CALL_DEPENDENT_ROPE_TYPES:
        problems.append(
            f"rope_parameters.rope_type={rope_type!r}: its tables depend on the length of each forward call, "
            "which vLLM chooses differently from generate()"
        )
    if pipeline_parallel_size != 1:
        problems.append(
            f"pipeline_parallel_size={pipeline_parallel_size}: the looped model is not split into pipeline stages "
            "(its shared block runs r times in one place); use tensor_parallel_size"
        )
    if config.num_attention_heads % tensor_parallel_size or (
        config.num_key_value_heads >= tensor_parallel_size
        and config.num_key_value_heads % tensor_parallel_size
    ):
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: must divide num_attention_heads={config.num_attention_heads} "
            f"and num_key_value_heads={config.num_key_value_heads}"
        )
    if tensor_parallel_size != 1 and getattr(config, "qk_norm", None) == "learnable_projection_before_rope":
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: qk_norm='learnable_projection_before_rope' normalises "
            "over every head of q and k at once, which a tensor-parallel shard does not hold; serve on one device"
        )
    if getattr(config, "loop_attention", None) is not None and tensor_parallel_size != 1:
        problems.append(
            f"tensor_parallel_size={tensor_parallel_size}: loop_attention={config.loop_attention!r} gates whole heads "
            "with per-head weights that are not sharded; serve on one device"
        )
    if device == "cpu" and config.head_dim > max(CPU_HEAD_SIZES):
        problems.append(
            f"head_dim={config.head_dim}: vLLM's CPU attention runs head sizes up to {max(CPU_HEAD_SIZES)} "
            "(smaller ones are padded to a size it runs)"
        )
    from .loop_lora_vllm import loop_lora_problems  # a per-loop LoRA retrofit's own limits

    return problems + loop_lora_problems(config, tensor_parallel_size=tensor_parallel_size)


def check_servable(config: Any, **kwargs: Any) -> None:
    """Raise ``ValueError`` with every line of ``servable_problems`` (see there)."""
    problems = servable_problems(config, **kwargs)
    if problems:
        raise ValueError("this looped checkpoint cannot be served by vLLM: " + "; ".join(problems))


__all__ = [
    "CALL_DEPENDENT_ROPE_TYPES",
    "CPU_HEAD_SIZES",
    "CPU_NORM_OPS",
    "CPU_NORM_PROVIDER",
    "VLLM_ARCHITECTURE",
    "VLLM_ARCHITECTURES",
    "VLLM_MODEL_CLASS",
    "check_servable",
    "servable_problems",
]
