"""Per-token adaptive exit (test-time compute): a token stops recurring once its criterion fires.

The references are built without the exit code: fixed-r forwards, the states of a forward that
runs every recurrence (``output_recurrent_states``) decoded by ``logit_lens``, and token-by-token
decoding through a cache.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_VOCAB, tiny_looped_config, tiny_looped_model
from test_logit_lens import with_random_norms
from transformers import DynamicCache

from looped_hf import LoopedConfig, LoopedForCausalLM, LoopedModel
from looped_hf.configuration_looped import EXIT_CRITERIA, EXIT_DEFAULT_THRESHOLDS

R = 5
P, K = 1, 2


def model_(seed: int = 0, **overrides) -> LoopedForCausalLM:
    # Additive injection with the study's init: the state keeps moving for several recurrences and
    # then settles, so thresholds between the two stop different tokens at different recurrences.
    return tiny_looped_model(
        seed, **{"num_recurrences": R, "input_injection": "add", "init_scheme": "study", "eos_token_id": None,
                 **overrides}
    )  # fmt: skip


def ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


NEVER = {"argmax_stability": 10**6}  # every other criterion fires on value < threshold, values >= 0
# The largest threshold each criterion accepts (a cosine distance is at most 2; inf is refused).
ALWAYS = {"argmax_stability": 0, "cosine": 2.0}


def never(criterion: str) -> float:
    return NEVER.get(criterion, 0.0)


def always(criterion: str) -> float:
    return ALWAYS.get(criterion, 1e30)


# --------------------------------------------------------------------------------------------
# The two ends: a threshold that never fires is fixed r; one that always fires is r = minimum
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("criterion", EXIT_CRITERIA)
def test_a_threshold_that_never_fires_is_the_fixed_r_forward(criterion: str) -> None:
    model, x = model_(), ids()
    with torch.no_grad():
        ref = model(x).logits
        out = model(x, exit_criterion=criterion, exit_threshold=never(criterion))
    assert torch.equal(out.logits, ref)
    assert out.recurrences_used.shape == x.shape and bool((out.recurrences_used == R).all())


@pytest.mark.parametrize("criterion", EXIT_CRITERIA)
@pytest.mark.parametrize("minimum", [1, 2, 4])
def test_a_threshold_that_always_fires_stops_every_token_at_min_recurrences(criterion: str, minimum: int) -> None:
    model, x = model_(), ids()
    with torch.no_grad():
        ref = model(x, num_recurrences=minimum).logits
        out = model(x, exit_criterion=criterion, exit_threshold=always(criterion), min_recurrences=minimum)
    assert torch.equal(out.logits, ref)
    assert bool((out.recurrences_used == minimum).all())


def test_generate_with_a_never_firing_threshold_is_plain_greedy() -> None:
    model, x = model_(), ids()
    plain = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0)
    out = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0, exit_criterion="kl",
                         exit_threshold=0.0, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, plain)
    assert out.recurrences_used.shape == (2, 8) and bool((out.recurrences_used == R).all())


# --------------------------------------------------------------------------------------------
# Each criterion computes what it says (one token per row: no other token's exit interferes)
# --------------------------------------------------------------------------------------------


def criterion_values(model: LoopedForCausalLM, x: torch.Tensor, criterion: str) -> torch.Tensor:
    """(rows, R) criterion value at recurrence c = 1..R, from a forward that runs every recurrence."""
    with torch.no_grad():
        out = model(x, output_recurrent_states=True)
        states = out.recurrent_states
        e = model.model.embedding_norm(model.model.embed_tokens(x))
        for layer in model.model.prelude_layers:
            pos = torch.arange(x.shape[1]).unsqueeze(0)
            e = layer(e, position_embeddings=model.model.rotary_emb(e, pos), position_ids=pos)[0]
        state0 = torch.zeros_like(e)  # the additive injection starts from h_0 = 0
        chain = [state0, *states]
        vocab = model.config.vocab_size
        logps = [torch.full((*x.shape, vocab), -math.log(vocab))]
        logps += [F.log_softmax(lg.float(), -1) for lg in model.logit_lens(states)]
    values = []
    stable = torch.zeros(x.shape, dtype=torch.long)
    for c in range(1, R + 1):
        prev, cur = chain[c - 1], chain[c]
        if criterion == "cosine":
            v = (1 - F.cosine_similarity(cur, prev, dim=-1, eps=1e-12)).clamp_min(0)
        elif criterion == "latent_diff":
            v = (cur - prev).norm(dim=-1) / cur.norm(dim=-1)
        elif criterion == "kl":
            v = F.kl_div(logps[c], logps[c - 1], reduction="none", log_target=True).sum(-1).clamp_min(0)
        elif criterion == "entropy_diff":
            ent = [-(lp.exp() * lp).sum(-1) for lp in (logps[c - 1], logps[c])]
            v = (ent[1] - ent[0]).abs()
        else:
            same = logps[c].argmax(-1) == logps[c - 1].argmax(-1) if c > 1 else torch.zeros(x.shape, dtype=torch.bool)
            stable = torch.where(same, stable + 1, 0)
            v = stable.clone()
        values.append(v[:, -1])
    return torch.stack(values, dim=1)


# Designs whose decoding of a state differs (the reference decodes through ``logit_lens``, which
# must run what the forward runs after the loop): the study's, and a post-loop norm that is the
# final norm's weight before the coda (Huginn's ln_f), with trained-looking (random) norm weights.
EXIT_DESIGNS = {"study": {}, "post_loop_final_norm": {"post_loop_norm": "final", "norm_placement": "sandwich"}}


def _design_model(design: str) -> LoopedForCausalLM:
    model = model_(**EXIT_DESIGNS[design])
    return with_random_norms(model) if design != "study" else model


@pytest.mark.parametrize("design", EXIT_DESIGNS)
@pytest.mark.parametrize("criterion", EXIT_CRITERIA)
def test_each_token_stops_at_the_first_recurrence_where_its_criterion_fires(criterion: str, design: str) -> None:
    model = _design_model(design)
    x = ids(batch=16, length=1, seed=3)
    values = criterion_values(model, x, criterion)
    fires_on = (lambda v, t: v >= t) if criterion == "argmax_stability" else (lambda v, t: v < t)
    # A threshold between the values, so rows stop at different recurrences.
    threshold = 2 if criterion == "argmax_stability" else float(values[:, 2].median())
    minimum = 2
    fired = fires_on(values, threshold)
    fired[:, : minimum - 1] = False
    expected = torch.where(fired.any(1), fired.float().argmax(1) + 1, R)
    with torch.no_grad():
        out = model(x, exit_criterion=criterion, exit_threshold=threshold, min_recurrences=minimum)
        # A stopped token's logits are those of a forward at the r where it stopped.
        by_r = {r: model(x, num_recurrences=r).logits for r in range(1, R + 1)}
    assert out.recurrences_used[:, 0].tolist() == expected.tolist()
    assert len(set(expected.tolist())) > 1, "the threshold should stop rows at different recurrences"
    for row, r in enumerate(expected.tolist()):
        torch.testing.assert_close(out.logits[row], by_r[r][row], rtol=1e-5, atol=1e-5)


def test_exit_traces_with_fullgraph_and_gives_the_eager_result() -> None:
    """Under torch.compile nothing branches on data: every recurrence runs and stopped tokens stay
    frozen, so the result is the eager one (where the loop really stops early)."""
    model, x = model_(), ids()
    with torch.no_grad():
        eager = model(x, exit_criterion="cosine", exit_threshold=2e-3)
        graphed = torch.compile(model, fullgraph=True, backend="eager")(x, exit_criterion="cosine", exit_threshold=2e-3)
    assert len(eager.recurrences_used.unique()) > 1
    assert torch.equal(graphed.recurrences_used, eager.recurrences_used)
    torch.testing.assert_close(graphed.logits, eager.logits)


# --------------------------------------------------------------------------------------------
# The cache: an exited token offers its latest KV; a sequence forward is token-by-token decoding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("criterion", ["cosine", "latent_diff"])
def test_a_sequence_forward_with_exits_equals_token_by_token_decoding(criterion: str) -> None:
    """State criteria read only the token's own states, so stopping tokens inside one forward
    (frozen state, latest KV to the later tokens) is exactly decoding them one by one through a
    cache filled by the same rule."""
    model, x = model_(), ids(batch=2, length=9)
    with torch.no_grad():
        states = model(x, output_recurrent_states=True).recurrent_states
        change = (1 - F.cosine_similarity(states[2], states[1], dim=-1)) if criterion == "cosine" \
            else (states[2] - states[1]).norm(dim=-1) / states[2].norm(dim=-1)  # fmt: skip
        # Halfway between the two middle values, not the median itself: a threshold equal to one
        # token's value would let a 1e-7 summation-order difference (a batched vs a one-token
        # matmul) flip that token's exit.
        middle = change.flatten().sort().values[change.numel() // 2 - 1 : change.numel() // 2 + 1]
        threshold = float(middle.mean())
        full = model(x, exit_criterion=criterion, exit_threshold=threshold)
        cache = DynamicCache(config=model.config)
        steps = [model(x[:, t : t + 1], cache=cache, use_cache=True, exit_criterion=criterion, exit_threshold=threshold)
                 for t in range(x.shape[1])]  # fmt: skip
    used = torch.cat([s.recurrences_used for s in steps], dim=1)
    assert len(full.recurrences_used.unique()) > 1, "the threshold should stop tokens at different recurrences"
    assert torch.equal(used, full.recurrences_used)
    torch.testing.assert_close(torch.cat([s.logits for s in steps], dim=1), full.logits, rtol=1e-5, atol=1e-5)


def test_a_stopped_token_leaves_its_latest_kv_in_the_later_recurrences_slots() -> None:
    model, x = model_(), ids(batch=2, length=5)
    minimum = 2
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, cache=cache, use_cache=True, exit_criterion="cosine", exit_threshold=2.0, min_recurrences=minimum)
        reference = DynamicCache(config=model.config)
        model(x, cache=reference, use_cache=True, num_recurrences=minimum)  # the recurrences every token ran
    assert len(cache.layers) == P + R * K + 1
    for j in range(K):
        latest = reference.layers[P + (minimum - 1) * K + j]
        for step in range(R):
            slot = cache.layers[P + step * K + j]
            source = reference.layers[P + min(step, minimum - 1) * K + j]
            assert torch.equal(slot.keys, source.keys) and torch.equal(slot.values, source.values), (step, j)
        assert torch.equal(cache.layers[P + (R - 1) * K + j].keys, latest.keys)
    # prelude and coda are untouched by the rule
    assert torch.equal(cache.layers[0].keys, reference.layers[0].keys)
    assert torch.equal(cache.layers[-1].keys, reference.layers[P + minimum * K].keys)


def test_the_distribution_criteria_leave_the_cache_as_a_fixed_r_forward_would() -> None:
    """kl decodes every intermediate state through the coda with the cache; those coda writes are
    cropped back out, so a never-firing kl call leaves exactly the fixed-r cache."""
    model, x = model_(), ids()
    a, b = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, cache=a, use_cache=True)
        model(x, cache=b, use_cache=True, exit_criterion="kl", exit_threshold=0.0)
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_exit_under_a_kv_budget_keeps_the_budgets_slots() -> None:
    model, x = model_(), ids()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(x, cache=cache, use_cache=True, kv_budget=2, exit_criterion="cosine", exit_threshold=2.0,
                    min_recurrences=2)  # fmt: skip
        ref = model(x, num_recurrences=2)
    assert len(cache.layers) == P + 2 * K + 1
    torch.testing.assert_close(out.logits, ref.logits)
    plain = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, kv_budget=1)
    never_ = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, kv_budget=1,
                            exit_criterion="cosine", exit_threshold=0.0)  # fmt: skip
    assert torch.equal(plain, never_)


# --------------------------------------------------------------------------------------------
# generate(): recurrences per new token
# --------------------------------------------------------------------------------------------


def test_generate_returns_the_recurrences_that_chose_each_new_token() -> None:
    model, x = model_(), ids(batch=1, length=4)
    threshold, new = 2e-3, 10
    out = model.generate(x, max_new_tokens=new, do_sample=False, pad_token_id=0, exit_criterion="cosine",
                         exit_threshold=threshold, return_dict_in_generate=True)  # fmt: skip
    assert type(out).__name__ == "LoopedGenerateOutput"
    # Reference: decode the same tokens one forward at a time through a cache.
    cache, used, seq = DynamicCache(config=model.config), [], out.sequences
    with torch.no_grad():
        step = model(seq[:, :4], cache=cache, use_cache=True, exit_criterion="cosine", exit_threshold=threshold)
        used.append(step.recurrences_used[:, -1])
        for t in range(4, 4 + new - 1):
            step = model(seq[:, t : t + 1], cache=cache, use_cache=True, exit_criterion="cosine",
                         exit_threshold=threshold)  # fmt: skip
            used.append(step.recurrences_used[:, -1])
    assert out.recurrences_used.tolist() == [torch.stack(used, 1)[0].tolist()]
    assert len(set(out.recurrences_used[0].tolist())) > 1


def test_generate_with_exit_works_with_a_static_cache_and_a_batch() -> None:
    model, x = model_(), ids(batch=3, length=4)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, exit_criterion="kl", exit_threshold=1e-3,
                  return_dict_in_generate=True)  # fmt: skip
    dynamic = model.generate(x, **kwargs)
    static = model.generate(x, **kwargs, cache_implementation="static")
    assert torch.equal(dynamic.sequences, static.sequences)
    assert torch.equal(dynamic.recurrences_used, static.recurrences_used)
    assert dynamic.recurrences_used.shape == (3, 6)


def test_the_config_sets_the_default_exit_and_round_trips(tmp_path) -> None:
    model = model_(exit_criterion="cosine", exit_threshold=2e-3, min_recurrences=2)
    model.save_pretrained(tmp_path)
    loaded = LoopedForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.exit_criterion, loaded.config.exit_threshold, loaded.config.min_recurrences) == ("cosine", 2e-3, 2)
    x = ids()
    with torch.no_grad():
        a, b = model(x), loaded(x)
        off = loaded(x, exit_criterion="none")
    assert torch.equal(a.recurrences_used, b.recurrences_used)
    assert bool((a.recurrences_used >= 2).all())
    assert off.recurrences_used is None


def test_the_base_model_and_heads_take_the_state_criteria() -> None:
    model, x = model_(), ids()
    base: LoopedModel = model.model
    with torch.no_grad():
        out = base(x, exit_criterion="cosine", exit_threshold=2.0, min_recurrences=2)
        ref = base(x, num_recurrences=2)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state)
    with pytest.raises(ValueError, match="exit_criterion='kl' reads the next-token distribution"):
        base(x, exit_criterion="kl")


# --------------------------------------------------------------------------------------------
# Bad input names the field and the value
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"exit_criterion": "entropy"}, "exit_criterion='entropy'"),
        ({"exit_criterion": "kl", "exit_threshold": "auto"}, "exit_threshold='auto'"),
        ({"exit_criterion": "kl", "exit_threshold": float("nan")}, "exit_threshold=nan"),
        # Thresholds the criterion's quantity can never meet name the criterion, the field and the value.
        ({"exit_criterion": "kl", "exit_threshold": -1.0}, "exit_threshold=-1.0: exit_criterion='kl'"),
        ({"exit_criterion": "kl", "exit_threshold": float("inf")}, "exit_threshold=inf"),
        ({"exit_criterion": "latent_diff", "exit_threshold": float("-inf")}, "exit_threshold=-inf"),
        ({"exit_criterion": "entropy_diff", "exit_threshold": -0.5}, "exit_threshold=-0.5: exit_criterion='entropy_diff'"),
        ({"exit_criterion": "cosine", "exit_threshold": 2.5}, r"exit_threshold=2.5: exit_criterion='cosine'.*\[0.0, 2.0\]"),
        ({"exit_criterion": "argmax_stability", "exit_threshold": 2.5}, "exit_threshold=2.5: exit_criterion='argmax_stability'"),
        ({"exit_criterion": "argmax_stability", "exit_threshold": -1}, "exit_threshold=-1: exit_criterion='argmax_stability'"),
        ({"min_recurrences": 0}, "min_recurrences=0"),
    ],
)
def test_a_bad_exit_setting_is_refused_in_the_config_and_per_call(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"LoopedConfig.{message}"):
        tiny_looped_config(**overrides)
    model = model_()
    with pytest.raises(ValueError, match=message):
        model(ids(), **overrides)


def test_exit_refuses_what_it_cannot_honour() -> None:
    model, x = model_(), ids()
    # One rule, one message: the call's and the config's refusal say the same.
    with pytest.raises(ValueError, match="^min_recurrences=6: exceeds num_recurrences=5, the cap on recurrences per token$"):
        model(x, exit_criterion="kl", min_recurrences=6)
    with pytest.raises(ValueError, match="^LoopedConfig.min_recurrences=6: exceeds num_recurrences=5, the cap on recurrences per token$"):
        tiny_looped_config(num_recurrences=5, exit_criterion="kl", min_recurrences=6)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(x, exit_criterion="cosine", output_hidden_states=True)
    # The refusal reads the model's flag; transformers < 5.23 sets it with gradient_checkpointing_enable.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        model(x, exit_criterion="cosine")


def test_exit_in_training_backpropagates_through_the_recurrences_each_token_ran() -> None:
    model, x = model_(), ids()
    model.train()
    out = model(x, labels=x, exit_criterion="cosine", exit_threshold=2.0, min_recurrences=2)
    ref = model(x, labels=x, num_recurrences=2)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref.loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_every_criterion_has_a_default_threshold() -> None:
    assert set(EXIT_DEFAULT_THRESHOLDS) == set(EXIT_CRITERIA)
    config = LoopedConfig(exit_criterion="latent_diff")
    assert config.exit_settings() == ("latent_diff", EXIT_DEFAULT_THRESHOLDS["latent_diff"], 1)
