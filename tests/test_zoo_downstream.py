"""Everything downstream of ``looped-hf convert`` works on each converted zoo model.

Huginn-0125, the two retrofitted-recurrence variants and Ouro, each converted from its tiny native
checkpoint (``tests/fixtures/zoo``, see ``tests/zoo_helpers.py``) the way a user converts one, then:
``generate()`` at several r and with a KV budget, ``looped-hf test-time`` on the converted folder,
``looped-hf eval`` at every r, and peft LoRA fine-tuning through the HF Trainer. vLLM serving of the
converted models is tested with the serving code.

The fixtures carry no tokenizer (256 tokens, not the byte tokenizer's 258): a character tokenizer
of exactly 256 tokens is saved into a copy of each native folder, as a released model's folder has
its tokenizer, and ``looped-hf convert`` carries it into the converted folder.
"""

from __future__ import annotations

import json
import lzma
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO
from zoo_helpers import ZOO, ZOO_FORMATS, convert_zoo, save_char_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = tuple(ZOO_FORMATS)
TRAINED_R = 4  # every fixture's mean_recurrence / total_ut_steps


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture, given a 256-token tokenizer as a released checkpoint's folder has one, converted
    by ``looped-hf convert FORMAT``: the tokenizer travels into the converted folder."""
    root = tmp_path_factory.mktemp("zoo-downstream")
    out = {}
    for name in NAMES:
        source = root / "native" / name
        shutil.copytree(ZOO / name, source)
        save_char_tokenizer(source, json.loads((source / "config.json").read_text())["vocab_size"])
        out[name] = convert_zoo(name, root / name, source)
        assert (out[name] / "tokenizer.json").is_file() and (out[name] / "tokenizer_config.json").is_file()
    return out


@pytest.fixture(scope="module")
def heldout_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~40 short documents of the embedded classics as JSONL (held-out text for test-time)."""
    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    with lzma.open(REPO / "looped_hf" / "assets" / "corpus.jsonl.xz", "rt", encoding="utf-8") as src:
        rows = [json.loads(line)["text"][:1200] for _, line in zip(range(40), src, strict=False)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows), encoding="utf-8")
    return path


def _load(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__module__.startswith("looped_hf")
    return model, AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------------------------
# 1. generate() at several r, and with a KV budget
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_generate_at_several_r_and_with_a_kv_budget(name: str, folders: dict) -> None:
    """At r = 1, 2, the trained 4 and 6 (none of these models is r-locked): cached greedy decoding is
    the uncached one, with no budget and with kv_budget = r; kv_budget = 1 < r runs. A left-padded
    batch of two prompts through the folder's tokenizer, as a user calls it."""
    model, tokenizer = _load(folders[name])
    assert model.config.num_recurrences == TRAINED_R and not model.config.is_recurrence_locked
    batch = tokenizer(["The capital of France is", "Once upon"], return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()  # the second prompt is really padded
    outputs = {}
    with torch.no_grad():
        for r in (1, 2, TRAINED_R, 6):
            kwargs = {"max_new_tokens": 6, "do_sample": False, "num_recurrences": r}
            uncached = model.generate(**batch, use_cache=False, **kwargs)
            assert uncached.shape == (2, batch["input_ids"].shape[1] + 6)
            assert torch.equal(model.generate(**batch, **kwargs), uncached), r
            assert torch.equal(model.generate(**batch, kv_budget=r, **kwargs), uncached), r
            assert torch.equal(model.generate(**batch, kv_budget=r + 2, **kwargs), uncached), r
            if r > 1:
                small = model.generate(**batch, kv_budget=1, **kwargs)
                assert small.shape == uncached.shape and 0 <= int(small.min()) < model.config.vocab_size
            outputs[r] = uncached
    # r changes what is decoded (a model that ignored r would pass the equalities above).
    assert len({tuple(out.flatten().tolist()) for out in outputs.values()}) > 1


# --------------------------------------------------------------------------------------------
# 2. looped-hf test-time on the converted folder
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_test_time_curve_runs_on_the_converted_folder(
    name: str, folders: dict, heldout_text: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A converted folder has no run record: without --data test-time says what to pass; with it the
    curve is measured on that text at r = 1 .. 2 x the trained r and written beside the checkpoint."""
    from looped_hf.cli import main
    from looped_hf.recurrence_curves import CURVE_JSON, CURVE_MD, CURVE_PNG, decoding_heldout_loss, load_run

    monkeypatch.setenv("LOOPED_HF_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / name
    shutil.copytree(folders[name], folder)  # test-time writes into the folder
    assert main(["test-time", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "no run_record.json" in err and "--data" in err and "\n" not in err.strip()

    argv = ["test-time", str(folder), "--data", str(heldout_text), "--seq-len", "32", "--eval-blocks", "4"]
    assert main([*argv, "--max-factor", "2"]) == 0
    curve = json.loads((folder / CURVE_JSON).read_text())
    assert curve["trained_num_recurrences"] == TRAINED_R and curve["recorded_loss"] is None
    assert [row["num_recurrences"] for row in curve["rows"]] == list(range(1, 2 * TRAINED_R + 1))
    losses = [row["loss"] for row in curve["rows"]]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == len(losses)
    assert all(row["eval_tokens"] == 4 * 31 for row in curve["rows"])
    assert curve["heldout_data"]["dataset"] == str(heldout_text)
    assert (folder / CURVE_MD).is_file() and (folder / CURVE_PNG).stat().st_size > 1000

    # The curve's loss is the next-token loss of the model's output, which decoding token by token
    # through the cache repeats (at r = 2 and the trained r, on the same held-out blocks).
    data = {"dataset": str(heldout_text), "seq_len": 32, "eval_blocks": 4}
    model, _, heldout, record = load_run(folder, data)
    assert record == {}
    for r in (2, TRAINED_R):
        decoded = decoding_heldout_loss(model, heldout, batch_size=4, num_recurrences=r)
        assert decoded["eval_tokens"] == 4 * 31 and decoded["mean_recurrences"] == r
        assert decoded["loss"] == pytest.approx(losses[r - 1], abs=1e-5), r


def test_test_time_refuses_seq_len_without_data_and_names_bad_data(
    folders: dict, tmp_path: Path, capsys
) -> None:
    from looped_hf.cli import main

    folder = folders["huginn-tiny"]
    assert main(["test-time", str(folder), "--seq-len", "32"]) == 2
    assert "apply to --data only" in capsys.readouterr().err
    assert main(["test-time", str(folder), "--data", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert err.startswith("looped-hf test-time: --data ") and "missing.jsonl" in err and "no such file" in err


# --------------------------------------------------------------------------------------------
# 3. looped-hf eval at every r
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_eval_at_every_r_on_the_converted_folder(name: str, folders: dict, tmp_path: Path) -> None:
    """The built-in tasks (two of them, six rows) at r = 1, 2, 4, 8, through the folder's own tokenizer,
    and once more decoding the continuation through a KV budget below r."""
    from looped_hf.cli import main
    from looped_hf.evaluation.report import RESULTS_JSON

    out = tmp_path / "eval"
    argv = ["eval", str(folders[name]), "--bundle", "builtin", "--builtin-examples", "6", "--device", "cpu",
            "--tasks", "induction_head", "addition_2d", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--recurrences", "1", "2", "4", "8"]) == 0
    results = json.loads((out / RESULTS_JSON).read_text())
    assert results["recurrences"] == [1, 2, 4, 8]
    losses = []
    for row in results["rows"]:
        assert set(row["tasks"]) == {"induction_head", "addition_2d"}
        for task in row["tasks"].values():
            assert task["num_items"] == 6 and 0.0 <= task["accuracy"] <= 1.0
        losses.append(row["tasks"]["addition_2d"]["loss"])
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == 4  # r changes the scores
    assert main([*argv, "--recurrences", "4", "--kv-budget", "2"]) == 0
    budget = json.loads((out / RESULTS_JSON).read_text())
    assert budget["settings"]["kv_budget"] == 2 and math.isfinite(
        budget["rows"][0]["tasks"]["addition_2d"]["loss"]
    )


# --------------------------------------------------------------------------------------------
# 4. peft LoRA through the HF Trainer
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_lora_fine_tuning_through_the_trainer(name: str, folders: dict, tmp_path: Path) -> None:
    """A few Trainer steps of LoRA on every linear layer: the loss is finite, the adapter's weights
    move, the base weights do not, and the saved adapter reloads onto a fresh base with equal logits."""
    peft = pytest.importorskip("peft")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model, tokenizer = _load(folders[name])
    text = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 4
    ids = tokenizer(text)["input_ids"]
    blocks = [ids[i : i + 24] for i in range(0, len(ids) - 24, 12)][:8]
    data = Dataset.from_dict({"input_ids": blocks, "labels": blocks})
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    )
    before = {k: v.detach().clone() for k, v in lora.named_parameters()}
    assert any("lora_B" in k for k in before)
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=lora, args=args, train_dataset=data)
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert (
        len(losses) == 3
        and all(math.isfinite(loss) for loss in losses)
        and math.isfinite(result.training_loss)
    )
    after = dict(lora.named_parameters())
    moved = [k for k in before if "lora_" in k and not torch.equal(before[k], after[k].detach())]
    assert any("lora_B" in k for k in moved) and any("lora_A" in k for k in moved)
    assert all(torch.equal(before[k], after[k].detach()) for k in before if "lora_" not in k)

    lora.eval()
    probe = torch.tensor([blocks[0]])
    with torch.no_grad():
        tuned = lora(probe).logits
    lora.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    with torch.no_grad():
        untuned = base(probe).logits
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        again = reloaded(probe).logits
    assert torch.allclose(again, tuned, atol=1e-5, rtol=0), (again - tuned).abs().max()
    assert (tuned - untuned).abs().max() > 1e-4  # the adapter is really applied


def test_a_converted_folder_without_a_tokenizer_is_named_in_one_line(tmp_path: Path, capsys) -> None:
    """The fixture as it is (no tokenizer files): eval and test-time say the folder has no tokenizer
    and how to give it one, before the model loads, instead of transformers' bare backend error."""
    from looped_hf.cli import main

    folder = convert_zoo("retrofit-llama-tiny", tmp_path / "converted")
    capsys.readouterr()
    assert main(["eval", str(folder), "--bundle", "builtin", "--out", str(tmp_path / "eval")]) == 2
    assert main(["test-time", str(folder), "--data", str(tmp_path / "x.jsonl")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    for line in lines:
        assert "has no tokenizer" in line and "tokenizer.save_pretrained" in line and str(folder) in line
    # The built-in bundle's options are checked before the checkpoint is read (here: before its
    # missing tokenizer is found).
    assert main(["eval", str(folder), "--bundle", "builtin", "--builtin-examples", "4",
                 "--out", str(tmp_path / "eval")]) == 2  # fmt: skip
    assert "n_examples=4: need an integer >= 6" in capsys.readouterr().err
