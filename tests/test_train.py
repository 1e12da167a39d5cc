"""One run: the run record, the run directory, flags over the file, failures, resume, two processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess

import pytest
import yaml
from conftest import PYTHON, REPO, subprocess_env
from transformers import TrainerCallback

from looped_hf.arguments import parse_recipe
from looped_hf.sweep import read_jsonl
from looped_hf.train import RECORD_KEYS, main, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(recipe: dict, *argv: str, callbacks=None) -> dict:
    return train(*parse_recipe(recipe, list(argv)), callbacks=callbacks)


def test_run_record_is_complete_and_run_dir_is_publishable(tiny_recipe, tmp_path):
    old_umask = os.umask(0o027)  # the weights follow it (safetensors alone writes them 0600)
    try:
        record = _run(tiny_recipe)
    finally:
        os.umask(old_umask)
    assert record["status"] == "ok", record.get("traceback")
    assert set(RECORD_KEYS) <= set(record)
    steps, batch, seq = (
        tiny_recipe["max_steps"],
        tiny_recipe["per_device_train_batch_size"],
        tiny_recipe["seq_len"],
    )
    assert record["tokens"] == steps * batch * seq
    assert record["train_flops"] == pytest.approx(record["train_flops_per_token"] * record["tokens"])
    assert record["eval_tokens"] == tiny_recipe["eval_blocks"] * (seq - 1)
    assert math.isfinite(record["loss"]) and record["eval_perplexity"] == pytest.approx(
        math.exp(record["loss"])
    )
    assert record["arch"] == "loop2" and record["num_recurrences"] == 2 and record["budget"] is None
    assert record["n_once"] > 0 and record["n_rec"] > 0 and record["effective_num_layers"] == 4
    assert record["versions"]["transformers"].startswith("5.")
    # The attention kernel the run used, and why (no CUDA here: the study's rule falls to sdpa).
    assert record["attention_backend"]["implementation"] == "sdpa"
    assert record["attention_backend"]["reason"] == "sdpa (no CUDA device)"
    run_dir = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py", "interface_looped.py", "generation_looped.py",
                 "generation_config.json", "tokenizer.json", "run_record.json", "recipe.yaml"):  # fmt: skip
        assert (run_dir / name).exists(), name
    assert stat.S_IMODE((run_dir / "model.safetensors").stat().st_mode) == 0o640
    config = json.loads((run_dir / "config.json").read_text())
    assert "AutoModelForCausalLM" in config["auto_map"] and config["use_cache"] is True
    assert json.loads((run_dir / "run_record.json").read_text())["loss"] == record["loss"]
    # The resolved recipe reruns the same run.
    model_args, data_args, training_args = parse_recipe(run_dir / "recipe.yaml")
    assert model_args.settings["num_recurrences"] == 2 and data_args.seq_len == seq and training_args.max_steps == steps


def test_flags_override_the_recipe_file(tiny_recipe, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe))
    model_args, data_args, training_args = parse_recipe(path, ["--num_recurrences", "8", "--seq_len", "16"])
    assert model_args.settings["num_recurrences"] == 8 and data_args.seq_len == 16
    assert model_args.settings["hidden_size"] == tiny_recipe["hidden_size"]
    # A length flag replaces the file's length instead of conflicting with it.
    _, _, training_args = parse_recipe(path, ["--train_tokens", "1000"])
    assert training_args.train_tokens == 1000 and training_args.max_steps == -1


def test_token_budget_sets_steps_and_muon_trains(tiny_recipe):
    recipe = dict(tiny_recipe, max_steps=None, train_tokens=600, optimizer="muon", num_recurrences=3,
                  backprop_recurrences=2)  # fmt: skip
    recipe.pop("max_steps")
    record = _run(recipe)
    assert record["status"] == "ok", record.get("traceback")
    assert record["max_steps"] == 5  # ceil(600 / (4 x 32))
    assert record["tokens"] == 5 * 128 and record["backprop_recurrences"] == 2


class _Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise RuntimeError("simulated crash")


def test_an_exception_is_recorded_as_a_failed_run(tiny_recipe, tmp_path):
    record = _run(tiny_recipe, callbacks=[_Boom()])
    assert record["status"] == "failed" and "simulated crash" in record["error"]
    assert json.loads((tmp_path / "run" / "run_record.json").read_text())["status"] == "failed"
    assert main([str(tmp_path / "missing.yaml")]) == 2


def test_rerun_resumes_from_the_last_checkpoint(tiny_recipe, tmp_path):
    recipe = dict(tiny_recipe, save_strategy="steps", save_steps=2, max_steps=4, optimizer="muon")
    first = _run(recipe)
    assert first["status"] == "ok"
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "checkpoint-4")  # as if killed before step 4
    second = _run(dict(recipe, max_steps=6))
    assert second["resumed_from"].endswith("checkpoint-2")
    assert second["tokens"] == 6 * 4 * 32  # the checkpointed token count carries over


@pytest.mark.slow  # several processes: minutes on a busy 2-core machine; CI runs it
def test_accelerate_two_processes_log_once_and_count_both(tiny_recipe, tmp_path):
    recipe = dict(
        tiny_recipe, max_steps=3, per_device_train_batch_size=2, results_file=str(tmp_path / "results.jsonl")
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    # On CPU, `--multi_gpu` (not `--cpu`, which starts one process) gives 2 gloo processes.
    cmd = [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           "-m", "looped_hf.train", str(path)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_jsonl(tmp_path / "results.jsonl")
    assert len(records) == 1
    record = records[0]
    assert record["status"] == "ok" and record["num_processes"] == 2
    assert record["tokens"] == 3 * 2 * 2 * 32  # steps x batch x processes x seq_len
    assert record["train_flops"] == pytest.approx(record["train_flops_per_token"] * record["tokens"])


def test_hyperconnection_model_trains_with_adamw(tiny_recipe):
    record = _run(
        dict(tiny_recipe, input_injection="hyperconnection", num_hyperconnection_lanes=2, max_steps=3)
    )
    assert record["status"] == "ok", record.get("traceback")
    assert record["config"]["input_injection"] == "hyperconnection"
