"""Depth in ``generation_config``: ``num_recurrences``, ``draft_num_recurrences`` and ``kv_budget`` work
wherever generation settings live. A keyword of ``generate()`` wins, else the generation config's field (a
passed one, the model's, ``generation_config.json``), else the model config's; a value the model cannot
run is refused in one line. transformers' ``GenerationConfig.update`` takes any keyword that names one of
its fields, so before this the depth never reached the forward once the generation config had the field.
Random weights, whose depths all give different scores, so a depth not honoured shows."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_looped_model
from test_modeling import prompts
from transformers import AutoModelForCausalLM, GenerationConfig

from looped_hf.generation_looped import DEPTH_SETTINGS, generation_depth


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


def _scores(model, ids=None, **kwargs) -> torch.Tensor:
    out = model.generate(prompts(1) if ids is None else ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True, **kwargs)  # fmt: skip
    return torch.stack(out.scores)


@pytest.fixture(scope="module")
def reference() -> dict:
    """Scores at each r and at r = 3 under a KV budget of 1, from a model whose generation config has no
    depth field (the keyword path that worked before)."""
    model = tiny_looped_model()
    scores = {r: _scores(model, num_recurrences=r) for r in (1, 2, 3)}
    scores["budget 1"] = _scores(model, kv_budget=1)
    assert not torch.equal(scores[1], scores[3]) and not torch.equal(scores[2], scores[3])
    assert not torch.equal(scores["budget 1"], scores[3])
    return scores


def test_a_keyword_wins_then_the_generation_config_then_the_model_config(reference) -> None:
    model = tiny_looped_model()  # config.num_recurrences = 3
    model.generation_config.num_recurrences = 1
    assert torch.equal(_scores(model), reference[1])
    assert torch.equal(_scores(model, num_recurrences=2), reference[2])
    model.generation_config.num_recurrences = None  # the field there, unset: the model config's r
    assert torch.equal(_scores(model), reference[3])
    assert torch.equal(_scores(model, num_recurrences=2), reference[2])


def test_a_passed_generation_config_beats_the_models_and_a_keyword_beats_both(reference) -> None:
    model = tiny_looped_model()
    model.generation_config.num_recurrences = 1
    passed = GenerationConfig(num_recurrences=2, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip
    ids = prompts(1)
    assert torch.equal(torch.stack(model.generate(ids, generation_config=passed).scores), reference[2])
    assert torch.equal(torch.stack(model.generate(ids, passed).scores), reference[2])  # positional
    assert torch.equal(torch.stack(model.generate(ids, generation_config=passed, num_recurrences=3).scores),
                       reference[3])  # fmt: skip


def test_generation_config_json_sets_the_default_depth(reference, tmp_path) -> None:
    model = tiny_looped_model()
    model.generation_config.num_recurrences = 1
    model.generation_config.kv_budget = None
    model.save_pretrained(tmp_path)
    assert '"num_recurrences": 1' in (tmp_path / "generation_config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.num_recurrences == 3 and loaded.generation_config.num_recurrences == 1
    # Saved and loaded, the weights are the same up to the last bit, the sums' order may not be.
    torch.testing.assert_close(_scores(loaded), reference[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_scores(loaded, num_recurrences=3), reference[3], rtol=1e-6, atol=1e-6)


def test_kv_budget_in_the_generation_config(reference) -> None:
    model = tiny_looped_model()
    model.generation_config.kv_budget = 1
    assert torch.equal(_scores(model), reference["budget 1"])
    assert torch.equal(_scores(model, kv_budget=3), reference[3])  # the keyword wins


def _block_applications(model, **kwargs) -> tuple[torch.Tensor, int, object]:
    """(greedy tokens, how many times the shared block's first layer ran, the output) of one generate."""
    calls = []
    hook = model.model.recurrent_layers[0].register_forward_hook(lambda *args: calls.append(1))
    try:
        out = model.generate(prompts(1), max_new_tokens=8, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, **kwargs)  # fmt: skip
    finally:
        hook.remove()
    return out.sequences, len(calls), out


def test_draft_num_recurrences_in_the_generation_config_drafts_at_its_depth() -> None:
    """Self-drafting from the generation config runs as the keyword does (the same draft depth, so the
    same block applications and acceptances), also when the generation config sets num_recurrences
    (the case that drafted at full depth, every draft accepted)."""
    plain = tiny_looped_model()
    tokens, applications, out = _block_applications(plain, num_recurrences=2, draft_num_recurrences=1)
    full_depth_draft = _block_applications(plain, num_recurrences=2, draft_num_recurrences=2)[1]
    assert out.num_draft_tokens > 0 and applications != full_depth_draft
    assert torch.equal(tokens, _block_applications(plain, num_recurrences=2)[0])  # greedy at r, drafted or not

    configured = tiny_looped_model()
    configured.generation_config.num_recurrences = 2
    configured.generation_config.draft_num_recurrences = 1
    got_tokens, got_applications, got = _block_applications(configured)
    assert torch.equal(got_tokens, tokens) and got_applications == applications
    assert (got.num_draft_tokens, got.num_accepted_draft_tokens) == (out.num_draft_tokens, out.num_accepted_draft_tokens)
    # The keyword still wins over the configured draft depth, and so does a drafter passed to the call.
    assert _block_applications(configured, draft_num_recurrences=2)[1] == full_depth_draft
    other = _block_applications(configured, assistant_model=tiny_looped_model(seed=1))
    assert torch.equal(other[0], tokens) and not hasattr(other[2], "num_draft_tokens")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_recurrences", 0, "generation_config.num_recurrences=0: must be an integer >= 1"),
        ("num_recurrences", 2.5, "generation_config.num_recurrences=2.5: must be an integer"),
        ("kv_budget", 0, "generation_config.kv_budget=0: must be"),
        ("draft_num_recurrences", 5, r"generation_config.draft_num_recurrences=5: must be an integer in \[1, "),
    ],
)
def test_a_generation_config_depth_the_model_cannot_run_is_refused_in_one_line(field, value, message) -> None:
    model = tiny_looped_model()
    setattr(model.generation_config, field, value)
    with pytest.raises(ValueError, match=message) as err:
        _scores(model)
    assert "\n" not in str(err.value)


def test_a_hyperconnection_models_generation_config_cannot_move_its_depth() -> None:
    model = tiny_looped_model(input_injection="hyperconnection")
    model.generation_config.num_recurrences = 2
    with pytest.raises(ValueError, match=r"generation_config.num_recurrences=2: .*only run at its trained") as err:
        _scores(model)
    assert "\n" not in str(err.value)


def test_generation_depth_is_the_one_rule() -> None:
    model = tiny_looped_model(kv_budget=2)
    config, own = model.config, GenerationConfig(num_recurrences=1)
    assert generation_depth(config) == {"num_recurrences": 3, "draft_num_recurrences": None, "kv_budget": 2}
    assert generation_depth(config, None, own)["num_recurrences"] == 1
    assert generation_depth(config, GenerationConfig(num_recurrences=2), own)["num_recurrences"] == 2
    assert generation_depth(config, own, num_recurrences=3)["num_recurrences"] == 3
    assert set(generation_depth(config)) == set(DEPTH_SETTINGS)


def test_the_text_generation_pipeline_reads_the_same_default() -> None:
    from transformers import pipeline

    from looped_hf.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("bytes")  # 258 ids: the 256 bytes, eos, pad
    model = tiny_looped_model(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    model.generation_config.num_recurrences = 1
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = "a looped model"
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    expected = {r: model.generate(ids, max_new_tokens=4, do_sample=False, num_recurrences=r)[0].tolist()
                for r in (1, 3)}  # fmt: skip
    assert expected[1] != expected[3]

    def run(**kwargs) -> list[int]:
        return generator(text, max_new_tokens=4, do_sample=False, return_tensors=True, **kwargs)[0]["generated_token_ids"]

    assert run() == expected[1]
    assert run(num_recurrences=3) == expected[3]


# --- test-time, eval and serving read the same default ------------------------------------------
def test_decoding_loss_and_the_eval_grid_read_the_generation_config_default() -> None:
    from datasets import Dataset

    from looped_hf.evaluation.cli import default_recurrences
    from looped_hf.recurrence_curves import decoding_heldout_loss

    blocks = Dataset.from_dict({"input_ids": prompts(2, 6).tolist()})
    plain, configured = tiny_looped_model(), tiny_looped_model()
    configured.generation_config.num_recurrences = 1
    configured.generation_config.kv_budget = 1
    got = decoding_heldout_loss(configured, blocks, batch_size=2)
    assert got == decoding_heldout_loss(plain, blocks, batch_size=2, num_recurrences=1, kv_budget=1)
    assert got["mean_recurrences"] == 1.0
    assert got != decoding_heldout_loss(plain, blocks, batch_size=2)
    assert decoding_heldout_loss(configured, blocks, batch_size=2, num_recurrences=3, kv_budget=3) == (
        decoding_heldout_loss(plain, blocks, batch_size=2)
    )
    config = plain.config  # r = 3: powers of 2 up to 2r, the trained r, and the generation default
    assert default_recurrences(config) == [1, 2, 3, 4]
    assert default_recurrences(config, 5) == [1, 2, 3, 4, 5]


def _serving_folder(tmp_path, **generation) -> object:
    from looped_hf.data.tokenizer import load_tokenizer

    model = tiny_looped_model(vocab_size=258, pad_token_id=257, eos_token_id=256, bos_token_id=256)
    for key, value in generation.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(tmp_path / "ckpt")
    load_tokenizer("bytes").save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_serve_and_engine_args_serve_the_generation_config_default(tmp_path, capsys, monkeypatch) -> None:
    from looped_hf.serving import cli as serve_cli
    from looped_hf.serving.engine import engine_args

    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: False)  # head_dim 8: the GPU path's settings
    folder = _serving_folder(tmp_path, num_recurrences=2, kv_budget=1)
    capsys.readouterr()
    assert serve_cli.main([str(folder), "--dry-run"]) == 0
    assert """--hf-overrides '{"num_recurrences":2,"kv_budget":1}'""" in capsys.readouterr().out
    assert serve_cli.main([str(folder), "-r", "3", "--dry-run"]) == 0  # a flag wins
    assert """--hf-overrides '{"num_recurrences":3,"kv_budget":1}'""" in capsys.readouterr().out
    assert engine_args(folder, device="cuda")["hf_overrides"] == {"num_recurrences": 2, "kv_budget": 1}
    assert engine_args(folder, device="cuda", num_recurrences=3)["hf_overrides"]["num_recurrences"] == 3


def test_serve_refuses_a_generation_config_depth_in_one_line(tmp_path, capsys, monkeypatch) -> None:
    from looped_hf.serving import cli as serve_cli

    monkeypatch.setattr(serve_cli, "_on_cpu", lambda: False)
    folder = _serving_folder(tmp_path, num_recurrences=0)
    capsys.readouterr()
    assert serve_cli.main([str(folder), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.num_recurrences=0: must be an integer >= 1" in err
    assert len(err.strip().splitlines()) == 1
