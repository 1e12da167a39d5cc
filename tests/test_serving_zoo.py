"""vLLM serves the four converted zoo models exactly as ``generate()`` computes them.

``tests/fixtures/zoo/{huginn-tiny, retrofit-llama-tiny, retrofit-olmo-tiny, ouro-tiny}`` go through
``looped-hf convert`` (as test_zoo_parity / test_zoo_ouro do) and are served by ``vllm.LLM`` in
float32 (the plugin's model, no remote code): greedy tokens equal ``generate(do_sample=False)``'s on
every prompt and each chosen token's log-probability is within 1e-3. Each model runs at its trained
r and one other r (r is per engine: one engine each), with kv_budget < r for Huginn and the OLMo
retrofit. Between them they cover what the zoo added to the vLLM model: the sandwich, sublayer-output
and pre-and-output norm placements, q/k bias, the whole-projection QK-norm, the embedding
multiplier, the post-loop norm (the final norm's weight), the recurrence norm sharing the final
norm, whole-stack looping, and Ouro's exit gate read at threshold 1.0 (the converter's; the last
loop's logits) and 0.5 (each token at its own exit step).

The fixtures have no tokenizer, so each converted folder gets a tiny word-level one of the model's
vocabulary (what a converted folder carries when its source has one): the engines load it, and
``looped-hf serve`` accepts each folder (its checks, without starting a server).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_path
from serving_helpers import greedy_references_via, reference_python, vllm_workdir
from test_serving_parity import (
    assert_one_attention_per_slot,
    assert_served_as_generate,
    close,
    greedy,
    make_llm,
    needs_vllm,
)

from looped_hf.generation_looped import KVSlotPlan
from looped_hf.serving import servable_problems

DATA = fixture_path("zoo")
MODELS = ("huginn-tiny", "retrofit-llama-tiny", "retrofit-olmo-tiny", "ouro-tiny")
PROMPT_LENGTHS = (1, 5, 17, 40)
VOCAB = 256  # every fixture's

# (model, hf_overrides): one engine each. {} is the converted config (trained r 4, no budget).
ENGINES = [
    ("huginn-tiny", {}), ("huginn-tiny", {"num_recurrences": 8, "kv_budget": 2}),
    ("retrofit-llama-tiny", {}), ("retrofit-llama-tiny", {"num_recurrences": 2}),
    ("retrofit-olmo-tiny", {}), ("retrofit-olmo-tiny", {"num_recurrences": 6, "kv_budget": 3}),
    ("ouro-tiny", {}), ("ouro-tiny", {"num_recurrences": 3, "exit_gate_threshold": 0.5}),
]  # fmt: skip


def engine_id(case: tuple) -> str:
    model, over = case
    return model + "".join(f"-{key}={value}" for key, value in over.items())


def generate_kwargs(over: dict) -> dict:
    """The engine's hf_overrides as ``generate()`` keywords (per call there)."""
    return dict(over)


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-vllm-zoo-") as root:
        yield root


@pytest.fixture(scope="module")
def converted(workdir: Path) -> dict[str, Path]:
    from looped_hf.convert import main

    formats = {"huginn-tiny": "huginn", "retrofit-llama-tiny": "retrofit", "retrofit-olmo-tiny": "retrofit",
               "ouro-tiny": "ouro"}  # fmt: skip
    folders = {}
    for name in MODELS:
        assert main([formats[name], str(DATA / name), "--out", str(workdir / name)]) == 0
        folders[name] = workdir / name
        save_tokenizer(folders[name])
    return folders


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of ``VOCAB`` tokens ("t0" .. "t255") saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0").save_pretrained(folder)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def references(converted, prompts) -> dict[str, list]:
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference "
                    "(set LOOPED_HF_REFERENCE_PYTHON)")  # fmt: skip
    jobs = [dict(checkpoint=converted[model], prompts=prompts, n=8, kwargs=generate_kwargs(over)) for model, over in ENGINES]
    return dict(zip(map(engine_id, ENGINES), greedy_references_via(python, jobs)))


def test_each_converted_config_is_servable_and_what_is_not_is_refused_in_one_line(converted) -> None:
    from looped_hf import LoopedConfig

    for name in MODELS:
        config = LoopedConfig.from_pretrained(converted[name])
        assert servable_problems(config, device="cpu") == [], name
    ouro = LoopedConfig.from_pretrained(converted["ouro-tiny"])
    assert (ouro.exit_gate, ouro.exit_gate_output, ouro.exit_gate_threshold) == (True, "threshold", 1.0)
    ouro.exit_gate_output = "weighted"
    (problem,) = servable_problems(ouro, device="cpu")
    assert problem.startswith("exit_gate_output='weighted': ")
    huginn = LoopedConfig.from_pretrained(converted["huginn-tiny"])
    huginn.state_init, huginn.state_init_std = "truncated_normal", 0.0
    assert servable_problems(huginn, device="cpu") == []  # std 0: the deterministic zero state
    huginn.state_init_std = 0.08
    (problem,) = servable_problems(huginn, device="cpu")
    assert problem.startswith("state_init='truncated_normal' with state_init_std=0.08: ")
    olmo = LoopedConfig.from_pretrained(converted["retrofit-olmo-tiny"])
    (problem,) = servable_problems(olmo, tensor_parallel_size=2)
    assert problem.startswith("tensor_parallel_size=2: qk_norm='learnable_projection_before_rope'")


@needs_vllm
@pytest.mark.parametrize("case", ENGINES, ids=engine_id)
def test_vllm_serves_each_converted_model_with_generates_tokens_and_logprobs(case, converted, prompts, references):
    model, over = case
    llm = make_llm(converted[model], over, max_model_len=128, skip_tokenizer_init=False)
    try:
        vllm_config = llm.llm_engine.vllm_config
        plan = KVSlotPlan.for_call(vllm_config.model_config.hf_config)
        assert_one_attention_per_slot(vllm_config, plan)  # one KV cache per layer application
        outputs = greedy(llm, prompts)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references[engine_id(case)])


@needs_vllm
def test_the_other_engines_settings_change_what_is_served(references) -> None:
    """The second engine of each model really runs something else (else its case proves nothing)."""
    for model in MODELS:
        first, second = (references[engine_id(case)] for case in ENGINES if case[0] == model)
        assert first != second, model


@pytest.mark.parametrize("name", MODELS)
def test_looped_hf_serve_accepts_each_converted_folder_and_refuses_what_vllm_cannot_serve(name, converted, capsys):
    from looped_hf.serving import cli as serve_cli

    assert serve_cli.main([str(converted[name]), "-r", "6", "--kv-budget", "2", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert """--hf-overrides '{"num_recurrences":6,"kv_budget":2}'""" in out, err
    edit = {"ouro-tiny": {"exit_gate_output": "weighted"}, "huginn-tiny": {"state_init": "truncated_normal"}}
    if name in edit:
        refused = converted[name].parent / f"{name}-refused"
        shutil.copytree(converted[name], refused, dirs_exist_ok=True)
        config = json.loads((refused / "config.json").read_text())
        (refused / "config.json").write_text(json.dumps({**config, **edit[name]}))
        assert serve_cli.main([str(refused), "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        field, value = next(iter(edit[name].items()))
        assert len(err.splitlines()) == 1 and f"{field}={value!r}" in err, err
