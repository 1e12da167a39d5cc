"""The model side of "every bad input refused": values a LoopedConfig cannot work with, a folder of another model
type, inputs beyond the positions or the vocabulary, and a recurrence count past the ceiling are
refused with a ValueError naming the field (or ``input_ids``) and the value."""

from __future__ import annotations

import math
import time

import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_config, tiny_looped_model
from transformers import GPT2Config

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.configuration_looped import RECURRENCE_CEILING_FACTOR

NAN, INF = math.nan, math.inf


# --------------------------------------------------------------------------------------------
# LoopedConfig: every numeric field
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("rms_norm_eps", -1.0), ("rms_norm_eps", 0.0), ("rms_norm_eps", NAN), ("rms_norm_eps", INF),
        ("rms_norm_eps", "1e-6"),
        ("initializer_range", -1.0), ("initializer_range", NAN),
        ("state_init_std", -0.5), ("state_init_std", NAN), ("state_init_std", INF),
        ("attention_dropout", 5.0), ("attention_dropout", -0.1), ("attention_dropout", NAN),
        ("logit_softcap", 0.0), ("logit_softcap", -15.0), ("logit_softcap", NAN), ("logit_softcap", INF),
        ("num_recurrences", 0), ("num_recurrences", 2.5), ("num_recurrences", True),
        ("vocab_size", 0), ("hidden_size", -32), ("max_position_embeddings", 0),
        ("num_coda_layers", -1), ("kv_budget", 0), ("min_recurrences", 0), ("backprop_recurrences", 0),
        ("pad_vocab_size_to_multiple_of", 0),
        ("pad_token_id", TINY_VOCAB), ("pad_token_id", -1), ("bos_token_id", 10**6), ("eos_token_id", [1, TINY_VOCAB]),
        ("max_recurrences", 2), ("max_recurrences", 10.5),
    ],
)  # fmt: skip
def test_a_value_that_cannot_work_is_refused_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"LoopedConfig\.{field}={value!r}".replace("[", r"\[").replace("(", r"\(")):
        tiny_looped_config(**{field: value})


def test_rope_theta_must_be_positive():
    with pytest.raises(ValueError, match="rope_parameters=.*rope_theta must be a finite number > 0"):
        tiny_looped_config(rope_parameters={"rope_type": "default", "rope_theta": -1.0})


@pytest.mark.parametrize(
    "overrides",
    [{"attention_dropout": 0.0}, {"attention_dropout": 1.0}, {"initializer_range": 0.0}, {"state_init_std": 0.0},
     {"logit_softcap": None}, {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
     {"eos_token_id": [1, 2]}, {"max_recurrences": 3}, {"rms_norm_eps": 1e-12}],
)  # fmt: skip
def test_the_edges_of_every_range_are_accepted(overrides):
    tiny_looped_config(**overrides)


def test_a_nan_eps_would_have_given_nan_logits():
    """Why eps is checked: the refused value is not cosmetic (a zero state normed with eps <= 0)."""
    norm = torch.nn.functional.rms_norm(torch.zeros(1, 4), (4,), eps=0.0)
    assert torch.isnan(norm).all()


# --------------------------------------------------------------------------------------------
# A folder of another model type
# --------------------------------------------------------------------------------------------


def test_a_gpt2_folder_is_refused_by_the_looped_classes(tmp_path):
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=TINY_VOCAB).save_pretrained(tmp_path)
    for load in (LoopedForCausalLM.from_pretrained, LoopedConfig.from_pretrained):
        with pytest.raises(ValueError, match=rf"{tmp_path}: config.json model_type='gpt2': .*only model_type 'looped'"):
            load(tmp_path)
    with pytest.raises(ValueError, match="model_type='llama'"):
        LoopedConfig.from_dict({"model_type": "llama", "hidden_size": 32})


def test_looped_folders_and_dicts_without_model_type_still_load(tmp_path):
    tiny_looped_model().save_pretrained(tmp_path)
    assert type(LoopedForCausalLM.from_pretrained(tmp_path)) is LoopedForCausalLM
    # A hand-written dict without the key (0.1.0's configs had one; this keeps the old reading).
    assert LoopedConfig.from_dict({"hidden_size": 32, "num_attention_heads": 2}).looped_format == 1


# --------------------------------------------------------------------------------------------
# input_ids: positions and vocabulary
# --------------------------------------------------------------------------------------------


def _model(**overrides) -> LoopedForCausalLM:
    return tiny_looped_model(max_position_embeddings=16, **overrides)


def test_more_tokens_than_positions_is_refused_naming_input_ids():
    model = _model()
    with pytest.raises(ValueError, match=r"^input_ids: 17 positions exceed max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    embeds = model.model.embed_tokens(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^inputs_embeds: 17 positions exceed"):
        model(inputs_embeds=embeds)
    assert model(torch.zeros(1, 16, dtype=torch.long)).logits.shape == (1, 16, TINY_VOCAB)  # the edge runs


def test_a_cache_counts_towards_the_positions():
    model = _model()
    out = model(torch.zeros(1, 10, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match=r"input_ids: 17 positions \(10 in the cache \+ 7 new\) exceed"):
        model(torch.zeros(1, 7, dtype=torch.long), cache=out.cache)
    assert model(torch.zeros(1, 6, dtype=torch.long), cache=out.cache).logits.shape[1] == 6


def test_dynamic_rope_may_run_past_the_positions():
    model = _model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert model(torch.zeros(1, 24, dtype=torch.long)).logits.shape[1] == 24


@pytest.mark.parametrize("bad", [TINY_VOCAB, TINY_VOCAB + 30, -1])
@pytest.mark.parametrize("training", [False, True])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_input_ids(bad, training):
    """Also ids in the padded rows (vocab_size <= id < padded_vocab_size), which the embedding has."""
    model = _model(pad_vocab_size_to_multiple_of=64).train(training)
    ids = torch.tensor([[3, 4, bad, 5]])
    with pytest.raises(ValueError, match=rf"^input_ids: token id {bad} is outside the vocabulary \[0, vocab_size=97\)"):
        model(ids, labels=ids)


def test_generate_refuses_a_run_that_would_outgrow_the_positions_before_any_forward():
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    prompt = torch.full((1, 10), 3)
    with pytest.raises(ValueError, match=r"input_ids: 20 positions \(a prompt of 10 tokens \+ up to 10 new"):
        model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert calls == []
    with pytest.raises(ValueError, match=r"input_ids: token id 97 is outside"):
        model.generate(torch.tensor([[3, 97]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (1, 16)


# --------------------------------------------------------------------------------------------
# The recurrence ceiling
# --------------------------------------------------------------------------------------------


def test_a_recurrence_count_past_the_ceiling_is_refused_with_its_cost_at_once():
    model = _model()  # r = 3: P 1 + 3 x K 2 + C 1 = 8 applications; ceiling 64 x 3 = 192
    ids = torch.full((1, 4), 3)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_recurrences=10000000: exceeds this model's ceiling of 192 recurrences "
                                         r"\(64 x the trained num_recurrences=3\); it would run 20000002 layer "
                                         r"applications per token, against 8"):  # fmt: skip
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0, num_recurrences=10**7)
    with pytest.raises(ValueError, match="exceeds this model's ceiling of 192"):
        model(ids, num_recurrences=193)
    assert time.perf_counter() - start < 5  # refused, not run
    assert model(ids, num_recurrences=RECURRENCE_CEILING_FACTOR * 3).logits.shape == (1, 4, TINY_VOCAB)


def test_max_recurrences_moves_the_ceiling():
    model = _model(num_recurrences=1, max_recurrences=70)
    ids = torch.full((1, 2), 3)
    assert model(ids, num_recurrences=70).logits.shape == (1, 2, TINY_VOCAB)
    with pytest.raises(ValueError, match=r"ceiling of 70 recurrences \(config.max_recurrences\)"):
        model(ids, num_recurrences=71)
