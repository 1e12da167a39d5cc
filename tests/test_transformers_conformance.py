"""The looped model behaves like transformers 5.24's decoders (the conformance a user relies on).

Legacy and unknown keywords, tuples, full-graph compile with a static cache, hidden states and
attentions through transformers' output capturing, the standard heads, tensor parallelism, LoRA
on the injection adapter, tokenizer and recipe defaults, and the once-per-forward injection.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_without_looped_hf, tiny_looped_config
from test_modeling import VOCAB, greedy, prompts, tiny_model
from torch import nn
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    CompileConfig,
    StaticCache,
)

from looped_hf import (
    LoopedConfig,
    LoopedForCausalLM,
    LoopedForQuestionAnswering,
    LoopedForSequenceClassification,
    LoopedForTokenClassification,
)
from looped_hf.interface_looped import CACHE_RENAMED


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


# --------------------------------------------------------------------------------------------
# 1. Keywords: the old cache name is mapped, nothing else vanishes into **kwargs
# --------------------------------------------------------------------------------------------


def _old_cache_name_warning(match: str):
    """From transformers 5.20 ``past_key_values`` is the old name, mapped with Llama's FutureWarning;
    before 5.20 it is the name generate() itself passes every step, so it is mapped silently."""
    if CACHE_RENAMED:
        return pytest.warns(FutureWarning, match=match)
    return warnings.catch_warnings(action="error", category=FutureWarning)


def test_past_key_values_is_mapped_to_cache_with_llamas_warning_on_the_lm():
    model, ids = tiny_model(), prompts()
    full = model(ids).logits
    first = model(ids[:, :4], use_cache=True)
    with _old_cache_name_warning(r"`past_key_values` is deprecated.*Use `cache` instead"):
        rest = model(ids[:, 4:], past_key_values=first.cache)
    # The cache was used: positions continue at 4 and the logits are those of the full sequence.
    torch.testing.assert_close(rest.logits, full[:, 4:], rtol=1e-5, atol=1e-5)


def test_past_key_values_is_mapped_to_cache_with_llamas_warning_on_the_base_model():
    base, ids = tiny_model().model, prompts()
    full = base(ids).last_hidden_state
    first = base(ids[:, :4], use_cache=True)
    with _old_cache_name_warning(r"`past_key_values` is deprecated.*LoopedModel"):
        rest = base(ids[:, 4:], past_key_values=first.cache)
    torch.testing.assert_close(rest.last_hidden_state, full[:, 4:], rtol=1e-5, atol=1e-5)


# Keywords v4-era code or other architectures pass, which **kwargs would otherwise swallow.
REFUSED = {
    "cache_position": torch.arange(7),
    "token_type_ids": torch.zeros(2, 7, dtype=torch.long),
    "head_mask": torch.ones(4),
    "num_logits_to_keep": 1,
    "output_router_logits": True,
    "layer_past": (torch.zeros(1),),
    "encoder_hidden_states": torch.zeros(2, 3, 32),
    "use_cahce": False,  # a typo must not pass silently either
}


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_a_keyword_the_model_does_not_use_raises_naming_it(keyword):
    model, ids = tiny_model(), prompts()
    with pytest.raises(TypeError, match=rf"LoopedForCausalLM.forward\(\) got an unexpected keyword argument {keyword}="):
        model(ids, **{keyword: REFUSED[keyword]})
    with pytest.raises(TypeError, match=rf"LoopedModel.forward\(\) got an unexpected keyword argument {keyword}="):
        model.model(ids, **{keyword: REFUSED[keyword]})


def test_labels_on_the_base_model_raise():
    ids = prompts()
    with pytest.raises(TypeError, match="labels=.*no loss"):
        tiny_model().model(ids, labels=ids)


def test_unknown_keywords_set_to_none_ask_for_nothing_and_are_accepted():
    model, ids = tiny_model(), prompts()
    out = model(ids, cache_position=None, token_type_ids=None, head_mask=None)
    torch.testing.assert_close(out.logits, model(ids).logits, rtol=0, atol=0)


def test_num_items_in_batch_reaches_the_loss():
    model, ids = tiny_model(), prompts()
    mean = model(ids, labels=ids).loss
    summed = model(ids, labels=ids, num_items_in_batch=torch.tensor(3)).loss
    tokens = ids[:, 1:].numel()  # the loss shifts: one target fewer per row
    torch.testing.assert_close(summed, mean * tokens / 3)


def test_ignore_index_and_shift_labels_reach_the_loss():
    model, ids = tiny_model(), prompts()
    labels = ids.clone()
    labels[:, :4] = 7
    ignored = model(ids, labels=labels, ignore_index=7).loss
    masked = labels.clone()
    masked[:, :4] = -100
    torch.testing.assert_close(ignored, model(ids, labels=masked).loss)
    shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    torch.testing.assert_close(model(ids, shift_labels=shifted).loss, model(ids, labels=ids).loss)


def test_is_causal_false_reaches_the_attention():
    model, ids = tiny_model(), prompts()
    causal = model(ids).logits
    bidirectional = model(ids, is_causal=False).logits
    # Position 0 now sees the whole sequence; with the flag swallowed it would not change.
    assert not torch.allclose(causal[:, 0], bidirectional[:, 0], atol=1e-4)


def test_packed_sequences_with_restarting_positions_attend_within_their_document():
    # TRL's padding-free packing: one row, position_ids restart at each document. transformers
    # reads the documents from position_ids when there is no mask and no cache (training).
    model = tiny_model()
    a, b = prompts(batch=1, length=5, seed=3), prompts(batch=1, length=4, seed=4)
    positions = torch.cat([torch.arange(5), torch.arange(4)])[None]
    packed = model(torch.cat([a, b], dim=1), position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed[:, :5], model(a).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], model(b).logits, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# 2. return_dict=False
# --------------------------------------------------------------------------------------------


def test_return_dict_false_as_an_argument_gives_a_tuple():
    model, ids = tiny_model(), prompts()
    out = model(ids, labels=ids)
    loss, logits, cache = model(ids, labels=ids, return_dict=False)
    torch.testing.assert_close(loss, out.loss)
    torch.testing.assert_close(logits, out.logits)
    assert len(cache.layers) == model.config.num_hidden_layers
    hidden, _cache = model.model(ids, return_dict=False)
    torch.testing.assert_close(hidden, model.model(ids).last_hidden_state)


def test_return_dict_false_in_the_config_gives_a_tuple():
    model, ids = tiny_model(), prompts()
    expected = model(ids).logits
    model.config.return_dict = False
    out = model(ids, use_cache=False)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], expected)
    assert isinstance(model.model(ids, use_cache=False), tuple)
    # An explicit argument wins over the config, as in transformers' decorators.
    assert model(ids, return_dict=True).logits.shape == expected.shape


# --------------------------------------------------------------------------------------------
# 3. Full-graph compile at a fixed r, static caches
# --------------------------------------------------------------------------------------------


def _prefill_and_decode(forward, config: LoopedConfig, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    cache = StaticCache(config=config, max_cache_len=ids.shape[1] + steps)
    batch, length = ids.shape
    logits = [forward(input_ids=ids, cache=cache, position_ids=torch.arange(length).expand(batch, -1)).logits]
    for i in range(steps):
        pos = torch.full((batch, 1), length + i)
        logits.append(forward(input_ids=ids[:, i : i + 1], cache=cache, position_ids=pos).logits)
    return logits


# Every h_0 the config allows; the random ones at a retrofit's std (sqrt(2 / 5d)).
STATE_INIT_CASES = {"prelude": {}, "zeros": {"input_injection": "add"}, "noise": {"state_init_std": 0.1},
                    "truncated_normal": {"state_init_std": (2 / (5 * 32)) ** 0.5}}  # fmt: skip


@pytest.mark.parametrize("state_init", sorted(STATE_INIT_CASES))
def test_every_state_init_traces_in_one_graph(state_init):
    """h_0 is the one part of the forward that differs between state inits (``INITIAL_STATES``, chosen
    when the model is built), so each rule traced alone with fullgraph=True, against its eager draw,
    covers every init; the whole forward compiles below for the study's and a retrofit's."""
    from looped_hf.configuration_looped import STATE_INITS
    from looped_hf.recurrent_block_looped import INITIAL_STATES

    assert set(STATE_INIT_CASES) == set(STATE_INITS) == set(INITIAL_STATES)
    config = tiny_looped_config(state_init=state_init, embedding_multiplier=2.0, **STATE_INIT_CASES[state_init])
    e = torch.randn(2, 5, config.hidden_size)
    torch._dynamo.reset()
    rule = torch.compile(INITIAL_STATES[state_init], fullgraph=True, backend="eager")
    torch.manual_seed(0)
    graphed = rule(config, e)
    torch.manual_seed(0)
    torch.testing.assert_close(graphed, INITIAL_STATES[state_init](config, e), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("state_init", ["prelude", "truncated_normal"])
def test_forward_compiles_with_fullgraph_and_a_static_cache(state_init):
    # truncated_normal: a retrofit's default h_0, drawn anew at every forward (seeded alike for the
    # eager and the compiled run: the eager backend draws in the same order), at a cheaper shape.
    cheap = {} if state_init == "prelude" else {"num_recurrences": 2}
    model = tiny_model(state_init=state_init, **STATE_INIT_CASES[state_init], **cheap)
    ids, steps = prompts(), 3 if state_init == "prelude" else 1
    assert type(model)._can_compile_fullgraph
    with torch.no_grad():
        torch.manual_seed(0)
        eager = _prefill_and_decode(model, model.config, ids, steps)
        torch._dynamo.reset()
        # fullgraph=True raises on any graph break; the eager backend traces without codegen.
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.manual_seed(0)
        graphed = _prefill_and_decode(compiled, model.config, ids, steps)
    torch._dynamo.reset()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_the_cache_r_check_never_reads_the_cache_length_at_a_fixed_r(monkeypatch):
    from looped_hf.generation_looped import _check_cache_recurrences

    model, ids = tiny_model(), prompts()
    cache = StaticCache(config=model.config, max_cache_len=16)
    model(ids, cache=cache, position_ids=torch.arange(7).expand(2, -1))
    reads = []
    real = cache.get_seq_length
    monkeypatch.setattr(cache, "get_seq_length", lambda *a, **k: reads.append(1) or real(*a, **k))
    _check_cache_recurrences(cache, model.config.num_recurrences)  # same r: a Python attribute check
    assert reads == []
    # Only another r reads it, to tell a filled cache (refused) from an emptied one (reusable).
    with pytest.raises(ValueError, match="num_recurrences=2, but this cache was filled at num_recurrences=3"):
        _check_cache_recurrences(cache, 2)
    assert reads == [1]
    cache.reset()
    _check_cache_recurrences(cache, 2)
    assert cache.looped_num_recurrences == 2


@pytest.mark.parametrize("state_init", ["prelude", "truncated_normal"])
def test_static_cache_generation_equals_dynamic_and_compiles_where_asked(state_init):
    # truncated_normal: a retrofit's default h_0, drawn anew at every step, so each run is seeded alike.
    model, ids = tiny_model(state_init=state_init, **STATE_INIT_CASES[state_init]), prompts()

    def seeded(*args, **kwargs):
        torch.manual_seed(0)
        return greedy(*args, **kwargs)

    dynamic = seeded(model, ids)
    assert torch.equal(seeded(model, ids, cache_implementation="static"), dynamic)
    # transformers compiles the decoding steps on GPU by itself; on CPU only when told to.
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = seeded(model, ids, cache_implementation="static", compile_config=config)
    torch._dynamo.reset()
    assert torch.equal(compiled, dynamic)
    # generate() reuses (and resets) its static cache: another r may run in it when it fits.
    assert torch.equal(seeded(model, ids, cache_implementation="static", num_recurrences=2),
                       seeded(model, ids, num_recurrences=2))  # fmt: skip


def test_growing_past_a_static_cache_keeps_its_clear_error():
    model, ids = tiny_model(num_recurrences=3), prompts()
    with pytest.raises(ValueError, match=r"cache has 8 slots but this call needs 12.*largest r"):
        greedy(model, ids, cache_implementation="static", num_recurrences=5)
    # A refused call leaves the cache as it was: it still decodes at the r it was filled at.
    cache = StaticCache(config=model.config, max_cache_len=16)
    model(ids, cache=cache, position_ids=torch.arange(7).expand(2, -1))
    with pytest.raises(ValueError, match="needs 12"):
        model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 7), num_recurrences=5)
    step = model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 7)).logits
    full = model(torch.cat([ids, ids[:, :1]], dim=1)).logits[:, -1:]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# 4. Hidden states and attentions through transformers' output capturing
# --------------------------------------------------------------------------------------------


def _applications(model: LoopedForCausalLM, ids: torch.Tensor, **kwargs) -> tuple[list, list]:
    """Every layer application's (input, output), in execution order, by hooks."""
    inputs, outputs = [], []
    base = model.model
    layers = [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers]

    def record(module, args, out) -> None:
        inputs.append(args[0])
        outputs.append(out[0])

    hooks = [layer.register_forward_hook(record) for layer in layers]
    try:
        with torch.no_grad():
            model(ids, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs, outputs


@pytest.mark.parametrize("r", [3, 5])
def test_hidden_states_are_one_per_layer_application_in_execution_order(r):
    model, ids = tiny_model(num_recurrences=3), prompts()
    inputs, outputs = _applications(model, ids, num_recurrences=r)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, num_recurrences=r)
    cfg = model.config
    assert len(out.hidden_states) == cfg.num_layer_applications(r) + 1 == len(outputs) + 1
    torch.testing.assert_close(out.hidden_states[0], inputs[0], rtol=0, atol=0)
    for i, output in enumerate(outputs[:-1]):
        torch.testing.assert_close(out.hidden_states[i + 1], output, rtol=0, atol=0)
    # As for Llama, the last entry is the final normed state.
    torch.testing.assert_close(out.hidden_states[-1], model.model.norm(outputs[-1]), rtol=0, atol=0)
    # The documented index of recurrence s, block layer j: P + s*K + j + 1.
    P, K = cfg.num_prelude_layers, cfg.num_recurrent_layers
    s, j = r - 1, 1
    torch.testing.assert_close(out.hidden_states[P + s * K + j + 1], outputs[P + s * K + j], rtol=0, atol=0)


def test_selecting_hidden_states_counts_negative_indices_at_the_calls_r():
    model, ids = tiny_model(num_recurrences=3), prompts()
    with torch.no_grad():
        every = model(ids, output_hidden_states=True, num_recurrences=5).hidden_states
        picked = model(ids, output_hidden_states=[0, -2, -1], num_recurrences=5).hidden_states
        as_tuple = model(ids, output_hidden_states=[0, -1], num_recurrences=5, use_cache=False, return_dict=False)
    assert len(picked) == len(every)
    torch.testing.assert_close(as_tuple[1][-1], every[-1], rtol=0, atol=0)
    assert as_tuple[1][1] is None
    for i, state in enumerate(picked):
        if i in (0, len(every) - 2, len(every) - 1):
            torch.testing.assert_close(state, every[i], rtol=0, atol=0)
        else:
            assert state is None


def test_attentions_are_one_per_layer_application_with_eager_attention():
    model, ids = tiny_model(), prompts()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True, num_recurrences=4)
    assert len(out.attentions) == model.config.num_layer_applications(4)
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 7, 7)
    # Causal rows of a softmax: each sums to one and nothing attends to the future.
    torch.testing.assert_close(out.attentions[3].sum(-1), torch.ones(2, 4, 7))
    assert out.attentions[3].triu(1).abs().max() == 0


# --------------------------------------------------------------------------------------------
# 5. The standard heads
# --------------------------------------------------------------------------------------------

HEADS = {
    "sequence": (LoopedForSequenceClassification, AutoModelForSequenceClassification),
    "token": (LoopedForTokenClassification, AutoModelForTokenClassification),
    "qa": (LoopedForQuestionAnswering, AutoModelForQuestionAnswering),
}


def _head_inputs(kind: str, ids: torch.Tensor) -> dict:
    if kind == "sequence":
        return {"labels": torch.tensor([0, 2])}
    if kind == "token":
        return {"labels": torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(0))}
    return {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 5])}


# The designs whose trunks differ in what the heads could leave untrained: the study's, and a gated
# one (Ouro-like: the whole stack loops under the final norm, with an exit gate the heads never read).
HEAD_DESIGNS = {
    "study": {},
    "ouro_like": dict(norm_placement="pre_and_output", num_prelude_layers=0, num_coda_layers=0,
                      input_injection="none", recurrence_norm_weight="final", embedding_norm=False, exit_gate=True),
}  # fmt: skip


@pytest.mark.parametrize("design", sorted(HEAD_DESIGNS))
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_head_forward_loss_and_save_load(kind, design, tmp_path):
    head_cls, auto_cls = HEADS[kind]
    torch.manual_seed(0)
    lm = tiny_model(**HEAD_DESIGNS[design])
    lm.save_pretrained(tmp_path / "lm")
    # A causal-LM checkpoint loads into the head (the trunk's weights, a new head), as for Llama.
    model = auto_cls.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    assert type(model) is head_cls
    torch.testing.assert_close(model.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    ids = prompts()
    out = model(ids, **_head_inputs(kind, ids))
    assert out.loss is not None and torch.isfinite(out.loss)
    if kind == "sequence":
        assert out.logits.shape == (2, 3)
    elif kind == "token":
        assert out.logits.shape == (2, 7, 3)
    else:
        assert out.start_logits.shape == out.end_logits.shape == (2, 7)
    out.loss.backward()
    # Every parameter trains (transformers' common training tests): a gated config's head has no
    # gate, which it would never read.
    untrained = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert untrained == []
    assert model.model.exit_gate is None
    with pytest.raises(TypeError, match="token_type_ids"):  # the trunk refuses what it would ignore
        model(ids, token_type_ids=torch.zeros_like(ids))
    model.save_pretrained(tmp_path / kind)
    auto_map = json.loads((tmp_path / kind / "config.json").read_text())["auto_map"]
    assert auto_map[auto_cls.__name__] == f"modeling_looped.{head_cls.__name__}"
    again = auto_cls.from_pretrained(tmp_path / kind).eval()
    model.eval()
    with torch.no_grad():
        for a, b in zip(model(ids, use_cache=False, return_dict=False), again(ids, use_cache=False, return_dict=False)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The trunk's r applies to the heads too.
    with torch.no_grad():
        assert not torch.allclose(model(ids, return_dict=False)[0], model(ids, num_recurrences=6, return_dict=False)[0])


@pytest.mark.parametrize("design", sorted(HEAD_DESIGNS))
@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_parameter_of_a_head_trains_under_gradient_checkpointing(kind, design):
    # transformers' test_training_gradient_checkpointing: with checkpointed layers, in train mode,
    # the loss reaches every parameter, and the gradients are those of the plain backward.
    head_cls, _ = HEADS[kind]
    torch.manual_seed(0)
    model = head_cls(tiny_looped_config(num_labels=3, **HEAD_DESIGNS[design])).train()
    ids = prompts()
    inputs = _head_inputs(kind, ids)
    if hasattr(model, "dropout"):
        model.dropout.p = 0.0  # the token head's dropout would draw differently in the two passes
    model(ids, **inputs).loss.backward()
    plain = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name (the old one warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.gradient_checkpointing
    model(ids, use_cache=False, **inputs).loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert [name for name, g in grads.items() if g is None] == []
    assert set(grads) == set(plain)
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_causal_lm_checkpoint_loads_into_a_head_as_remote_code(tmp_path):
    model = tiny_model()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    auto_map = json.loads((ckpt / "config.json").read_text())["auto_map"]
    assert set(auto_map) >= {"AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                             "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"}  # fmt: skip
    script = f"""
        import torch
        from transformers import AutoModelForSequenceClassification
        model = AutoModelForSequenceClassification.from_pretrained({str(ckpt)!r}, trust_remote_code=True, num_labels=3)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        out = model(torch.tensor([[5, 6, 7]]), labels=torch.tensor([1]))
        assert out.logits.shape == (1, 3) and torch.isfinite(out.loss)
        print("REMOTE-HEAD-OK")
        """
    assert "REMOTE-HEAD-OK" in run_without_looped_hf(script, tmp_path)


# --------------------------------------------------------------------------------------------
# 6. Tensor parallelism
# --------------------------------------------------------------------------------------------


def test_tensor_parallel_plan_names_every_layer_list_and_only_modules_that_exist():
    for act in ("relu2", "silu"):
        model = tiny_model(hidden_act=act)
        names = {name for name, _ in model.named_modules()}
        plan = model.tp_plan
        assert plan["lm_head"] == "colwise_gather_output"
        for stack in ("prelude_layers", "recurrent_layers", "coda_layers"):
            assert plan[f"model.{stack}.*.self_attn.q_proj"] == "colwise"
            assert plan[f"model.{stack}.*.mlp.down_proj"] == "rowwise"
        for pattern in plan:
            regex = pattern.replace(".", r"\.").replace("*", r"\d+")
            assert any(re.fullmatch(regex, n) for n in names), pattern
        assert not any("injection" in p for p in plan)  # replicated: it reads the full state


def _invalid_tp_entries(model) -> set[str]:
    """transformers' ``test_tp_plan_matches_params`` rule: every plan entry must match a parameter."""
    params = [name for name, _ in model.named_parameters()]
    bad = set()
    for pattern in model.config.base_model_tp_plan:
        regex = pattern.replace(".", r"\.").replace("*", r"\d+")
        if not any(re.search(regex, name) for name in params):
            bad.add(pattern)
    return bad


@pytest.mark.parametrize(
    "layers", [{"num_prelude_layers": 0, "num_recurrent_layers": 1, "num_coda_layers": 0, "num_recurrences": 2},
               {"num_prelude_layers": 1, "num_recurrent_layers": 1, "num_coda_layers": 0},
               {"num_prelude_layers": 0, "num_recurrent_layers": 2, "num_coda_layers": 1}],
)  # fmt: skip
def test_tensor_parallel_plan_names_only_the_layer_lists_the_model_has(layers: dict) -> None:
    model = tiny_model(**layers)
    assert _invalid_tp_entries(model) == set()
    stacks = {key.split(".")[0] for key in model.config.base_model_tp_plan}
    expected = {name for name in ("prelude", "recurrent", "coda") if layers[f"num_{name}_layers"]}
    assert stacks == {f"{name}_layers" for name in expected}


def test_tensor_parallel_plan_follows_layer_counts_changed_at_load(tmp_path) -> None:
    tiny_model().save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path, num_coda_layers=0, num_prelude_layers=0)
    assert model.config.num_coda_layers == 0 and len(model.model.coda_layers) == 0
    assert _invalid_tp_entries(model) == set()
    assert not any(key.startswith(("coda_layers", "prelude_layers")) for key in model.config.base_model_tp_plan)


TP_SCRIPT = """
import os, sys, torch
import torch.distributed as dist
torch.set_num_threads(1)
import looped_hf  # noqa: F401
from transformers import AutoModelForCausalLM
ckpt = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(ckpt, tp_plan="auto").eval()
ref = torch.load(os.path.join(ckpt, "ref.pt"))
q = model.model.recurrent_layers[0].self_attn.q_proj.weight
assert type(q).__name__ == "DTensor" and q.to_local().shape[0] == q.shape[0] // 2, (type(q), q.shape)
with torch.no_grad():
    torch.testing.assert_close(model(ref["ids"]).logits, ref["logits"], rtol=1e-5, atol=1e-5)
gen = model.generate(ref["ids"], max_new_tokens=4, do_sample=False, pad_token_id=0)
assert torch.equal(gen, ref["gen"])
print(f"TP-OK rank {dist.get_rank()}")
"""


@pytest.mark.slow  # several processes: minutes on a busy 2-core machine; CI runs it
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_tensor_parallel_from_pretrained_on_two_cpu_processes(tmp_path):
    # The head's rows padded to a multiple of the TP size: transformers < 5.20 shards a gathered
    # colwise head only then (the vocabulary, 97, is odd); the logits keep vocab_size columns.
    model = tiny_model(pad_vocab_size_to_multiple_of=2)
    model.save_pretrained(tmp_path / "ckpt")
    ids = prompts()
    ref = {"ids": ids, "logits": model(ids).logits.detach(),
           "gen": model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)}  # fmt: skip
    torch.save(ref, tmp_path / "ckpt" / "ref.pt")
    (tmp_path / "tp.py").write_text(TP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "tp.py"), str(tmp_path / "ckpt")]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("TP-OK") == 2, result.stdout


# --------------------------------------------------------------------------------------------
# 7. LoRA on the injection adapter (and the shared block)
# --------------------------------------------------------------------------------------------


def test_lora_can_target_the_injection_adapter_and_the_shared_block():
    peft = pytest.importorskip("peft")
    model, ids = tiny_model(), prompts()
    base_logits = model(ids).logits.detach()
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["injection", "q_proj", "v_proj"])
    lora = peft.get_peft_model(model, config)
    injection = lora.base_model.model.model.injection
    assert isinstance(injection, peft.tuners.lora.LoraLayer)
    # B starts at zero: the adapted model is the base model until it trains.
    torch.testing.assert_close(lora(ids).logits, base_logits, rtol=0, atol=1e-6)
    lora.train()
    lora(input_ids=ids, labels=ids).loss.backward()
    trainable = {name for name, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert injection.lora_B["default"].weight.grad.abs().sum() > 0  # the injection's adapter trains
    with torch.no_grad():
        injection.lora_B["default"].weight.normal_()
    lora.eval()
    assert not torch.allclose(lora(ids).logits, base_logits, atol=1e-4)  # and it is applied


# --------------------------------------------------------------------------------------------
# 8. Tokenizer and recipe defaults
# --------------------------------------------------------------------------------------------


def test_the_saved_tokenizer_pads_on_the_left(tmp_path):
    from transformers import AutoTokenizer

    from looped_hf.data import load_tokenizer

    tok = load_tokenizer("bytes")
    assert tok.padding_side == "left"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.padding_side == "left"
    batch = again(["a long prompt", "hi"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0 and batch["attention_mask"][1, -1] == 1
    assert "token_type_ids" not in batch  # nothing the model would refuse


def test_recipes_do_not_tie_max_position_embeddings_to_seq_len():
    from looped_hf.arguments import ModelArguments

    args = ModelArguments({"hidden_size": 32, "num_attention_heads": 4})
    assert args.to_config(vocab_size=VOCAB, seq_len=64).max_position_embeddings == 2048
    assert args.to_config(vocab_size=VOCAB, seq_len=4096).max_position_embeddings == 4096
    explicit = ModelArguments({"hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 512})
    assert explicit.to_config(vocab_size=VOCAB, seq_len=64).max_position_embeddings == 512


# --------------------------------------------------------------------------------------------
# 9. The linear injection computed once per forward equals the concatenated form
# --------------------------------------------------------------------------------------------


class _WrappedLinear(nn.Linear):
    """Not exactly nn.Linear, as an adapter wrapper is: the model must call it on [e; h]."""


@pytest.mark.parametrize("looped_format", [1, 2])
def test_the_injection_split_equals_the_concatenated_adapter(looped_format):
    ids = prompts()
    fast = tiny_model(looped_format=looped_format).train()
    slow = tiny_model(looped_format=looped_format).train()
    wrapped = _WrappedLinear(2 * fast.config.hidden_size, fast.config.hidden_size, bias=False)
    wrapped.weight = slow.model.injection.weight
    slow.model.injection = wrapped
    calls = []
    wrapped.register_forward_hook(lambda m, a, out: calls.append(a[0].shape))
    loss_fast = fast(ids, labels=ids).loss
    loss_slow = slow(ids, labels=ids).loss
    assert len(calls) == fast.config.num_recurrences  # the wrapper ran once per recurrence
    torch.testing.assert_close(loss_fast, loss_slow, rtol=1e-6, atol=1e-6)
    loss_fast.backward()
    loss_slow.backward()
    for (name, a), b in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_declared_transformers_range_is_the_one_the_model_supports():
    from looped_hf.interface_looped import SUPPORTED_TRANSFORMERS

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.findall(r'"(transformers[<>=!~].*?)"', pyproject) == [f"transformers{SUPPORTED_TRANSFORMERS}"]
