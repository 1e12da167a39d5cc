"""``looped-hf serve``: its refusals (one line, exit 2, no vLLM needed) and, where vLLM is installed
(``make serve-setup``), a real server on 127.0.0.1 whose ``/v1/completions`` greedy tokens equal
the offline ``vllm.LLM``'s and ``generate()``'s, and whose ``/v1/chat/completions`` applies the
tokenizer's chat template."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from looped_hf.serving import cli as serve_cli

REPO = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (make serve-setup, docs/serving.md)")
# A chat template for the byte tokenizer, which ships none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _config_folder(path: Path, **overrides) -> Path:
    """A looped config, the byte tokenizer and a weights file that is never read: enough for every
    check ``looped-hf serve`` makes before it starts vLLM."""
    from looped_hf import LoopedConfig
    from looped_hf.data import load_tokenizer

    kwargs = dict(vocab_size=258, hidden_size=64, num_attention_heads=2, num_prelude_layers=1,
                  num_recurrent_layers=1, num_coda_layers=1, num_recurrences=3)  # fmt: skip
    LoopedConfig(**{**kwargs, **overrides}).save_pretrained(path)
    load_tokenizer("bytes").save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")
    return path


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = serve_cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return _config_folder(tmp_path / "ckpt")


# --- the command, without vLLM ---------------------------------------------------------------
def test_dry_run_prints_the_server_module_with_r_and_budget_as_hf_overrides(folder, capsys) -> None:
    code, out, err = _serve([str(folder), "-r", "5", "--kv-budget", "2", "--port", "8123", "--dry-run",
                             "--", "--dtype", "float32"], capsys)  # fmt: skip
    assert code == 0, err
    assert f"-m {serve_cli.SERVER_MODULE} --model {folder} --host 127.0.0.1 --port 8123" in out
    assert """--hf-overrides '{"num_recurrences":5,"kv_budget":2}' --dtype float32""" in out


def test_without_flags_the_checkpoints_r_is_kept(folder, capsys) -> None:
    code, out, _ = _serve([str(folder), "--dry-run"], capsys)
    assert code == 0 and "--hf-overrides" not in out


def test_a_run_directory_serves_its_publish_folder_when_there_is_one(tmp_path, capsys, monkeypatch) -> None:
    from test_publish import make_run_dir

    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: False)  # its head_dim 16 runs on GPUs only

    run = make_run_dir(tmp_path / "run")
    code, out, err = _serve([str(run), "--dry-run"], capsys)
    assert code == 0, err
    assert f"--model {run} " in out
    _config_folder(run / "publish")
    code, out, err = _serve([str(run), "--dry-run"], capsys)
    assert code == 0, err
    assert f"--model {run / 'publish'} " in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["{missing}"], "CKPT="),
        (["{folder}", "--num-recurrences", "0"], "--num-recurrences 0: must be an integer >= 1"),
        (["{folder}", "--kv-budget", "0"], "--kv-budget 0: must be an integer >= 1"),
        (["{folder}", "-r", "100000"], "--num-recurrences 100000: above this model's ceiling"),
        (["{folder}", "--port", "70000"], "--port 70000"),
        (["{folder}", "--", "--hf-overrides", "{{}}"], "--hf-overrides after --"),
        (["{folder}", "--", "--model=x"], "--model after --"),
        (["{llama}"], "model_type='llama', not a looped_hf checkpoint"),
        (["{noise}"], "state_init='noise'"),
        (["{head16}"], "head_dim=16"),
        (["{hyper}", "-r", "4"], "--num-recurrences 4: input_injection='hyperconnection'"),
        (["{no_tokenizer}"], "no tokenizer"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, folder, capsys, monkeypatch, argv, needle) -> None:
    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    paths = {"missing": tmp_path / "nope", "folder": folder}
    paths["llama"] = tmp_path / "llama"
    paths["llama"].mkdir()
    (paths["llama"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    paths["noise"] = _config_folder(tmp_path / "noise", state_init="noise")
    paths["head16"] = _config_folder(tmp_path / "head16", hidden_size=32)
    paths["hyper"] = _config_folder(tmp_path / "hyper", input_injection="hyperconnection")
    paths["no_tokenizer"] = _config_folder(tmp_path / "no_tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (paths["no_tokenizer"] / name).unlink()
    code, out, err = _serve([a.format(**paths) for a in argv], capsys)
    assert code == 2
    assert needle in err
    assert err.startswith("looped-hf serve: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""


def test_missing_vllm_names_the_install_command(folder, capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    code, _, err = _serve([str(folder)], capsys)
    assert code == 2
    assert "vllm: not installed" in err and "make serve-setup" in err


def test_the_cli_does_not_import_vllm() -> None:
    # torch is imported (import looped_hf registers the Auto classes); vLLM waits for `serve` to run.
    code = "import sys, looped_hf.cli, looped_hf.serving.cli; print(sorted({'vllm'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- a real server ----------------------------------------------------------------------------
R, BUDGET, NEW_TOKENS = 2, 1, 8
# The offline engine, in its own process (the server is another): greedy tokens of each prompt.
OFFLINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, overrides, prompts, n = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=folder, dtype="float32", enforce_eager=True, block_size=32, max_model_len=256, seed=0,
          hf_overrides=overrides)
params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


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


@needs_vllm
def test_server_completions_equal_offline_vllm_and_generate_and_chat_works(tmp_path) -> None:
    import torch
    from serving_helpers import greedy_references_via, reference_python, save_serving_checkpoint, vllm_env

    from looped_hf.data import load_tokenizer

    tok = load_tokenizer("bytes")
    tok.chat_template = CHAT_TEMPLATE
    folder = save_serving_checkpoint(tmp_path / "ckpt", seed=3, vocab_size=len(tok))
    tok.save_pretrained(folder)
    messages = [{"role": "user", "content": "Hello, loop!"}]
    chat_ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    g = torch.Generator().manual_seed(0)
    # Lengths across vLLM's 32-token KV blocks.
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, 33, 70)]
    # vLLM's IPC sockets need a short path (107 bytes), shorter than pytest-xdist's tmp_path.
    vllm_root = Path(tempfile.mkdtemp(prefix="lvs-"))
    env = {**_env(), **vllm_env(vllm_root), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    port = _free_port()
    serve = [sys.executable, "-m", "looped_hf", "serve", str(folder), "--num-recurrences", str(R),
             "--kv-budget", str(BUDGET), "--port", str(port),
             "--", "--dtype", "float32", "--enforce-eager", "--block-size", "32", "--max-model-len", "256"]  # fmt: skip
    overrides = json.dumps({"num_recurrences": R, "kv_budget": BUDGET})
    offline_cmd = [sys.executable, "-c", OFFLINE, str(folder), overrides, json.dumps([*prompts, chat_ids]),
                   str(NEW_TOKENS)]  # fmt: skip
    with contextlib.ExitStack() as cleanup, _running(serve, env, tmp_path / "server.log") as proc:
        cleanup.callback(shutil.rmtree, vllm_root, ignore_errors=True)
        # The offline engine starts beside the server, on the other core.
        offline = subprocess.run(offline_cmd, env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                                 capture_output=True, text=True, timeout=480)  # fmt: skip
        assert offline.returncode == 0, offline.stderr[-4000:]
        expected = json.loads(offline.stdout.split("RESULT ", 1)[1])
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, tmp_path / "server.log", timeout_s=480)
        model_name = _post_get(url + "/v1/models")["data"][0]["id"]
        done = _post(url + "/v1/completions", {
            "model": model_name, "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        })  # fmt: skip
        served = [c["token_ids"] for c in sorted(done["choices"], key=lambda c: c["index"])]
        chat = _post(url + "/v1/chat/completions", {
            "model": model_name, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True,
        })  # fmt: skip
        # A request cannot change the engine's r: asking for another one is a 400 that says so.
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(url + "/v1/completions", {"model": model_name, "prompt": prompts[0], "max_tokens": 2,
                                            "vllm_xargs": {"num_recurrences": R + 1}})  # fmt: skip
        assert refused.value.code == 400
        assert f"this engine serves num_recurrences={R}" in refused.value.read().decode()
    assert served == expected[:-1]
    assert chat["prompt_token_ids"] == chat_ids  # the template was applied
    assert chat["choices"][0]["token_ids"] == expected[-1]
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    python = reference_python()
    if python is None:
        pytest.skip("served == offline vLLM checked; no interpreter here runs generate() for the third side")
    job = dict(checkpoint=folder, prompts=prompts, n=NEW_TOKENS, kwargs={"num_recurrences": R, "kv_budget": BUDGET})
    [reference] = greedy_references_via(python, [job])
    assert [tokens for tokens, _ in reference] == served


def _post_get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())
