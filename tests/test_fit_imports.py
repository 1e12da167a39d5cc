"""`import looped_hf` registers the Auto classes at once, with nothing installed into the import
system; the ``looped-hf`` console script defers that registration for the commands that need no
model, so ``fit`` and the help load neither torch nor transformers; a model name registers on first
use; and the fit's numeric core (``looped-hf fit``, a cached ``plan``) still runs where torch and
transformers cannot be imported (the registration is skipped there)."""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from looped_hf.scaling import load_runs
from looped_hf.scaling.synthetic import study_runs

REPO = Path(__file__).resolve().parents[1]

# Prepended to a subprocess's code: torch and transformers cannot be imported (an ImportError, and
# importlib.util.find_spec answers None), as on a machine where they are not installed.
WITHOUT_TORCH = "import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"


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


def test_fit_cli_runs_without_torch_or_transformers(results: Path) -> None:
    code = WITHOUT_TORCH + (
        "import looped_hf.cli\n"
        "rc = looped_hf.cli.main(['fit', sys.argv[1], '--bootstrap', '4', '--fix-phi', '0.5'])\n"
        "print('RC', rc, 'looped_hf.configuration_looped' in sys.modules)\n"
    )
    out = _run(["-c", code, str(results)]).stdout
    assert "phi" in out and "bootstrap fit checks:" in out
    # The protocol in full, so that a protocol difference can be told from a data difference.
    assert "Huber delta 0.001 on log residuals, summed" in out
    assert "search box (starts and L-BFGS-B bounds): log A [-5, 35], alpha [0, 2.5]" in out
    assert "starts screened" in out and "seed 0" in out
    assert out.strip().splitlines()[-1] == "RC 0 False"  # ran, and registered nothing


def test_python_m_looped_hf_fit_runs_without_torch(results: Path) -> None:
    # -m runs the package's __init__ first: without torch it must skip the registration, not fail.
    code = WITHOUT_TORCH + (
        "import runpy\n"
        "sys.argv = ['looped_hf', 'fit', sys.argv[1], '--fix-phi', '0.5']\n"
        "runpy.run_module('looped_hf', run_name='__main__', alter_sys=True)\n"
    )
    out = _run(["-c", code, str(results)])
    assert "R^2" in out.stdout


# One fresh process for the checks that start with a bare ``import looped_hf`` (each process loads
# torch and transformers: seconds of CPU), each check's output on lines of its own.
BARE_IMPORT = (
    "import sys\n"
    "finders = list(sys.meta_path)\n"
    "import looped_hf\n"
    "print('AT IMPORT', 'looped_hf.modeling_looped' in sys.modules)\n"
    # The registration imported torch and transformers; the scaling modules must not need them: nothing
    # under looped_hf.scaling may be the first to import either.
    "before = set(sys.modules)\n"
    "import looped_hf.scaling, looped_hf.scaling.cli, looped_hf.scaling.fit\n"
    "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'transformers'))\n"
    "print('NEW', new, 'looped_hf.scaling.fit' in sys.modules, 'torch' in before)\n"
    "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
    "print('REGISTERED', 'looped' in CONFIG_MAPPING, [f for f in sys.meta_path if f not in finders\n"
    "      and type(f).__module__.startswith('looped_hf')])\n"
    "from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification\n"
    "kw = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128, vocab_size=64)\n"
    "cfg = AutoConfig.for_model('looped', **kw)\n"
    "model = AutoModelForCausalLM.from_config(cfg)\n"
    "model.save_pretrained(sys.argv[1] + '/ckpt')\n"
    "back = AutoModelForCausalLM.from_pretrained(sys.argv[1] + '/ckpt')\n"
    "print('CAUSAL', type(cfg).__name__, type(model).__name__, type(back).__name__, sorted(cfg.auto_map))\n"
    "print('SAME CLASSES', looped_hf.LoopedConfig is type(cfg), looped_hf.LoopedForCausalLM is type(back))\n"
    "head = AutoModelForSequenceClassification.from_config(AutoConfig.for_model('looped', num_labels=3, **kw))\n"
    "head.save_pretrained(sys.argv[1] + '/head')\n"
    "back = AutoModelForSequenceClassification.from_pretrained(sys.argv[1] + '/head')\n"
    "print('HEAD', type(back).__name__, back.config.auto_map['AutoModelForSequenceClassification'])\n"
)


@pytest.fixture(scope="module")
def bare_import(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """``BARE_IMPORT``'s output lines by their label, and the folder it saved into."""
    folder = tmp_path_factory.mktemp("bare_import")
    out = _run(["-c", BARE_IMPORT, str(folder)]).stdout.strip().splitlines()
    labels = ("AT IMPORT", "NEW", "REGISTERED", "CAUSAL", "SAME CLASSES", "HEAD")
    return {label: line for line in out for label in labels if line.startswith(label + " ")}, folder


def test_the_numeric_core_imports_neither_torch_nor_transformers_itself(bare_import) -> None:
    assert bare_import[0]["NEW"] == "NEW [] True True"
    blocked = WITHOUT_TORCH + "import looped_hf.scaling.cli, looped_hf.scaling.compare\nprint('OK')\n"
    assert _run(["-c", blocked]).stdout.strip().splitlines()[-1] == "OK"


def test_bare_import_registers_the_auto_classes_with_no_import_hook(bare_import) -> None:
    lines, folder = bare_import
    # Registered by the import itself, before the program touched transformers.
    assert (lines["AT IMPORT"], lines["REGISTERED"]) == ("AT IMPORT True", "REGISTERED True []")
    assert (
        lines["CAUSAL"]
        == "CAUSAL LoopedConfig LoopedForCausalLM LoopedForCausalLM ['AutoConfig', 'AutoModelForCausalLM']"
    )
    assert lines["SAME CLASSES"] == "SAME CLASSES True True"
    assert (folder / "ckpt" / "modeling_looped.py").is_file()  # shipped as remote code


def test_the_package_installs_nothing_into_the_import_system() -> None:
    # The old design wrapped loaders through a sys.meta_path finder and read CPython's private
    # spec._initializing; neither may come back, in the package or in the console script's launcher.
    for path in (REPO / "looped_hf" / "__init__.py", REPO / "looped_hf_launcher" / "__init__.py"):
        tree = ast.parse(path.read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not used & {"meta_path", "path_hooks", "_initializing", "MetaPathFinder", "__import__"}, path


# The console script as pip writes it for `looped-hf = "looped_hf_launcher:main"`, then the model
# stack this process loaded.
LAUNCHED = (
    "import sys\n"
    "from looped_hf_launcher import main\n"
    "try:\n"
    "    rc = main(sys.argv[1:])\n"
    "except SystemExit as stop:  # argparse's --help\n"
    "    rc = stop.code\n"
    "print('RC', rc, sorted({'torch', 'transformers'} & set(sys.modules)))\n"
)


def test_the_console_script_is_the_launcher_and_ships() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["looped-hf"] == "looped_hf_launcher:main"
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert any(fnmatch.fnmatch("looped_hf_launcher", pattern) for pattern in include)


@pytest.mark.parametrize(
    "argv", [["--help"], [], ["fit", "--help"], ["fit", "{results}", "--fix-phi", "0.5"]]
)
def test_looped_hf_fit_and_help_load_neither_torch_nor_transformers(results: Path, argv: list[str]) -> None:
    out = _run(["-c", LAUNCHED, *(a.format(results=results) for a in argv)]).stdout
    assert out.strip().splitlines()[-1] == "RC 0 []"
    assert ("phi" in out) if "{results}" in argv else ("usage: looped-hf" in out)


def test_a_deferred_registration_runs_on_a_model_names_first_use(tmp_path: Path) -> None:
    # What an uncached `plan` (or any code path) does in a process whose launcher deferred the
    # registration: reading a model name registers everything, remote code included.
    code = (
        "import sys, looped_hf_launcher\n"
        "looped_hf_launcher.defer_registration = True\n"
        "import looped_hf\n"
        "print('AT IMPORT', 'torch' in sys.modules, 'transformers' in sys.modules)\n"
        "from looped_hf import LoopedForCausalLM\n"
        "from transformers import AutoConfig, AutoModelForSequenceClassification\n"
        "cfg = AutoConfig.for_model('looped', hidden_size=64, num_attention_heads=2, num_key_value_heads=2,\n"
        "                           intermediate_size=128, vocab_size=64)\n"
        "LoopedForCausalLM(cfg).save_pretrained(sys.argv[1])\n"
        "head = AutoModelForSequenceClassification.from_config(cfg)\n"
        "print(type(cfg).__name__, type(head).__name__, sorted(cfg.auto_map), looped_hf.LoopedConfig is type(cfg))\n"
    )
    out = _run(["-c", code, str(tmp_path / "ckpt")]).stdout.strip().splitlines()
    assert out[0] == "AT IMPORT False False"
    assert (
        out[-1] == "LoopedConfig LoopedForSequenceClassification ['AutoConfig', 'AutoModelForCausalLM'] True"
    )
    assert (tmp_path / "ckpt" / "modeling_looped.py").is_file()  # shipped as remote code


def test_heads_are_registered_for_auto_and_remote_code(bare_import) -> None:
    assert (
        bare_import[0]["HEAD"]
        == "HEAD LoopedForSequenceClassification modeling_looped.LoopedForSequenceClassification"
    )


def test_importing_transformers_first_still_registers() -> None:
    code = (
        "import transformers.modeling_utils\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "import looped_hf\n"
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
    # family on disk; the next plan of the same recipe is numpy only (it runs with torch blocked)
    # and gives the same answer.
    body = (
        "import json, looped_hf.cli\n"
        "rc = looped_hf.cli.main(['plan', sys.argv[1], '--budget', '1.2e11', '--recipe', sys.argv[2], '--json'])\n"
        "print('RC', rc, sys.modules.get('torch') is not None, sys.modules.get('transformers') is not None)\n"
    )
    fit = REPO / "model_cards" / "iso_depth_tiny" / "fit.json"
    recipe = REPO / "recipes" / "iso_depth_tiny.yaml"
    env = {"LOOPED_HF_CACHE": str(tmp_path / "cache")}
    first = _run(["-c", "import sys\n" + body, str(fit), str(recipe)], env).stdout.strip().splitlines()
    assert first[-1] == "RC 0 True True"
    assert len(list((tmp_path / "cache" / "families").glob("*.json"))) == 1
    second = _run(["-c", WITHOUT_TORCH + body, str(fit), str(recipe)], env).stdout.strip().splitlines()
    assert second[-1] == "RC 0 False False"
    plans = [json.loads("\n".join(out[:-1])) for out in (first, second)]
    for p in plans:
        p["settings"].pop("seconds")  # the planner's own run time
    assert plans[0] == plans[1]


def test_family_recipe_copy_name_is_the_sweeps() -> None:
    from looped_hf.planner.family import RECIPE_COPY
    from looped_hf.sweep import RECIPE_COPY as SWEEP_RECIPE_COPY

    assert RECIPE_COPY == SWEEP_RECIPE_COPY


def test_every_public_name_is_bound_on_first_use() -> None:
    import looped_hf

    assert set(looped_hf.__all__) == {*looped_hf._MODEL_NAMES, *looped_hf._LAZY, "register", "__version__"}
    assert all(getattr(looped_hf, name) is not None for name in looped_hf.__all__)
