"""``looped_hf.at_depth`` and the depth registry (looped_hf/depth.py): inside the block the logits
equal transformers' own forward built with that depth in its config (the zoo2 references, computed
by transformers 5.25.0), the model is restored after it (also on an exception), HRM-Text's cache
is resized to the cycles (a cached forward at more cycles raised IndexError without it), and an
unregistered class or a depth out of range is refused in one line.

The HRM-Text and Inkling2Loop tests need transformers >= 5.25 (the serving venv has 5.19, which
lacks both classes): they skip there with the reason; the registry tests run everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fixture_path, tiny_looped_model

import looped_hf
from looped_hf.depth import REGISTRY, DepthError, at_depth, entry_for, entry_for_model_type, registered_names

HRM_GRID = [(1, 1), (1, 3), (2, 1), (2, 3), (3, 3)]
PROMPTS = ("p0", "p1")


def _load(name: str, module: str):
    # The references are transformers 5.25.0's; 5.19 (the serving venv) lacks inkling2_loop and has
    # an hrm_text that takes its cache as past_key_values.
    why = f"{module} needs transformers >= 5.25 (the zoo2 references' version)"
    pytest.importorskip("transformers", minversion="5.25", reason=why)
    pytest.importorskip(f"transformers.models.{module}", reason=why)
    from transformers import AutoModelForCausalLM

    folder = fixture_path("zoo2", name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, np.load(folder / "reference.npz")


@pytest.fixture(scope="module")
def hrm():
    return _load("hrm-text-tiny", "hrm_text")


@pytest.fixture(scope="module")
def inkling():
    return _load("inkling2-loop-tiny", "inkling2_loop")


def _max_diff(logits: torch.Tensor, ref: np.ndarray) -> float:
    return float((logits - torch.from_numpy(ref)).abs().max())


@torch.no_grad()
def test_hrm_at_every_reference_depth_equals_the_class_built_there(hrm) -> None:
    model, ref = hrm
    for prompt in PROMPTS:
        ids = torch.from_numpy(ref[f"{prompt}_input_ids"])
        for h, low in HRM_GRID:
            with at_depth(model, (h, low)):
                uncached = model(ids, use_cache=False).logits
                cached = model(ids, use_cache=True).logits  # at (3, 3) this indexed past the cache before
            assert _max_diff(uncached, ref[f"{prompt}_H{h}_L{low}_logits"]) <= 1e-5, (prompt, h, low)
            assert float((cached - uncached).abs().max()) <= 1e-5, (prompt, h, low)
        with at_depth(model, 3):  # an int is H_cycles, L_cycles as configured (3)
            assert _max_diff(model(ids).logits, ref[f"{prompt}_H3_L3_logits"]) <= 1e-5
    assert (model.config.H_cycles, model.config.L_cycles, model.config.num_hidden_layers) == (2, 3, 8)


@torch.no_grad()
def test_hrm_prefix_lm_after_other_depths_equals_reference(hrm) -> None:
    model, ref = hrm
    for prompt in PROMPTS:
        ids, types = (torch.from_numpy(ref[f"{prompt}_{k}"]) for k in ("input_ids", "prefix3_token_type_ids"))
        with at_depth(model, (1, 1)):
            model(ids, token_type_ids=types)
        with at_depth(model, (2, 3)):  # the trained depth, named explicitly
            assert _max_diff(model(ids, token_type_ids=types).logits, ref[f"{prompt}_prefix3_logits"]) <= 1e-5
        assert _max_diff(model(ids, token_type_ids=types).logits, ref[f"{prompt}_prefix3_logits"]) <= 1e-5


@torch.no_grad()
def test_hrm_generate_at_more_cycles_with_cache_equals_no_cache(hrm) -> None:
    model, ref = hrm
    ids = torch.from_numpy(ref["p0_input_ids"])
    with at_depth(model, (3, 3)):
        cached = model.generate(ids, max_new_tokens=6, do_sample=False)
        uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
        # The greedy token after the prompt is the argmax of the reference logits at (3, 3).
        assert int(cached[0, ids.shape[1]]) == int(ref["p0_H3_L3_logits"][0, -1].argmax())
    assert cached.tolist() == uncached.tolist()
    # At the trained depth, transformers' own generate (reference) is reproduced.
    assert (
        model.generate(ids, max_new_tokens=8, do_sample=False).tolist()
        == ref["p0_hf_generate_use_cache_True"].tolist()
    )


@torch.no_grad()
def test_hrm_cache_filled_at_another_depth_is_refused_and_empty_one_is_grown(hrm) -> None:
    from transformers import DynamicCache

    model, ref = hrm
    ids = torch.from_numpy(ref["p0_input_ids"])
    filled = DynamicCache(config=model.config)  # 8 slots: the trained (2, 3)
    model(ids, cache=filled, use_cache=True)
    with at_depth(model, (3, 3)), pytest.raises(DepthError, match=r"the cache has 8 layers filled at another depth; "
                                                r"H_cycles=3, L_cycles=3 needs 12"):  # fmt: skip
        model(ids[:, :1], cache=filled, use_cache=True)
    # A cache made from the trained config (8 slots) decodes at a shallower depth (4 slots used).
    trained_size = DynamicCache(config=model.config)
    with at_depth(model, (1, 3)):
        prefill = model(ids[:, :-1], cache=trained_size, use_cache=True).logits
        step = model(ids[:, -1:], cache=trained_size, use_cache=True).logits
    assert _max_diff(torch.cat([prefill, step], dim=1), ref["p0_H1_L3_logits"]) <= 1e-5
    with at_depth(model, (2, 3)), pytest.raises(DepthError, match="filled at another depth"):
        model(ids[:, :1], cache=trained_size, use_cache=True)
    empty = DynamicCache(config=model.config)
    with at_depth(model, (3, 3)):
        logits = model(ids, cache=empty, use_cache=True).logits
    assert len(empty.layers) == 12
    assert _max_diff(logits, ref["p0_H3_L3_logits"]) <= 1e-5


@torch.no_grad()
def test_inkling_passes_1_to_4_equal_the_class_built_there(inkling) -> None:
    model, ref = inkling
    for prompt in PROMPTS:
        ids = torch.from_numpy(ref[f"{prompt}_input_ids"])
        for passes in range(1, 5):
            with at_depth(model, passes):
                uncached = model(ids, use_cache=False).logits
                cached = model(ids, use_cache=True).logits
            assert _max_diff(uncached, ref[f"{prompt}_passes{passes}_logits"]) <= 1e-5, (prompt, passes)
            assert float((cached - uncached).abs().max()) <= 2e-5, (prompt, passes)  # reference: 8e-6
        with at_depth(model, (4,)):
            model(ids, use_cache=False)
        assert _max_diff(model(ids, use_cache=False).logits, ref[f"{prompt}_default_logits"]) <= 1e-5
    assert model.config.loop_num_passes == 3


@torch.no_grad()
def test_inkling_generate_at_depth_and_stale_cache_refused(inkling) -> None:
    from transformers import DynamicCache

    model, ref = inkling
    ids = torch.from_numpy(ref["p0_input_ids"])
    with at_depth(model, 1):
        cached = model.generate(ids, max_new_tokens=4, do_sample=False)
        uncached = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    assert int(cached[0, ids.shape[1]]) == int(ref["p0_passes1_logits"][0, -1].argmax())
    filled = DynamicCache(config=model.config)
    model(ids, cache=filled, use_cache=True)  # 4 layers + 2 loop layers x 2 more passes = 8
    with at_depth(model, 4), pytest.raises(DepthError, match="loop_num_passes=4 needs 10"):
        model(ids[:, :1], cache=filled, use_cache=True)


def test_restored_after_an_exception_and_bad_depths_refused(hrm) -> None:
    model, _ = hrm
    with pytest.raises(RuntimeError, match="inside"), at_depth(model, (4, 1)):
        assert (model.config.H_cycles, model.config.L_cycles, model.config.num_hidden_layers) == (4, 1, 8)
        raise RuntimeError("inside")
    assert (model.config.H_cycles, model.config.L_cycles, model.config.num_hidden_layers) == (2, 3, 8)
    for depth, message in (
        (0, "HrmTextForCausalLM: H_cycles=0: must be >= 1"),
        ((2, 0), "HrmTextForCausalLM: L_cycles=0: must be >= 1"),
        ((1, 2, 3), r"depth=\(1, 2, 3\): give r or \(H_cycles, L_cycles\)"),
        ("2", "H_cycles='2': must be an integer >= 1"),
    ):
        with pytest.raises(DepthError, match=message), at_depth(model, depth):
            pass
    assert not model._forward_pre_hooks
    assert (model.config.H_cycles, model.config.num_hidden_layers) == (2, 8)


@torch.no_grad()
def test_looped_model_at_depth_is_its_per_call_r() -> None:
    model = tiny_looped_model()
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    for r in (1, 2, 5):
        with looped_hf.at_depth(model, r):
            inside = model(ids).logits
            generated = model.generate(ids, max_new_tokens=3, do_sample=False)
            with pytest.raises(DepthError, match=rf"num_recurrences=4 inside at_depth\(model, {r}\)"):
                model(ids, num_recurrences=4)
        assert torch.equal(inside, model(ids, num_recurrences=r).logits)
        assert (
            generated.tolist()
            == model.generate(ids, max_new_tokens=3, do_sample=False, num_recurrences=r).tolist()
        )
    assert model.config.num_recurrences == 3 and not model._forward_pre_hooks
    with pytest.raises(DepthError, match="num_recurrences=1000: exceeds this model's ceiling of 192"):
        with at_depth(model, 1000):
            pass


def test_unregistered_class_refused_naming_the_registered_ones() -> None:
    with pytest.raises(DepthError) as err, at_depth(torch.nn.Linear(2, 2), 2):
        pass
    message = str(err.value)
    assert "\n" not in message
    assert message == ("Linear has no depth registry entry; registered: LoopedForCausalLM, HrmTextForCausalLM, "
                       "Inkling2LoopForCausalLM")  # fmt: skip
    assert registered_names() == [entry.name for entry in REGISTRY]
    assert entry_for_model_type("hrm_text").fields == ("H_cycles", "L_cycles")
    assert entry_for_model_type("llama") is None
    assert entry_for(tiny_looped_model()).call_kwarg == "num_recurrences"
