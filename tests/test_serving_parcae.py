"""vLLM serves the converted Parcae exactly as ``generate()`` computes it, each request at its own depth.

``tests/fixtures/zoo2/parcae-tiny`` goes through ``looped-hf convert parcae`` (the deterministic zero
state) and is served by ``vllm.LLM`` in float32 with per-request depth up to ``max_num_recurrences``
8: one batch of requests at r = 1, 2, 4, 8 and the served default (the trained 4), prompts of 1 to
40 tokens; greedy tokens equal ``generate(do_sample=False, num_recurrences=r)``'s for each request
and each chosen token's log-probability is within 1e-3. This covers what Parcae added to the vLLM
model (``serving/parcae_vllm.py``): the diagonal injection, the prelude norm, C after the loop, the
0.5 squared ReLU, the QK norm with torch's default eps, and value embeddings with their gates on a
core layer (run on a subset of the tokens when the depths differ) and on the coda; and, built
here, a GQA prelude / coda beside the MHA core (every layer served at the core's KV heads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_path
from serving_helpers import greedy_references_via, reference_python, vllm_workdir
from test_serving_depth import mixed_greedy, recording_mixed_steps
from test_serving_parity import assert_served_as_generate, close, make_llm, needs_vllm
from test_serving_zoo import save_tokenizer

from looped_hf import LoopedConfig
from looped_hf.serving import servable_problems

DATA = fixture_path("zoo2", "parcae-tiny")
SERVER = {"max_num_recurrences": 8}
DEPTHS = [{"num_recurrences": r} for r in (1, 2, 4, 8, 8, 1, 2)] + [{}]  # {}: the served default, r 4
LENGTHS = (1, 5, 17, 40, 3, 29, 12, 8)


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-parcae-") as root:
        yield root


@pytest.fixture(scope="module")
def folder(workdir: Path) -> Path:
    from looped_hf.convert import main

    out = workdir / "parcae"
    assert main(["parcae", str(DATA), "--out", str(out)]) == 0
    save_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def test_the_converted_parcae_is_servable_and_its_random_state_is_refused(folder) -> None:
    config = LoopedConfig.from_pretrained(folder)
    assert servable_problems(config, device="cpu") == []
    config.state_init = "like_init"
    (problem,) = servable_problems(config, device="cpu")
    assert problem.startswith("state_init='like_init' with state_init_std=0.079") and "\n" not in problem
    config.state_init = "zeros"
    (problem,) = servable_problems(config, tensor_parallel_size=2)
    assert problem.startswith("tensor_parallel_size=2: value embeddings")


@pytest.fixture(scope="module")
def gqa_folder(workdir: Path) -> Path:
    """A Parcae built here with a GQA prelude / coda (2 KV heads of 4) beside its MHA core and a value
    embedding on the coda (test_zoo_parcae's "gqa" shape), converted."""
    from test_zoo_parcae import SHAPES, build_parcae

    from looped_hf.convert import main

    changes, seed = SHAPES["gqa"]
    build_parcae(workdir / "gqa-native", seed, **changes)
    out = workdir / "gqa"
    assert main(["parcae", str(workdir / "gqa-native"), "--out", str(out)]) == 0
    save_tokenizer(out)
    return out


@needs_vllm
def test_a_gqa_prelude_and_coda_beside_an_mha_core_serves_as_generate(gqa_folder, prompts) -> None:
    """Every layer served at the core's 4 KV heads, the prelude's and coda's 2 repeated (exact)."""
    config = LoopedConfig.from_pretrained(gqa_folder)
    assert (config.num_key_value_heads, config.recurrent_num_key_value_heads) == (2, 4)
    assert servable_problems(config, device="cpu") == []
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    jobs = [dict(checkpoint=gqa_folder, prompts=[p], n=8, kwargs=d) for p, d in zip(prompts, DEPTHS)]
    references = [done[0] for done in greedy_references_via(python, jobs)]
    llm = make_llm(gqa_folder, SERVER, max_model_len=64, skip_tokenizer_init=False)
    try:
        outputs = mixed_greedy(llm, prompts, DEPTHS)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references)


def test_looped_hf_serve_accepts_the_folder_up_to_its_max_depth(folder, capsys) -> None:
    from looped_hf.serving import cli as serve_cli

    assert serve_cli.main([str(folder), "--max-num-recurrences", "8", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert '"max_num_recurrences":8' in out, (out, err)
    refused = folder.parent / "parcae-like-init"
    shutil.copytree(folder, refused)
    config = json.loads((refused / "config.json").read_text())
    (refused / "config.json").write_text(json.dumps({**config, "state_init": "like_init"}))
    assert serve_cli.main([str(refused), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "state_init='like_init'" in err, err


@needs_vllm
def test_one_batch_of_mixed_depths_equals_generate_at_each_requests_r_compiled(folder, prompts, monkeypatch) -> None:
    """The engine compiles (vLLM's CPU mode with its CI backend, as test_serving_depth's Ouro engine):
    the mixed batch runs eagerly, then a batch of default-depth requests runs the traced graph (the
    value-embedding rows and the diagonal injection inside it), each as generate()."""
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    jobs = [dict(checkpoint=folder, prompts=[p], n=8, kwargs=d) for p, d in zip(prompts, DEPTHS)]
    jobs.append(dict(checkpoint=folder, prompts=prompts, n=8, kwargs={}))
    *done, defaults = greedy_references_via(python, jobs)
    references = [job[0] for job in done]
    mixed_steps = recording_mixed_steps(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    llm = make_llm(folder, SERVER, max_model_len=64, skip_tokenizer_init=False, enforce_eager=False)
    try:
        outputs = mixed_greedy(llm, prompts, DEPTHS)
        default_outputs = mixed_greedy(llm, prompts, [{}] * len(prompts))
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references)
    assert_served_as_generate(prompts, default_outputs, defaults)
    assert any(set(r) >= {1, 2, 4, 8} for r in mixed_steps)  # one forward ran every depth (the subset loop)
    assert len({tuple(tokens) for tokens, _ in references[:4]}) > 1  # the depths differ in what they serve


@needs_vllm
def test_looped_hf_serve_answers_the_openai_client_at_each_requests_depth_as_generate(folder, prompts, tmp_path):
    """The real server (``looped-hf serve DIR --max-num-recurrences 8`` on loopback): the mix of
    requests sent at once with the async openai client, each naming its r at the top of the body (or
    nothing: the default), answered with ``generate()``'s greedy tokens at that r."""
    import asyncio
    import sys
    import tempfile

    import openai
    from conftest import subprocess_env
    from serving_helpers import free_port, vllm_env
    from test_serving_walk import _running, _wait_healthy

    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    jobs = [dict(checkpoint=folder, prompts=[p], n=8, kwargs=d) for p, d in zip(prompts, DEPTHS)]
    references = [done[0][0] for done in greedy_references_via(python, jobs)]

    async def ask_all(url: str, model: str) -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        async def one(prompt: list[int], depth: dict) -> list[int]:
            done = await client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True, **depth},
            )  # fmt: skip
            return list(done.choices[0].token_ids)

        return await asyncio.gather(*(one(p, d) for p, d in zip(prompts, DEPTHS)))

    vllm_root = Path(tempfile.mkdtemp(prefix="lvp-"))  # vLLM's IPC sockets need a short path
    env = {**subprocess_env(), **vllm_env(vllm_root)}
    port = free_port()
    serve = [sys.executable, "-m", "looped_hf", "serve", str(folder), "--max-num-recurrences", "8",
             "--port", str(port), "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64",
             "--max-num-seqs", str(len(prompts))]  # fmt: skip
    try:
        with _running(serve, env, tmp_path / "server.log") as proc:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, tmp_path / "server.log", timeout_s=480)
            served = asyncio.run(ask_all(url, str(folder)))
    finally:
        shutil.rmtree(vllm_root, ignore_errors=True)
    assert served == references
