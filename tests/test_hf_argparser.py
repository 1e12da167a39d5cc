"""The recipe dataclasses under a plain `HfArgumentParser`, as users build one.

HfArgumentParser passes every metadata key of a field to argparse's ``add_argument``, so a rule
must live in the annotation (``Annotated[int, AT_LEAST_1]``), never in ``metadata``.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from looped_hf.arguments import LoopedTrainingArguments, RecipeError, recipe_parser
from looped_hf.data import DataArguments
from looped_hf.field_checks import AT_LEAST_0, field_rule
from looped_hf.sweep.plan import SweepArguments, parse_sweep_section

ARGPARSE_KEYS = {"help", "choices", "aliases"}


@pytest.mark.parametrize("dtype", [DataArguments, LoopedTrainingArguments, SweepArguments])
def test_metadata_holds_argparse_keys_only(dtype: type) -> None:
    own = set(vars(dtype).get("__annotations__", {}))
    for f in dataclasses.fields(dtype):
        if f.name in own:  # TrainingArguments' own fields are transformers' business
            assert set(f.metadata) <= ARGPARSE_KEYS, (f.name, dict(f.metadata))


def test_data_arguments_build_parse_and_refuse() -> None:
    parser = HfArgumentParser(DataArguments)
    (args,) = parser.parse_args_into_dataclasses(["--seq_len", "64", "--num_proc", "2"])
    assert (args.seq_len, args.num_proc) == (64, 2)
    (args,) = parser.parse_dict({"eval_blocks": 4})
    assert args.eval_blocks == 4
    with pytest.raises(RecipeError, match=r"seq_len=1: must be an integer >= 2"):
        parser.parse_args_into_dataclasses(["--seq_len", "1"])


def test_training_arguments_build_parse_and_refuse(tmp_path: Path) -> None:
    parser = HfArgumentParser(LoopedTrainingArguments)
    flags = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
    (args,) = parser.parse_args_into_dataclasses([*flags, "--learning_rate", "0.01", "--eval_steps", "5"])
    assert (args.learning_rate, args.eval_steps) == (0.01, 5)
    with pytest.raises(RecipeError, match=r"learning_rate=-1: must be a finite number > 0"):
        parser.parse_args_into_dataclasses([*flags, "--learning_rate", "-1"])
    # Optional fields (Annotated[int | None, RULE]) keep their rule.
    with pytest.raises(RecipeError, match=r"save_total_limit=-2: must be an integer >= 0"):
        parser.parse_args_into_dataclasses([*flags, "--save_total_limit", "-2"])


def test_recipe_tuple_builds_parses_and_shows_rules(tmp_path: Path) -> None:
    parser = HfArgumentParser((DataArguments, LoopedTrainingArguments))
    data, train = parser.parse_args_into_dataclasses(
        ["--seq_len", "32", "--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
    )
    assert data.seq_len == 32 and train.output_dir == str(tmp_path)
    with pytest.raises(RecipeError, match=r"eval_blocks=0: must be an integer >= 1"):
        parser.parse_args_into_dataclasses(["--eval_blocks", "0", "--output_dir", str(tmp_path)])
    # looped_hf's own parser shows each rule in --help.
    text = " ".join(recipe_parser().format_help().split())
    assert "Tokens per packed block (>= 2). (an integer >= 2)" in text
    assert "(a finite number > 0)" in text


def test_sweep_arguments_rules_are_read_from_annotations() -> None:
    assert field_rule(SweepArguments, "prelude") is AT_LEAST_0
    with pytest.raises(RecipeError, match=r"sweep\.prelude=-1: must be an integer >= 0"):
        parse_sweep_section({"budgets": [1e15], "widths": [128], "prelude": -1}, "recipe")
    # Every field but `widths` (one list per budget, or one list for all: a union that argparse, one
    # type per argument, cannot express) builds under HfArgumentParser, as it resolves them.
    hints = typing.get_type_hints(SweepArguments)
    parser = HfArgumentParser([])
    for f in dataclasses.fields(SweepArguments):
        if f.name != "widths":
            clone = copy.copy(f)
            clone.type = hints[f.name]
            HfArgumentParser._parse_dataclass_field(parser, clone)
    args = parser.parse_args(["--prelude", "3", "--seeds", "0", "1"])
    assert (args.prelude, args.seeds) == (3, [0, 1])
