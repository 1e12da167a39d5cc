"""The one real ``looped-hf serve`` that starts, on 127.0.0.1, reached as a user reaches it (train ->
publish -> serve -> the openai client -> lm-eval): its greedy tokens equal ``generate()``'s at each
request's depth and ``/v1/chat/completions`` applies the tokenizer's chat template. A file of its own
(``make test-serve`` hands out whole files), so that it runs beside test_serving_server's failed start."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving_helpers import free_port
from test_serving_parity import needs_vllm

# A chat template for the byte tokenizer, which ships none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    pytest.fail(f"no /health within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def _running(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """Run ``command`` in its own process group; stop the whole group (vLLM's engine process too)."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


# --- the whole path, as a user walks it -------------------------------------------------------------
R, BUDGET, NEW_TOKENS = 2, 1, 8  # the recipe's r; the budget and length the walk's text prompts ask for
SERVED_R, CEILING = 3, 8  # serve's -r (past the trained r: the flag decides) and its --max-num-recurrences


def _train_and_publish(tmp_path: Path, small_corpus: Path, data_cache: Path) -> Path:
    """``looped-hf train`` (the tiny recipe, 30 steps) then ``looped-hf publish``, through the CLI's
    dispatcher in this process (two interpreter start-ups fewer; ``serve`` below is a process of its
    own, as a user runs it); returns the run folder, its publish folder with a chat template."""
    import yaml
    from transformers import AutoTokenizer

    from looped_hf.cli import main as looped_hf

    run = tmp_path / "run"
    # The study's shape (GQA: 2 heads of 32, one KV head; 2 block layers): vLLM's CPU attention runs
    # head_dim 32. 30 steps make greedy choices well separated (top-2 logit gap >= 6e-3 on every request).
    recipe = dict(hidden_size=64, head_dim=32, num_key_value_heads=1, num_prelude_layers=1, num_recurrent_layers=2,
                  num_coda_layers=1, num_recurrences=R, dataset=str(small_corpus), tokenizer="bytes", seq_len=32,
                  eval_blocks=8, data_cache_dir=str(data_cache), output_dir=str(run), per_device_train_batch_size=4,
                  per_device_eval_batch_size=8, max_steps=30, logging_steps=10, save_strategy="no", report_to="none",
                  disable_tqdm=True, learning_rate=3e-3, seed=0, dataloader_num_workers=0, torch_num_threads=1)  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert looped_hf(["train", str(tmp_path / "recipe.yaml")]) == 0
    publish = ["publish", str(run), "--repo-id", "local/looped-tiny", "--out", str(run / "publish")]
    assert looped_hf(publish) == 0
    # The user gives the published tokenizer a chat template (the byte tokenizer ships none).
    tok = AutoTokenizer.from_pretrained(run / "publish")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(run / "publish")
    return run


async def _mixed_depths_and_a_hang_up(url: str, model: str, prompts: list, depths: list) -> tuple[int, list]:
    """Every request of the mix at once with the async openai client, beside one that hangs up after
    two chunks: even requests name their depth at the top of the body (looped-hf serve moves it), odd
    ones in vllm_xargs; every third streams. Returns the hang-up's chunks and each request's (tokens,
    logprobs)."""
    import asyncio

    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[list[int], list[float]]:
        extra = {"ignore_eos": True, "return_token_ids": True}
        extra |= depths[i] if i % 2 == 0 else {"vllm_xargs": depths[i]}
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

    async def hang_up() -> int:
        stream = await client.completions.create(model=model, prompt=prompts[3], max_tokens=64, stream=True,
                                                 temperature=0, extra_body={"num_recurrences": CEILING})  # fmt: skip
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                await stream.close()  # the client goes away mid-stream
                break
        return chunks

    chunks, *served = await asyncio.gather(hang_up(), *(one(i) for i in range(len(prompts))))
    return chunks, served


@needs_vllm
def test_train_publish_serve_and_query_at_mixed_depths_with_the_openai_client_and_lm_eval(
    tmp_path, small_corpus, data_cache, one_torch_thread, monkeypatch
) -> None:
    """The one real server, as a user walks to it: train (the tiny recipe) -> publish -> ``looped-hf
    serve`` the run on loopback at -r 3 (past its trained r 2), --max-num-recurrences 8, --kv-budget 8,
    with serve's own KV cache sizing and vLLM's default worker process -> the openai client:
    - completions on token prompts across vLLM's 32-token KV blocks at the served default, and on text
      at r 2 with kv_budget 1 named at the top of the body; chat completions apply the tokenizer's chat
      template;
    - 32 concurrent requests at r = 1, 2, 4, 8 and budgets (test_serving_depth's mix: top-level fields
      and vllm_xargs, a third streaming), beside a request that hangs up after its first chunks;
    - refusals: 400s naming the field and its range (a depth above the ceiling at the top level and
      in vllm_xargs, a budget of 0, a string, an exit threshold this model has no gate for), and the
      server keeps serving;
    -> lm-eval's local-completions on a local task -> stop. Every greedy token equals ``generate()``'s
    at the request's own r and kv_budget (the mix's logprobs within 1e-3). (The offline ``vllm.LLM``
    equals generate() in test_serving_parity, so the server is compared with generate() alone.)"""
    import asyncio

    import lm_eval
    import openai
    import torch
    from conftest import subprocess_env
    from lm_eval.tasks import TaskManager
    from serving_helpers import greedy_references_via, reference_python, vllm_env
    from test_eval_lm_eval import _local_task
    from test_serving_depth import as_generate, depth_mix, mix_prompts
    from transformers import AutoTokenizer

    run = _train_and_publish(tmp_path, small_corpus, data_cache)
    tok = AutoTokenizer.from_pretrained(run / "publish")
    messages = [{"role": "user", "content": "Hello, loop!"}]
    chat_ids = list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    g = torch.Generator().manual_seed(0)
    token_prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 33, 70)]
    text_prompts = ["To be, or not to be", "Once upon a time"]
    text_depth = {"num_recurrences": R, "kv_budget": BUDGET}
    # The mix: two of its requests name nothing (the served default).
    mix, depths = mix_prompts(0, 256), depth_mix()

    env = subprocess_env()
    vllm_root = Path(tempfile.mkdtemp(prefix="lvs-"))  # vLLM's IPC sockets need a short path (107 bytes)
    # vLLM's default: the model in a worker process of its own (the failed start above runs it in the engine's).
    served_env = {**env, **vllm_env(vllm_root), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    served_env.pop("VLLM_CPU_KVCACHE_SPACE")  # serve sizes it, as for a user who never heard of it
    port = free_port()
    serve = [sys.executable, "-m", "looped_hf", "serve", str(run), "--num-recurrences", str(SERVED_R),
             "--max-num-recurrences", str(CEILING), "--kv-budget", str(CEILING), "--port", str(port),
             "--", "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "256",
             "--max-num-seqs", str(len(mix) + 1)]  # fmt: skip
    greedy = {"ignore_eos": True, "return_token_ids": True}
    log = tmp_path / "server.log"
    monkeypatch.chdir(tmp_path)  # lm-eval may write caches beside the working directory
    with contextlib.ExitStack() as cleanup, _running(serve, served_env, log) as proc:
        cleanup.callback(shutil.rmtree, vllm_root, ignore_errors=True)
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, log, timeout_s=480)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        [model] = [m.id for m in client.models.list().data]
        assert model == str(run / "publish")  # the run's published folder is what is served
        served = []
        for prompts, extra in ((token_prompts, {}), (text_prompts, text_depth)):
            done = client.completions.create(model=model, prompt=prompts, max_tokens=NEW_TOKENS, temperature=0,
                                             extra_body={**greedy, **extra})  # fmt: skip
            served += [(c.prompt_token_ids, c.token_ids) for c in sorted(done.choices, key=lambda c: c.index)]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                              extra_body=greedy)  # fmt: skip

        chunks, mixed = asyncio.run(_mixed_depths_and_a_hang_up(url, model, mix, depths))

        refused = [
            ({"num_recurrences": CEILING + 1}, f"num_recurrences={CEILING + 1}: must be an integer from 1 to {CEILING}"),
            ({"vllm_xargs": {"num_recurrences": CEILING + 1}},
             f"vllm_xargs.num_recurrences={CEILING + 1}: must be an integer from 1 to {CEILING}"),
            ({"vllm_xargs": {"kv_budget": 0}}, f"kv_budget=0: must be an integer from 1 to {CEILING}"),
            ({"num_recurrences": "2"}, "num_recurrences='2': must be an integer"),
            ({"exit_threshold": 0.5}, "this model has no exit gate with the threshold readout"),
        ]  # fmt: skip
        for extra, message in refused:
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=model, prompt=mix[0], max_tokens=2, extra_body=extra)
            assert message in str(err.value), extra
        # Still serving, at a depth after the refusals.
        after = client.completions.create(model=model, prompt=mix[7], max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={**greedy, **depths[7]})  # fmt: skip

        # lm-eval's local-completions client, through its Python API in this process (an interpreter
        # start-up fewer), on the local task alone (indexing lm-eval's own thousands of tasks took seconds).
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        _local_task(tasks)
        evaluated = lm_eval.simple_evaluate(
            model="local-completions", tasks=["looped_toy_qa"], limit=4,
            model_args=f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={model},num_concurrent=1,max_retries=1",
            task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        )  # fmt: skip
        assert 0 <= evaluated["results"]["looped_toy_qa"]["acc,none"] <= 1, evaluated["results"]
    assert proc.returncode is not None  # stopped
    assert "[serve] VLLM_CPU_KVCACHE_SPACE=1 (GiB) for vLLM's KV cache" in log.read_text()
    assert [ids for ids, _ in served[:4]] == token_prompts
    assert list(chat.prompt_token_ids) == chat_ids  # the template was applied
    assert isinstance(chat.choices[0].message.content, str)
    assert all(len(tokens) == NEW_TOKENS for _, tokens in served)
    assert chunks == 2
    python = reference_python()
    if python is None:
        pytest.skip("served checked; no interpreter here runs generate() for the reference")
    # One reference interpreter, one job (one model load) per depth.
    default = {"num_recurrences": SERVED_R}
    requests = [(ids, default) for ids, _ in served[:4]] + [(ids, text_depth) for ids, _ in served[4:]]
    requests += [(chat_ids, default)] + [(p, as_generate(d) or default) for p, d in zip(mix, depths)]
    jobs, where = [], []
    for kwargs in {json.dumps(k, sort_keys=True): k for _, k in requests}.values():
        mine = [i for i, (_, k) in enumerate(requests) if k == kwargs]
        where += [(i, len(jobs), n) for n, i in enumerate(mine)]
        jobs.append(dict(checkpoint=run / "publish", prompts=[requests[i][0] for i in mine], n=NEW_TOKENS,
                         kwargs=kwargs))  # fmt: skip
    done = greedy_references_via(python, jobs)
    reference = [done[job][n] for _, job, n in sorted(where)]
    served_chat = list(chat.choices[0].token_ids)
    walk = len(served) + 1
    served_walk = [list(tokens) for _, tokens in served] + [served_chat]
    assert [tokens for tokens, _ in reference[:walk]] == served_walk
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(zip(mixed, reference[walk:])):
        assert tokens == ref_tokens, (i, depths[i])
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-3, (i, depths[i])
    assert list(after.choices[0].token_ids) == reference[walk + 7][0]
