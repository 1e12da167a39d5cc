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
    vllm_workdir,
)
from test_serving_parity import (
    assert_one_attention_per_slot,
    assert_served_as_generate,
    close,
    make_llm,
    needs_vllm,
)

from looped_hf.generation_looped import KVSlotPlan
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
    with vllm_workdir("looped-depth-") as root:
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
        assert_one_attention_per_slot(vllm_config, KVSlotPlan.for_call(config, 4, 4))  # the deepest request's slots
        assert not vllm_config.cache_config.enable_prefix_caching  # a cached prefix is one depth's KV
        outputs = mixed_greedy(llm, all_prompts, all_depths)
    finally:
        close(llm)
    assert_served_as_generate(all_prompts, outputs, reference)
    assert any(len(set(r)) > 2 for r in mixed_steps)  # batches mixed depths (and ran the subset loop)
    assert len({tuple(t) for t, _ in reference[:4]}) == 4  # the depths really differ in what they serve


@needs_vllm
def test_a_converted_ouro_serves_mixed_depths_and_exit_thresholds_per_request_as_generate(workdir) -> None:
    """The converted Ouro fixture (threshold readout at 1.0, trained r 4): requests at r = 1 .. 4 and
    thresholds 0.3, 0.5 or the config's, in one batch, each equal generate() at their r and
    exit_gate_threshold (each token reads its exit step's state among its own r states)."""
    from conftest import fixture_path
    from test_serving_zoo import save_tokenizer

    from looped_hf.convert import main

    folder = workdir / "ouro"
    assert main(["ouro", str(fixture_path("zoo", "ouro-tiny")), "--out", str(folder)]) == 0
    save_tokenizer(folder)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 3, 28)]
    depths = [{"num_recurrences": 1 + i % 4, **({"exit_threshold": (0.3, 0.5)[i % 2]} if i % 3 else {})} for i in range(6)]
    as_generate = [
        {"num_recurrences": d["num_recurrences"], **({"exit_gate_threshold": d["exit_threshold"]} if "exit_threshold" in d else {})}
        for d in depths
    ]  # fmt: skip
    reference = references(folder, prompts, as_generate)
    llm = make_llm(folder, {}, max_num_seqs=4, max_model_len=64)
    try:
        outputs = mixed_greedy(llm, prompts, depths)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, reference)


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


@needs_vllm
def test_the_openai_server_serves_mixed_depths_streaming_refuses_bad_ones_and_survives_a_disconnect(tmp_path) -> None:
    """One ``looped-hf serve`` server: concurrent requests at r = 1 .. 4 and budgets (top-level fields and
    vllm_xargs, half streaming) each equal generate() at their depth; a request that hangs up after its
    first chunks leaves the others whole; refusals are 400s naming the field and its range, and the
    server keeps serving."""
    import asyncio
    import contextlib
    import os
    import shutil
    import sys

    import openai
    from test_serving_server import _free_port, _running, _wait_healthy

    from looped_hf.data import load_tokenizer

    tok = load_tokenizer("bytes")
    folder = save_serving_checkpoint(tmp_path / "ckpt", seed=3, vocab_size=len(tok))
    tok.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 33, 70, 12, 40)] * 2
    depths = [{"num_recurrences": 1 + i % 4, **({"kv_budget": 1 + i % 3} if i % 5 == 1 else {})} for i in range(12)]
    reference = references(folder, prompts, depths)
    port = _free_port()
    vllm_root = Path(tempfile.mkdtemp(prefix="lvd-"))
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, **vllm_env(vllm_root), "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    command = [sys.executable, "-m", "looped_hf", "serve", str(folder), "--max-num-recurrences", "4",
               "--kv-budget", "4", "--port", str(port), "--", "--dtype", "float32", "--enforce-eager",
               "--block-size", "32", "--max-model-len", "256", "--max-num-seqs", "8"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, vllm_root, ignore_errors=True)
        proc = cleanup.enter_context(_running(command, env, tmp_path / "server.log"))
        _wait_healthy(url, proc, tmp_path / "server.log", timeout_s=480)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> tuple[list[int], list[float]]:
            # Even requests name their depth at the top of the body (looped-hf serve moves it), odd ones in vllm_xargs.
            extra = {"ignore_eos": True, "return_token_ids": True}
            extra |= depths[i] if i % 2 == 0 else {"vllm_xargs": depths[i]}
            kwargs = dict(model=str(folder), prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
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

        async def hang_up() -> int:
            stream = await client.completions.create(model=str(folder), prompt=prompts[3], max_tokens=64, stream=True,
                                                     temperature=0, extra_body={"num_recurrences": 4})  # fmt: skip
            chunks = 0
            async for _ in stream:
                chunks += 1
                if chunks == 2:
                    await stream.close()  # the client goes away mid-stream
                    break
            return chunks

        async def everyone():
            return await asyncio.gather(hang_up(), *(one(i) for i in range(12)))

        chunks, *served = asyncio.run(everyone())
        assert chunks == 2
        for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(served, reference)):
            assert tokens == ref_tokens, (i, depths[i])
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3, (i, depths[i])

        sync = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        refused = {
            "num_recurrences": ({"num_recurrences": 5}, "num_recurrences=5: must be an integer from 1 to 4"),
            "vllm_xargs.kv_budget": ({"vllm_xargs": {"kv_budget": 0}}, "kv_budget=0: must be an integer from 1 to 4"),
            "num_recurrences ": ({"num_recurrences": "2"}, "num_recurrences='2': must be an integer"),
            "exit_threshold": ({"exit_threshold": 0.5}, "this model has no exit gate with the threshold readout"),
        }
        for field, (extra, message) in refused.items():
            with pytest.raises(openai.BadRequestError) as err:
                sync.completions.create(model=str(folder), prompt=prompts[0], max_tokens=2, extra_body=extra)
            assert message in str(err.value), field
        # Still serving, at a depth after the refusals.
        after = sync.completions.create(model=str(folder), prompt=prompts[1], max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True, **depths[1]})  # fmt: skip
        assert list(after.choices[0].token_ids) == reference[1][0]


@needs_vllm
def test_the_depth_mix_benchmark_runs_and_prints_its_table(capsys) -> None:
    """bench_serve.py --depth-mix, tiny: every side timed, the table and the loop's share printed."""
    from conftest import load_benchmark

    bench = load_benchmark("bench_serve")
    argv = ["--depth-mix", "--hidden", "64", "--layers", "1", "1", "1", "--r", "2", "--shallow", "1", "--vocab", "64",
            "--prompt-len", "4", "--new-tokens", "2", "--concurrency", "2", "--repeats", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "| requests | mixed r=1 + r=2 (s) |" in out and "the loop is " in out
    assert out.strip().splitlines()[-1].startswith("| 2 | ")


def test_the_admission_guards_name_carries_the_servers_depths_and_loads_by_name() -> None:
    """vLLM loads the guard as ``module:Name`` (a dot in the name would be an attribute path)."""
    from looped_hf.serving import plugin

    for served in (ServedDepth(3, 8, 2, None, False), ServedDepth(4, 4, None, 1.0, False), ServedDepth(2, 2, None, 1e-05, True)):
        name = plugin.guard_name(served)
        assert "." not in name and plugin._served_from_name(name) == served
