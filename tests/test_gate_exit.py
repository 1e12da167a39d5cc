"""The exit gate as an adaptive-exit criterion (``exit_criterion="gate"``): a token stops at the first
recurrence whose exit CDF reaches the threshold, the step the threshold readout picks, and really
stops there: its state freezes and its later KV is its latest, as every criterion's.

The references are the gate's threshold readout (every recurrence runs for every token), fixed-r
forwards and token-by-token decoding through a cache.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, load_benchmark, tiny_looped_model
from transformers import DynamicCache

from looped_hf import LoopedConfig, LoopedForCausalLM, LoopedForSequenceClassification

R = 4
# Ouro's stack (tests/test_logit_lens.py's "ouro_like" design): no prelude or coda, the whole stack
# looped, the recurrence norm the final norm, an exit gate.
OURO_LIKE = dict(norm_placement="pre_and_output", num_prelude_layers=0, num_coda_layers=0, input_injection="none",
                 recurrence_norm=True, recurrence_norm_weight="final", embedding_norm=False, exit_gate=True,
                 num_recurrences=R, eos_token_id=None)  # fmt: skip
K = 2  # block layers (tiny_looped_config)


def gated_model(seed: int = 0, **overrides) -> LoopedForCausalLM:
    """A tiny Ouro-like model whose gate stops different tokens at different recurrences (an
    untrained gate at init says ~0.5 everywhere, which would stop every token at one step)."""
    model = tiny_looped_model(seed, **{**OURO_LIKE, **overrides})
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 100)
        model.model.exit_gate.weight.copy_(torch.randn(model.model.exit_gate.weight.shape, generator=g))
        model.model.exit_gate.bias.fill_(-1.0)
    return model


def ids(batch: int = 2, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def gate_exit(model: LoopedForCausalLM, x: torch.Tensor, threshold: float, **kwargs):
    return model(x, exit_criterion="gate", exit_threshold=threshold, **kwargs)


# --------------------------------------------------------------------------------------------
# The token itself: its exit step and logits are the threshold readout's
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8])
def test_a_single_tokens_exit_step_and_logits_are_the_threshold_readouts(threshold: float) -> None:
    """One token per row: nothing else attends or is attended to, so stopping it changes nothing
    but the recurrences run."""
    model, x = gated_model(), ids(batch=12, length=1)
    with torch.no_grad():
        readout = model(x, exit_gate_output="threshold", exit_gate_threshold=threshold)
        stopped = gate_exit(model, x, threshold)
    assert len(readout.recurrences_used.unique()) > 1, "the gate should stop rows at different recurrences"
    assert torch.equal(stopped.recurrences_used, readout.recurrences_used)
    torch.testing.assert_close(stopped.logits, readout.logits, rtol=0, atol=1e-5)


def test_threshold_one_stops_no_token_early_and_is_todays_readout() -> None:
    model, x = gated_model(), ids()
    with torch.no_grad():
        readout = model(x, exit_gate_output="threshold", exit_gate_threshold=1.0)
        last = model(x, exit_gate_output="last")
        stopped = gate_exit(model, x, 1.0)
    assert bool((stopped.recurrences_used == R).all()) and bool((readout.recurrences_used == R).all())
    torch.testing.assert_close(stopped.logits, readout.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(stopped.logits, last.logits, rtol=0, atol=1e-6)


def test_min_recurrences_delays_the_gates_exit() -> None:
    model, x = gated_model(), ids(batch=12, length=1)
    with torch.no_grad():
        free = gate_exit(model, x, 0.3).recurrences_used
        held = gate_exit(model, x, 0.3, min_recurrences=2).recurrences_used
    assert bool((free == 1).any())
    assert torch.equal(held, free.clamp_min(2))


# --------------------------------------------------------------------------------------------
# The cache: a stopped token's later slots hold its latest KV; the cache path is exact
# --------------------------------------------------------------------------------------------


def test_a_stopped_tokens_later_slots_hold_its_exit_step_kv() -> None:
    model, x = gated_model(), ids(batch=1, length=6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        used = gate_exit(model, x, 0.5, cache=cache, use_cache=True).recurrences_used[0]
    assert len(used.unique()) > 1 and bool((used < R).any())
    for t, exit_step in enumerate(used.tolist()):
        for j in range(K):
            latest = cache.layers[(exit_step - 1) * K + j]
            for step in range(exit_step, R):
                slot = cache.layers[step * K + j]
                assert torch.equal(slot.keys[:, :, t], latest.keys[:, :, t]), (t, step, j)
                assert torch.equal(slot.values[:, :, t], latest.values[:, :, t]), (t, step, j)
    # The first token attends only to itself: its exit-step KV is a fixed-r forward's at that r.
    first = used[0].item()
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x[:, :1], cache=reference, use_cache=True, num_recurrences=first)
    for j in range(K):
        torch.testing.assert_close(
            cache.layers[(R - 1) * K + j].keys[:, :, 0], reference.layers[(first - 1) * K + j].keys[:, :, 0]
        )


def test_a_sequence_forward_with_gate_exits_equals_token_by_token_decoding() -> None:
    """The gate reads only the token's own states, so stopping tokens inside one forward is exactly
    decoding them one by one through a cache filled by the same rule."""
    model, x = gated_model(), ids(batch=2, length=9)
    with torch.no_grad():
        full = gate_exit(model, x, 0.5)
        cache = DynamicCache(config=model.config)
        steps = [
            gate_exit(model, x[:, t : t + 1], 0.5, cache=cache, use_cache=True) for t in range(x.shape[1])
        ]
    used = torch.cat([s.recurrences_used for s in steps], dim=1)
    assert len(full.recurrences_used.unique()) > 1
    assert torch.equal(used, full.recurrences_used)
    torch.testing.assert_close(torch.cat([s.logits for s in steps], dim=1), full.logits, rtol=1e-5, atol=1e-5)


def test_generate_with_a_cache_equals_generate_recomputing_without_one() -> None:
    model, x = gated_model(), ids(batch=1, length=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, exit_criterion="gate", exit_threshold=0.5,
                  return_dict_in_generate=True)  # fmt: skip
    cached = model.generate(x, **kwargs)
    recomputed = model.generate(x, **kwargs, use_cache=False)
    assert torch.equal(cached.sequences, recomputed.sequences)
    assert torch.equal(cached.recurrences_used, recomputed.recurrences_used)
    assert len(cached.recurrences_used.unique()) > 1
    readout = model.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0, exit_gate_output="threshold",
                             exit_gate_threshold=1.0)  # fmt: skip
    never = model.generate(x, **{**kwargs, "exit_threshold": 1.0})
    assert torch.equal(never.sequences, readout)


def test_the_gate_exit_really_skips_block_applications() -> None:
    """A forward runs a recurrence while any of its tokens still runs: decoding one token, the
    block runs exactly the recurrences that token used."""
    model, x = gated_model(), ids(batch=1, length=8)
    calls = []
    hook = model.model.recurrent_layers[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        cache, used, runs = DynamicCache(config=model.config), [], []
        with torch.no_grad():
            for t in range(x.shape[1]):
                before = len(calls)
                used.append(
                    gate_exit(
                        model, x[:, t : t + 1], 0.3, cache=cache, use_cache=True
                    ).recurrences_used.item()
                )
                runs.append(len(calls) - before)
    finally:
        hook.remove()
    assert runs == used and sum(runs) < R * x.shape[1]


def test_the_gate_exit_under_a_kv_budget_keeps_the_budgets_slots() -> None:
    model, x = gated_model(), ids()
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        # Threshold 0: every CDF reaches it, so every token stops at min_recurrences.
        out = gate_exit(model, x, 0.0, cache=cache, use_cache=True, kv_budget=2, min_recurrences=2)
        ref = model(x, num_recurrences=2)
    assert len(cache.layers) == 2 * K and bool((out.recurrences_used == 2).all())
    torch.testing.assert_close(out.logits, ref.logits)
    plain = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, kv_budget=1)
    never = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0, kv_budget=1,
                           exit_criterion="gate", exit_threshold=1.0)  # fmt: skip
    assert torch.equal(plain, never)


def test_the_gate_exit_traces_with_fullgraph_and_gives_the_eager_result() -> None:
    model, x = gated_model(), ids()
    # A fresh dynamo, before and after: forward compiled in this process at another threshold makes
    # the float dynamic on recompile, and the config's range checks read it as a Python number.
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = gate_exit(model, x, 0.5)
            graphed = torch.compile(model, fullgraph=True, backend="eager")(
                x, exit_criterion="gate", exit_threshold=0.5
            )
    finally:
        torch._dynamo.reset()
    assert len(eager.recurrences_used.unique()) > 1
    assert torch.equal(graphed.recurrences_used, eager.recurrences_used)
    torch.testing.assert_close(graphed.logits, eager.logits)


# --------------------------------------------------------------------------------------------
# How it is asked for: the config, per call, the gate's own threshold; refusals
# --------------------------------------------------------------------------------------------


def test_the_config_and_exit_gate_threshold_set_the_gate_exit(tmp_path) -> None:
    model, x = gated_model(), ids()
    with torch.no_grad():
        expected = gate_exit(model, x, 0.3)
        assert torch.equal(model(x, exit_criterion="gate", exit_gate_threshold=0.3).logits, expected.logits)
    model.config.exit_criterion, model.config.exit_gate_threshold = "gate", 0.3
    model.save_pretrained(tmp_path)
    loaded = LoopedForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.exit_criterion, loaded.config.exit_threshold) == ("gate", None)
    assert loaded.config.exit_settings() == ("gate", 0.3, 1)
    with torch.no_grad():
        out = loaded(x)
        off = loaded(x, exit_criterion="none")
    assert torch.equal(out.recurrences_used, expected.recurrences_used)
    torch.testing.assert_close(out.logits, expected.logits, rtol=0, atol=0)
    assert off.recurrences_used is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LoopedConfig(exit_criterion="gate"),
         r"^LoopedConfig\.exit_criterion='gate': this model has no exit gate"),
        (lambda: LoopedConfig(**{**OURO_LIKE, "exit_criterion": "gate", "exit_gate_output": "weighted"}),
         r"^LoopedConfig\.exit_gate_output='weighted': 'weighted' reads every recurrence"),
        (lambda: LoopedConfig(**{**OURO_LIKE, "exit_criterion": "gate", "exit_threshold": 1.5}),
         r"^LoopedConfig\.exit_threshold=1\.5: must be a number in \[0, 1\]"),
        (lambda: tiny_looped_model()(ids(), exit_criterion="gate"),
         r"^exit_criterion='gate': this model has no exit gate"),
        (lambda: gated_model()(ids(), exit_criterion="gate", exit_threshold=-0.1),
         r"^exit_threshold=-0\.1: must be a number in \[0, 1\]"),
        (lambda: gated_model()(ids(), exit_criterion="gate", exit_gate_output="weighted"),
         r"^exit_gate_output='weighted': reads every recurrence of every token"),
        (lambda: gated_model()(ids(), exit_criterion="gate", exit_threshold=0.3, exit_gate_threshold=0.5),
         r"^exit_gate_threshold=0\.5: differs from exit_threshold=0\.3"),
        (lambda: gated_model(exit_gate_entropy_beta=0.1)(ids(), labels=ids(), exit_criterion="gate"),
         r"^exit_gate_entropy_beta=0\.1: Ouro's loss reads every recurrence"),
        (lambda: gated_model()(ids(), exit_criterion="kl"),
         r"^exit_criterion='kl': refused with exit_gate=True .*exit_criterion='gate'"),
        (lambda: LoopedForSequenceClassification(LoopedConfig(**OURO_LIKE)).model(ids(), exit_criterion="gate"),
         r"^exit_criterion='gate': this model has no exit gate"),
    ],
)  # fmt: skip
def test_a_gate_exit_it_cannot_honour_is_refused_in_one_line(build, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err, torch.no_grad():
        build()
    assert "\n" not in str(err.value)


def test_the_gate_exit_benchmark_counts_recurrences_on_a_widened_fixture(capsys) -> None:
    """Its smoke run (the engine side needs vLLM; docs/serving.md shows one): the ratios are fractions
    of every token running all r, and the gate never runs more than generate() did."""
    bench = load_benchmark("bench_gate_exit")
    bench.main(["--width", "128", "--r", "2", "--thresholds", "0.5", "--new-tokens", "1"])
    out = capsys.readouterr().out
    assert "at width 128" in out
    r, threshold, tokens, readout, gate, ran = out.strip().splitlines()[-1].strip("| ").split(" | ")
    # every prompt token and the one fed-back token of each prompt
    assert (r, threshold, int(tokens)) == ("2", "0.5", sum(bench.PROMPT_LENGTHS) + len(bench.PROMPT_LENGTHS))
    assert 0 < float(readout) <= 1 and 0 < float(gate) <= float(ran) <= 1


@pytest.mark.parametrize("argv", [["--width", "100"], ["some/checkpoint", "--width", "128"]])
def test_the_gate_exit_benchmark_refuses_a_width_it_cannot_build(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_benchmark("bench_gate_exit").main(argv)
    assert exit_.value.code == 2 and "--width" in capsys.readouterr().err
