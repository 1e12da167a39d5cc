"""Ouro converted by ``looped-hf convert ouro`` gives the outputs of Ouro's own code.

The references are ``tests/fixtures/zoo/ouro-tiny`` (see tests/fixtures/zoo/PROVENANCE.md): a 2-layer, width-64
``OuroForCausalLM`` with random weights, saved by Ouro's remote modeling_ouro.py under transformers
4.55.4, and what that code computed in float32: logits after each loop count 1..4, each loop's
normed state and the gate's logit on it, the per-step exit distribution, logits at exit threshold
0.5 with each token's exit step, the weighted-exit logits and greedy tokens. Two prompts, 7 and 12
tokens, unpadded (Ouro masks no padding).

Measured max |delta| over both prompts, every loop count and every readout: 0.0 (float32, CPU,
torch 2.13, one thread): the converted model runs Ouro's arithmetic op for op, so the logits are
bit-identical. The tolerances leave room for another BLAS only: 1e-5 on logits (the issue asks for
1e-4), 1e-6 on the states, gate logits and exit probabilities.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_path
from transformers import AutoModelForCausalLM
from zoo_helpers import load_converted, load_reference, remote_code_results

from looped_hf import LoopedConfig
from looped_hf.convert import ConversionError, main
from looped_hf.convert.ouro import OURO_SETTINGS, convert_ouro, ouro_config, ouro_to_looped
from looped_hf.modeling_looped import (
    LoopedForCausalLM,
    exit_gate_loss,
    exit_gate_probabilities,
    threshold_exit_steps,
)

DATA = fixture_path("zoo", "ouro-tiny")
PROMPTS = ("p0", "p1")
LOOPS = (1, 2, 3, 4)
TOLERANCE = 1e-5  # logits (the issue asks for 1e-4; measured: 0.0)
TIGHT = 1e-6  # exit probabilities and the gate on the reference's own states (measured: 0.0)
# The per-loop states reach |3.8|, where a float32 ulp is 2.4e-7: on a CPU whose kernels differ from
# the fixture machine's they and the gate logits computed from them move by a few ulps (1.5e-6 seen).
TIGHT_STATES = 4e-6


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: a second OpenMP thread only adds contention on a shared machine."""


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_reference(DATA)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return convert_ouro(DATA, tmp_path_factory.mktemp("ouro") / "ouro-tiny-looped")


@pytest.fixture(scope="module")
def model(folder: Path) -> LoopedForCausalLM:
    return load_converted(folder)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> float:
    delta = (actual.detach().float() - expected.float()).abs().max().item()
    assert delta <= tolerance, f"{what}: max |delta| {delta:.3g} > {tolerance}"
    return delta


# --- the gate's arithmetic, on the reference's own states (no model around it) -------------------
def test_the_gate_turns_the_references_states_into_its_logits_exit_distribution_and_threshold_steps(ref):
    from safetensors.torch import load_file

    weights = load_file(DATA / "model.safetensors")
    gate = torch.nn.Linear(64, 1)
    gate.load_state_dict({"weight": weights["model.early_exit_gate.weight"], "bias": weights["model.early_exit_gate.bias"]})
    for p in PROMPTS:
        states = list(ref[f"{p}_step_hidden"])
        with torch.no_grad():
            logits = torch.cat([gate(s) for s in states], dim=-1)
            probs = exit_gate_probabilities(gate, states)
        assert_close(logits, ref[f"{p}_gate_logits"], 1e-6, f"{p} gate logits")
        assert_close(probs, ref[f"{p}_exit_pdf"], 1e-6, f"{p} exit distribution")
        assert torch.allclose(probs.sum(-1), torch.ones(1, probs.shape[1]), atol=1e-6)
        assert torch.equal(threshold_exit_steps(ref[f"{p}_exit_pdf"], 0.5), ref[f"{p}_thr0.5_exit_step"])
    # A CDF that rounds to just under the threshold at the last step still exits there.
    assert threshold_exit_steps(torch.tensor([[[0.25, 0.25, 0.25, 0.2499]]]), 1.0).item() == 3
    assert threshold_exit_steps(torch.tensor([[[0.6, 0.2, 0.1, 0.1]]]), 0.5).item() == 0


# --- the converted model against Ouro's outputs -------------------------------------------------
def test_the_converted_config_is_oures_whole_stack_loop(model: LoopedForCausalLM) -> None:
    c = model.config
    assert (c.num_prelude_layers, c.num_recurrent_layers, c.num_coda_layers, c.num_recurrences) == (0, 2, 0, 4)
    assert (c.norm_placement, c.recurrence_norm_weight, c.input_injection) == ("pre_and_output", "final", "none")
    assert (c.exit_gate, c.exit_gate_output, c.exit_gate_threshold) == (True, "threshold", 1.0)
    assert not c.tie_word_embeddings and c.rope_parameters["rope_theta"] == 1e6 and c.logit_softcap is None
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("loops", LOOPS)
def test_logits_after_each_loop_count_match_oures(model, ref, loops: int) -> None:
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"], num_recurrences=loops, exit_gate_output="last", use_cache=False)
        assert_close(out.logits, ref[f"{p}_loop{loops}_logits"], TOLERANCE, f"{p} logits after {loops} loops")


def test_the_default_call_gives_oures_default_logits(model, ref) -> None:
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"])
        assert_close(out.logits, ref[f"{p}_default_logits"], TOLERANCE, f"{p} default logits")
        assert torch.equal(out.recurrences_used, torch.full_like(out.recurrences_used, 4))


def test_each_loops_normed_state_gate_logit_and_exit_probability_match(model, ref) -> None:
    gate = model.model.exit_gate
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"], output_recurrent_states=True, exit_gate_output="last")
            states = torch.stack(out.recurrent_states)
            gate_logits = gate(states).squeeze(-1).permute(1, 2, 0)
        assert_close(states, ref[f"{p}_step_hidden"], TIGHT_STATES, f"{p} per-loop normed states")
        assert_close(gate_logits, ref[f"{p}_gate_logits"], TIGHT_STATES, f"{p} gate logits")
        assert_close(out.exit_probabilities, ref[f"{p}_exit_pdf"], TIGHT, f"{p} exit probabilities")
        # Each loop's logits come from lm_head on its normed state directly (no second norm).
        for k in LOOPS:
            assert_close(model.lm_head(states[k - 1]), ref[f"{p}_loop{k}_logits"], TOLERANCE, f"{p} lm_head(s_{k})")


def test_threshold_exit_gives_oures_logits_and_per_token_exit_steps(model, ref) -> None:
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"], exit_gate_output="threshold", exit_gate_threshold=0.5)
        steps = ref[f"{p}_thr0.5_exit_step"]
        assert torch.equal(out.recurrences_used, steps + 1)
        assert_close(out.logits, ref[f"{p}_thr0.5_logits"], TOLERANCE, f"{p} threshold-0.5 logits")
    # The fixture exercises more than one exit step, so a readout that ignores them would fail.
    assert len(set(torch.cat([ref[f"{p}_thr0.5_exit_step"].flatten() for p in PROMPTS]).tolist())) > 1


def test_weighted_exit_gives_oures_expected_logits(model, ref) -> None:
    for p in PROMPTS:
        with torch.no_grad():
            out = model(ref[f"{p}_input_ids"], exit_gate_output="weighted")
        assert_close(out.logits, ref[f"{p}_weighted_logits"], TOLERANCE, f"{p} weighted-exit logits")


def test_logits_to_keep_slices_every_readout_alike(model, ref) -> None:
    ids = ref["p1_input_ids"]
    for output in ("last", "threshold", "weighted"):
        with torch.no_grad():
            full = model(ids, exit_gate_output=output, exit_gate_threshold=0.5)
            last = model(ids, exit_gate_output=output, exit_gate_threshold=0.5, logits_to_keep=1)
        assert torch.allclose(last.logits, full.logits[:, -1:], atol=1e-6), output
        if full.recurrences_used is not None:
            assert torch.equal(last.recurrences_used, full.recurrences_used[:, -1:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_is_token_equal_to_oures(model, ref, use_cache: bool) -> None:
    for p in PROMPTS:
        ids = ref[f"{p}_input_ids"]
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=use_cache, pad_token_id=0)
        assert torch.equal(tokens, ref[f"{p}_greedy_nocache"]), p
        assert torch.equal(tokens, ref[f"{p}_hf_generate_use_cache_False"]), p


def test_the_converted_folder_loads_as_remote_code_with_oures_logits(folder: Path, tmp_path: Path) -> None:
    deltas = remote_code_results(folder, DATA / "reference.npz", """
for p in ("p0", "p1"):
    ids = torch.from_numpy(ref[p + "_input_ids"])
    out[p] = (m(ids).logits - torch.from_numpy(ref[p + "_default_logits"])).abs().max().item()
""", tmp_path)
    assert max(deltas.values()) <= TOLERANCE, deltas


# --- Ouro's training objective ----------------------------------------------------------------
def test_the_entropy_regularised_loss_is_sum_p_t_l_t_minus_beta_h_computed_by_hand(folder: Path, ref) -> None:
    beta = 0.1
    model = AutoModelForCausalLM.from_pretrained(folder, exit_gate_entropy_beta=beta, dtype=torch.float32)
    ids = ref["p1_input_ids"]
    labels = ids.clone()
    labels[0, 3] = -100  # an ignored label is left out of both terms
    out = model(ids, labels=labels, output_recurrent_states=True)
    states = out.recurrent_states
    p = out.exit_probabilities[0]  # (tokens, steps)
    # By hand: per position i predicting labels[i + 1], sum_t p_t CE_t - beta H(p), averaged.
    terms = []
    for i in range(ids.shape[1] - 1):
        target = labels[0, i + 1].item()
        if target == -100:
            continue
        expected_loss = sum(p[i, t] * -torch.log_softmax(model.lm_head(states[t][0, i]), -1)[target] for t in range(4))
        entropy = -sum(p[i, t] * torch.log(p[i, t]) for t in range(4))
        terms.append(expected_loss - beta * entropy)
    by_hand = torch.stack(terms).mean()
    # The threshold readout (the converted default, 1.0) picks from the step logits the loss computed.
    assert_close(out.logits, ref["p1_default_logits"], TOLERANCE, "threshold readout beside Ouro's loss")
    assert abs(out.loss.item() - by_hand.item()) < 1e-5, (out.loss.item(), by_hand.item())
    out.loss.backward()
    assert model.model.exit_gate.weight.grad is not None and model.model.exit_gate.weight.grad.abs().sum() > 0
    # Without beta the loss is the returned logits' cross-entropy, and the formula differs from it.
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids, labels=labels)
    assert abs(plain.loss.item() - by_hand.item()) > 1e-3
    assert plain.loss.item() == pytest.approx(
        F.cross_entropy(plain.logits[0, :-1], labels[0, 1:], ignore_index=-100).item(), abs=1e-6)


def test_exit_gate_loss_divides_by_num_items_in_batch_when_given() -> None:
    torch.manual_seed(0)
    logits = [torch.randn(1, 5, 7) for _ in range(3)]
    probs = torch.softmax(torch.randn(1, 5, 3), -1)
    labels = torch.randint(0, 7, (1, 5))
    mean = exit_gate_loss(logits, probs, labels, 0.2)
    summed = exit_gate_loss(logits, probs, labels, 0.2, num_items_in_batch=1)
    assert summed.item() == pytest.approx(mean.item() * 4, rel=1e-6)  # 4 labelled positions after the shift


# --- accounting -------------------------------------------------------------------------------
def test_the_gate_counts_in_n_rec_and_the_weighted_readout_pays_r_head_passes(model) -> None:
    params = model.num_scaling_params()
    d, layers = model.config.hidden_size, model.model.recurrent_layers
    assert params["recurrent"] == sum(p.numel() for p in layers.parameters()) + d + 1
    assert params["once"] == d  # the final norm, which also closes every loop
    last = model.inference_flops_per_token(16)
    model.config.exit_gate_output = "weighted"
    try:
        weighted = model.inference_flops_per_token(16)
    finally:
        model.config.exit_gate_output = "threshold"
    assert weighted - last == 2 * 3 * model.config.vocab_size * d  # three more head passes


# --- refusals ---------------------------------------------------------------------------------
def test_the_gate_and_adaptive_exit_are_refused_together_in_one_line(model, ref) -> None:
    with pytest.raises(ValueError, match=r"^LoopedConfig\.exit_criterion='kl': refused with exit_gate=True"):
        LoopedConfig(**{**OURO_SETTINGS, "exit_criterion": "kl"})
    with pytest.raises(ValueError, match=r"^exit_criterion='cosine': refused with exit_gate=True") as err:
        model(ref["p0_input_ids"], exit_criterion="cosine")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^exit_gate_output='weighted': .*num_coda_layers=2"):
        LoopedConfig(exit_gate=True).exit_gate_settings("weighted")
    with pytest.raises(ValueError, match=r"^exit_gate_threshold=1\.5: must be a number in \[0, 1\]"):
        model(ref["p0_input_ids"], exit_gate_threshold=1.5)
    with pytest.raises(ValueError, match=r"^exit_gate_output='weighted': this model has no exit gate"):
        LoopedConfig().exit_gate_settings("weighted")


def test_a_config_without_the_gate_keys_builds_no_gate_and_no_gate_weights() -> None:
    saved = {k: v for k, v in LoopedConfig().to_diff_dict().items() if not k.startswith("exit_gate")}
    model = LoopedForCausalLM(LoopedConfig.from_dict(saved))
    assert model.model.exit_gate is None and not any("exit_gate" in key for key in model.state_dict())
    assert model(torch.tensor([[1, 2, 3]])).exit_probabilities is None


def _copy(tmp_path: Path, **changes) -> Path:
    src = tmp_path / "ouro-src"
    shutil.copytree(DATA, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize(("changes", "message"), [
    ({"flux_capacitor": 3}, "config.json flux_capacitor=3: unknown Ouro config key"),
    ({"early_exit_step": 1}, "config.json early_exit_step=1: a fixed exit step is not converted"),
    ({"use_sliding_window": True}, "config.json use_sliding_window=True: sliding-window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "config.json layer_types='sliding_attention'"),
    ({"hidden_act": "relu2"}, "config.json hidden_act='relu2': must be one of"),
    ({"model_type": "qwen2"}, "config.json model_type='qwen2': not an Ouro config"),
])  # fmt: skip
def test_the_cli_refuses_what_it_cannot_convert_in_one_line_and_writes_nothing(tmp_path, capsys, changes, message):
    src, out = _copy(tmp_path, **changes), tmp_path / "out"
    assert main(["ouro", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("looped-hf convert: error: ") and message in err and "\n" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_weight_ouro_does_not_have_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = _copy(tmp_path)
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(weights, src / "model.safetensors")
    with pytest.raises(ConversionError, match=r"unknown Ouro weight 'model\.layers\.0\.mystery\.weight'"):
        convert_ouro(src, tmp_path / "out")


def test_the_cli_writes_a_folder_with_a_card_and_the_tokenizer_files(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, models

    src, out = _copy(tmp_path), tmp_path / "converted"
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(src / "tokenizer.json"))
    tokenizer = (src / "tokenizer.json").read_bytes()
    assert main(["ouro", str(src), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer
    assert "[convert] wrote" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert "converted_from" in card and "format: ouro" in card
    assert json.loads((out / "config.json").read_text())["exit_gate"] is True


def test_gqa_and_rope_scaling_map_onto_the_config() -> None:
    native = json.loads((DATA / "config.json").read_text())
    native.update(num_key_value_heads=1, rope_scaling={"type": "linear", "factor": 2.0})
    config = ouro_config(native)
    assert config.num_key_value_heads == 1
    assert config.rope_parameters == {"factor": 2.0, "rope_type": "linear", "rope_theta": 1e6}
    assert math.isclose(config.exit_gate_threshold, 1.0)


def test_lora_on_every_linear_including_the_gate_trains_ouros_loss(folder: Path, ref) -> None:
    """peft's "all-linear" wraps the gate too; the gate is read through its own forward, so the
    adapter applies, and Ouro's loss reaches the gate's adapter."""
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(folder, exit_gate_entropy_beta=0.05, dtype=torch.float32)
    ids = ref["p1_input_ids"]
    with torch.no_grad():
        base = model(ids, exit_gate_output="weighted")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules="all-linear"))
    gate = lora.base_model.model.model.exit_gate
    assert isinstance(gate, peft.tuners.lora.LoraLayer)
    with torch.no_grad():
        same = lora(ids, exit_gate_output="weighted")
    assert_close(same.logits, base.logits, 1e-6, "LoRA at init")
    assert_close(same.exit_probabilities, base.exit_probabilities, 1e-6, "LoRA at init: exit probabilities")
    lora.train()
    lora(input_ids=ids, labels=ids).loss.backward()
    assert gate.lora_B["default"].weight.grad.abs().sum() > 0


def test_generate_at_another_r_and_with_a_kv_budget_decodes_as_full_forwards(model, ref) -> None:
    """Cached decoding at r = 2 (kv_budget 1 and none) picks the tokens repeated full forwards at
    r = 2 pick; at the trained r a budget of r is the default cache."""
    ids = ref["p0_input_ids"]
    expected = ids
    with torch.no_grad():
        for _ in range(6):
            nxt = model(expected, num_recurrences=2, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, num_recurrences=2), expected)
    budget = model.generate(ids, max_new_tokens=6, do_sample=False, num_recurrences=2, kv_budget=1)
    assert budget.shape == expected.shape  # a budget changes which KV later tokens read: runs, not equal
    full = model.generate(ids, max_new_tokens=8, do_sample=False, kv_budget=4)
    assert torch.equal(full, ref["p0_greedy_nocache"])


def test_a_bf16_checkpoint_converts_in_bf16(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = _copy(tmp_path)
    save_file({k: v.bfloat16() for k, v in load_file(src / "model.safetensors").items()}, src / "model.safetensors")
    model = ouro_to_looped(src)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.equal(model.model.exit_gate.bias, load_file(src / "model.safetensors")["model.early_exit_gate.bias"])
    with torch.no_grad():
        out = model(torch.tensor([[37, 235, 140, 72]]), exit_gate_output="weighted")
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()
    assert out.exit_probabilities.dtype == torch.float32  # the survival product stays in float32
    assert torch.allclose(out.exit_probabilities.sum(-1), torch.ones(1, 4))
