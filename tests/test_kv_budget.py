"""KV budget (test-time compute): only k recurrence slots in the cache, the study's engine.

Recurrence i's block layer j uses slot P + (i mod k)*K + j (kschwethelm/looped-lm-scaling,
nanochat/gpt.py ``_get_kv_layer_idx``); a slot keeps its last writer's KV. The references below are
built from the default model (every recurrence keeping its slots), never from the budget code.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_config, tiny_looped_model
from transformers import DynamicCache, StaticCache

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.generation_looped import KVSlotPlan
from looped_hf.interface_looped import CACHE_KEYWORD

VOCAB = TINY_VOCAB
P, K, C, R = 1, 2, 1, 4


def tiny_config(**overrides) -> LoopedConfig:
    return tiny_looped_config(**{"num_recurrences": R, "eos_token_id": None, **overrides})


def tiny_model(seed: int = 0, **overrides) -> LoopedForCausalLM:
    # Larger injection / lane noise than elsewhere: a slot holding the wrong recurrence's KV must
    # change the logits visibly.
    return tiny_looped_model(seed, noise=0.3, **{"num_recurrences": R, "eos_token_id": None, **overrides})


def prompts(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def greedy(model: LoopedForCausalLM, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **kwargs)


def last_writer(i: int, k: int, r: int) -> int:
    """The last recurrence that writes slot (i mod k): the KV a budget-k slot ends up holding."""
    return max(step for step in range(r) if step % k == i % k)


def budget_slot_to_full_slot(slot: int, k: int, r: int) -> int:
    """Which slot of a full (no budget) cache holds the same KV as ``slot`` of a budget-k cache."""
    if slot < P:
        return slot
    if slot < P + k * K:
        i, j = divmod(slot - P, K)
        return P + last_writer(i, k, r) * K + j
    return slot - P - k * K + P + r * K


# --------------------------------------------------------------------------------------------
# k >= r is the default, exactly
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [R, R + 3])
def test_budget_of_r_or_more_equals_the_default(k):
    model, ids = tiny_model(), prompts()
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        out = model(ids, use_cache=True, kv_budget=k)
        assert torch.equal(out.logits, ref.logits)
        assert len(out.cache.layers) == len(ref.cache.layers) == P + R * K + C
        step = ids[:, :1]
        ref_step = model(step, cache=ref.cache).logits
        out_step = model(step, cache=out.cache, kv_budget=k).logits
    assert torch.equal(out_step, ref_step)
    assert torch.equal(greedy(model, ids, kv_budget=k), greedy(model, ids))
    model.config.kv_budget = k
    assert torch.equal(greedy(model, ids), greedy(model, ids, kv_budget=None))


# --------------------------------------------------------------------------------------------
# k < r: slot count, the prefill cache, and a decode step against a hand-built reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prefill_keeps_each_slots_last_writer(k):
    """A prefill attends to its own fresh KV at every recurrence, so its logits are the default's,
    and slot P + (i mod k)*K + j holds the KV of the last recurrence congruent to i mod k."""
    model, ids = tiny_model(), prompts()
    with torch.no_grad():
        full = model(ids, use_cache=True)
        out = model(ids, use_cache=True, kv_budget=k)
    assert torch.equal(out.logits, full.logits)
    assert len(out.cache.layers) == model.config.num_kv_slots(kv_budget=k) == P + k * K + C
    for slot, layer in enumerate(out.cache.layers):
        ref = full.cache.layers[budget_slot_to_full_slot(slot, k, R)]
        assert layer.keys.shape[-2] == ids.shape[1]
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


def test_budget_one_single_token_cache_holds_the_last_recurrence():
    """The brief's property: k = 1, a one-token prompt: the recurrence slots hold exactly the KV of
    the last recurrence (and a cache-free reference at r confirms the logits)."""
    model, ids = tiny_model(), prompts(batch=1, length=1)
    with torch.no_grad():
        full = model(ids, use_cache=True)
        out = model(ids, use_cache=True, kv_budget=1)
        no_cache = model(ids, use_cache=False).logits
    assert torch.equal(out.logits, no_cache)
    for j in range(K):
        assert torch.equal(out.cache.layers[P + j].keys, full.cache.layers[P + (R - 1) * K + j].keys)
        assert torch.equal(out.cache.layers[P + j].values, full.cache.layers[P + (R - 1) * K + j].values)


def remapped_full_cache(full: DynamicCache, k: int, r: int) -> DynamicCache:
    """A default-layout cache whose recurrence-i slots hold the prefill KV of recurrence
    last_writer(i): decoding on it with the default model is the budget semantics by hand."""
    cache = DynamicCache()
    for slot in range(P + r * K + C):
        if P <= slot < P + r * K:
            i, j = divmod(slot - P, K)
            source = full.layers[P + last_writer(i, k, r) * K + j]
        else:
            source = full.layers[slot]
        cache.update(source.keys.clone(), source.values.clone(), slot)
    return cache


@pytest.mark.parametrize("k", [1, 2, 3])
def test_decode_attends_to_each_slots_last_writer(k):
    model, ids = tiny_model(), prompts()
    nxt = prompts(length=2, seed=5)
    with torch.no_grad():
        full = model(ids, use_cache=True)
        reference = model(nxt, cache=remapped_full_cache(full.cache, k, R)).logits
        out = model(ids, use_cache=True, kv_budget=k)
        decoded = model(nxt, cache=out.cache, kv_budget=k).logits
        default = model(nxt, cache=full.cache).logits
    torch.testing.assert_close(decoded, reference, rtol=1e-5, atol=1e-5)
    assert len(out.cache.layers) == P + k * K + C
    assert all(layer.keys.shape[-2] == ids.shape[1] + 2 for layer in out.cache.layers)
    # The budget really changes what a later token sees.
    assert not torch.allclose(decoded, default, atol=1e-4)


@pytest.mark.parametrize("k", [1, 2])
def test_generate_with_a_budget_matches_step_by_step_decoding(k):
    model, ids = tiny_model(), prompts()
    out = greedy(model, ids, kv_budget=k, return_dict_in_generate=True)
    # transformers' own GenerateDecoderOnlyOutput: its cache field is past_key_values before 5.20
    assert len(getattr(out, CACHE_KEYWORD).layers) == P + k * K + C
    # Greedy by hand: prefill then one token at a time with the same budget.
    with torch.no_grad():
        step = model(ids, use_cache=True, kv_budget=k)
        tokens = [step.logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(5):
            step = model(tokens[-1], cache=step.cache, kv_budget=k)
            tokens.append(step.logits[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(out.sequences[:, ids.shape[1] :], torch.cat(tokens, dim=1))
    model.config.kv_budget = k
    assert torch.equal(greedy(model, ids), out.sequences)


def test_static_cache_with_a_budget_equals_the_dynamic_one():
    model, ids = tiny_model(), prompts()
    with torch.no_grad():
        dynamic = model(ids, use_cache=True, kv_budget=2)
        static_cache = StaticCache(config=model.config, max_cache_len=16)
        assert len(static_cache.layers) == P + R * K + C  # sized from num_hidden_layers
        static = model(ids, cache=static_cache, kv_budget=2)
        assert len(static_cache.layers) == P + 2 * K + C  # unwritten slots dropped
        torch.testing.assert_close(static.logits, dynamic.logits)
        for i in range(3):
            tok = ids[:, i : i + 1]
            torch.testing.assert_close(
                model(tok, cache=static_cache, kv_budget=2).logits,
                model(tok, cache=dynamic.cache, kv_budget=2).logits, rtol=1e-5, atol=1e-5,
            )  # fmt: skip
    assert torch.equal(
        greedy(model, ids, kv_budget=2, cache_implementation="static"), greedy(model, ids, kv_budget=2)
    )


def test_a_budget_lets_a_static_cache_run_more_recurrences():
    """P + k*K + C slots fit in a cache sized for the default r even at a larger r."""
    model, ids = tiny_model(), prompts()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        out = model(ids, cache=cache, num_recurrences=2 * R, kv_budget=2)
        ref = model(ids, use_cache=True, num_recurrences=2 * R, kv_budget=2)
    torch.testing.assert_close(out.logits, ref.logits)
    assert len(cache.layers) == P + 2 * K + C


def test_hyperconnection_model_takes_a_budget():
    model, ids = tiny_model(input_injection="hyperconnection"), prompts()
    nxt = prompts(length=1, seed=5)
    assert torch.equal(greedy(model, ids, kv_budget=R), greedy(model, ids))
    with torch.no_grad():
        full = model(ids, use_cache=True)
        reference = model(nxt, cache=remapped_full_cache(full.cache, 2, R)).logits
        out = model(ids, use_cache=True, kv_budget=2)
        decoded = model(nxt, cache=out.cache, kv_budget=2).logits
    torch.testing.assert_close(decoded, reference, rtol=1e-5, atol=1e-5)


def test_forward_compiles_with_a_budget_and_a_static_cache():
    model, ids = tiny_model(), prompts()

    def run(forward) -> list[torch.Tensor]:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        logits = [forward(input_ids=ids, cache=cache, position_ids=pos, kv_budget=2).logits]
        for i in range(2):
            pos = torch.full((ids.shape[0], 1), ids.shape[1] + i)
            logits.append(forward(input_ids=ids[:, i : i + 1], cache=cache, position_ids=pos, kv_budget=2).logits)
        return logits

    with torch.no_grad():
        eager = run(model)
        torch._dynamo.reset()
        graphed = run(torch.compile(model, fullgraph=True, backend="eager"))
    torch._dynamo.reset()
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_budget", [None, 1], ids=["plain", "kv_budget_1"])
def test_generate_compiles_its_decoding_steps_with_a_static_cache_and_a_budget(kv_budget):
    """transformers' compiled decoding (a static cache and ``compile_config``: on a GPU
    ``mode="reduce-overhead"``, CUDA graphs) runs the looped forward, under a KV budget too, as
    one graph per shape, and decodes exactly what eager decoding does."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, ids = tiny_model(), prompts(batch=1)
    model.config.use_cache = True
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # transformers compiles on a CPU only when told
    with torch.no_grad():
        plain = greedy(model, ids, kv_budget=kv_budget)
        torch._dynamo.reset()
        counters.clear()
        compiled = greedy(model, ids, kv_budget=kv_budget, cache_implementation="static", compile_config=config)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    assert torch.equal(compiled, plain)
    assert graphs >= 1 and breaks == 0


# --------------------------------------------------------------------------------------------
# The budget is fixed for the life of a cache; bad values are refused by name
# --------------------------------------------------------------------------------------------


def test_the_budget_must_stay_fixed_for_the_life_of_a_cache():
    model, ids = tiny_model(), prompts()
    with torch.no_grad():
        out = model(ids, use_cache=True, kv_budget=1)
        with pytest.raises(ValueError, match=r"kv_budget=2, but this cache was filled at kv_budget=1"):
            model(ids[:, :1], cache=out.cache, kv_budget=2)
        full = model(ids, use_cache=True)
        with pytest.raises(ValueError, match=rf"kv_budget=1, but this cache was filled at kv_budget={R}"):
            model(ids[:, :1], cache=full.cache, kv_budget=1)
        # Budgets of r and more are the same layout: allowed on the same cache.
        model(ids[:, :1], cache=full.cache, kv_budget=R + 5)
        # An emptied cache can be reused at another budget. transformers < 5.18's DynamicCache.reset()
        # zeroes its KV but keeps its length: not emptied, so it keeps its budget.
        out.cache.reset()
        if out.cache.get_seq_length() > 0:
            with pytest.raises(ValueError, match=r"kv_budget=3, but this cache was filled at kv_budget=1"):
                model(ids, cache=out.cache, kv_budget=3)
            return
        model(ids, cache=out.cache, kv_budget=3)
    assert out.cache.looped_kv_budget == 3


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_bad_budget_in_the_config_names_the_field(bad):
    with pytest.raises(ValueError, match=rf"LoopedConfig\.kv_budget={bad!r}"):
        tiny_config(kv_budget=bad)


@pytest.mark.parametrize("bad", [0, True, "2"])
def test_bad_budget_per_call_names_the_keyword(bad):
    model, ids = tiny_model(), prompts()
    with pytest.raises(ValueError, match=rf"kv_budget={bad!r}"):
        model(ids, kv_budget=bad)


def test_budget_survives_save_and_load(tmp_path):
    model = tiny_model(kv_budget=2)
    model.save_pretrained(tmp_path)
    loaded = LoopedForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.kv_budget == 2
    assert loaded.config.num_hidden_layers == P + R * K + C  # compute depth, not the cache's
    ids = prompts()
    assert torch.equal(greedy(loaded.eval(), ids), greedy(model, ids, kv_budget=2))


# --------------------------------------------------------------------------------------------
# The slot plan: the one layout the model, generation and the vLLM model share
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, k_layers, c, r, k", [(1, 2, 1, 4, None), (1, 2, 1, 4, 1), (2, 3, 0, 5, 2), (0, 1, 2, 3, 7)])
def test_the_slot_plan_is_the_studys_layout_and_knows_its_overwritten_recurrences(p, k_layers, c, r, k):
    """Slots written in forward order: prelude j -> j, block (i, j) -> P + (i mod k)*K + j, coda j ->
    P + k*K + j; each slot's last writer is what a cache keeps, and a recurrence is "overwritten"
    exactly when a later one of the same forward writes its slots again."""
    config = tiny_looped_config(num_prelude_layers=p, num_recurrent_layers=k_layers, num_coda_layers=c, num_recurrences=r)
    plan = KVSlotPlan.for_call(config, kv_budget=k)
    kk = r if k is None else min(k, r)
    apps = list(plan.applications())
    assert len(apps) == config.num_layer_applications() and plan.num_slots == p + kk * k_layers + c
    assert {slot for *_, slot in apps} == set(range(plan.num_slots))
    last = {}
    for stack, step, j, slot in apps:
        want = {"prelude": j, "recurrent": p + (step % kk) * k_layers + j, "coda": p + kk * k_layers + j}[stack]
        assert slot == want
        last[slot] = (stack, step)
        if stack == "recurrent":
            assert plan.layer_of_slot(slot) == j
    for step in range(r):
        rewritten = any(s > step and s % kk == step % kk for s in range(r))
        assert plan.overwritten(step) == rewritten
        assert all(last[plan.block(step, j)] == ("recurrent", step) for j in range(k_layers)) == (not rewritten)
    assert plan.shares_slots == (kk < r)
