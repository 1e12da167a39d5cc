"""vLLM serves a retrofitted folder exactly as ``generate()`` computes it.

A tiny Llama parent (tied head, GQA, heads of 32 for vLLM's CPU attention) goes through
``looped-hf retrofit --loop-in-place --state-init zeros`` (a deterministic h_0: vLLM refuses a
random one) and is served by ``vllm.LLM`` in float32 (the plugin's model, no remote code): greedy
tokens equal ``generate(do_sample=False)``'s and each chosen token's log-probability is within
1e-3, at the folder's r = 1 (where it is the parent) and at r = 3 (three passes of the block, each
with its own KV slots; the identity adapter makes each pass read the prelude's output, so the
tokens are r = 1's, served through another slot plan). The RRT share with a rank-4 LoRA per loop
(``--share stepwise --blocks 2 --lora-rank 4``: model type ``looped_loop_lora``, its deltas applied
by the same vLLM model class, ``serving/loop_lora_vllm.py``) is served so too, at its 3 loops, and with
a KV budget of 1 (every loop shares one slot per block layer, each still runs its own deltas: the
loop step is an argument of each layer application on both sides) and a peft adapter on the usual
Llama targets through ``enable_lora`` (the deltas are added inside the layers' forward, beside vLLM's
LoRA wrappers): greedy equals ``generate()`` of the model with the adapter merged. What it cannot
serve (a depth past its loops) is refused in one line. Run with the serving venv:
``.venv-serve/bin/python -m pytest tests/test_serving_retrofit.py`` (``make serve-setup`` builds it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serving_helpers import greedy_references_via, reference_python, vllm_workdir
from test_retrofit import VOCAB, tiny_parent
from test_serving_depth import mixed_greedy
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
# The loop-LoRA folder's requests: one batch at mixed depths (recurrence i runs only the requests
# deeper than i, each at its own loops' deltas), one depth per prompt; their references follow the engines'.
LOOP_LORA_DEPTHS = [3, 1, 2, 3]


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-vllm-retrofit-") as root:
        yield root


@pytest.fixture(scope="module")
def parent(workdir) -> Path:
    return tiny_parent(workdir / "parent", "llama_tied", num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def folder(workdir, parent) -> Path:
    out = workdir / "retrofit"
    assert cli_main(["retrofit", str(parent), "--loop-in-place", "--layers", "2,3,1", "--state-init", "zeros",
                     "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def loop_lora_folder(workdir, parent) -> Path:
    """6 parent layers as 2 shared layers looped 3 times, a rank-4 LoRA (and norm deltas) per loop."""
    out = workdir / "rrt"
    assert cli_main(["retrofit", str(parent), "--share", "stepwise", "--blocks", "2", "--lora-rank", "4",
                     "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.fixture(scope="module")
def adapter(workdir, loop_lora_folder) -> dict[str, Path]:
    """A peft LoRA on the usual Llama targets of the loop-LoRA model (the shared block's projections,
    not the per-loop deltas), random non-zero B; {"adapter": its folder, "merged": the model with it
    merged, a loop-LoRA folder too}."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loop_lora_folder)
    torch.manual_seed(4)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    lora = peft.get_peft_model(model, config)
    lora.save_pretrained(workdir / "adapter")
    lora.merge_and_unload().save_pretrained(workdir / "merged")
    return {"adapter": workdir / "adapter", "merged": workdir / "merged"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 17, 40)]


@pytest.fixture(scope="module")
def references(folder, loop_lora_folder, adapter, prompts) -> list:
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference "
                    "(set LOOPED_HF_REFERENCE_PYTHON)")  # fmt: skip
    jobs = [dict(checkpoint=folder, prompts=prompts, n=8, kwargs=over) for over in ENGINES]
    jobs += [dict(checkpoint=loop_lora_folder, prompts=[p], n=8, kwargs={"num_recurrences": r})
             for p, r in zip(prompts, LOOP_LORA_DEPTHS)]  # fmt: skip
    # The KV-budget engine's: the base and the adapter-merged loop-LoRA model at kv_budget=1.
    jobs += [dict(checkpoint=checkpoint, prompts=prompts, n=8, kwargs={"kv_budget": 1})
             for checkpoint in (loop_lora_folder, adapter["merged"])]  # fmt: skip
    return greedy_references_via(python, jobs)


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


@needs_vllm
def test_vllm_serves_a_loop_lora_retrofit_with_generates_tokens_and_logprobs(
    loop_lora_folder, prompts, references
):
    llm = make_llm(loop_lora_folder, max_model_len=128)
    try:
        vllm_config = llm.llm_engine.vllm_config
        assert_one_attention_per_slot(vllm_config, KVSlotPlan.for_call(vllm_config.model_config.hf_config))
        outputs = mixed_greedy(llm, prompts, [{"num_recurrences": r} for r in LOOP_LORA_DEPTHS])
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, [job[0] for job in references[len(ENGINES) :]])


@needs_vllm
def test_vllm_serves_a_loop_lora_retrofit_with_a_kv_budget_and_a_peft_adapter_as_generate(
    loop_lora_folder, adapter, prompts, references
):
    from vllm.lora.request import LoRARequest

    llm = make_llm(loop_lora_folder, {"kv_budget": 1}, max_model_len=128, enable_lora=True, max_lora_rank=8,
                   max_loras=1)  # fmt: skip
    try:
        vllm_config = llm.llm_engine.vllm_config
        assert_one_attention_per_slot(vllm_config, KVSlotPlan.for_call(vllm_config.model_config.hf_config))
        # min_tokens: as generate()'s reference, which never stops (its EOS suppressed), vLLM does not
        # pick the EOS token either (ignore_eos alone only keeps going after it).
        base = greedy(llm, prompts, min_tokens=8)
        adapted = greedy(
            llm, prompts, lora_request=LoRARequest("adapter", 1, str(adapter["adapter"])), min_tokens=8
        )
    finally:
        close(llm)
    budget_base, budget_merged = references[-2:]
    assert [t for t, _ in budget_base] != [t for t, _ in budget_merged]  # the adapter changes the tokens
    assert_served_as_generate(prompts, base, budget_base)
    assert_served_as_generate(prompts, adapted, budget_merged)


def test_serve_takes_a_loop_lora_retrofit_with_a_kv_budget_and_refuses_a_depth_past_its_loops(
    loop_lora_folder, capsys
):
    """``looped-hf serve --dry-run`` checks the folder as a real start does, before vLLM starts: a KV
    budget is taken (each loop is handed its own deltas, whatever slots it shares: the HF model takes
    it too), one line (exit 2) for a server deeper than the loops; a request deeper than the loops is
    refused by the server's bounds."""
    from looped_hf.model_types import load_config
    from looped_hf.serving.depth import DepthError, ServedDepth

    assert cli_main(["serve", str(loop_lora_folder), "--dry-run"]) == 0
    assert cli_main(["serve", str(loop_lora_folder), "--kv-budget", "1", "--dry-run"]) == 0
    refused = {
        ("--max-num-recurrences", "4"): "num_recurrences=4: a per-loop LoRA model runs at most its 3 loops",
    }
    capsys.readouterr()
    for flags, message in refused.items():
        assert cli_main(["serve", str(loop_lora_folder), *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, flags
    with pytest.raises(DepthError, match="num_recurrences=4: must be an integer from 1 to 3"):
        ServedDepth.from_config(load_config(loop_lora_folder)).resolve({"num_recurrences": 4})
