"""``looped-hf serve``: its refusals (one line, exit 2, no vLLM needed), its request guard, and its
failed starts, read from a recorded vLLM log and from one real server that fails. The one real server
that starts is test_serving_walk's."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from serving_helpers import free_port
from test_serving_parity import needs_vllm

from looped_hf.serving import cli as serve_cli

REPO = Path(__file__).resolve().parents[1]


# A safetensors file with no tensors: an 8-byte header length, then the header "{}".
EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _config_folder(path: Path, *, weights: bool = True, **overrides) -> Path:
    """A looped model and the byte tokenizer, saved: enough for every check ``looped-hf serve`` makes
    before it starts vLLM. ``weights=False``: a well-formed but empty weights file instead, for a
    folder refused before its weights are checked."""
    from looped_hf import LoopedConfig, LoopedForCausalLM
    from looped_hf.data import load_tokenizer

    kwargs = dict(vocab_size=258, hidden_size=64, num_attention_heads=2, num_prelude_layers=1,
                  num_recurrent_layers=1, num_coda_layers=1, num_recurrences=3)  # fmt: skip
    config = LoopedConfig(**{**kwargs, **overrides})
    if weights:
        LoopedForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
        (path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    load_tokenizer("bytes").save_pretrained(path)
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


def test_the_servers_engine_flags_are_engine_args_settings(folder, capsys, monkeypatch) -> None:
    """One owner: ``looped-hf serve`` passes exactly ``engine_args``' settings as vLLM flags (prefix
    caching and chunked prefill off, the depth worker, the request guard, the CPU norm kernels)."""
    from looped_hf.serving.engine import engine_args, engine_flags

    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    code, out, err = _serve([str(folder), "-r", "5", "--kv-budget", "2", "--dry-run"], capsys)
    assert code == 0, err
    flags = engine_flags(engine_args(folder, device="cpu", num_recurrences=5, kv_budget=2))
    assert shlex.join(flags) in out
    assert {"--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--worker-cls", "--logits-processors",
            "--ir-op-priority"} <= set(flags)  # fmt: skip


def test_a_users_logits_processors_run_after_the_request_guard(folder, capsys, monkeypatch) -> None:
    """``--logits-processors`` after ``--`` (each occurrence, both spellings) joins the guard in one
    flag, since vLLM keeps only the last occurrence of a flag; one naming nothing is refused."""
    from looped_hf.serving.engine import engine_args

    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    vllm_args = ["--logits-processors", "mine:First", "mine.Second", "--dtype", "float32",
                 "--logits-processors=mine:Third"]  # fmt: skip
    code, out, err = _serve([str(folder), "--dry-run", "--", *vllm_args], capsys)
    assert code == 0, err
    [guard] = engine_args(folder, device="cpu")["logits_processors"]
    assert out.count("--logits-processors") == 1
    assert f"--logits-processors {guard} mine:First mine.Second mine:Third " in out
    assert "--dtype float32" in out
    for bad in (["--logits-processors", "--dtype", "float32"], ["--logits-processors="]):
        code, out, err = _serve([str(folder), "--dry-run", "--", *bad], capsys)
        assert code == 2 and "--logits-processors" in err and "names no processor" in err
        assert len(err.strip().splitlines()) == 1


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
    ("argv", "needles"),
    [
        (["{missing}"], ["CKPT="]),
        # r and kv_budget are checked by LoopedConfig's own rules, in its words.
        (["{folder}", "--num-recurrences", "0"], ["num_recurrences=0"]),
        (["{folder}", "--kv-budget", "0"], ["kv_budget=0"]),
        (["{folder}", "-r", "100000"], ["num_recurrences=100000", "ceiling"]),
        (["{folder}", "--port", "70000"], ["--port 70000"]),
        (["{folder}", "--", "--hf-overrides", "{{}}"], ["--hf-overrides after --"]),
        (["{folder}", "--", "--model=x"], ["--model after --"]),
        (["{folder}", "--", "--enable-prefix-caching"], ["--enable-prefix-caching after --", "engine_args"]),
        (["{llama}"], ["model_type='llama'"]),
        (["{truncated}"], ["model.safetensors", "truncated"]),
        (["{noise}"], ["state_init='noise'"]),
        (["{head576}"], ["head_dim=576"]),
        (["{hyper}", "-r", "4"], ["num_recurrences=4", "hyperconnection"]),
        (["{no_tokenizer}"], ["no tokenizer"]),
        (["{edited}"], ["the weights are not the model its config.json builds",
                        "has shape [256, 64] in model.safetensors, the config makes [192, 64]"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, folder, capsys, monkeypatch, argv, needles) -> None:
    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    paths = {"missing": tmp_path / "nope", "folder": folder}
    paths["llama"] = tmp_path / "llama"
    paths["llama"].mkdir()
    (paths["llama"] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    paths["truncated"] = _config_folder(tmp_path / "truncated", weights=False)
    (paths["truncated"] / "model.safetensors").write_bytes(EMPTY_SAFETENSORS[:5])
    paths["noise"] = _config_folder(tmp_path / "noise", weights=False, state_init="noise")
    paths["head576"] = _config_folder(tmp_path / "head576", weights=False, hidden_size=576, num_attention_heads=1)
    paths["hyper"] = _config_folder(tmp_path / "hyper", weights=False, input_injection="hyperconnection")
    paths["no_tokenizer"] = _config_folder(tmp_path / "no_tok", weights=False)
    paths["edited"] = tmp_path / "edited"  # saved, then config.json edited: the MLP's width no longer fits
    shutil.copytree(folder, paths["edited"])
    edited = json.loads((paths["edited"] / "config.json").read_text())
    (paths["edited"] / "config.json").write_text(json.dumps({**edited, "intermediate_size": 192}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (paths["no_tokenizer"] / name).unlink()
    code, out, err = _serve([a.format(**paths) for a in argv], capsys)
    assert code == 2
    assert all(needle in err for needle in needles), err
    assert err.startswith("looped-hf serve: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""


def test_missing_vllm_names_the_install_command(folder, capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    code, _, err = _serve([str(folder)], capsys)
    assert code == 2
    assert "vllm: not installed" in err and "make serve-setup" in err


def test_the_cli_and_looped_hf_serving_do_not_import_vllm() -> None:
    """One fresh process for both: torch is imported (import looped_hf registers the Auto classes);
    vLLM waits for ``serve`` to run, and is imported only by the plugin and the vLLM model."""
    code = (
        "import sys, looped_hf, looped_hf.serving, looped_hf.cli, looped_hf.serving.cli; "
        "print(sorted({'vllm'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- the KV cache space on CPU -------------------------------------------------------------------
GIB = 1024**3


def test_on_cpu_the_kv_cache_gets_what_the_model_can_use_and_says_so(folder, capsys, monkeypatch) -> None:
    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(serve_cli, "available_memory", lambda: 20 * GIB)
    code, out, err = _serve([str(folder), "--dry-run"], capsys)
    assert code == 0, err
    # hidden 64 with 2 heads, r 3 with one block layer: 5 KV caches of 2 x 2 x 32 float32 per token,
    # 128 sequences of 2048 tokens = 0.31 GiB, so 1 GiB (the variable's unit), far below half of 20.
    [line] = [x for x in out.splitlines() if "VLLM_CPU_KVCACHE_SPACE" in x]
    assert line.startswith("[serve] VLLM_CPU_KVCACHE_SPACE=1 (GiB)"), line
    assert "128 sequences of 2048 tokens at num_recurrences=3 (5 KV caches)" in line
    assert "set VLLM_CPU_KVCACHE_SPACE to choose" in line


def test_kv_cache_space_is_what_the_model_needs_within_half_the_free_memory(folder) -> None:
    config = serve_cli.read_looped_config(folder)  # 5 KV caches x 2 x 2 heads x 32 x 4 bytes = 2560 B/token
    per_token = 2560
    many = ["--max-num-seqs", "4096", "--max-model-len=4096"]  # 40 GiB at most
    assert per_token * 4096 * 4096 == 40 * GIB
    assert serve_cli.kv_cache_space(config, many, 100 * GIB)[0] == 40
    assert serve_cli.kv_cache_space(config, many, 24 * GIB)[0] == 12  # half of the free memory
    assert serve_cli.kv_cache_space(config, [*many, "-tp", "2"], 24 * GIB)[0] == 6  # each worker its own
    assert serve_cli.kv_cache_space(config, many, GIB)[0] == 1  # never below the unit
    assert serve_cli.kv_cache_space(config, [], 24 * GIB)[0] == 1
    # The user sized it among vLLM's flags, or the free memory is unknown: vLLM decides.
    assert serve_cli.kv_cache_space(config, ["--kv-cache-memory-bytes", "1000000"], 24 * GIB) is None
    assert serve_cli.kv_cache_space(config, ["--gpu-memory-utilization=0.3"], 24 * GIB) is None
    assert serve_cli.kv_cache_space(config, [], None) is None


def test_a_users_kv_cache_space_is_left_alone(folder, capsys, monkeypatch) -> None:
    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: True)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    code, out, err = _serve([str(folder), "--dry-run"], capsys)
    assert code == 0 and "VLLM_CPU_KVCACHE_SPACE" not in out, out + err
    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    code, out, err = _serve([str(folder), "--dry-run"], capsys)  # a GPU: vLLM's memory fraction rules
    assert code == 0 and "VLLM_CPU_KVCACHE_SPACE" not in out, out + err


# --- a failed start: its root cause last ------------------------------------------------------------
# What vLLM's server and its engine print when the worker cannot get its KV cache (shortened from a
# real run of vllm-cpu 0.32.0): the cause in the worker, wrapped by the engine core, then the server.
FAILING_SERVER = r"""
import sys
out, err = sys.stdout, sys.stderr
print("(APIServer pid=1) INFO 12-06 02:32:21 [api_utils.py:286] non-default args: {}", file=out)
for who in ("Worker pid=3", "EngineCore pid=2"):
    print(f"({who}) ERROR 12-06 02:33:42 [core.py:1510] Traceback (most recent call last):", file=out)
    print(f'({who}) ERROR 12-06 02:33:42 [core.py:1510]   File "core.py", line 157, in __init__', file=out)
    print(f"({who}) INFO 12-06 02:33:42 [other.py:1] another process's line in between", file=out)
    print(f"({who}) ERROR 12-06 02:33:42 [core.py:1510]     raise ValueError(", file=out)
    cause = "ValueError: Available memory on node 0 (1.00/23.54 GiB) is less than requested memory for kv"
    if who.startswith("EngineCore"):
        cause = f"RuntimeError: Worker failed with error '{cause}', please check the stack trace above for the root cause"
    print(f"({who}) ERROR 12-06 02:33:42 [core.py:1510] {cause}", file=out)
out.flush()
print("Traceback (most recent call last):", file=err)
print('  File "utils.py", line 1431, in wait_for_engine_startup', file=err)
print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", file=err)
sys.exit(1)
"""


def test_a_failed_start_ends_with_its_root_cause(capfd) -> None:
    from looped_hf.serving.launch import run_server

    code = run_server([sys.executable, "-c", FAILING_SERVER], dict(os.environ))
    out, err = capfd.readouterr()
    assert code == 1
    assert "(APIServer pid=1) INFO" in out and "Engine core initialization failed" in err  # passed through
    assert err.splitlines()[-1] == (
        "looped-hf serve: vLLM's engine failed to start: ValueError: Available memory on node 0 "
        "(1.00/23.54 GiB) is less than requested memory for kv"
    )


# vllm-cpu 0.32.0's own output, recorded from `looped-hf serve` with VLLM_CPU_KVCACHE_SPACE=100000: the
# worker's ValueError, wrapped by the engine core's RuntimeError on both streams, then the server's.
RECORDED_FAILED_START = REPO / "tests" / "fixtures" / "vllm_failed_start"
REPLAY = (
    "import pathlib, sys\n"
    "log = pathlib.Path(sys.argv[1])\n"
    "sys.stdout.write((log / 'stdout.log').read_text())\n"
    "sys.stdout.flush()\n"
    "sys.stderr.write((log / 'stderr.log').read_text())\n"
    "sys.exit(1)\n"
)


def test_a_recorded_failed_start_of_vllm_ends_with_the_workers_error(capfd) -> None:
    from looped_hf.serving.launch import run_server

    code = run_server([sys.executable, "-c", REPLAY, str(RECORDED_FAILED_START)], dict(os.environ))
    out, err = capfd.readouterr()
    assert code == 1
    assert out == (RECORDED_FAILED_START / "stdout.log").read_text()  # passed through unchanged
    assert "Engine core initialization failed. See root cause above" in err
    assert err.splitlines()[-1] == (
        "looped-hf serve: vLLM's engine failed to start: ValueError: Available memory on node 0 (13.67/23.54 GiB) "
        "on kv cache allocation is less than requested memory for kv (100000.0 GiB). Decrease "
        "--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes."
    )


def test_a_server_that_exits_cleanly_adds_nothing(capfd) -> None:
    from looped_hf.serving.launch import run_server

    script = "print('Traceback (most recent call last):'); print('ValueError: handled and logged')"
    assert run_server([sys.executable, "-c", script], dict(os.environ)) == 0
    out, err = capfd.readouterr()
    assert "looped-hf serve" not in out + err


def test_a_sigterm_to_serve_alone_is_passed_on_to_the_server(tmp_path, capfd) -> None:
    """A supervisor that stops serve's process only: the server is stopped too, and a stop asked for
    is not reported as a failure."""
    import threading

    from looped_hf.serving.launch import run_server

    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "def stop(*_):\n"
        "    print('Traceback (most recent call last):'); print('KeyboardInterrupt: stopping'); sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(120)\n"
    )

    def stop_serve() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_serve, daemon=True).start()
    started = time.monotonic()
    code = run_server([sys.executable, "-c", script], dict(os.environ))
    out, err = capfd.readouterr()
    assert code == 3 and time.monotonic() - started < 60
    assert "KeyboardInterrupt: stopping" in out and "looped-hf serve" not in out + err


@needs_vllm
def test_a_real_failed_start_ends_with_vllms_root_cause(tmp_path, capfd, monkeypatch) -> None:
    """vLLM's engine cannot get the KV cache asked for: the last line is vLLM's ValueError, not the
    server's "Engine core initialization failed. See root cause above". ``looped-hf serve`` runs
    through the CLI's dispatcher in this process (one interpreter start-up fewer), vLLM's server as
    its child, as for a user. vLLM's engine core runs the model itself (VLLM_ENABLE_V1_MULTIPROCESSING=0:
    no worker process, one start-up fewer); the recorded log above covers the form with a worker
    process, and the one real server test below starts one."""
    from serving_helpers import save_serving_checkpoint, vllm_env

    from looped_hf.cli import main as looped_hf
    from looped_hf.data import load_tokenizer

    tok = load_tokenizer("bytes")
    folder = save_serving_checkpoint(tmp_path / "ckpt", vocab_size=len(tok))
    tok.save_pretrained(folder)
    vllm_root = Path(tempfile.mkdtemp(prefix="lvs-"))
    try:
        env = {**_env(), **vllm_env(vllm_root), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "100000"}  # GiB: more than any machine here has  # fmt: skip
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        code = looped_hf(["serve", str(folder), "--port", str(free_port()), "--", "--dtype", "float32",
                          "--enforce-eager", "--max-model-len", "256"])  # fmt: skip
        _, err = capfd.readouterr()
    finally:
        shutil.rmtree(vllm_root, ignore_errors=True)
    assert code == 1, err[-3000:]
    assert "Engine core initialization failed" in err  # vLLM's own words, passed through
    last = err.strip().splitlines()[-1]
    assert last.startswith("looped-hf serve: vLLM's engine failed to start: ValueError: Available memory"), last
    assert "VLLM_CPU_KVCACHE_SPACE" in last


# --- a request that asks for another r ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"prompt": "x", "num_recurrences": 8}, "num_recurrences=8"),  # the OpenAI client's extra_body
        ({"prompt": "x", "vllm_xargs": {"kv_budget": 1}}, "vllm_xargs.kv_budget=1"),
        ({"prompt": "x", "extra_body": {"num_recurrences": 3}}, "extra_body.num_recurrences=3"),
        ({"prompt": "x", "sampling_params": {"extra_args": {"num_recurrences": "4"}}},
         "sampling_params.extra_args.num_recurrences='4'"),  # fmt: skip
        ({"prompt": "x", "num_recurrences": True}, "num_recurrences=True"),
        ({"prompt": "x", "num_recurrences": 4, "kv_budget": None}, None),  # within the server's bounds: served
        ({"prompt": "x", "num_recurrences": 1}, None),
        ({"prompt": "x", "max_tokens": 2}, None),
        # A misspelt depth key would be dropped and served at the default depth with 200: refused.
        ({"prompt": "x", "num_recurrence": 2}, "num_recurrence=2"),
        ({"prompt": "x", "vllm_xargs": {"kv-budget": 1}}, "vllm_xargs.kv-budget=1"),
        ({"prompt": "x", "vllm_xargs": {"num_recurrences": 2, "exit_treshold": 0.5}}, "vllm_xargs.exit_treshold=0.5"),
        ({"messages": [{"role": "user", "content": "hi"}], "Num_Recurrences": 3}, "Num_Recurrences=3"),
        # Keys in the user's data are not options: a JSON schema's property, a message.
        ({"messages": [{"role": "user", "content": "hi", "num_recurrences": 9}],
          "response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {
              "num_recurrences": {"type": "integer"}}}}}}, None),  # fmt: skip
    ],
)
def test_a_request_body_naming_a_depth_the_server_cannot_honour_is_refused(body, refused) -> None:
    from looped_hf.serving.depth import ServedDepth
    from looped_hf.serving.plugin import map_body

    _, found = map_body(body, ServedDepth(4, 4, None, None, False))  # r 4 (ceiling 4), no budget
    if refused is None:
        assert found is None
    else:
        field, why = found
        assert why.startswith(refused + ": "), why
        assert field == refused.split("=")[0]


def test_the_request_guard_answers_400_before_vllm_reads_the_body() -> None:
    import asyncio
    from types import SimpleNamespace

    from looped_hf.serving.plugin import RequestGuard

    seen = []

    async def vllm_app(scope, receive, send) -> None:
        while not seen or seen[-1].get("more_body"):
            seen.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    from serving_helpers import serving_config

    hf_config = serving_config(num_recurrences=2, kv_budget=1)
    device = SimpleNamespace(device_type="cpu")  # vLLM's DeviceConfig: per-request depth runs on CPU
    app = SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(
        hf_config=hf_config), device_config=device)))  # fmt: skip

    def call(body: dict) -> tuple[int, bytes]:
        raw = json.dumps(body).encode()
        chunks = [{"type": "http.request", "body": raw[:5], "more_body": True},
                  {"type": "http.request", "body": raw[5:], "more_body": False}]  # fmt: skip
        sent = []

        async def receive() -> dict:
            return chunks.pop(0)

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "app": app}
        asyncio.run(RequestGuard(vllm_app)(scope, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    status, body = call({"prompt": "x", "num_recurrences": 8})
    assert status == 400 and not seen
    error = json.loads(body)["error"]
    assert error["code"] == 400 and error["param"] == "num_recurrences"
    assert error["message"].startswith("num_recurrences=8: must be an integer from 1 to 2")
    status, body = call({"prompt": "x", "num_recurrences": 2, "vllm_xargs": {"kv_budget": 1}})
    assert status == 200 and body == b"ok"
    # vLLM got the whole body, its top-level depth moved into vllm_xargs (where vLLM hands it to the engine).
    assert json.loads(b"".join(m["body"] for m in seen)) == {"prompt": "x", "vllm_xargs": {"kv_budget": 1,
                                                                                          "num_recurrences": 2}}
    # On a GPU (no runner hands the model per-request depth yet) only the default depth is admitted.
    device.device_type = "cuda"
    status, body = call({"prompt": "x", "num_recurrences": 1})
    assert status == 400 and "num_recurrences=1: this server runs every request at its default depth" in (
        json.loads(body)["error"]["message"]
    )
    assert call({"prompt": "x", "num_recurrences": 2})[0] == 200
