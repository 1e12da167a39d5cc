"""Shared test fixtures: a small offline corpus and a tiny, fast training recipe."""

from __future__ import annotations

import json
import lzma
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
#: Data the tests read, in the repository: one folder per set, each with a PROVENANCE.md that says
#: what made it, from which code, its licence and the sha256 of every file.
FIXTURES = REPO / "tests" / "fixtures"

# Nothing in the tests may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`make test` runs `-n 2`) each worker is one process per core: a second
# OpenMP thread per worker would only oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """The serving tests' one vLLM cache folder (serving_helpers.vllm_env), made by the controlling
    pytest process before xdist starts its workers (which inherit the variable), removed at its end."""
    from serving_helpers import SESSION_VLLM_CACHE_ENV

    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(SESSION_VLLM_CACHE_ENV):
        os.environ[SESSION_VLLM_CACHE_ENV] = tempfile.mkdtemp(prefix="looped-hf-vllm-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(SESSION_VLLM_CACHE_ENV), ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow (tens of seconds each) first, in a session that runs both suites (`make
    test-all`): pytest-xdist hands tests out in this order, so the long ones start while the short
    ones can still fill the other worker, instead of one of them running alone at the end. A stable
    sort: the order within each group is unchanged."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def fixture_path(*parts: str) -> Path:
    """``tests/fixtures/<parts...>``, which must exist: a missing fixture FAILS the test (or the
    module that names it, at collection) instead of skipping it, so that a checkout without the
    data cannot pass by running fewer tests. Each set's PROVENANCE.md says how to remake it."""
    path = FIXTURES.joinpath(*parts)
    if not path.exists():
        where = FIXTURES / parts[0] / "PROVENANCE.md" if parts else FIXTURES
        pytest.fail(
            f"test fixture {path} is missing (see {where} for what it is and how it is made)", pytrace=False
        )
    return path


@pytest.fixture
def one_torch_thread():
    """Tiny models on a busy 2-core machine: a second OpenMP thread only adds contention (seen
    to make 4-step runs 20x slower). Restores the previous setting afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo():
    """No compiled code, recompile budget or graph count left over from an earlier test in this
    process (tests count the graphs they compile), and no compiled code left behind for a later one."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps the counters: an earlier test's graphs would count here
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~120 KB of the embedded classics as a JSONL file (one document per line)."""
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    size = 0
    with (
        lzma.open(REPO / "looped_hf" / "assets" / "corpus.jsonl.xz", "rt", encoding="utf-8") as src,
        open(path, "w", encoding="utf-8") as dst,
    ):
        for line in src:
            row = json.loads(line)
            text = row["text"][:4000]
            dst.write(json.dumps({"text": text}) + "\n")
            size += len(text)
            if size > 120_000:
                break
    return path


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenized-data cache for the whole session (tests build the same blocks)."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture
def tiny_recipe(small_corpus: Path, data_cache: Path, tmp_path: Path) -> dict:
    """A flat recipe for a model that trains in about a second on CPU (bytes tokenizer)."""
    return tiny_recipe_in(small_corpus, data_cache, tmp_path / "run")


def tiny_recipe_in(small_corpus: Path, data_cache: Path, output_dir: Path) -> dict:
    """``tiny_recipe`` with its run in ``output_dir``, for a fixture of a wider scope than a test."""
    return {
        "hidden_size": 32,
        "head_dim": 16,
        "num_prelude_layers": 1,
        "num_recurrent_layers": 1,
        "num_coda_layers": 1,
        "num_recurrences": 2,
        "dataset": str(small_corpus),
        "tokenizer": "bytes",
        "seq_len": 32,
        "eval_blocks": 8,
        "data_cache_dir": str(data_cache),
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "max_steps": 6,
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "learning_rate": 3e-3,
        "seed": 0,
        "dataloader_num_workers": 0,
    }


def subprocess_env() -> dict[str, str]:
    """Environment for `python -m looped_hf...` subprocesses: offline, repo importable, 1 thread."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_DATASETS_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


PYTHON = sys.executable


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as module ``name`` (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# Prepended to scripts that must prove a checkpoint loads as remote code, without the package.
_BLOCK_LOOPED_HF = """
import sys
sys.modules["looped_hf"] = None  # importing looped_hf must fail here
try:
    import looped_hf  # noqa
    raise SystemExit("looped_hf was importable")
except ImportError:
    pass
"""


def run_without_looped_hf(script: str, tmp_path: Path) -> str:
    """Run ``script`` in a fresh Python where ``import looped_hf`` fails (remote code only),
    offline, with a private modules cache; assert it succeeds and return its stdout."""
    import subprocess
    import textwrap

    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf_home"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}  # fmt: skip
    code = _BLOCK_LOOPED_HF + textwrap.dedent(script)
    result = subprocess.run(
        [PYTHON, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


class RandomBlocks(torch.utils.data.Dataset):
    """``n`` seeded random token blocks of ``seq_len`` with labels = inputs: data for Trainer tests
    that count tokens and FLOPs, where the text does not matter."""

    def __init__(self, n: int, vocab: int, seq_len: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


TINY_VOCAB = 97


def tiny_looped_config(**overrides):
    """A looped config small enough for exact tests in milliseconds: d 32, GQA 4/2 heads,
    prelude 1 + block 2 x r 3 + coda 1; any field can be overridden."""
    from looped_hf import LoopedConfig

    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_prelude_layers=1, num_recurrent_layers=2, num_coda_layers=1, num_recurrences=3,
        max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    kwargs.update(overrides)
    return LoopedConfig(**kwargs)


def tiny_looped_model(seed: int = 0, noise: float = 0.1, **overrides):
    """``tiny_looped_config`` in eval mode, with random (not identity) injection and lane gains
    (``noise`` x N(0, 1) added), so every recurrence differs and tests exercise every path."""
    from looped_hf import LoopedForCausalLM

    torch.manual_seed(seed)
    model = LoopedForCausalLM(tiny_looped_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "injection" in name or "hyperconnection" in name:
                p.add_(noise * torch.randn_like(p))
    return model
