"""Causal attention without a mask where none is needed, eager and under ``torch.compile``.

SDPA's flash / cuDNN kernels skip the upper triangle only with ``is_causal=True`` and no mask; a
materialised (batch, 1, T, T) mask costs about 3x the attention time on a GPU. Under compile,
transformers' ``create_causal_mask`` cannot read tensors and builds that mask even for unpadded
rows, so the looped model decides itself. These tests intercept every call of
``torch.nn.functional.scaled_dot_product_attention`` (compiled with ``backend="eager"``: dynamo
traces the real forward, nothing is lowered, so it runs in seconds) and check what it gets:
unpadded training and prefill get no mask and ``is_causal``; padding, cached decoding, chunked
prefill, static caches and packed documents keep the mask that makes them right.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_looped_model
from transformers import DynamicCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool, int, int]]:
    """Every SDPA call as (mask is None, is_causal, q_len, kv_len); dynamo is reset around the
    test so no graph compiled with another SDPA survives into it."""
    calls: list[tuple[bool, bool, int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask is None, bool(is_causal), query.shape[-2], key.shape[-2]))
        return sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
        )

    torch._dynamo.reset()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    yield calls
    torch._dynamo.reset()


def _ids(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _applications(model) -> int:
    config = model.config
    return config.num_layer_applications(config.num_recurrences)


CONFIGS = {
    "linear": {},
    "truncated_backprop": {"backprop_recurrences": 1},
    "hyperconnections": {"input_injection": "hyperconnection"},
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_unpadded_training_step_gives_every_application_is_causal_and_no_mask(
    sdpa_calls, overrides, compiled
):
    """The Trainer's step (train mode, no cache, no attention_mask, labels, backward): every layer
    application, truncated or not, with hyperconnection lanes, runs SDPA's causal mode."""
    model = tiny_looped_model(**overrides).train()
    forward = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    ids = _ids()
    loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert len(sdpa_calls) == _applications(model)
    assert all(none and causal for none, causal, _, _ in sdpa_calls), sdpa_calls
    # The shortcut changes no number: eager attention (which always builds its mask) agrees.
    model.zero_grad()
    with torch.no_grad():
        eager_attention = model.set_attn_implementation("eager") or model
        reference = eager_attention(input_ids=ids, labels=ids, use_cache=False).loss
    torch.testing.assert_close(loss.detach(), reference)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_all_ones_mask_and_an_empty_cache_prefill_are_causal_too(sdpa_calls, compiled):
    """Prefill of an unpadded prompt into an empty cache is the causal square. An all-ones 2-D
    mask is recognised where its values can be read (eager); compiled code cannot read it, so a
    caller that knows the rows are unpadded (the packed-block collators) passes no mask."""
    model = tiny_looped_model()
    forward = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    ids = _ids()
    with torch.no_grad():
        forward(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True)
        if not compiled:
            forward(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert len(sdpa_calls) == _applications(model) * (1 if compiled else 2)
    assert all(none and causal for none, causal, _, _ in sdpa_calls), sdpa_calls


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_padding_keeps_its_mask_and_the_logits_of_the_unpadded_rows(sdpa_calls, compiled):
    """Left padding must be masked out: a mask reaches SDPA, and the padded row's real tokens get
    the logits they get alone."""
    model = tiny_looped_model()
    forward = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    ids = _ids(batch=2, length=10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        padded = forward(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert sdpa_calls and not any(none for none, _, _, _ in sdpa_calls), sdpa_calls
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 3:], use_cache=False).logits
    torch.testing.assert_close(padded[1, 3:], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_budget", [None, 1], ids=["full_cache", "kv_budget_1"])
def test_chunked_prefill_over_a_cache_keeps_its_mask(sdpa_calls, kv_budget):
    """A second chunk of several tokens attends to the cached ones and to its own causally:
    q_len < kv_len, which SDPA's upper-left ``is_causal`` would get wrong, so it keeps a mask. Its
    logits equal eager attention's (which always builds the mask) and, with the full cache, one
    prefill of the whole prompt. (Under a KV budget a chunk reads the earlier tokens' last-written
    KV, not a whole prefill's fresh one, so only the first comparison holds there.)"""
    model = tiny_looped_model()
    ids = _ids(batch=2, length=12)

    def chunked() -> torch.Tensor:
        cache = DynamicCache(config=model.config)
        first = model(input_ids=ids[:, :7], cache=cache, kv_budget=kv_budget).logits
        sdpa_calls.clear()
        return torch.cat([first, model(input_ids=ids[:, 7:], cache=cache, kv_budget=kv_budget).logits], dim=1)

    with torch.no_grad():
        whole = model(input_ids=ids, cache=DynamicCache(config=model.config), kv_budget=kv_budget).logits
        logits = chunked()
        calls = list(sdpa_calls)
        model.set_attn_implementation("eager")
        eager = chunked()
    assert calls and all(q < kv for _, _, q, kv in calls), calls
    assert not any(none for none, _, _, _ in calls), "a chunk after the cache needs its mask"
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    if kv_budget is None:
        torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)


def test_packed_documents_in_position_ids_keep_their_block_mask(sdpa_calls):
    """Padding-free packing (TRL): position_ids restart at each document, and attention must not
    cross documents, so the caller's position_ids still build the block-diagonal mask."""
    model = tiny_looped_model()
    ids = _ids(batch=1, length=10)
    positions = torch.cat([torch.arange(4), torch.arange(6)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        second_alone = model(input_ids=ids[:, 4:], use_cache=False).logits
    assert sdpa_calls and not any(none for none, _, _, _ in sdpa_calls[: _applications(model)])
    torch.testing.assert_close(packed[:, 4:], second_alone, rtol=1e-5, atol=1e-5)


def test_eager_attention_still_gets_its_causal_mask() -> None:
    """Eager attention has no causal mode: without its mask a token would read the future. Its
    logits equal SDPA's for every prefix (the future never leaks)."""
    model = tiny_looped_model()
    ids = _ids(batch=1, length=8)
    with torch.no_grad():
        sdpa = model(input_ids=ids, use_cache=False).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids=ids, use_cache=False).logits
        prefix = model(input_ids=ids[:, :5], use_cache=False).logits
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager[:, :5], prefix, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_cache", [False, None], ids=["no_cache", "config_default_cache"])
@pytest.mark.parametrize("r", [1, 3])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_three_packed_sequences_equal_the_padded_batch(attn, r, use_cache):
    """What DataCollatorWithFlattening (and TRL's padding-free packing) hands the model: one row,
    no attention_mask, position_ids restarting for each sequence. Its logits equal the right-padded
    batch's at every real token, through every recurrence. The row is longer than
    max_position_embeddings (its largest position is not): positions are read, not tokens counted.
    With ``use_cache`` left to the config (True) the forward brings an empty cache, which must not
    hide the packing (transformers reads it only without a cache)."""
    model = tiny_looped_model(max_position_embeddings=16, num_recurrences=r)
    model.set_attn_implementation(attn)
    lengths = (7, 12, 9)
    docs = [_ids(batch=1, length=n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    padded = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, doc in enumerate(docs):
        padded[i, : len(doc)], mask[i, : len(doc)] = doc, 1
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    assert packed.shape[1] > model.config.max_position_embeddings > int(positions.max())
    with torch.no_grad():
        reference = model(input_ids=padded, attention_mask=mask, use_cache=False).logits[mask.bool()]
        out = model(input_ids=packed, position_ids=positions, use_cache=use_cache).logits[0]
        # The base model's hidden states too (the heads read them), and the rows one by one.
        alone = torch.cat([model(input_ids=doc[None], use_cache=False).logits[0] for doc in docs])
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
    # The packing matters: the same row read as one sequence gives other logits after the first.
    with torch.no_grad():
        unpacked = model(input_ids=packed, use_cache=False).logits[0]
    assert not torch.allclose(unpacked[lengths[0]:], reference[lengths[0]:], atol=1e-3)


def test_packed_position_ids_with_padding_keep_the_callers_mask() -> None:
    """A 2-D attention_mask beside position_ids is the caller's (generate's left padding, whose
    position_ids start after the pads): transformers does not re-read packing then, and neither
    does the looped model. Left-padded generation still equals the prompts one by one."""
    model = tiny_looped_model()
    ids = _ids(batch=2, length=8, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
        one = model.generate(ids[1:, 3:], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(batch[1:, 3:], one)
