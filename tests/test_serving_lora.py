"""A peft LoRA adapter of a looped model serves through vLLM's LoRA support as ``generate()`` runs it.

A tiny looped checkpoint (prelude, a shared block at r = 3, coda; gated MLP, so both of the vLLM
model's fused layers, q/k/v and gate/up, take their adapter's parts) gets a peft adapter on every
projection of every layer, with random non-zero B (``init_lora_weights=False``), so the adapter
changes what the model says. vLLM serves the base folder with ``enable_lora=True``: without a
``LoRARequest`` its greedy tokens are the base model's ``generate()``'s, with one they are the
``generate()`` tokens of the model with the adapter merged (``merge_and_unload``), and chosen
tokens' log-probabilities agree within 1e-3, in float32. The shared block's adapter applies at
every recurrence, in vLLM as in the HF model.
"""

from __future__ import annotations

import pytest
import torch
from serving_helpers import (
    SERVING_VOCAB,
    greedy_references_via,
    reference_python,
    serving_model,
    vllm_workdir,
)
from test_serving_parity import NEW_TOKENS, assert_served_as_generate, close, greedy, make_llm, needs_vllm

peft = pytest.importorskip("peft")

PROMPT_LENGTHS = (1, 9, 33)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARCH = dict(hidden_act="silu", qk_norm="learnable_before_rope")


@pytest.fixture(scope="module")
def folders():
    """{"base": the checkpoint, "adapter": its peft adapter, "merged": base + adapter merged}."""
    with vllm_workdir("looped-vllm-lora-") as root:
        base = serving_model(seed=3, **ARCH)
        base.save_pretrained(root / "base")
        torch.manual_seed(4)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False
        )
        lora = peft.get_peft_model(base, config)
        lora.save_pretrained(root / "adapter")
        lora.merge_and_unload().save_pretrained(root / "merged")
        yield {name: root / name for name in ("base", "adapter", "merged")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, SERVING_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(folders, prompts) -> dict[str, list]:
    """``generate()``'s greedy tokens and logprobs of the base and the merged model."""
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference "
                    "(set LOOPED_HF_REFERENCE_PYTHON)")  # fmt: skip
    jobs = [
        dict(checkpoint=folders[name], prompts=prompts, n=NEW_TOKENS, kwargs={})
        for name in ("base", "merged")
    ]
    return dict(zip(("base", "merged"), greedy_references_via(python, jobs)))


def test_the_adapter_covers_every_layer_and_changes_what_the_model_says(folders, references) -> None:
    """The adapter holds A and B for each target of the prelude, the shared block and the coda; B is
    not zero, and the merged model's greedy tokens differ from the base's (else the serving test
    below could not tell an ignored adapter from a served one)."""
    from safetensors.torch import load_file

    weights = load_file(folders["adapter"] / "adapter_model.safetensors")
    for stack, n in (("prelude_layers", 1), ("recurrent_layers", 2), ("coda_layers", 1)):
        for j in range(n):
            for target in TARGETS:
                part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                stem = f"base_model.model.model.{stack}.{j}.{part}.{target}"
                assert f"{stem}.lora_A.weight" in weights and f"{stem}.lora_B.weight" in weights, stem
    assert all(w.abs().sum() > 0 for name, w in weights.items() if "lora_B" in name)
    assert [tokens for tokens, _ in references["base"]] != [tokens for tokens, _ in references["merged"]]


@needs_vllm
def test_vllm_serves_a_peft_adapter_with_the_merged_models_generate_tokens(
    folders, prompts, references
) -> None:
    from vllm.lora.request import LoRARequest

    llm = make_llm(folders["base"], enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        base = greedy(llm, prompts)
        adapted = greedy(llm, prompts, lora_request=LoRARequest("adapter", 1, str(folders["adapter"])))
    finally:
        close(llm)
    assert_served_as_generate(prompts, base, references["base"])
    assert_served_as_generate(prompts, adapted, references["merged"])
