"""vLLM serves a retrofitted folder exactly as ``generate()`` computes it.

A tiny Llama parent (tied head, GQA, heads of 32 for vLLM's CPU attention) goes through
``looped-hf retrofit --loop-in-place --state-init zeros`` (a deterministic h_0: vLLM refuses a
random one) and is served by ``vllm.LLM`` in float32 (the plugin's model, no remote code): greedy
tokens equal ``generate(do_sample=False)``'s and each chosen token's log-probability is within
1e-3, at the folder's r = 1 (where it is the parent) and at r = 3 (three passes of the block, each
with its own KV slots; the identity adapter makes each pass read the prelude's output, so the
tokens are r = 1's, served through another slot plan). Run with the serving venv:
``PYTHONPATH=$PWD /work/main/.venv-serve/bin/python -m pytest tests/test_serving_retrofit.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serving_helpers import greedy_references_via, reference_python, vllm_workdir
from test_retrofit import VOCAB, tiny_parent
from test_serving_parity import (
    assert_one_attention_per_slot,
    assert_served_as_generate,
    close,
    greedy,
    make_llm,
    needs_vllm,
)

from looped_hf.cli import main as cli_main
from looped_hf.generation_looped import KVSlotPlan

ENGINES = [{}, {"num_recurrences": 3}]


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-vllm-retrofit-") as root:
        yield root


@pytest.fixture(scope="module")
def folder(workdir) -> Path:
    parent = tiny_parent(workdir / "parent", "llama_tied", num_attention_heads=2, num_key_value_heads=1)
    out = workdir / "retrofit"
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--layers", "2,3,1", "--state-init", "zeros",
                     "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def references(folder, prompts) -> list:
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference "
                    "(set LOOPED_HF_REFERENCE_PYTHON)")  # fmt: skip
    return greedy_references_via(
        python, [dict(checkpoint=folder, prompts=prompts, n=8, kwargs=over) for over in ENGINES]
    )


@needs_vllm
@pytest.mark.parametrize(
    "index", range(len(ENGINES)), ids=lambda i: f"r={ENGINES[i].get('num_recurrences', 1)}"
)
def test_vllm_serves_a_retrofit_with_generates_tokens_and_logprobs(index, folder, prompts, references):
    llm = make_llm(folder, ENGINES[index], max_model_len=128)
    try:
        vllm_config = llm.llm_engine.vllm_config
        assert_one_attention_per_slot(vllm_config, KVSlotPlan.for_call(vllm_config.model_config.hf_config))
        outputs = greedy(llm, prompts)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references[index])
