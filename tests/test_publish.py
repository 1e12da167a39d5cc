"""Publishing a run: the Hub-ready folder, fresh-process loading, the push path, refusals."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_without_looped_hf
from transformers import AutoModelForCausalLM

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.data import load_tokenizer
from looped_hf.publish import PublishError, build_folder, check_run_dir, main, push_folder, scan_for_tokens

HUB_FILES = {
    "README.md", "config.json", "model.safetensors", "configuration_looped.py", "modeling_looped.py", "interface_looped.py", "generation_looped.py",
    "accounting_looped.py", "recurrent_block_looped.py", "decoder_layers_looped.py", "loop_attention_looped.py",
    "config_rules_looped.py", "parcae_looped.py",
    "generation_config.json", "tokenizer.json", "tokenizer_config.json",
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Fixture run directories (no trainer: a tiny model saved the way train.py saves it)
# --------------------------------------------------------------------------------------------
def make_run_dir(
    path: Path,
    *,
    num_recurrences: int = 2,
    injection: str = "linear",
    hidden_size: int = 32,
    status: str = "ok",
    loss: float = 4.25,
    seed: int = 0,
    record_extra: dict[str, Any] | None = None,
) -> Path:
    """A finished run directory: weights + code (save_pretrained, use_cache off as the Trainer
    leaves it), the byte tokenizer, run_record.json and recipe.yaml."""
    tok = load_tokenizer("bytes")
    torch.manual_seed(seed)
    config = LoopedConfig(
        vocab_size=len(tok), hidden_size=hidden_size, head_dim=16, num_prelude_layers=1, num_recurrent_layers=1,
        num_coda_layers=1, num_recurrences=num_recurrences, input_injection=injection, max_position_embeddings=64,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    model = LoopedForCausalLM(config).eval()
    with torch.no_grad():  # move the injection off its identity init so every path matters
        for name, p in model.named_parameters():
            if "injection" in name or "hyperconnection" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.config.use_cache = False  # what Trainer saves (transformers-5 notes, section 0.6)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    params = model.num_scaling_params()
    recipe = {"hidden_size": hidden_size, "num_recurrences": num_recurrences, "tokenizer": "bytes", "dataset": None,
              "seq_len": 32, "learning_rate": 3e-3, "output_dir": str(path), "data_cache_dir": "/tmp/x"}  # fmt: skip
    record = {
        "loss": loss, "tokens": 4096, "n_once": params["once"], "n_rec": params["recurrent"],
        "num_recurrences": num_recurrences, "train_flops": 4096 * model.training_flops_per_token(32),
        "budget": 1e9, "arch": f"loop{num_recurrences}" if num_recurrences > 1 else "base", "variant": "base",
        "hidden_size": hidden_size, "seed": seed, "status": status, "error": None if status == "ok" else "boom",
        "effective_num_layers": config.effective_num_layers, "backprop_recurrences": None,
        "eval_perplexity": math.exp(loss), "eval_tokens": 248, "trainer_total_flos": 1.0e8, "max_steps": 32,
        "tokens_per_step": 128, "seq_len": 32, "config": json.loads(config.to_json_string()), "recipe": recipe,
        "versions": {"python": "3.11", "torch": torch.__version__}, "wall_time_s": 12.5,
        "run_id": path.name, "run_dir": str(path),
    }  # fmt: skip
    record.update(record_extra or {})
    (path / "run_record.json").write_text(json.dumps(record, indent=2))
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("runs") / "loop2-w32-b0")


@pytest.fixture(scope="module")
def published(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_folder(run_dir, "me/looped-tiny", tmp_path_factory.mktemp("pub") / "looped-tiny")


def _listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------------------------
# The folder
# --------------------------------------------------------------------------------------------
def test_published_folder_is_a_complete_hub_repository(published: Path):
    assert _listing(published) == HUB_FILES
    config = json.loads((published / "config.json").read_text())
    # Every class of the model file, so the checkpoint loads into any head through remote code.
    assert config["auto_map"] == {
        "AutoConfig": "configuration_looped.LoopedConfig",
        "AutoModel": "modeling_looped.LoopedModel",
        "AutoModelForCausalLM": "modeling_looped.LoopedForCausalLM",
        "AutoModelForSequenceClassification": "modeling_looped.LoopedForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_looped.LoopedForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_looped.LoopedForQuestionAnswering",
    }
    assert config["use_cache"] is True  # the run dir said false (as the Trainer saves it)
    # The shipped code is the installed package's current code, not a stale copy from the run.
    import looped_hf.modeling_looped as current

    assert (published / "modeling_looped.py").read_text() == Path(current.__file__).read_text()
    # Shareable permissions (mkdtemp gives 0700, safetensors writes 0600).
    assert (published / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_published_folder_loads_without_trust_remote_code_when_looped_hf_is_installed(
    published: Path, run_dir: Path
):
    model = AutoModelForCausalLM.from_pretrained(published).eval()
    assert type(model) is LoopedForCausalLM
    original = LoopedForCausalLM.from_pretrained(run_dir).eval()
    ids = torch.tensor([[72, 101, 108, 108, 111, 32, 119]])
    torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_published_folder_loads_in_a_fresh_process_without_looped_hf(
    published: Path, run_dir: Path, tmp_path: Path
):
    original = LoopedForCausalLM.from_pretrained(run_dir).eval()
    tok = load_tokenizer("bytes")
    ids = tok(["To be, or not", "Hello there!!"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = {"ids": ids, "logits": original(ids).logits,
               "gen": original.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                                        num_recurrences=4)}  # fmt: skip
    torch.save(ref, tmp_path / "ref.pt")
    script = f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder = {str(published)!r}
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        assert tok(["To be, or not", "Hello there!!"], return_tensors="pt")["input_ids"].tolist() == ref["ids"].tolist()
        with torch.no_grad():
            torch.testing.assert_close(model(ref["ids"]).logits, ref["logits"], rtol=0, atol=0)
            gen = model.generate(ref["ids"], max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
                                 num_recurrences=4)
        assert torch.equal(gen, ref["gen"]), (gen, ref["gen"])
        assert model.config.use_cache is True
        print("FRESH-PROCESS-OK", tok.decode(gen[0]))
        """
    assert "FRESH-PROCESS-OK" in run_without_looped_hf(script, tmp_path)


# --------------------------------------------------------------------------------------------
# Refusals: nothing is written
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "remove, named",
    [("model.safetensors", "model.safetensors"), ("run_record.json", "run_record.json"),
     ("config.json", "config.json"), ("tokenizer.json tokenizer_config.json", "tokenizer")],
)  # fmt: skip
def test_incomplete_run_dir_is_refused_naming_the_missing_file_and_writes_nothing(
    tmp_path: Path, remove: str, named: str
):
    run = make_run_dir(tmp_path / "runs" / "broken")
    for name in remove.split():
        (run / name).unlink()
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    with pytest.raises(PublishError, match=named) as err:
        build_folder(run, "me/broken", out_parent / "broken")
    assert str(run) in str(err.value)
    assert list(out_parent.iterdir()) == []  # no folder, no temp leftovers
    # The CLI says the same and exits 2.
    assert main([str(run), "--repo-id", "me/broken", "--out", str(out_parent / "broken")]) == 2
    assert list(out_parent.iterdir()) == []


def test_failed_run_is_refused(tmp_path: Path):
    run = make_run_dir(tmp_path / "failed-run", status="failed", loss=float("nan"))
    with pytest.raises(PublishError, match=r"status='failed'.*boom"):
        check_run_dir(run)


def test_existing_output_is_refused_unless_overwrite(run_dir: Path, tmp_path: Path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PublishError, match="already exists.*--overwrite"):
        build_folder(run_dir, "me/looped-tiny", out)
    assert (out / "keep.txt").read_text() == "mine"
    build_folder(run_dir, "me/looped-tiny", out, overwrite=True)
    assert _listing(out) == HUB_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # old copy and temp dir are gone


def test_output_that_is_or_contains_the_run_directory_is_refused(run_dir: Path):
    for out in (run_dir, run_dir.parent):
        with pytest.raises(PublishError, match="is \\(or contains\\) the run directory"):
            build_folder(run_dir, "me/looped-tiny", out, overwrite=True)
    assert (run_dir / "model.safetensors").is_file()


@pytest.mark.parametrize("repo_id", ["no-slash", "a/b/c", "me/../x", "", "me/name with space"])
def test_bad_repo_id_is_refused(run_dir: Path, tmp_path: Path, repo_id: str):
    with pytest.raises(PublishError, match="--repo-id"):
        build_folder(run_dir, repo_id, tmp_path / "x")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# Pushing (the network calls are replaced; nothing else is)
# --------------------------------------------------------------------------------------------
class RecordingApi:
    """Stands in for the two HfApi network calls; records what would be sent."""

    calls: list[tuple[str, dict[str, Any]]] = []
    sent: set[str] = set()

    def create_repo(self, repo_id, **kwargs):
        RecordingApi.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        RecordingApi.calls.append(("upload_folder", kwargs))
        RecordingApi.sent = _listing(Path(kwargs["folder_path"]))  # what upload_folder would walk
        return type(
            "CommitInfo", (), {"commit_url": f"https://huggingface.co/{kwargs['repo_id']}/commit/abc"}
        )()


def test_push_sends_exactly_the_folder_and_never_writes_the_token(
    run_dir: Path, tmp_path: Path, monkeypatch, capsys
):
    import huggingface_hub

    monkeypatch.setenv("HF_TOKEN", "hf_fake_secret")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", RecordingApi.create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", RecordingApi.upload_folder)
    RecordingApi.calls, RecordingApi.sent = [], set()
    out = tmp_path / "to-push"
    code = main([str(run_dir), "--repo-id", "me/looped-tiny", "--out", str(out), "--push", "--private"])
    assert code == 0, capsys.readouterr().err
    (create_name, create), (upload_name, upload) = RecordingApi.calls
    assert (create_name, upload_name) == ("create_repo", "upload_folder")
    assert create["repo_id"] == "me/looped-tiny" and create["private"] is True and create["exist_ok"] is True
    assert upload["repo_id"] == "me/looped-tiny" and Path(upload["folder_path"]) == out
    assert RecordingApi.sent == _listing(out) == HUB_FILES
    assert "token" not in upload and "token" not in create  # left to huggingface_hub to resolve
    for file in out.rglob("*"):
        assert b"hf_fake_secret" not in file.read_bytes(), file
    captured = capsys.readouterr()
    assert "hf_fake_secret" not in captured.out + captured.err


def test_push_after_a_folder_only_publish_uploads_that_folder_as_it_is(
    run_dir: Path, tmp_path: Path, monkeypatch
):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", RecordingApi.create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", RecordingApi.upload_folder)
    out = tmp_path / "inspected"
    assert main([str(run_dir), "--repo-id", "me/looped-tiny", "--out", str(out)]) == 0  # folder only
    stamp = (out / "README.md").stat().st_mtime_ns
    RecordingApi.calls, RecordingApi.sent = [], set()
    assert main([str(run_dir), "--repo-id", "me/looped-tiny", "--out", str(out), "--push"]) == 0
    assert (out / "README.md").stat().st_mtime_ns == stamp  # not rebuilt
    assert RecordingApi.sent == HUB_FILES
    assert RecordingApi.calls[0][1]["private"] is None  # visibility left to the Hub's default


def test_push_refuses_a_folder_holding_a_token(published: Path, tmp_path: Path):
    import shutil

    folder = tmp_path / "leaky"
    shutil.copytree(published, folder)
    (folder / "notes.txt").write_text("token = hf_" + "a1B2" * 9)
    assert scan_for_tokens(folder) == [folder / "notes.txt"]
    RecordingApi.calls = []
    with pytest.raises(PublishError, match="notes.txt"):
        push_folder(folder, "me/leaky", api=RecordingApi())
    assert RecordingApi.calls == []


# --------------------------------------------------------------------------------------------
# --verify: the folder reproduces the recorded held-out loss (through the evaluate metric)
# --------------------------------------------------------------------------------------------
def test_verify_recomputes_the_recorded_heldout_loss(
    small_corpus: Path, data_cache: Path, tmp_path: Path, monkeypatch
):
    import evaluate

    from looped_hf.data import DataArguments, build_datasets
    from looped_hf.train import heldout_loss

    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")
    monkeypatch.setattr(evaluate.config, "HF_METRICS_CACHE", tmp_path / "metrics")
    monkeypatch.setattr(sys, "path", list(sys.path))
    data = {"dataset": str(small_corpus), "tokenizer": "bytes", "seq_len": 32, "eval_blocks": 8,
            "data_cache_dir": str(data_cache)}  # fmt: skip
    run = make_run_dir(tmp_path / "run", record_extra={"recipe": data})
    # The loss as train.py measures it (its own token-weighted loop, not the metric).
    _, heldout = build_datasets(DataArguments(**data), load_tokenizer("bytes"))
    loss, _ = heldout_loss(LoopedForCausalLM.from_pretrained(run), heldout, 8)
    record = json.loads((run / "run_record.json").read_text())
    (run / "run_record.json").write_text(
        json.dumps({**record, "loss": loss, "eval_perplexity": math.exp(loss)})
    )
    assert _listing(build_folder(run, "me/verified", tmp_path / "ok", verify=True)) == HUB_FILES

    (run / "run_record.json").write_text(json.dumps({**record, "loss": loss + 0.01}))
    with pytest.raises(PublishError, match=r"run_record.json loss=.* but the published model scores"):
        build_folder(run, "me/verified", tmp_path / "bad", verify=True)
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bad")]


def test_published_card_shows_the_runs_downstream_results_and_plot(tmp_path: Path):
    """`looped-hf eval` on a run directory, then publish: the folder carries the figure and the
    card shows the task table and model-index entries at the trained r."""
    from huggingface_hub import ModelCard

    from looped_hf.evaluation.cli import main as eval_main

    run = make_run_dir(tmp_path / "runs" / "loop2-w32-b0")
    bundle = Path(__file__).parent / "fixtures" / "eval_bundle"
    assert eval_main([str(run), "--bundle", str(bundle), "--recurrences", "1", "2", "--max-per-task", "3"]) == 0
    out = build_folder(run, "me/looped-tiny", tmp_path / "pub")
    assert (out / "eval_results.png").stat().st_size > 0
    card = (out / "README.md").read_text()
    assert "eval_results.png" in card and "capitals_mc" in card
    index = ModelCard.load(out / "README.md").data.eval_results or []
    assert any(e.dataset_name == "capitals_mc" for e in index)
