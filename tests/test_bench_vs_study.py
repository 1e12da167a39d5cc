"""benchmarks/bench_vs_study.py keeps running: its Trainer-cost table (no study code needed) wraps
private Trainer methods, which a transformers release may move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from conftest import load_benchmark
from transformers.trainer_callback import CallbackHandler

from looped_hf.trainer import LoopedTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_trainer_cost_table_runs_and_leaves_the_trainer_classes_as_they_were(tmp_path, capsys):
    bench = load_benchmark("bench_vs_study")
    before = {cls: dict(vars(cls)) for cls in (transformers.Trainer, LoopedTrainer, CallbackHandler)}
    out = tmp_path / "numbers.json"
    assert bench.main(["--overhead-only", "--overhead-steps", "3", "--overhead-rounds", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "LoopedTrainer" in printed and "transformers.Trainer" in printed and "of the paper step" in printed
    numbers = json.loads(out.read_text())
    classes = numbers["overhead"]["classes"]
    assert set(classes) == {"LoopedTrainer", "transformers.Trainer"}
    for name, c in classes.items():
        assert set(c["parts_ms"]) == set(bench.PartTimers.PARTS)
        assert c["parts_ms"]["batch fetch (get_batch_samples)"] > 0, name
    # The vanilla Trainer computes the gradient norm every step; LoopedTrainer's timer sees a call
    # that returns at once (no logging step among the timed ones).
    assert classes["transformers.Trainer"]["parts_ms"]["grad norm (_get_grad_norm)"] > 0
    assert {cls: dict(vars(cls)) for cls in before} == before  # every wrapper removed


def test_without_the_study_it_says_what_it_needs(capsys):
    assert load_benchmark("bench_vs_study").main([]) == 0
    assert "--study-src DIR" in capsys.readouterr().out


# A stand-in for the study's nanochat package with the interface bench_vs_study calls (the study's
# code stays out of this repository): GPTConfig, GPT (meta construction, init_weights,
# setup_optimizer, forward(x, y, num_recur)) and common.compute_gradient_stats.
FAKE_GPT = '''
from dataclasses import dataclass
import torch

@dataclass
class GPTConfig:
    sequence_len: int
    vocab_size: int
    n_head: int
    n_kv_head: int
    n_embd: int
    n_prelude: int
    n_recur_block: int
    n_coda: int
    num_recur: int
    bptt_k: int
    input_injection: str

class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.block = torch.nn.Linear(config.n_embd, config.n_embd)
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def init_weights(self):
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.02)

    def setup_optimizer(self, unembedding_lr, embedding_lr, matrix_lr, d_ref):
        opt = torch.optim.AdamW(self.parameters(), lr=matrix_lr)
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
        return opt

    def forward(self, x, y, num_recur):
        h = self.wte(x)
        for _ in range(num_recur):
            h = h + torch.relu(self.block(h))
        return torch.nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1).float(), y.flatten())
'''
FAKE_COMMON = '''
def compute_gradient_stats(model, mode):
    return {"grad_norm": sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)}
'''


def write_fake_study(root: Path) -> Path:
    """A stand-in for the study's nanochat package under ``root``; returns the folder to pass as
    ``--study-src`` (the study's own code is never in this repository)."""
    study = root / "nanochat"
    study.mkdir(parents=True)
    (study / "__init__.py").write_text("")
    (study / "gpt.py").write_text(FAKE_GPT)
    (study / "common.py").write_text(FAKE_COMMON)
    return root


@pytest.mark.slow
def test_three_sides_per_width_with_mfu_phases_and_top_kernels(tmp_path, capsys):
    """The comparison's whole path on a CPU (the GPU run differs in device, bf16 and compile):
    per width, the study / looped_hf / bare sides interleaved, MFU from the model's FLOPs, each
    side's phases and the top entries of one profiled step."""
    study_src = write_fake_study(tmp_path / "study")
    out = tmp_path / "numbers.json"
    argv = ["--study-src", str(study_src), "--widths", "32", "48", "--head-dim", "16", "--seq", "32",
            "--batch", "2", "--steps", "2", "--warmup", "1", "--profile-top", "3", "--overhead-steps", "0",
            "--peak-flops", "1e10", "--json", str(out)]  # fmt: skip
    assert load_benchmark("bench_vs_study").main(argv) == 0
    printed = capsys.readouterr().out
    assert "top of one profiled looped_hf step" in printed
    numbers = json.loads(out.read_text())
    assert set(numbers["widths"]) == {"32", "48"} and numbers["device"] == "cpu"
    for width, result in numbers["widths"].items():
        assert result["shape"]["width"] == int(width)
        session = result["sessions"]["eager"]
        tokens = result["shape"]["batch"] * result["shape"]["seq"]
        for side in ("study", "looped_hf", "bare"):
            assert session["tokens_per_s"][side] == pytest.approx(tokens / session["ms"][side] * 1e3)
            assert session["mfu"][side] == pytest.approx(
                session["flops_per_token"] * session["tokens_per_s"][side] / 1e10
            )
            assert 1 <= len(session["kernels"][side]) <= 3
            assert all(k["ms"] > 0 and 0 < k["share"] <= 1 for k in session["kernels"][side])
        assert set(session["phases_ms"]["study"]) == {"fwd", "bwd", "stats", "opt"}
        assert set(session["phases_ms"]["bare"]) == {"fwd", "bwd", "opt"}
