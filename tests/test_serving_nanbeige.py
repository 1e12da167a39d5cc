"""``looped-hf serve`` serves the converted Nanbeige4.2 fixture per request, as ``generate()`` computes it.

``tests/fixtures/zoo2/nanbeige-tiny`` (whole-stack loop, ``model.norm`` shared between loops, head_dim
32 != hidden / heads, GQA, trained at 2 loops) goes through ``looped-hf convert nanbeige``, gets a
word-level tokenizer of its 256 tokens, and is served by a real ``looped-hf serve`` on 127.0.0.1 with
``--max-num-recurrences 4``. The ``openai`` client sends 16 requests at once, at 1, 2, 3 and 4 loops
and the served default (some naming their depth at the top of the body, some in ``vllm_xargs``, some
streaming), so they are batched together at mixed depths; every request's greedy tokens equal
``generate()``'s at its own loop count, each chosen token's log-probability within 1e-3 (float32). A depth
above the ceiling is refused with a 400 naming the field and the range. A file of its own: ``make
test-serve`` hands out whole files.
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
from serving_helpers import free_port
from test_serving_parity import needs_vllm

from looped_hf.serving import servable_problems

NEW_TOKENS = 8
CEILING = 4  # --max-num-recurrences: every request may ask 1 .. 4 loops
LOGPROB_TOLERANCE = 1e-3


def requests_mix() -> tuple[list[list[int]], list[dict]]:
    """16 prompts of 1 to 61 tokens (across vLLM's 32-token blocks) and their depths: 1, 2, 3, 4
    loops interleaved, requests 5 and 14 naming none (the served default, the trained 2). Token ids from
    3 up: the fixture's pad id is 0, and ``generate()`` masks a prompt's pad tokens out of attention
    (its attention mask inferred from ``pad_token_id``), which a served prompt does not."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (1 + (i * 29) % 61,), generator=g).tolist() for i in range(16)]
    depths = [{} if i in (5, 14) else {"num_recurrences": 1 + i % 4} for i in range(16)]
    return prompts, depths


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from test_serving_zoo import save_tokenizer

    from looped_hf.convert import main

    out = tmp_path_factory.mktemp("nanbeige-serve") / "nanbeige-tiny-looped"
    assert main(["nanbeige", str(fixture_path("zoo2", "nanbeige-tiny")), "--out", str(out)]) == 0
    save_tokenizer(out)
    return out


def test_the_converted_folder_is_servable_and_serve_passes_the_ceiling(converted: Path, capsys) -> None:
    from looped_hf import LoopedConfig
    from looped_hf.serving import cli as serve_cli

    assert servable_problems(LoopedConfig.from_pretrained(converted), device="cpu") == []
    assert serve_cli.main([str(converted), "--max-num-recurrences", str(CEILING), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"max_num_recurrences":4' in out.replace(" ", ""), out


async def _mixed(url: str, model: str, prompts: list, depths: list) -> list[tuple[list[int], list[float]]]:
    """Every request at once with the async openai client: even ones name their depth at the top of the
    body (looped-hf serve moves it), odd ones in vllm_xargs; every third streams."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[list[int], list[float]]:
        extra = {"ignore_eos": True, "return_token_ids": True}
        extra |= depths[i] if i % 2 == 0 else ({"vllm_xargs": depths[i]} if depths[i] else {})
        kwargs = dict(model=model, prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
                      extra_body=extra)  # fmt: skip
        if i % 3:
            done = await client.completions.create(**kwargs)
            return list(done.choices[0].token_ids), list(done.choices[0].logprobs.token_logprobs)
        tokens, logprobs = [], []
        async for chunk in await client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                tokens += choice.token_ids or []
                logprobs += choice.logprobs.token_logprobs if choice.logprobs else []
        return tokens, logprobs

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


@needs_vllm
def test_serve_answers_requests_at_mixed_loop_counts_as_generate_through_the_openai_client(
    converted: Path, tmp_path: Path, one_torch_thread
) -> None:
    import openai
    from conftest import subprocess_env
    from serving_helpers import greedy_references_via, reference_python, vllm_env
    from test_serving_walk import _running, _wait_healthy

    prompts, depths = requests_mix()
    vllm_root = Path(tempfile.mkdtemp(prefix="lvn-"))  # vLLM's IPC sockets need a short path
    env = {**subprocess_env(), **vllm_env(vllm_root)}
    port = free_port()
    serve = [sys.executable, "-m", "looped_hf", "serve", str(converted), "--max-num-recurrences", str(CEILING),
             "--port", str(port), "--", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
             "--max-model-len", "128", "--max-num-seqs", str(len(prompts))]  # fmt: skip
    log = tmp_path / "server.log"
    with contextlib.ExitStack() as cleanup, _running(serve, env, log) as proc:
        cleanup.callback(shutil.rmtree, vllm_root, ignore_errors=True)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout_s=480)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        served = asyncio.run(_mixed(url, model, prompts, depths))
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt=prompts[0], max_tokens=2,
                                      extra_body={"num_recurrences": CEILING + 1})  # fmt: skip
        assert f"num_recurrences={CEILING + 1}: must be an integer from 1 to {CEILING}" in str(err.value)
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in served)
    python = reference_python()
    if python is None:
        pytest.skip("served checked; no interpreter here runs generate() for the reference")
    jobs, where = [], {}
    for kwargs in {json.dumps(d, sort_keys=True): d for d in depths}.values():
        mine = [i for i, d in enumerate(depths) if d == kwargs]
        for n, i in enumerate(mine):
            where[i] = (len(jobs), n)
        jobs.append(
            dict(checkpoint=converted, prompts=[prompts[i] for i in mine], n=NEW_TOKENS, kwargs=kwargs)
        )
    # One prompt at each loop count, to show that the depths differ in what they serve.
    probe = len(jobs)
    jobs += [dict(checkpoint=converted, prompts=[prompts[7]], n=NEW_TOKENS, kwargs={"num_recurrences": r})
             for r in range(1, CEILING + 1)]  # fmt: skip
    done = greedy_references_via(python, jobs)
    reference = [done[job][n] for job, n in (where[i] for i in range(len(prompts)))]
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(served, reference, strict=True)):
        assert tokens == ref_tokens, (i, depths[i])
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < LOGPROB_TOLERANCE, (
            i,
            depths[i],
        )
    # The loop counts really differ in what they serve (else a server that ignored them would pass).
    assert len({tuple(done[job][0][0]) for job in range(probe, probe + CEILING)}) > 1
