"""The model side of "every bad input refused": values a LoopedConfig cannot work with, a folder of another model
type, token ids outside the vocabulary, and a recurrence count past the ceiling are refused with a
ValueError naming the field (or ``input_ids``) and the value. What can work is not refused: inputs
past max_position_embeddings run as on Llama (RoPE computes any position), with one warning."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import time

import huggingface_hub.dataclasses
import huggingface_hub.errors
import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_config, tiny_looped_model
from huggingface_hub.dataclasses import strict
from transformers import GPT2Config

from looped_hf import LoopedConfig, LoopedForCausalLM, configuration_looped
from looped_hf.configuration_looped import (
    HIDDEN_ACTS,
    MAX_NUM_RECURRENCES,
    RECURRENCE_CEILING_FACTOR,
    LoopedConfigError,
)

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


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("num_recurrences", 10**12, "exceeds MAX_NUM_RECURRENCES=4096"),
        ("num_recurrences", MAX_NUM_RECURRENCES + 1, "exceeds MAX_NUM_RECURRENCES=4096"),
        ("max_recurrences", 10**6, "exceeds MAX_NUM_RECURRENCES=4096"),
        ("hidden_size", 10**9, r"the model would have ~.* parameters, over the bound of 1e\+13 \(MAX_PARAMETERS"),
        ("vocab_size", 10**12, r"the model would have ~.* parameters, over the bound of 1e\+13"),
        ("num_recurrent_layers", 10**8, r"the model would have 100000002 unique layers, over the bound of 4096"),
        ("intermediate_size", 10**13, r"the model would have ~.* parameters, over the bound of 1e\+13"),
        ("tie_word_embeddings", "false", "expected bool"),
        ("tie_word_embeddings", 1, "expected bool"),
    ],
)  # fmt: skip
def test_a_config_the_model_could_never_run_or_allocate_is_refused_in_one_line(field, value, why):
    # As a converted config.json would carry it: from_dict, and the constructor, refuse it alike.
    # (A converted config.json names the sizes it has; the rest derive from them, as here.)
    derived = ("intermediate_size", "head_dim", "num_key_value_heads", "num_hidden_layers")
    saved = {k: v for k, v in tiny_looped_config().to_dict().items() if k not in derived}
    for build in (lambda: LoopedConfig.from_dict(saved | {field: value}),
                  lambda: tiny_looped_config(**{field: value})):  # fmt: skip
        with pytest.raises(LoopedConfigError, match=rf"^LoopedConfig\.{field}={value!r}: {why}") as err:
            build()
        assert "\n" not in str(err.value)
    assert MAX_NUM_RECURRENCES >= 64 * 64  # generous: 64 x the largest trained r of a published looped model


def test_the_largest_allowed_r_is_accepted_in_the_config_and_per_call():
    config = tiny_looped_config(num_recurrences=MAX_NUM_RECURRENCES, max_recurrences=MAX_NUM_RECURRENCES)
    assert config.recurrence_ceiling == MAX_NUM_RECURRENCES
    # 64 x r past the bound: the ceiling is the bound, named as such, without a pointer to max_recurrences.
    big = tiny_looped_config(num_recurrences=100)
    assert big.recurrence_ceiling == MAX_NUM_RECURRENCES
    with pytest.raises(ValueError, match=r"ceiling of 4096 recurrences \(MAX_NUM_RECURRENCES=4096\).*num_recurrences=100$"):
        big.resolve_num_recurrences(MAX_NUM_RECURRENCES + 1)


@pytest.mark.parametrize(
    "keyword, value",
    [("num_recurrences", 0), ("num_recurrences", -3), ("kv_budget", 0), ("min_recurrences", 0),
     ("exit_gate_threshold", 1.5), ("exit_gate_threshold", -0.5), ("exit_gate_threshold", NAN)],
)  # fmt: skip
def test_a_per_call_value_is_refused_in_the_words_of_its_config_field(keyword, value):
    # One rule, one message: forward's keyword and the config field run the field's own rule.
    # (A value of the wrong type is refused by the field's type first; per call, by the rule's words.)
    gated = {"exit_gate": True, "num_coda_layers": 0} if keyword == "exit_gate_threshold" else {}
    extra = {"exit_criterion": "cosine"} if keyword == "min_recurrences" else {}
    with pytest.raises(LoopedConfigError) as field_err:
        tiny_looped_config(**gated, **{keyword: value})
    model = tiny_looped_model(**gated)
    with pytest.raises(LoopedConfigError) as call_err:
        model(torch.full((1, 3), 3), **extra, **{keyword: value})
    assert str(field_err.value) == f"LoopedConfig.{call_err.value}"
    assert str(call_err.value).startswith(f"{keyword}={value!r}: must be ")


@pytest.mark.parametrize(
    "keyword, value", [("num_recurrences", 2.5), ("num_recurrences", "3"), ("kv_budget", True), ("min_recurrences", 1.0)]
)
def test_a_per_call_value_of_the_wrong_type_is_refused_in_one_line(keyword, value):
    extra = {"exit_criterion": "cosine"} if keyword == "min_recurrences" else {}
    with pytest.raises(LoopedConfigError, match=rf"^{keyword}={value!r}: must be an integer >= 1") as err:
        tiny_looped_model()(torch.full((1, 3), 3), **extra, **{keyword: value})
    assert "\n" not in str(err.value)


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


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("hidden_size", "64", "expected int, got str"),
        ("exit_gate", 1, "expected bool, got int"),
        ("hidden_act", "gelu_new", re.escape(f"must be one of {HIDDEN_ACTS}")),
        ("rms_norm_eps", 0.0, r"must be a finite number > 0 \(a norm divides by sqrt\(mean \+ eps\)\)"),
        ("num_recurrences", 0, "must be an integer >= 1"),
    ],
)  # fmt: skip
def test_an_assignment_is_refused_in_one_line_and_leaves_the_field_as_it_was(field, value, why):
    # As ``serve`` and vLLM's --hf-overrides set a loaded config's fields: one line, nothing changed.
    config = tiny_looped_config()
    before = getattr(config, field)
    with pytest.raises(LoopedConfigError, match=rf"^LoopedConfig\.{field}={value!r}: {why}$") as err:
        setattr(config, field, value)
    assert "\n" not in str(err.value)
    assert getattr(config, field) == before


def test_validate_refuses_an_assigned_value_that_breaks_a_rule_across_fields_in_one_line(tmp_path):
    # Each field alone is fine; together they are not: validate() (which save_pretrained runs) says so.
    config = tiny_looped_config()
    config.num_attention_heads = 3
    why = r"^LoopedConfig\.num_attention_heads=3: does not divide hidden_size=32$"
    with pytest.raises(LoopedConfigError, match=why):
        config.validate()
    with pytest.raises(LoopedConfigError, match=r"^LoopedConfig\.num_attention_heads=3: does not divide"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def _names_strict_adds() -> set[str]:
    """The underscore names huggingface_hub's @strict puts on a class and its ``validate``: its
    private machinery, found by decorating a probe, so the check does not depend on their spelling."""

    @dataclasses.dataclass
    class Plain:
        x: int = 0

    @strict
    @dataclasses.dataclass
    class Probe:
        x: int = 0

        def validate_x(self) -> None:
            pass

    added = (set(vars(Probe)) - set(vars(Plain))) | set(vars(Probe.validate)) | set(vars(Probe.__setattr__))
    modules = (huggingface_hub.dataclasses, huggingface_hub.errors)
    helpers = {name for module in modules for name in vars(module) if not name.startswith("__")}
    return {name for name in added | helpers if name.startswith("_")} - set(dir(object))


def test_the_config_reaches_huggingface_hub_only_through_public_names():
    # configuration_looped.py ships as remote code: huggingface_hub's private names (@strict's
    # markers, its helper functions) may change in any release. Its messages are not parsed either.
    nodes = list(ast.walk(ast.parse(inspect.getsource(configuration_looped))))
    imported = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in nodes if isinstance(node, ast.ImportFrom)}
    named = {node.attr for node in nodes if isinstance(node, ast.Attribute)}
    named |= {node.id for node in nodes if isinstance(node, ast.Name)}
    named |= {node.value for node in nodes if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    imports = [node for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))]
    named |= {alias.name for node in imports for alias in node.names}
    private = named & _names_strict_adds()
    assert not private, sorted(private)
    assert "re" not in imported  # no regular expression over huggingface_hub's wording
    for module in imported:
        if module.startswith("huggingface_hub"):
            assert not any(part.startswith("_") for part in module.split(".")), module


def test_a_subclass_may_apply_strict_again_as_to_any_strict_config():
    @strict
    class WiderConfig(LoopedConfig):
        pass

    assert WiderConfig(hidden_size=64, num_attention_heads=4).hidden_size == 64


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


def _past_positions_warnings(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "past max_position_embeddings" in rec.getMessage()]


def test_more_tokens_than_positions_run_as_on_llama_and_warn_once(caplog):
    """RoPE computes any position: 1.5 x max_position_embeddings runs (Llama runs it too), with one
    warning naming the argument and the limit, not one per call."""
    from looped_hf.interface_looped import logger

    logger.warning_once.cache_clear()  # warn-once is process-wide; another test may have warned
    model = _model()
    ids = torch.randint(3, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING"):
        logits = model(ids).logits
        model(ids)
    assert logits.shape == (2, 24, TINY_VOCAB) and torch.isfinite(logits).all()
    assert _past_positions_warnings(caplog) == [
        "input_ids: positions past max_position_embeddings=16, the positions this model was trained for; "
        "they run (RoPE computes any position), but the model was not trained there"
    ]
    # Causal: the first 16 positions are the ones a 16-token input gets.
    torch.testing.assert_close(logits[:, :16], model(ids[:, :16]).logits, rtol=1e-5, atol=1e-5)
    embeds = model.model.embed_tokens(ids)
    torch.testing.assert_close(model(inputs_embeds=embeds).logits, logits, rtol=1e-5, atol=1e-5)


def test_a_cache_may_grow_past_the_positions():
    model = _model()
    ids = torch.randint(3, TINY_VOCAB, (1, 17), generator=torch.Generator().manual_seed(1))
    out = model(ids[:, :10], use_cache=True)
    step = model(ids[:, 10:], cache=out.cache).logits
    torch.testing.assert_close(step, model(ids).logits[:, 10:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "yarn"])
def test_rope_scaling_from_config_runs_past_the_positions(rope_type):
    """transformers' test_model_rope_scaling_from_config, on the looped model: a short input and
    one of 1.5 x max_position_embeddings through the unscaled and the scaled model. Dynamic
    scaling leaves the short input alone (it rescales only past the positions); linear and yarn
    change both."""
    ids = torch.randint(3, TINY_VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    short = ids[:, :10]
    original = _model()
    scaled = _model(rope_parameters={"rope_type": rope_type, "factor": 10.0, "rope_theta": 10000.0})
    assert scaled.model.rotary_emb.rope_type == rope_type
    short_a, long_a = original(short).logits, original(ids).logits
    short_b, long_b = scaled(short).logits, scaled(ids).logits
    assert long_a.shape == long_b.shape == (1, 24, TINY_VOCAB) and torch.isfinite(long_b).all()
    if rope_type == "dynamic":
        torch.testing.assert_close(short_a, short_b, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(short_a, short_b, atol=1e-5)
    assert not torch.allclose(long_a, long_b, atol=1e-5)


@pytest.mark.parametrize("bad", [TINY_VOCAB, TINY_VOCAB + 30, -1])
@pytest.mark.parametrize("training", [False, True])
def test_a_token_id_outside_the_vocabulary_is_refused_naming_input_ids(bad, training):
    """Also ids in the padded rows (vocab_size <= id < padded_vocab_size), which the embedding has."""
    model = _model(pad_vocab_size_to_multiple_of=64).train(training)
    ids = torch.tensor([[3, 4, bad, 5]])
    with pytest.raises(ValueError, match=rf"^input_ids: token id {bad} is outside the vocabulary \[0, vocab_size=97\)"):
        model(ids, labels=ids)


def test_generate_may_run_past_the_positions_with_one_warning(caplog):
    from looped_hf.interface_looped import logger

    logger.warning_once.cache_clear()
    model = _model()
    prompt = torch.full((1, 10), 3)
    with caplog.at_level("WARNING"):
        out = model.generate(prompt, max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (1, 24) and len(_past_positions_warnings(caplog)) == 1
    # The cached decode equals greedy over full forwards (no cache) past the positions too.
    ids = prompt
    for _ in range(14):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)
    with pytest.raises(ValueError, match=r"input_ids: token id 97 is outside"):
        model.generate(torch.tensor([[3, 97]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


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
