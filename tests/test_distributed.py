"""Many processes: the shipped accelerate configs (recipes/accelerate/), DDP on 2 CPU processes
through `accelerate launch` and FSDP2's `fully_shard` on 2 CPU processes, each against 1 process
with the same global batch (fp32, so the only differences are reduction orders)."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import yaml
from conftest import PYTHON, REPO, subprocess_env

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import parse_recipe
from looped_hf.train import train

ACCELERATE = REPO / "recipes" / "accelerate"
# fp32 on CPU: 1 process and 2 processes add the same numbers in another order (~1e-7 relative).
REL_TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shipped_accelerate_configs_load_and_wrap_the_models_layers():
    from accelerate.commands.config.config_args import ClusterConfig

    ddp = ClusterConfig.from_yaml_file(ACCELERATE / "ddp.yaml")
    assert ddp.distributed_type == "MULTI_GPU" and ddp.mixed_precision == "no"
    fsdp = ClusterConfig.from_yaml_file(ACCELERATE / "fsdp2.yaml")
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    # No class named: accelerate wraps the model's `_no_split_modules` that the model instantiates,
    # so every norm placement's decoder layer becomes one FSDP unit.
    assert fsdp.fsdp_config.get("fsdp_transformer_layer_cls_to_wrap") is None
    from accelerate.utils import FullyShardedDataParallelPlugin

    for placement in ("pre", "sandwich", "sublayer_output", "pre_and_output"):
        model = LoopedForCausalLM(LoopedConfig(vocab_size=64, hidden_size=32, num_attention_heads=2,
                                               norm_placement=placement))  # fmt: skip
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        plugin.set_auto_wrap_policy(model)
        layers = {type(m).__name__ for m in model.modules() if type(m).__name__ in model._no_split_modules}
        assert set(plugin.transformer_cls_names_to_wrap) == layers
        assert len(layers) == 1


def _train(
    tiny_recipe: dict, tmp_path, name: str, batch: int, launcher: list[str] | None
) -> tuple[list, list, dict]:
    """4 steps of ``looped_hf.train`` under ``launcher`` (``None``: in this process, as one process);
    the logged losses and gradient norms, and the run record."""
    recipe = {**tiny_recipe, "output_dir": str(tmp_path / name), "per_device_train_batch_size": batch,
              "max_steps": 4, "logging_steps": 1, "save_strategy": "steps", "save_steps": 4,
              "torch_num_threads": 1}  # fmt: skip
    if launcher is None:
        assert train(*parse_recipe(recipe))["status"] == "ok"
    else:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        proc = subprocess.run([*launcher, "-m", "looped_hf.train", str(path)], cwd=REPO, env=subprocess_env(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((tmp_path / name / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    record = json.loads((tmp_path / name / "run_record.json").read_text())
    return [e["loss"] for e in logs], [e["grad_norm"] for e in logs], record


@pytest.mark.slow
def test_ddp_on_two_processes_logs_the_losses_of_one_process_with_the_same_global_batch(
    tiny_recipe, tmp_path, one_torch_thread
):
    launch = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / "ddp.yaml"),
              "--num_processes", "2", "--main_process_port", str(_free_port())]  # fmt: skip
    loss2, grad2, rec2 = _train(tiny_recipe, tmp_path, "two", 4, launch)
    loss1, grad1, rec1 = _train(tiny_recipe, tmp_path, "one", 8, None)  # one process: this one
    assert rec2["num_processes"] == 2 and rec1["num_processes"] == 1  # two processes really ran
    assert len(loss1) == len(loss2) == 4
    assert loss2 == pytest.approx(loss1, rel=REL_TOL)
    assert grad2 == pytest.approx(grad1, rel=REL_TOL)
    assert loss1[-1] < loss1[0]  # it trained
    assert rec2["tokens"] == rec1["tokens"] and rec2["train_flops"] == rec1["train_flops"]
    assert rec2["loss"] == pytest.approx(rec1["loss"], rel=REL_TOL)  # held-out loss, reduced across processes


def _torchrun(script, n: int, *args: str) -> dict:
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                           str(script), *args], cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muonh"])
def test_fsdp2_sharding_each_layer_trains_the_shared_block_as_one_process_does(optimizer, one_torch_thread):
    # FSDP2 through accelerate needs a GPU-class distributed type (accelerate turns a CPU launch into
    # DDP), so tests/fsdp2_train.py shards with torch's fully_shard directly. The one-process run is
    # the same function here, unsharded: a process of its own would only re-import torch.
    import fsdp2_train

    sharded = _torchrun(REPO / "tests" / "fsdp2_train.py", 2, optimizer)
    single = fsdp2_train.run(optimizer)
    assert sharded["losses"] == pytest.approx(single["losses"], rel=REL_TOL)
    assert sharded["losses"][-1] < sharded["losses"][0]
    # The block runs 3 times per forward: its gradient (reduce-scattered once per step) must hold all 3 uses.
    assert sharded["params"].keys() == single["params"].keys()
    for name, value in single["params"].items():
        assert sharded["params"][name] == pytest.approx(value, rel=REL_TOL), name
