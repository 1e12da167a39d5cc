"""The logit lens decodes a recurrence's state as the forward decodes the last one, for every design.

``logit_lens`` of the last state must be the model's own logits whatever runs after the loop: a
post-loop norm (Huginn's, its own weight or the final norm's), a recurrence norm that is the final
norm (Ouro's, which then does not run again after the loop), an exit gate, a coda or none. The
norms get random weights: at their init (all ones) an RMSNorm applied twice is nearly the same as
once, which would hide a norm run twice or skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, tiny_looped_model
from zoo_helpers import ZOO_FORMATS, convert_zoo

from looped_hf import LoopedForCausalLM

# Every norm placement, post-loop norm, shared recurrence norm, gate and coda combination the
# designs use, plus the corners between them.
DESIGNS = {
    "study": {},
    "huginn_like": dict(norm_placement="sandwich", post_loop_norm="final", recurrence_norm=False,
                        embedding_norm=False, input_injection="linear", state_init="truncated_normal",
                        state_init_std=0.0),
    "post_loop_own": dict(post_loop_norm="own"),
    "ouro_like": dict(norm_placement="pre_and_output", num_prelude_layers=0, num_coda_layers=0,
                      input_injection="none", recurrence_norm=True, recurrence_norm_weight="final",
                      embedding_norm=False, exit_gate=True),
    "shared_recurrence_norm_with_coda": dict(recurrence_norm_weight="final", exit_gate=True),
    "olmo_like": dict(norm_placement="sublayer_output", qk_norm="learnable_projection_before_rope",
                      recurrence_norm=False, num_coda_layers=0),
    "post_loop_final_no_coda": dict(post_loop_norm="final", num_coda_layers=0),
    "hyperconnection": dict(input_injection="hyperconnection", post_loop_norm="own"),
}  # fmt: skip


def with_random_norms(model: LoopedForCausalLM, seed: int = 7) -> LoopedForCausalLM:
    """``model`` with every norm weight drawn around 1 (as trained norms are), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def lens_gap(model: LoopedForCausalLM, through_coda: bool = True) -> float:
    x = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    # With a gate the returned logits are the last recurrence's only under the "last" readout.
    readout = {"exit_gate_output": "last"} if model.config.exit_gate else {}
    with torch.no_grad():
        out = model(x, output_recurrent_states=True, **readout)
        lens = model.logit_lens(out.recurrent_states, through_coda=through_coda)
    assert len(lens) == model.config.num_recurrences
    return float((lens[-1] - out.logits).abs().max())


@pytest.mark.parametrize("design", DESIGNS)
def test_the_lens_of_the_last_state_is_the_models_own_logits(design: str) -> None:
    model = with_random_norms(tiny_looped_model(**DESIGNS[design]))
    assert lens_gap(model) <= 1e-5
    if model.config.num_coda_layers == 0:
        assert lens_gap(model, through_coda=False) <= 1e-5  # nothing to skip


@pytest.fixture(scope="module")
def zoo_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoopedForCausalLM]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: LoopedForCausalLM.from_pretrained(convert_zoo(name, Path(root) / name)).eval()
            for name in ZOO_FORMATS}  # fmt: skip


@pytest.mark.parametrize("name", ZOO_FORMATS)
def test_the_lens_of_the_last_state_is_the_converted_zoo_models_logits(name: str, zoo_models) -> None:
    # The converted checkpoints carry their trained norm weights (Huginn's post-loop ln_f, Ouro's
    # shared final norm): each design's lens reads them as its forward does.
    assert lens_gap(zoo_models[name]) <= 1e-5


def test_the_lens_decodes_every_recurrence_not_only_the_last() -> None:
    model = with_random_norms(tiny_looped_model(**DESIGNS["huginn_like"]))
    x = torch.randint(3, TINY_VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lens = model.logit_lens(model(x, output_recurrent_states=True).recurrent_states)
        # Recurrence 1's decoding is the logits of a forward that ran one recurrence.
        torch.testing.assert_close(lens[0], model(x, num_recurrences=1).logits, rtol=0, atol=1e-5)
    assert not torch.allclose(lens[0], lens[-1])
