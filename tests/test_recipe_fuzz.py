"""Fuzz the recipe loader: random types and values for every field, seeded and bounded. Each
recipe must load or be refused with one line naming the field; never a traceback or a hang."""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import pytest
import yaml

from looped_hf.arguments import RecipeError, parse_recipe, recipe_field_types

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
CASES = 400


def _scalar(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([0, 1, -1, 2, 7, 10**6, -(10**6), 2**63, 10**30])
    if kind == 1:
        return rng.choice([0.0, 0.5, -0.5, 1e-12, 1e300, -1e300, float("nan"), float("inf"), 3.7])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 12)))
    if kind == 4:
        return rng.choice(["", " ", "none", "auto", "true", "1e-3", "-1", "nan", "adamw", "steps", "☃", "../x"])
    if kind == 5:
        return rng.randrange(-5, 300)
    if kind == 6:
        return rng.uniform(-2, 2)
    if kind == 7:
        return "x" * rng.randrange(1, 300)
    return rng.choice([0, 1, 0.1, "a"])


def _value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if depth < 2 and roll < 0.25:
        return {str(_scalar(rng)): _value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}
    return _scalar(rng)


@pytest.mark.parametrize("through_yaml", [False, True], ids=["mapping", "yaml-file"])
def test_random_values_for_every_field_load_or_give_one_line(tmp_path, through_yaml):
    rng = random.Random(20261205 + through_yaml)
    base = yaml.safe_load((RECIPES / "tiny.yaml").read_text()) | {"output_dir": str(tmp_path / "run")}
    names = sorted(recipe_field_types())
    outcomes = {"loaded": 0, "refused": 0}
    for case in range(CASES // 2):
        recipe = dict(base)
        changed = rng.sample(names, rng.choice([1, 1, 1, 2, 3]))
        for name in changed:
            recipe[name] = _value(rng)
        source: Any = recipe
        if through_yaml:
            source = tmp_path / f"r{case}.yaml"
            source.write_text(yaml.safe_dump(recipe, allow_unicode=True))
        try:
            parse_recipe(source)
        except RecipeError as err:
            message = str(err)
            assert "\n" not in message and "Traceback" not in message, (changed, message)
            assert any(name in message for name in changed) or "run length" in message, (changed, message)
            outcomes["refused"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - anything but a RecipeError is the bug looked for
            pytest.fail(f"{ {n: recipe[n] for n in changed} }: {type(err).__name__}: {err}")
        outcomes["loaded"] += 1
    assert outcomes["refused"] > CASES // 8 and outcomes["loaded"] > 0, outcomes  # the fuzz reaches both


PATH_FIELDS = ["dataset", "tokenizer", "output_dir", "data_cache_dir", "resume_from_checkpoint", "results_file"]
ODD_PATHS = ["x" * 300, "a\x00b", "~no_such_user_here/x", "/etc/hostname", ".", ""]


@pytest.mark.parametrize("field", PATH_FIELDS)
def test_odd_paths_in_path_fields_give_one_line_at_check(tmp_path, field):
    """The fuzz's finding: a name the OS cannot look up (too long, a NUL byte, an unknown ~user)
    once raised OSError / RuntimeError from a check that only meant to test existence."""
    from looped_hf.train import check_recipe

    base = yaml.safe_load((RECIPES / "tiny.yaml").read_text()) | {"output_dir": str(tmp_path / "run")}
    for value in ODD_PATHS:
        try:
            check_recipe(base | {field: value})
        except RecipeError as err:
            assert "\n" not in str(err), (field, value, str(err))
        except Exception as err:  # noqa: BLE001
            pytest.fail(f"{field}={value[:20]!r}: {type(err).__name__}: {err}")
