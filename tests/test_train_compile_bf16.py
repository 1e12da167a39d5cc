"""Compiled and bf16 training through `looped_hf.train.train` (the vanilla Trainer), on CPU.

- `torch_compile: true` compiles the looped model's forward (hooks stay eager): one graph, no
  graph break, no recompile per step; with a sampled r at most one graph per distinct r. Losses
  of 10 steps match eager training within 2e-3 nats (inductor reorders fp32 reductions; the
  trajectories drift apart by ~1e-5 per step on these tiny models, so 2e-3 leaves room without
  hiding a wrong graph, which is off by far more than that from step 1).
- `bf16: true` trains under CPU autocast; its loss over 50 steps stays within 0.05 nats of the fp32
  run's at every logged step (bf16 has 8 bits of mantissa: per-step loss differences of ~1e-2 are
  expected, a broken mixed-precision path would differ by far more), and MuonH's parameters and
  its optimizer state (momentum, initial norm) stay fp32: the master weights.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from looped_hf.arguments import parse_recipe
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMPILE_LOSS_TOL = 2e-3
BF16_LOSS_TOL = 0.05


class _Losses(TrainerCallback):
    """Training loss of every logged step, and the model and optimizer the Trainer used."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.optimizer = None
        self.model = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = float(logs["loss"])

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer


def _run(recipe: dict, **fields) -> tuple[dict, _Losses]:
    losses = _Losses()
    record = train(*parse_recipe({**recipe, **fields}), callbacks=[losses])
    assert record["status"] == "ok", record.get("traceback")
    return record, losses


def _dynamo_counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks) since the last `torch._dynamo.reset()`."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _compile_recipe(tiny_recipe: dict, tmp_path, **fields) -> dict:
    # drop_last: an epoch's partial last batch would be a new shape (a second graph, legitimately).
    return {**tiny_recipe, "max_steps": 10, "logging_steps": 1, "num_recurrences": 3, "dataloader_drop_last": True,
            "output_dir": str(tmp_path / "run"), **fields}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "backend"),
    [
        ({"backprop_recurrences": 2}, "inductor"),  # the real compiler; truncated backprop
        ({"input_injection": "hyperconnection"}, "aot_eager"),  # graph capture + AOT autograd only
    ],
    ids=["truncated-inductor", "hyperconnection-aot_eager"],
)
def test_compiled_training_is_one_graph_and_tracks_eager(tiny_recipe, tmp_path, fresh_dynamo, fields, backend):
    recipe = _compile_recipe(tiny_recipe, tmp_path, **fields)
    eager, eager_losses = _run(recipe)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recipe["output_dir"] = str(tmp_path / "compiled")
    compiled, compiled_losses = _run(recipe, torch_compile=True, torch_compile_backend=backend)
    graphs, breaks = _dynamo_counters()
    assert breaks == 0 and graphs == 1, (graphs, breaks)  # 10 steps, one graph: no recompile per step
    assert compiled["recipe"]["torch_compile"] is True
    assert sorted(compiled_losses.losses) == list(range(1, 11))
    for step, loss in eager_losses.losses.items():
        assert compiled_losses.losses[step] == pytest.approx(loss, abs=COMPILE_LOSS_TOL), step
    # Held-out evaluation runs the eager forward again, on the trained weights.
    assert compiled["loss"] == pytest.approx(eager["loss"], abs=COMPILE_LOSS_TOL)
    assert "forward" not in vars(compiled_losses.model)


@pytest.mark.slow
def test_compiled_sampled_r_compiles_one_graph_per_distinct_r(tiny_recipe, tmp_path, fresh_dynamo):
    # 5 steps, not 10: seed 0 draws r = 4, 4, 2, 6, 2, so an r drawn again right away and one drawn
    # again after another r both reuse their graph, for 3 compiles (10 steps: 5 compiles, ~2x the time).
    recipe = _compile_recipe(tiny_recipe, tmp_path, recurrence_sampling="poisson_lognormal", max_steps=5)
    record, losses = _run(recipe, torch_compile=True, torch_compile_backend="aot_eager")
    graphs, breaks = _dynamo_counters()
    ran = _sampled_rs(record)
    assert breaks == 0  # the sampler's numpy draw runs in its (eager) hook, outside the graph
    assert graphs == len(ran) > 1, (graphs, ran)
    assert len(ran) < record["max_steps"]  # an r drawn twice: its graph was reused, not recompiled
    # The FLOP count follows the r each step ran, under compile too.
    assert record["train_flops"] == pytest.approx(record["train_flops_per_token"] * record["tokens"])
    assert len(losses.losses) == 5


def _sampled_rs(record: dict) -> set[int]:
    from looped_hf.recurrence import sample_num_recurrences

    steps = record["max_steps"]
    return {sample_num_recurrences(record["num_recurrences"], s, record["seed"]) for s in range(steps)}


def test_compile_flag_leaves_the_trainer_uncompiled_and_hooks_eager(tiny_recipe, tmp_path, monkeypatch):
    """What `torch_compile: true` does, without paying for a compile: forward is compiled once,
    with the recipe's backend, the Trainer's own (whole-module) compile is off."""
    from looped_hf import train as train_module

    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(train_module.torch, "compile", fake_compile)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    record, losses = _run({**tiny_recipe, "max_steps": 2}, torch_compile=True, torch_compile_backend="aot_eager")
    assert calls == [{"backend": "aot_eager", "mode": None}]
    assert not isinstance(losses.model, torch._dynamo.eval_frame.OptimizedModule)
    assert record["recipe"]["torch_compile"] is True and record["recipe"]["torch_compile_backend"] == "aot_eager"


@pytest.mark.slow
def test_bf16_tracks_fp32_over_50_steps_with_fp32_master_weights(tiny_recipe, tmp_path):
    recipe = {k: v for k, v in tiny_recipe.items() if k != "learning_rate"}  # muonh has its own lrs
    recipe.update(max_steps=50, logging_steps=5, optimizer="muonh", init_scheme="study", max_grad_norm=0.0,
                  lr_scaling="none", muon_learning_rate=0.02)  # fmt: skip
    fp32, fp32_losses = _run({**recipe, "output_dir": str(tmp_path / "fp32")})
    # transformers refuses bf16 without a bf16 GPU unless use_cpu is set: CPU autocast then.
    bf16, bf16_losses = _run({**recipe, "output_dir": str(tmp_path / "bf16")}, bf16=True, use_cpu=True)
    assert sorted(bf16_losses.losses) == sorted(fp32_losses.losses) == list(range(5, 51, 5))
    gaps = {s: abs(bf16_losses.losses[s] - fp32_losses.losses[s]) for s in fp32_losses.losses}
    assert max(gaps.values()) < BF16_LOSS_TOL, gaps
    assert fp32_losses.losses[50] < fp32_losses.losses[5] - 0.1  # it trained: the gap is not between two flat lines
    assert gaps[5] > 0  # bf16 really ran (autocast changed the numbers)
    # MuonH and AdamW update fp32 master weights; the autocast copies are transient.
    assert all(p.dtype == torch.float32 for p in bf16_losses.model.parameters())
    states = [s for opt in bf16_losses.optimizer.optimizer.optimizers for s in opt.state.values()]
    for state in states:
        for value in state.values():
            if torch.is_tensor(value) and value.is_floating_point():
                assert value.dtype == torch.float32
    assert any("initial_norm" in s for s in states)
    assert abs(bf16["loss"] - fp32["loss"]) < BF16_LOSS_TOL
