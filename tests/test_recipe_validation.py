"""Bad recipe values: one line naming the recipe field and the value, before anything runs.

Every field a recipe may set (model, data, training, optimizer, sweep) is walked through values
that are wrong in type, sign, finiteness, emptiness or size; each must be refused with a clear
error naming that field, or pass `looped-hf train --check` (which builds no model weights and
reads no data, so the walk takes seconds).
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest
import yaml

from looped_hf import data as data_mod
from looped_hf.arguments import RecipeError, recipe_field_types
from looped_hf.sweep import make_plan
from looped_hf.sweep.plan import SweepArguments
from looped_hf.train import check_recipe, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
NAN, INF = float("nan"), float("inf")
# Wrong in type (a list, a mapping, a word), sign, finiteness, emptiness and size.
BAD_VALUES = [[1, 2], {"a": 1}, "not-a-value", "", -1, 0, NAN, INF, -INF, 10**30, 1e300, True]


def _tiny(tmp_path: Path) -> dict:
    recipe = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    recipe["output_dir"] = str(tmp_path / "run")
    return recipe


@pytest.fixture
def cached_tokenizers(monkeypatch):
    """Load each tokenizer once for the whole walk (the check loads the recipe's per call)."""
    monkeypatch.setattr(data_mod, "load_tokenizer", functools.lru_cache(maxsize=8)(data_mod.load_tokenizer))


def _is_one_clear_line(message: str, field: str) -> bool:
    return "\n" not in message and "Traceback" not in message and field in message


# The issue's list: each of these, in recipes/tiny.yaml, used to crash, train, or name a field
# the recipe does not have.
ISSUE_CASES = [
    # Model fields are LoopedConfig's, which names itself; data and training fields are checked
    # against their declarations (type, validator, choices).
    ("hidden_size", [1, 2], "LoopedConfig.hidden_size=[1, 2]: expected int, got list"),
    ("tokenizer", 12, "tokenizer=12: must be a valid string"),
    ("accelerator_config", 1, "accelerator_config=1: must be a valid dictionary or a valid string"),
    ("seq_len", NAN, "seq_len=nan: must be a finite number"),
    ("learning_rate", -1, "learning_rate=-1: must be a finite number > 0"),
    ("logit_softcap", INF, "LoopedConfig.logit_softcap=inf: must be a finite number > 0"),
    ("per_device_train_batch_size", 0, "per_device_train_batch_size=0: must be an integer >= 1"),
    ("num_recurrences", -1, "LoopedConfig.num_recurrences=-1: must be an integer >= 1"),
]


@pytest.mark.parametrize("check", [True, False], ids=["check", "train"])
@pytest.mark.parametrize(("field", "value", "expected"), ISSUE_CASES, ids=[c[0] for c in ISSUE_CASES])
def test_bad_value_in_tiny_recipe_exits_2_with_one_line_naming_field_and_line(
    field, value, expected, check, tmp_path, capsys
):
    recipe = _tiny(tmp_path)
    recipe[field] = value
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    line = 1 + list(recipe).index(field)
    assert main([str(path), *(["--check"] if check else [])]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"looped-hf train: recipe {str(path)!r}, line {line}: {expected}"), err
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    os.fstat(1)  # accelerator_config: 1 once closed the process's stdout


def test_a_bad_flag_is_named_as_a_flag(capsys):
    assert main([str(RECIPES / "tiny.yaml"), "--check", "--learning_rate", "nan"]) == 2
    err = capsys.readouterr().err
    assert "flag --learning_rate: learning_rate=nan: must be a finite number" in err


def test_yaml_strings_for_numbers_are_read_as_numbers(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-3 and 1.536e5 (no dot, no sign in the exponent) as strings; a
    # recipe file means the numbers (YAML 1.2), for model fields too.
    path = tmp_path / "r.yaml"
    text = yaml.safe_dump({k: v for k, v in _tiny(tmp_path).items() if k not in ("learning_rate", "train_tokens")})
    path.write_text(text + "learning_rate: 3e-3\ntrain_tokens: 1.536e5\ninitializer_range: 2e-2\n")
    (model, data, training), _ = check_recipe(path)
    assert training.learning_rate == 3e-3 and training.train_tokens == 153_600
    assert model.settings["initializer_range"] == 2e-2
    # A mapping's strings: read as the field's type asks, where they spell one.
    (_, data, _), _ = check_recipe({**_tiny(tmp_path), "seq_len": "64"})
    assert data.seq_len == 64
    with pytest.raises(RecipeError, match=r"seq_len='sixty': must be a valid integer"):
        check_recipe({**_tiny(tmp_path), "seq_len": "sixty"})


def test_invalid_yaml_names_file_and_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("hidden_size: 64\nseq_len: [1\n")
    assert main([str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert f"recipe {str(path)!r}, line 3, column 1: not valid YAML" in err and err.count("\n") == 1


def test_check_prints_what_the_recipe_resolves_to_and_trains_nothing(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_tiny(tmp_path)))
    assert main([str(path), "--check", "--num_recurrences", "8"]) == 0
    out = capsys.readouterr().out
    assert "valid; nothing was trained" in out and "with --num_recurrences 8" in out
    assert "loop8: hidden 64" in out and "layers 1 + 2 x 8 + 1 = 18 applied" in out
    assert "the embedded corpus" in out and "looped_hf/embedded-bpe-4096 (4,096 tokens)" in out
    assert "150 optimizer steps x 1,024 tokens = 153,600 tokens (train_tokens 153,600, rounded up)" in out
    assert "adamw, lr 0.003" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"dataset": str(Path("no") / "such" / "corpus.jsonl")}, "dataset="),
        ({"dataset": "not a hub id"}, "dataset='not a hub id'"),
        ({"tokenizer": str(Path("no") / "such" / "tokenizer.json")}, "tokenizer="),
        ({"input_injection": "abc"}, "input_injection"),
        ({"train_tokens": 10}, "train_tokens=10: buys"),
        ({"optimizer": "muonh"}, "learning_rate=0.003: not used by optimizer 'muonh'"),
        ({"recurrence_sampling": "poisson_lognormal", "num_recurrences": 1}, "num_recurrences=1"),
    ],
)
def test_check_refuses_what_only_the_resolved_run_shows(changes, named, tmp_path):
    """Names of the data source and tokenizer, the config, the length and the optimizer: found
    by --check (and by train, before the run directory is made), one line each."""
    with pytest.raises(RecipeError) as err:
        check_recipe({**_tiny(tmp_path), **changes})
    assert _is_one_clear_line(str(err.value), named), str(err.value)


def test_every_recipe_field_refuses_bad_values_or_checks_valid(tmp_path, cached_tokenizers):
    """Each field x each bad value: a RecipeError of one line naming the field, or a valid check.
    NaN and infinity are never valid; nor is a list or a mapping where the type takes none."""
    fields = recipe_field_types()
    assert len(fields) > 150 and {"hidden_size", "seq_len", "learning_rate", "accelerator_config"} <= set(
        fields
    )
    base = _tiny(tmp_path)
    valid: list[str] = []
    for field, annotation in fields.items():
        takes = str(annotation)
        for value in BAD_VALUES:
            recipe = {
                k: v
                for k, v in base.items()
                if not (field in ("max_steps", "train_flops_budget") and k == "train_tokens")
            }
            recipe[field] = value
            try:
                check_recipe(recipe)
            except RecipeError as err:
                assert _is_one_clear_line(str(err), field), (field, value, str(err))
                continue
            except Exception as err:  # noqa: BLE001 - any other exception is the bug this test is for
                pytest.fail(f"{field}={value!r}: {type(err).__name__}: {err}")
            is_number = isinstance(value, float) and not math.isfinite(value)
            assert not is_number, f"{field}={value!r} passed the check"
            assert not (isinstance(value, list) and "list" not in takes), (
                f"{field}={value!r} passed the check"
            )
            assert not (isinstance(value, dict) and "dict" not in takes), (
                f"{field}={value!r} passed the check"
            )
            valid.append(f"{field}={value!r}")
    # The values a user most needs refused (issue list above) are refused, not "valid".
    for field, value, _ in ISSUE_CASES:
        assert f"{field}={value!r}" not in valid


def _sweep_recipe() -> dict:
    return yaml.safe_load((RECIPES / "iso_depth_tiny.yaml").read_text())


def test_every_sweep_field_refuses_bad_values_or_plans(tmp_path):
    names = [f.name for f in SweepArguments.__dataclass_fields__.values()]
    for field in names:
        for value in BAD_VALUES:
            recipe = _sweep_recipe()
            recipe["sweep"][field] = value
            try:
                make_plan(recipe, tmp_path / "sweep")
            except RecipeError as err:
                # A range error names sweep.<field>; one between fields (r must divide the
                # depth left after prelude and coda) names the fields it relates.
                assert _is_one_clear_line(str(err), field), (field, value, str(err))
                continue
            except Exception as err:  # noqa: BLE001
                pytest.fail(f"sweep.{field}={value!r}: {type(err).__name__}: {err}")
            assert not (isinstance(value, float) and not math.isfinite(value)), f"sweep.{field}={value!r}"


def test_check_names_a_local_data_source_without_reading_it(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "one document"}\n' * 2000)  # enough bytes for the held-out blocks
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**_tiny(tmp_path), "dataset": str(corpus), "tokenizer": "bytes"}))
    assert main([str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert f"data       1 local json file from {corpus}" in out and "looped_hf/bytes (258 tokens)" in out
    assert not (tmp_path / "data").exists()  # nothing tokenized or cached


def test_attn_implementation_takes_auto_a_transformers_name_or_a_hub_kernel_and_refuses_the_rest() -> None:
    from looped_hf.arguments import ModelArguments, RecipeError

    for name in (None, "auto", "eager", "sdpa", "flash_attention_3", "kernels-community/flash-attn3"):
        assert ModelArguments(attn_implementation=name).attn_implementation == name
    with pytest.raises(RecipeError, match=r"attn_implementation='flash3': must be auto, eager, one of"):
        ModelArguments(attn_implementation="flash3")


def test_the_model_section_is_loopedconfigs_fields_with_its_defaults():
    """No mirror: every LoopedConfig field a recipe sets keeps the config's default when left out,
    and a flag's value reaches the config as a recipe file would give it."""
    import dataclasses

    from looped_hf.arguments import NOT_RECIPE_FIELDS, model_fields, parse_recipe
    from looped_hf.configuration_looped import LoopedConfig

    own = set(LoopedConfig.__annotations__) - NOT_RECIPE_FIELDS - {"use_cache"}  # TrainingArguments owns that name
    assert set(model_fields()) == own and {"hidden_size", "num_recurrences", "qk_norm", "kv_budget"} <= own
    model, _, _ = parse_recipe({})
    built, plain = model.to_config(100, 64).to_dict(), LoopedConfig(vocab_size=100).to_dict()
    assert model.settings == {} and built == plain  # hidden_size 256, LoopedConfig's, not a copy's
    model, _, _ = parse_recipe({}, ["--qk_norm", "false", "--num_recurrences", "8", "--no_recurrence_norm",
                                    "--initializer_range", "1e-3", "--logit_softcap", "null"])  # fmt: skip
    config = model.to_config(100, 64)
    assert (config.qk_norm, config.num_recurrences, config.recurrence_norm) == ("none", 8, False)
    assert config.initializer_range == 1e-3 and config.logit_softcap is None
    defaults = {f.name: f.default for f in dataclasses.fields(LoopedConfig)}
    assert all(f.default == defaults[name] for name, f in model_fields().items())


def test_help_reads_the_declarations(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--num_recurrences NUM_RECURRENCES" in out and "an integer >= 1; default 4. r, the default number" in out
    assert "one of relu2, silu, gelu, gelu_pytorch_tanh; default relu2" in out
    assert "Tokens per packed block (>= 2). (an integer >= 2)" in out
    assert "numpy's RandomState takes 0 .. 2**32 - 1" in out  # seed: declared on LoopedTrainingArguments
