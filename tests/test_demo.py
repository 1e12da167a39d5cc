"""The main job: `looped-hf demo` goes sweep -> fit -> sweep card -> best checkpoint folder."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

from looped_hf import demo
from looped_hf.sweep import make_plan

sys.path.insert(0, str(Path(__file__).parent))
from conftest import PYTHON, REPO, subprocess_env  # noqa: E402
from test_cards import law_loss  # noqa: E402
from test_publish import HUB_FILES, make_run_dir  # noqa: E402

MICRO = REPO / "tests" / "data" / "micro_sweep.yaml"


def fake_finished_sweep(sweep_dir: Path) -> str:
    """A sweep directory in which every run of the micro plan is already recorded (losses from
    the law, phi = 0.5), so the demo's sweep stage resumes with nothing to train. Only the best
    looped run gets a real (tiny, untrained) run directory: it is the one the demo publishes."""
    plan = make_plan(MICRO, sweep_dir)
    sweep_dir.mkdir(parents=True)
    shutil.copy(MICRO, sweep_dir / "sweep.yaml")  # the runner checks it is the same recipe
    records = []
    for run in plan.runs:
        loss = law_loss(run.n_once, run.n_rec, run.num_recurrences, run.tokens)
        records.append({
            "run_id": run.run_id, "loss": loss, "tokens": run.tokens, "n_once": run.n_once, "n_rec": run.n_rec,
            "num_recurrences": run.num_recurrences, "train_flops": run.flops, "budget": run.budget, "arch": run.arch,
            "variant": "base", "hidden_size": run.hidden_size, "seed": 0, "status": "ok",
            "eval_perplexity": math.exp(loss), "eval_tokens": 248,
            "config": {"num_prelude_layers": run.num_prelude_layers, "num_recurrent_layers": run.num_recurrent_layers,
                       "num_coda_layers": run.num_coda_layers},
        })  # fmt: skip
    with open(sweep_dir / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    best = min((r for r in records if r["num_recurrences"] > 1), key=lambda r: r["loss"])
    make_run_dir(sweep_dir / best["run_id"], num_recurrences=best["num_recurrences"], loss=best["loss"],
                 hidden_size=best["hidden_size"], record_extra={k: best[k] for k in ("tokens", "budget", "arch")})  # fmt: skip
    return best["run_id"]


def test_demo_resumes_a_finished_sweep_and_writes_fit_card_and_checkpoint(tmp_path: Path, capsys):
    """Everything it writes is inside the sweep directory: the card (by default ``OUT/card``, saying how
    far its figures move between machines) and the checkpoint folder."""
    sweep_dir = tmp_path / "runs" / "micro_sweep"
    best_id = fake_finished_sweep(sweep_dir)
    card_dir = sweep_dir / demo.CARD_DIR
    # verify=False: the fake run's recorded loss is made up (the end-to-end test verifies for real).
    result = demo.run_demo(MICRO, sweep_dir, bootstrap=6, repo_id="me/looped-micro", verify=False)
    assert result["card"] == card_dir / "README.md" and {p.name for p in tmp_path.iterdir()} == {"runs"}
    out = capsys.readouterr().out
    assert "8 already recorded, 0 to run" in out  # resumed: nothing retrained
    fit = result["fit"]
    assert (sweep_dir / "fit.json").is_file()
    phi, (lo, hi) = fit.params["phi"], fit.ci["phi"]
    assert f"phi = {phi:.3f}  (95% CI [{lo:.3f}, {hi:.3f}])" in out
    # The sweep card and its plots.
    card = ModelCard.load(card_dir / "README.md")
    assert card.data.to_dict()["looped_sweep"]["phi"] == pytest.approx(phi, rel=1e-5)
    for link in ("plots/loss_vs_flops.png", "plots/residuals.png", "plots/phi_bootstrap.png"):
        assert f"]({link})" in card.text and (card_dir / link).is_file()
    assert "looped-hf demo --recipe" in card.text  # the reproducibility block has the command
    assert demo.MACHINE_NOTE in card.text and "1.02232 [0.878, 1.143]" in card.text
    # The best looped run as a Hub-ready folder, with phi in its card.
    checkpoint = result["checkpoint"]
    assert checkpoint == sweep_dir / demo.BEST_DIR
    assert {p.name for p in checkpoint.iterdir()} == HUB_FILES
    meta = ModelCard.load(checkpoint / "README.md").data.to_dict()
    assert meta["looped"]["phi"] == pytest.approx(phi, rel=1e-5)
    assert best_id in card.text


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_demo_in_a_clone_writes_only_git_ignored_folders() -> None:
    """A newcomer's ``make demo`` changes no tracked file: its sweep folder and its card folder are
    git-ignored and hold no tracked file; ``make example-card`` (maintainers) is what rewrites the
    committed example card."""
    import shlex

    def dry_run(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout

    command = shlex.split(next(line for line in dry_run("demo").splitlines() if "looped_hf demo" in line))
    written = [command[command.index(flag) + 1] for flag in ("--out", "--card-dir")]
    assert written == ["runs/iso_depth_tiny", "runs/iso_depth_tiny/card"]
    for folder in written:
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{folder}/README.md"], cwd=REPO)
        assert ignored.returncode == 0, f"{folder} is not git-ignored"
        tracked = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True)
        assert tracked.stdout == ""
    assert "--card-dir model_cards/iso_depth_tiny" in dry_run("example-card")


def test_demo_with_a_missing_recipe_fails_clearly(tmp_path: Path, capsys):
    assert demo.main(["--recipe", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_demo_refuses_a_bad_jobs_count_naming_the_flag(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--recipe", str(MICRO), "--out", str(tmp_path / "o"), "--jobs", "-1"])
    assert exit_info.value.code == 2 and "--jobs='-1': must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_micro_demo_end_to_end(small_corpus: Path, data_cache: Path, tmp_path: Path):
    """The real thing on the micro recipe: 8 tiny runs trained two at a time, fitted, carded,
    published; the console shows the sweep's lines, not the runs' logs."""
    recipe = yaml.safe_load(MICRO.read_text())
    recipe.update(dataset=str(small_corpus), data_cache_dir=str(data_cache))
    recipe_path = tmp_path / "micro_sweep.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out, card_dir = tmp_path / "sweep", tmp_path / "card"
    cmd = [PYTHON, "-m", "looped_hf", "demo", "--recipe", str(recipe_path), "--out", str(out),
           "--card-dir", str(card_dir), "--bootstrap", "4", "--jobs", "2"]  # fmt: skip
    # evaluate copies the metric script into HF_MODULES_CACHE: keep it out of the user's home.
    env = {**subprocess_env(), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "[sweep] 8/8 runs done" in result.stdout
    assert "2 at once in worker processes" in result.stdout
    # Not a terminal: one line per finished run, and nothing of the runs' own logs.
    assert result.stdout.count("runs done (") == 8
    assert "{'loss'" not in result.stdout + result.stderr and "pin_memory" not in result.stdout + result.stderr
    assert "{'loss'" in (out / "base-w32-b0" / "train.log").read_text()
    assert "phi = " in result.stdout and "95% CI" in result.stdout
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["status"] == "ok" for r in records)
    assert (card_dir / "README.md").is_file() and (card_dir / "plots" / "loss_vs_flops.png").is_file()
    assert {p.name for p in (out / demo.BEST_DIR).iterdir()} == HUB_FILES
    assert "[publish] verified:" in result.stdout  # the folder reproduces the recorded held-out loss


def test_folders_the_demo_writes_keep_the_users_umask(tmp_path: Path):
    """The user's report: `make demo` left model_cards/iso_depth_tiny/ at mode 0700 (mkdtemp's mode,
    kept when the finished folder was renamed into place), and safetensors writes its files 0600."""
    import os
    import stat

    sweep_dir = tmp_path / "runs" / "micro_sweep"
    fake_finished_sweep(sweep_dir)
    card_dir = tmp_path / "model_cards" / "micro_sweep"
    old = os.umask(0o027)  # a mask no default gives: each mode must come from it
    try:
        result = demo.run_demo(MICRO, sweep_dir, card_dir, bootstrap=6, repo_id="me/looped-micro", verify=False)
    finally:
        os.umask(old)
    checkpoint = result["checkpoint"]
    for folder in (card_dir, card_dir / "plots", checkpoint):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o750, folder
    for file in (card_dir / "README.md", checkpoint / "model.safetensors", checkpoint / "README.md"):
        assert stat.S_IMODE(file.stat().st_mode) == 0o640, file
