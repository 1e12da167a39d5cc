"""Per-request depth when serving: each request runs at its own r, kv_budget and exit threshold.

One ``vllm.LLM`` engine per model serves requests at r = 1 .. 4 and several KV budgets together in
one continuously batched run (prompts of different lengths, more requests than ``max_num_seqs``, so
requests join and leave the batch at different depths), and every request's greedy tokens equal
``generate()``'s at its own r and kv_budget, with each chosen token's log-probability within 1e-3 in
float32. The engine keeps one ``Attention`` per KV slot of the deepest request (``ServedDepth.plan``).
A gated (Ouro) model takes ``exit_threshold`` per request. Requests the server cannot honour are
refused at admission with the field and its range, and the engine keeps serving.

``ServedDepth.resolve`` (the rule) and the HTTP body mapping (``plugin.map_body``) are tested here
without an engine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from serving_helpers import (
    SERVING_VOCAB,
    greedy_references_via,
    reference_python,
    save_serving_checkpoint,
    serving_config,
    vllm_env,
)
from test_serving_parity import (
    assert_one_attention_per_slot,
    assert_served_as_generate,
    close,
    make_llm,
    needs_vllm,
)

from looped_hf.serving.depth import DepthError, RequestDepth, ServedDepth
from looped_hf.serving.plugin import map_body

NEW_TOKENS = 8
PROMPT_LENGTHS = (1, 5, 17, 40, 3, 70, 9, 28)
# Per request (extra_args): every r from 1 to the server's ceiling 4, at the server's budget (4), and
# budgets below r; {} is the served default (r 3, the checkpoint's).
DEPTHS = [
    {"num_recurrences": 1}, {"num_recurrences": 4}, {"num_recurrences": 2, "kv_budget": 1}, {},
    {"num_recurrences": 4, "kv_budget": 2}, {"num_recurrences": 2}, {"num_recurrences": 3, "kv_budget": 1},
    {"num_recurrences": 4, "kv_budget": 3},
]  # fmt: skip
SERVER = {"max_num_recurrences": 4, "kv_budget": 4}


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory(prefix="looped-depth-") as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        for key, value in vllm_env(root).items():
            mp.setenv(key, value)
        yield root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, SERVING_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def references(checkpoint: Path, prompts: list[list[int]], depths: list[dict]) -> list:
    """generate()'s (tokens, logprobs) for each prompt at its own depth."""
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    jobs = [dict(checkpoint=checkpoint, prompts=[p], n=NEW_TOKENS, kwargs=d) for p, d in zip(prompts, depths)]
    return [job[0] for job in greedy_references_via(python, jobs)]


def mixed_greedy(llm, prompts: list[list[int]], depths: list[dict]) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, extra_args=d or None)
        for d in depths
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [out.outputs[0] for out in outputs]


@needs_vllm
def test_requests_at_mixed_depths_in_one_batch_each_equal_generate_at_their_own_depth(
    workdir, prompts, monkeypatch
) -> None:
    from looped_hf.serving import vllm_model

    mixed_steps = []  # the forward calls that ran requests at different depths (engine in-process)
    run_mixed = vllm_model._VllmRecurrentBlock.run_mixed
    monkeypatch.setattr(vllm_model._VllmRecurrentBlock, "run_mixed",
                        lambda self, e, depth, keep: (mixed_steps.append(depth.recurrences), run_mixed(self, e, depth, keep))[1])  # fmt: skip
    checkpoint = save_serving_checkpoint(workdir / "study", seed=0)
    # Twice the prompts, the second half at the first half's depths shifted: 16 requests, 4 at a time.
    all_prompts = prompts + prompts[::-1]
    all_depths = DEPTHS + DEPTHS[3:] + DEPTHS[:3]
    reference = references(checkpoint, all_prompts, all_depths)
    llm = make_llm(checkpoint, SERVER, max_num_seqs=4)
    try:
        vllm_config = llm.llm_engine.vllm_config
        config = vllm_config.model_config.hf_config
        assert_one_attention_per_slot(vllm_config, config.slot_plan(4, 4))  # the deepest request's slots
        assert not vllm_config.cache_config.enable_prefix_caching  # a cached prefix is one depth's KV
        outputs = mixed_greedy(llm, all_prompts, all_depths)
    finally:
        close(llm)
    assert_served_as_generate(all_prompts, outputs, reference)
    assert any(len(set(r)) > 2 for r in mixed_steps)  # batches mixed depths (and ran the subset loop)
    assert len({tuple(t) for t, _ in reference[:4]}) == 4  # the depths really differ in what they serve


def test_a_request_depth_is_resolved_within_the_servers_bounds_and_refused_with_the_range() -> None:
    served = ServedDepth.from_config(serving_config(num_recurrences=3, kv_budget=2, max_num_recurrences=6))
    assert served.resolve(None) == RequestDepth(3, 2, None)
    assert served.resolve({"num_recurrences": 1}) == RequestDepth(1, 1, None)
    assert served.resolve({"num_recurrences": 6, "kv_budget": 1}) == RequestDepth(6, 1, None)
    refused = {
        "num_recurrences": ([0, 7, 2.0, "3", True], "must be an integer from 1 to 6"),
        "kv_budget": ([0, 3, 1.5], "must be an integer from 1 to 2"),
        "exit_threshold": ([0.5], "this model has no exit gate with the threshold readout"),
    }
    for field, (values, message) in refused.items():
        for value in values:
            with pytest.raises(DepthError, match=message) as err:
                served.resolve({field: value}, where="vllm_xargs.")
            assert err.value.field == f"vllm_xargs.{field}" and f"{field}={value!r}" in str(err.value)
    no_budget = ServedDepth.from_config(serving_config())
    with pytest.raises(DepthError, match="kv_budget=2: must be null: this server keeps every recurrence's KV"):
        no_budget.resolve({"kv_budget": 2})
    with pytest.raises(DepthError, match="num_recurrences=4: must be an integer from 1 to 3"):
        no_budget.resolve({"num_recurrences": 4})  # the default ceiling is the served r
    locked = ServedDepth.from_config(serving_config(input_injection="hyperconnection"))
    with pytest.raises(DepthError, match="runs its trained r only"):
        locked.resolve({"num_recurrences": 2})
    gated = ServedDepth.from_config(serving_config(exit_gate=True, exit_gate_output="threshold", num_coda_layers=0))
    assert gated.resolve({"exit_threshold": 0.25}).exit_threshold == 0.25
    with pytest.raises(DepthError, match=r"exit_threshold=1\.5: must be a number from 0 to 1"):
        gated.resolve({"exit_threshold": 1.5})
    with pytest.raises(ValueError, match="max_num_recurrences=2: below the served num_recurrences=3"):
        ServedDepth.from_config(serving_config(max_num_recurrences=2))


def test_top_level_depth_fields_move_into_vllm_xargs_and_bad_ones_are_refused_by_name() -> None:
    served = ServedDepth.from_config(serving_config(kv_budget=2, max_num_recurrences=4))
    body = {"model": "m", "prompt": "num_recurrences", "num_recurrences": 4, "kv_budget": 1, "vllm_xargs": {"x": 1}}
    mapped, refused = map_body(body, served)
    assert refused is None
    assert mapped == {"model": "m", "prompt": "num_recurrences", "vllm_xargs": {"x": 1, "num_recurrences": 4, "kv_budget": 1}}
    unchanged = {"prompt": "p", "vllm_xargs": {"num_recurrences": 2}}
    assert map_body(unchanged, served) == (unchanged, None)
    cases = {
        json.dumps({"num_recurrences": 5}): ("num_recurrences", "from 1 to 4"),
        json.dumps({"vllm_xargs": {"kv_budget": 3}}): ("vllm_xargs.kv_budget", "from 1 to 2"),
        json.dumps({"extra": {"kv_budget": 1}}): ("extra.kv_budget", "not read there"),
        json.dumps({"num_recurrences": 2, "vllm_xargs": {"num_recurrences": 3}}): ("num_recurrences", "set it once"),
    }
    for text, (field, message) in cases.items():
        _, (got_field, why) = map_body(json.loads(text), served)
        assert got_field == field and message in why
