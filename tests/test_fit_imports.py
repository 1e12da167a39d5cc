"""`looped-hf fit` never imports torch or transformers, while a bare `import looped_hf` still
registers the Auto classes (deferred until the program uses transformers or the model classes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from looped_hf.scaling import load_runs
from looped_hf.scaling.synthetic import study_runs

REPO = Path(__file__).resolve().parents[1]


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, "LOOPED_HF_CACHE": "", **(env or {})},
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fit") / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in study_runs(seed=0)))
    return path


def test_fit_cli_imports_neither_torch_nor_transformers(results: Path) -> None:
    code = (
        "import sys, looped_hf.cli\n"
        "rc = looped_hf.cli.main(['fit', sys.argv[1], '--bootstrap', '4', '--fix-phi', '0.5'])\n"
        "print('RC', rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    out = _run(["-c", code, str(results)]).stdout
    assert "phi" in out and "bootstrap fit checks:" in out
    # The protocol in full, so that a protocol difference can be told from a data difference.
    assert "Huber delta 0.001 on log residuals, summed" in out
    assert "search box (starts and L-BFGS-B bounds): log A [-5, 35], alpha [0, 2.5]" in out
    assert "starts screened" in out and "seed 0" in out
    assert out.strip().splitlines()[-1] == "RC 0 False False"


def test_python_m_looped_hf_fit_imports_no_torch(results: Path) -> None:
    # -m runs the package's __init__ first: it must not pull torch in either (-X importtime lists
    # every module the process imported, on stderr).
    out = _run(["-X", "importtime", "-m", "looped_hf", "fit", str(results), "--fix-phi", "0.5"])
    assert "R^2" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "looped_hf.scaling.fit" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers")}


def test_bare_import_still_registers_the_auto_classes(tmp_path: Path) -> None:
    code = (
        "import sys, looped_hf\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('looped', hidden_size=64, num_attention_heads=2, num_key_value_heads=2,\n"
        "                           intermediate_size=128, vocab_size=64)\n"
        "model = AutoModelForCausalLM.from_config(cfg)\n"
        "model.save_pretrained(sys.argv[1])\n"
        "back = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "print(type(cfg).__name__, type(model).__name__, type(back).__name__, sorted(cfg.auto_map))\n"
        "print(looped_hf.LoopedConfig is type(cfg), looped_hf.LoopedForCausalLM is type(back))\n"
    )
    out = _run(["-c", code, str(tmp_path / "ckpt")]).stdout.strip().splitlines()
    assert (
        out[-2] == "LoopedConfig LoopedForCausalLM LoopedForCausalLM ['AutoConfig', 'AutoModelForCausalLM']"
    )
    assert out[-1] == "True True"
    assert (tmp_path / "ckpt" / "modeling_looped.py").is_file()  # shipped as remote code


def test_registration_waits_for_transformers_to_finish_importing(tmp_path: Path) -> None:
    # transformers imports its Auto modules from inside modeling_utils: registering there would
    # import modeling_looped against a half-initialised transformers.
    code = (
        "import sys, looped_hf\n"
        "import transformers.modeling_utils\n"
        "from looped_hf.modeling_looped import LoopedForCausalLM\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = AutoConfig.for_model('looped', hidden_size=64, num_attention_heads=2, num_key_value_heads=2,\n"
        "                           intermediate_size=128, vocab_size=64)\n"
        "print(type(AutoModelForCausalLM.from_config(cfg)).__name__)\n"
    )
    assert _run(["-c", code]).stdout.strip().splitlines()[-1] == "LoopedForCausalLM"


def test_bad_numbers_are_named_in_plain_python() -> None:
    rec = {"loss": np.float64(0.0), "tokens": 1e9, "params": 1e6}
    with pytest.raises(ValueError, match=r"column 'loss' must be > 0, got 0$") as info:
        load_runs([rec, {**rec, "loss": 3.0}])
    assert "np.float64" not in str(info.value)
    bad_r = {"loss": 3.0, "tokens": 1e9, "n_once": 1e6, "n_rec": 1e6, "num_recurrences": np.float64(0.5)}
    with pytest.raises(ValueError, match=r"'num_recurrences' must be an integer >= 1, got 0\.5$"):
        load_runs([bad_r, {**bad_r, "num_recurrences": 2}])


def test_plan_reuses_its_measured_family_without_torch(tmp_path: Path) -> None:
    # The first plan of a recipe measures its models (torch, on the meta device) and caches the
    # family on disk; the next plan of the same recipe is numpy only and gives the same answer.
    code = (
        "import json, sys, looped_hf.cli\n"
        "rc = looped_hf.cli.main(['plan', sys.argv[1], '--budget', '1.2e11', '--recipe', sys.argv[2], '--json'])\n"
        "print('RC', rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    fit = REPO / "model_cards" / "iso_depth_tiny" / "fit.json"
    recipe = REPO / "recipes" / "iso_depth_tiny.yaml"
    env = {"LOOPED_HF_CACHE": str(tmp_path / "cache")}
    first = _run(["-c", code, str(fit), str(recipe)], env).stdout.strip().splitlines()
    assert first[-1] == "RC 0 True True"
    assert len(list((tmp_path / "cache" / "families").glob("*.json"))) == 1
    second = _run(["-c", code, str(fit), str(recipe)], env).stdout.strip().splitlines()
    assert second[-1] == "RC 0 False False"
    plans = [json.loads("\n".join(out[:-1])) for out in (first, second)]
    for p in plans:
        p["settings"].pop("seconds")  # the planner's own run time
    assert plans[0] == plans[1]


def test_family_recipe_copy_name_is_the_sweeps() -> None:
    from looped_hf.planner.family import RECIPE_COPY
    from looped_hf.sweep import RECIPE_COPY as SWEEP_RECIPE_COPY

    assert RECIPE_COPY == SWEEP_RECIPE_COPY
