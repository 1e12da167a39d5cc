"""Self-speculative decoding (test-time compute): the model at k recurrences drafts, at r verifies.

``generate(..., draft_num_recurrences=k)`` must give exactly plain greedy at r, with the same
weights (one model object, called at both r's), and report what it drafted and accepted.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_model
from transformers import GenerationConfig

from looped_hf import LoopedForCausalLM

R = 4


def model_(seed: int = 0, **overrides) -> LoopedForCausalLM:
    return tiny_looped_model(seed, noise=0.3, **{"num_recurrences": R, "eos_token_id": None, **overrides})


def prompt(length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: LoopedForCausalLM, x: torch.Tensor, **kwargs):
    return model.generate(x, max_new_tokens=16, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("k", [1, 2, 3, R])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_a_draft_at_k_recurrences_is_plain_greedy_at_r(k: int, seed: int) -> None:
    model, x = model_(seed), prompt(seed=seed + 1)
    plain = greedy(model, x)
    out = greedy(model, x, draft_num_recurrences=k, num_assistant_tokens=4, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert 0 <= out.num_accepted_draft_tokens <= out.num_draft_tokens
    if k == R:  # the draft is the model itself: everything it proposes is accepted
        assert out.num_accepted_draft_tokens == out.num_draft_tokens > 0


def test_a_weaker_draft_is_rejected_sometimes_and_the_output_is_still_greedy_at_r() -> None:
    """Across prompts, the draft at r = 1 must disagree with r somewhere: the rejection path runs."""
    model = model_()
    drafted = accepted = 0
    for seed in range(4):
        x = prompt(seed=seed)
        out = greedy(model, x, draft_num_recurrences=1, num_assistant_tokens=6, return_dict_in_generate=True)
        assert torch.equal(out.sequences, greedy(model, x))
        drafted += out.num_draft_tokens
        accepted += out.num_accepted_draft_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize(("length", "drafted"), [(1, 8), (3, 12)])
def test_the_calls_draft_length_is_honoured(length: int, drafted: int) -> None:
    """A draft at k = r is always accepted: each round drafts ``num_assistant_tokens`` and gains one
    more from the verification, so 16 new tokens take 16 / (length + 1) rounds."""
    model, x = model_(), prompt()
    out = greedy(model, x, draft_num_recurrences=R, num_assistant_tokens=length, assistant_confidence_threshold=0.0,
                 return_dict_in_generate=True)  # fmt: skip
    assert out.num_draft_tokens == out.num_accepted_draft_tokens == drafted


def test_a_self_draft_defaults_to_four_tokens_without_the_confidence_stop() -> None:
    """16 new tokens with an always-accepted draft: three rounds of 4 drafted + 1 verified, then
    one token with no room left for a draft."""
    model, x = model_(), prompt()
    out = greedy(model, x, draft_num_recurrences=R, return_dict_in_generate=True)
    assert out.num_draft_tokens == out.num_accepted_draft_tokens == 12
    passed = GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=0, num_assistant_tokens=3,
                              return_dict_in_generate=True)  # fmt: skip
    assert model.generate(x, passed, draft_num_recurrences=R).num_draft_tokens == 12  # 4 rounds of 3 + 1
    assert passed.assistant_confidence_threshold is None, "the caller's config object is not modified"
    model.generation_config.num_assistant_tokens = 1  # the model's own setting wins over the default
    assert greedy(model, x, draft_num_recurrences=R, return_dict_in_generate=True).num_draft_tokens == 8


def test_drafting_uses_the_same_model_at_both_recurrence_counts() -> None:
    model, x = model_(), prompt()
    seen: list[int | None] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("num_recurrences")), with_kwargs=True
    )
    try:
        greedy(model, x, draft_num_recurrences=2, num_assistant_tokens=3)
    finally:
        handle.remove()
    assert 2 in seen, "the draft runs the same module at k recurrences"
    assert None in seen or R in seen, "the verification runs it at r"


def test_drafting_at_an_explicit_r_and_with_a_budget_that_keeps_every_recurrence() -> None:
    model, x = model_(), prompt()
    plain = greedy(model, x, num_recurrences=6)
    assert torch.equal(greedy(model, x, num_recurrences=6, draft_num_recurrences=2), plain)
    assert torch.equal(greedy(model, x, kv_budget=R, draft_num_recurrences=2), greedy(model, x))


def test_sampling_with_a_draft_runs_and_is_reproducible() -> None:
    model, x = model_(), prompt()

    def sample() -> torch.Tensor:
        torch.manual_seed(0)
        return model.generate(x, max_new_tokens=12, do_sample=True, pad_token_id=0, draft_num_recurrences=2)

    first = sample()
    assert first.shape == (1, x.shape[1] + 12)
    assert torch.equal(first, sample())


def test_without_a_draft_generate_returns_what_transformers_returns() -> None:
    model, x = model_(), prompt()
    out = greedy(model, x, return_dict_in_generate=True)
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_num_recurrences": 0}, r"draft_num_recurrences=0: must be an integer in \[1, num_recurrences=4\]"),
        ({"draft_num_recurrences": R + 1}, "draft_num_recurrences=5"),
        ({"draft_num_recurrences": 2.0}, "draft_num_recurrences=2.0"),
        ({"draft_num_recurrences": 2, "kv_budget": 1}, "kv_budget=1 < num_recurrences=4"),
        ({"draft_num_recurrences": 2, "exit_criterion": "kl"}, "exit_criterion='kl'"),
    ],
)
def test_a_draft_that_cannot_reproduce_greedy_at_r_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        greedy(model_(), prompt(), **kwargs)


def test_a_draft_with_another_assistant_or_a_batch_is_refused() -> None:
    model = model_()
    with pytest.raises(ValueError, match="do not pass assistant_model"):
        greedy(model, prompt(), draft_num_recurrences=2, assistant_model=model)
    with pytest.raises(ValueError, match="batch_size = 1"):
        greedy(model, torch.cat([prompt(), prompt(seed=2)]), draft_num_recurrences=2)


def test_a_hyperconnection_model_cannot_draft_at_another_r() -> None:
    model = model_(input_injection="hyperconnection")
    with pytest.raises(ValueError, match="hyperconnection model runs only at its trained num_recurrences=4"):
        greedy(model, prompt(), draft_num_recurrences=2)


# --------------------------------------------------------------------------------------------
# bf16: the exact guarantee (identical to plain greedy in fp32 above; within rounding in bf16)
# --------------------------------------------------------------------------------------------


def _study_like_bf16(seed: int) -> LoopedForCausalLM:
    """The study's block and init (lm_head std 0.001: random logits all close, near-ties common) in bf16."""
    from conftest import tiny_looped_config

    torch.manual_seed(seed)
    config = tiny_looped_config(
        vocab_size=2048, hidden_size=64, num_recurrences=R, init_scheme="study", logit_softcap=15.0,
        tie_word_embeddings=False, qk_norm="after_rope", hidden_act="relu2", eos_token_id=None,
    )  # fmt: skip
    return LoopedForCausalLM(config).eval().to(torch.bfloat16)


def _bf16_rounding(model: LoopedForCausalLM, sequences: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Two bf16 ulps of each position's largest logit (bf16 keeps 8 significant bits)."""
    with torch.no_grad():
        logits = model(input_ids=sequences, use_cache=False).logits.float()[:, prompt_length - 1 : -1]
    return 2.0**-6 * logits.abs().amax(dim=-1)


@pytest.mark.parametrize("seed", [0, 2])
def test_in_bf16_every_self_drafted_token_is_greedy_within_rounding(seed: int) -> None:
    """A bf16 verification forward of several tokens rounds differently from one-token decoding,
    so at a near-tie it may pick the other token; what holds is that every emitted token's logit
    is within bf16 rounding of the maximum, for plain and self-drafted greedy alike."""
    model = _study_like_bf16(seed)
    x = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(seed))
    kwargs = dict(max_new_tokens=48, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(x, **kwargs)
        drafted = model.generate(x, draft_num_recurrences=1, **kwargs)
    for sequences in (plain, drafted):
        gaps = model.greedy_gaps(sequences, x.shape[1])
        assert gaps.shape == (1, sequences.shape[1] - x.shape[1])
        assert (gaps <= _bf16_rounding(model, sequences, x.shape[1])).all(), gaps.max()


def test_greedy_gaps_flag_a_token_that_is_not_greedy() -> None:
    model, x = model_(), prompt()
    plain = greedy(model, x)
    assert torch.allclose(model.greedy_gaps(plain, x.shape[1]), torch.zeros(1, 16), atol=1e-5)
    with torch.no_grad():
        logits = model(input_ids=plain, use_cache=False).logits[0, x.shape[1] - 1]
    wrong = plain.clone()
    wrong[0, x.shape[1]] = logits.argmin()  # the first new token replaced by the least likely one
    gaps = model.greedy_gaps(wrong, x.shape[1])
    assert gaps[0, 0] == pytest.approx(float(logits.max() - logits.min()), rel=1e-5)
    with pytest.raises(ValueError, match="prompt_length=0"):
        model.greedy_gaps(plain, 0)
