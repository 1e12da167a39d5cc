"""``looped-hf retrofit``: exactness against the parent, run through transformers' own classes.

Tiny parents of every supported class (random weights, norms and biases moved off their init so a
dropped or misplaced tensor shows), saved with ``save_pretrained``, retrofitted through the CLI and
loaded back from the written folder:

* loop-in-place at r = 1 is the parent (logits within 1e-5, the same greedy tokens);
* the RRT share with a full-rank per-loop LoRA is the parent (within 1e-4), through the folder's
  remote code, although every parent layer has norm scales and biases of its own (the per-loop
  module carries their deltas); at a lower rank it is not;
* a ``--layers`` retrofit holds the parent's tensors of every kept layer bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_without_looped_hf
from safetensors.torch import load_file
from zoo_helpers import save_char_tokenizer

from looped_hf.cli import main as cli_main
from looped_hf.fileio import sha256_file
from looped_hf.retrofit.plan import paper_rule, share

VOCAB = 61
FAMILIES = ("llama", "llama_tied", "mistral", "qwen2", "qwen3", "olmo2")


def parent_config(family: str, num_layers: int = 6, **overrides):
    """A tiny config of ``family``'s transformers class: GQA (4 heads, 2 KV heads), llama3 RoPE
    scaling for Llama, tied head for ``llama_tied`` (SmolLM's shape)."""
    from transformers import LlamaConfig, MistralConfig, Olmo2Config, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None)  # fmt: skip
    common.update(overrides)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
        return LlamaConfig(**common, rope_parameters=rope)
    if family == "llama_tied":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "llama_bias":
        return LlamaConfig(**common, attention_bias=True, mlp_bias=True)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, head_dim=16)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    return Olmo2Config(**common)


def tiny_parent(folder: Path, family: str, *, num_layers: int = 6, seed: int = 0, **overrides) -> Path:
    """Save a tiny random parent of ``family`` (and a character tokenizer) to ``folder``.

    Every norm scale and bias is moved off its init (1 / 0), drawn anew in every layer, as in a
    trained parent. ``overrides`` change the config (e.g. heads of 32 for vLLM's CPU attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(parent_config(family, num_layers, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, p.shape[1] ** -0.5 if "embed" not in name else 1.0)
            else:
                p.copy_((1 if name.endswith("norm.weight") else 0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    save_char_tokenizer(folder, VOCAB)
    return folder


def retrofit(*argv: str) -> None:
    assert cli_main(["retrofit", *map(str, argv)]) == 0


def prompts() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def load_pair(parent: Path, folder: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    import looped_hf  # noqa: F401  (registers the looped classes)

    reference = AutoModelForCausalLM.from_pretrained(parent).eval()
    looped = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    return reference, looped


@pytest.mark.parametrize("family", FAMILIES)
def test_loop_in_place_at_one_recurrence_is_the_parent(tmp_path, family):
    parent = tiny_parent(tmp_path / "parent", family)
    retrofit(parent, "--loop-in-place", "--layers", "2,3,1")
    reference, looped = load_pair(parent, tmp_path / "parent-retrofit")
    assert type(looped).__name__ == "LoopedForCausalLM" and looped.config.num_recurrences == 1
    ids = prompts()
    with torch.no_grad():
        torch.testing.assert_close(looped(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(looped.generate(ids, **greedy), reference.generate(ids, **greedy))


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}],
    ids=lambda rope: rope["rope_type"],
)  # fmt: skip
def test_loop_in_place_carries_every_rope_type_it_accepts(tmp_path, rope):
    # max_position_embeddings 8 < the 12 prompt tokens + 6 generated: dynamic scaling recomputes.
    parent = tiny_parent(tmp_path / "parent", "llama_tied", num_layers=2, max_position_embeddings=8,
                         rope_parameters={"rope_theta": 10000.0, **rope})  # fmt: skip
    retrofit(parent, "--loop-in-place", "--layers", "0,2,0")
    reference, looped = load_pair(parent, tmp_path / "parent-retrofit")
    assert looped.config.rope_parameters["rope_type"] == rope["rope_type"]
    ids = prompts()
    with torch.no_grad():
        torch.testing.assert_close(looped(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(looped.generate(ids, **greedy), reference.generate(ids, **greedy))


@pytest.mark.parametrize("family", (*FAMILIES, "llama_bias"))
def test_shared_stack_with_full_rank_loop_lora_is_the_parent(tmp_path, family):
    parent = tiny_parent(tmp_path / "parent", family)
    vectors = [k for k in load_file(parent / "model.safetensors") if k.startswith("model.layers.0.") and
               (k.endswith("norm.weight") or k.endswith(".bias"))]  # fmt: skip
    assert vectors, "the parent has per-layer norm scales / biases that differ between tied layers"
    retrofit(parent, "--share", "average", "--blocks", "2", "--lora-rank", "64", "--out", tmp_path / "rrt")
    reference, looped = load_pair(parent, tmp_path / "rrt", trust_remote_code=True)
    assert type(looped).__name__ == "LoopLoRAForCausalLM" and looped.config.num_recurrences == 3
    ids = prompts()
    with torch.no_grad():
        torch.testing.assert_close(looped(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(looped.generate(ids, **greedy), reference.generate(ids, **greedy))


def test_low_rank_loop_lora_is_not_the_parent_and_shares_keep_their_sources(tmp_path):
    parent = tiny_parent(tmp_path / "parent", "qwen2")
    retrofit(parent, "--share", "average", "--blocks", "2", "--lora-rank", "4", "--out", tmp_path / "low")
    reference, looped = load_pair(parent, tmp_path / "low", trust_remote_code=True)
    assert looped.model.loop_lora.steps[0][0]["q_proj_delta"].A.shape == (4, 64)
    # Loop 1's block layer 0 stands for parent layer 2: its q delta is the best rank-4 part of the
    # residual, what is left its other singular values; its bias delta is the whole residual.
    theirs, ours = load_file(parent / "model.safetensors"), load_file(tmp_path / "low" / "model.safetensors")
    residual = (
        theirs["model.layers.2.self_attn.q_proj.weight"]
        - ours["model.recurrent_layers.0.self_attn.q_proj.weight"]
    )
    pair = looped.model.loop_lora.steps[1][0]["q_proj_delta"]
    with torch.no_grad():
        left = torch.linalg.matrix_norm(residual - pair.B @ pair.A)
        torch.testing.assert_close(left, torch.linalg.svdvals(residual)[4:].norm(), rtol=1e-4, atol=0)
        shared_bias = ours["model.recurrent_layers.0.self_attn.q_proj.bias"]
        torch.testing.assert_close(shared_bias + pair.bias, theirs["model.layers.2.self_attn.q_proj.bias"])
    assert left > 0.1
    vectors = json.loads((tmp_path / "low" / "retrofit.json").read_text())["lora"]["vectors"]
    assert {"input_layernorm.weight", "self_attn.v_proj.bias", "self_attn.o_proj.bias"} <= set(vectors)
    ids = prompts()
    with torch.no_grad():
        assert (looped(ids).logits - reference(ids).logits).abs().max() > 1e-2
    # A call past the loops that have a LoRA is refused by name.
    with pytest.raises(ValueError, match="num_recurrences=4"):
        looped(ids, num_recurrences=4)


def test_loop_lora_parameters_and_flops_match_a_hand_count(tmp_path):
    parent = tiny_parent(tmp_path / "parent", "llama")
    retrofit(parent, "--share", "lower", "--blocks", "2", "--lora-rank", "4", "--out", tmp_path / "rrt")
    _, looped = load_pair(parent, tmp_path / "rrt", trust_remote_code=True)
    # Per block layer and loop: rank * (in + out) per projection (d = 64, q 4x16, k/v 2x16, MLP 96)
    # and the two pre-norm scales (64 each); 2 block layers, 3 loops.
    shapes = {"q": (64, 64), "k": (64, 32), "v": (64, 32), "o": (64, 64), "gate": (64, 96), "up": (64, 96),
              "down": (96, 64)}  # fmt: skip
    matrices = 2 * sum(4 * (n_in + n_out) for n_in, n_out in shapes.values())  # one loop's
    assert looped.num_scaling_params()["loop_lora"] == 3 * (matrices + 2 * 2 * 64)
    with_lora = {r: looped.training_flops_per_token(32, r) for r in (1, 3)}
    inference = looped.inference_flops_per_token(32)
    looped.config.backprop_recurrences = 1
    truncated = looped.training_flops_per_token(32)
    looped.model.loop_lora = None  # the same model without its deltas: what the accounting adds is theirs
    looped.config.backprop_recurrences = None
    # 2 * rank * (in + out) FLOPs per token and projection forward, x3 with backward, every loop run.
    assert with_lora[1] - looped.training_flops_per_token(32, 1) == 6 * matrices
    assert with_lora[3] - looped.training_flops_per_token(32, 3) == 3 * 6 * matrices
    assert inference - looped.inference_flops_per_token(32) == 3 * 2 * matrices
    looped.config.backprop_recurrences = 1  # truncated backprop: the first two loops forward only
    assert truncated - looped.training_flops_per_token(32) == (6 + 2 * 2) * matrices


@pytest.mark.parametrize("family", FAMILIES)
def test_layers_retrofit_keeps_every_kept_layer_bit_for_bit(tmp_path, family):
    parent = tiny_parent(tmp_path / "parent", family)
    retrofit(parent, "--layers", "2,2,1", "--out", tmp_path / "out")
    theirs = load_file(parent / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    layer_map = {"prelude_layers": [0, 1], "recurrent_layers": [3, 4], "coda_layers": [5]}
    compared = 0
    for name, tensor in ours.items():
        parts = name.split(".")
        if parts[1] in layer_map:
            source = f"model.layers.{layer_map[parts[1]][int(parts[2])]}.{'.'.join(parts[3:])}"
            if family == "qwen2" and name.endswith("o_proj.bias"):
                assert not tensor.any() and source not in theirs  # Qwen2's o_proj has no bias: zero
                continue
        elif name == "model.injection.weight":
            torch.testing.assert_close(
                tensor, torch.cat([torch.eye(64), torch.zeros(64, 64)], 1), rtol=0, atol=0
            )
            continue
        else:
            source = name
        assert torch.equal(tensor, theirs[source]), name
        compared += 1
    assert compared == len(theirs) - _dropped(theirs, 2)  # every parent tensor but the dropped layer's
    record = json.loads((tmp_path / "out" / "retrofit.json").read_text())
    assert record["layer_map"]["dropped"] == [2]
    assert record["layer_map"]["recurrent"] == [3, 4]


def _dropped(tensors: dict, layer: int) -> int:
    return sum(name.startswith(f"model.layers.{layer}.") for name in tensors)


def test_paper_rule_picks_the_published_layers():
    tinyllama = paper_rule(22, 4, 8, 4)
    assert (list(tinyllama.prelude), [g[0] for g in tinyllama.recurrent], list(tinyllama.coda)) == (
        [0, 1, 2, 3], list(range(10, 18)), [18, 19, 20, 21])  # fmt: skip
    assert tinyllama.dropped == list(range(4, 10))
    olmo = paper_rule(16, 4, 6, 4)
    assert ([g[0] for g in olmo.recurrent], olmo.dropped) == (list(range(6, 12)), [4, 5])


def test_share_strategies_pick_their_source_layers():
    assert [g for g in share(12, 4, "stepwise").recurrent] == [(0,), (4,), (7,), (11,)]
    assert [g for g in share(12, 4, "lower").recurrent] == [(0,), (1,), (2,), (3,)]
    average = share(12, 4, "average")
    assert average.recurrent[1] == (1, 5, 9) and average.num_recurrences == 3
    assert average.unrolled[2] == (8, 9, 10, 11)


def test_average_share_holds_the_mean_of_its_tied_layers(tmp_path):
    parent = tiny_parent(tmp_path / "parent", "llama")
    retrofit(parent, "--share", "average", "--blocks", "3", "--out", tmp_path / "avg")
    theirs, ours = load_file(parent / "model.safetensors"), load_file(tmp_path / "avg" / "model.safetensors")
    key = "self_attn.q_proj.weight"
    mean = (theirs[f"model.layers.1.{key}"] + theirs[f"model.layers.4.{key}"]) / 2
    torch.testing.assert_close(ours[f"model.recurrent_layers.1.{key}"], mean)
    config = json.loads((tmp_path / "avg" / "config.json").read_text())
    assert (config["input_injection"], config["state_init"], config["num_recurrences"]) == (
        "none",
        "prelude",
        2,
    )


def test_folder_names_the_parent_and_carries_its_tokenizer(tmp_path):
    parent = tiny_parent(tmp_path / "parent", "llama")
    retrofit(parent, "--layers", "1,2,1", "--adapter-init", "study", "--state-init", "zeros", "--seed", "3")
    folder = tmp_path / "parent-retrofit"
    record = json.loads((folder / "retrofit.json").read_text())
    assert record["parent"]["weights_sha256"] == {
        "model.safetensors": sha256_file(parent / "model.safetensors")
    }
    assert record["parent"]["config"] == json.loads((parent / "config.json").read_text())
    assert record["parent"]["architectures"] == ["LlamaForCausalLM"] and record["method"] == "retrofit"
    assert (record["adapter_init"], record["state_init"], record["seed"]) == ("study", "zeros", 3)
    card = (folder / "README.md").read_text()
    assert (
        "LlamaForCausalLM" in card and sha256_file(parent / "model.safetensors") in card and "[3, 4]" in card
    )
    assert (folder / "tokenizer.json").read_bytes() == (parent / "tokenizer.json").read_bytes()
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["num_key_value_heads"] == 2
    # The study adapter is the paper's random nn.Linear (bound 1/sqrt(2d)), seeded: not [I | 0].
    adapter = load_file(folder / "model.safetensors")["model.injection.weight"]
    assert adapter.abs().max() <= 1 / (2 * 64) ** 0.5 and not torch.equal(adapter[:, :64], torch.eye(64))


def test_retrofitted_folder_loads_as_remote_code_without_looped_hf(tmp_path):
    parent = tiny_parent(tmp_path / "parent", "qwen3")
    retrofit(parent, "--loop-in-place", "--out", tmp_path / "lip")
    retrofit(parent, "--share", "lower", "--blocks", "3", "--lora-rank", "64", "--out", tmp_path / "rrt")
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(parent).eval()
    ids = prompts()
    with torch.no_grad():
        torch.save({"ids": ids, "logits": reference(ids).logits}, tmp_path / "ref.pt")
    script = f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        for folder, atol in (({str(tmp_path / "lip")!r}, 1e-5), ({str(tmp_path / "rrt")!r}, 1e-4)):
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                torch.testing.assert_close(model(ref["ids"]).logits, ref["logits"], rtol=0, atol=atol)
            AutoTokenizer.from_pretrained(folder)
        # The per-loop LoRA model (the last one), saved again from its remote code, ships that code.
        model.save_pretrained({str(tmp_path / "resaved")!r})
        again = AutoModelForCausalLM.from_pretrained({str(tmp_path / "resaved")!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ref["ids"]).logits, ref["logits"], rtol=0, atol=1e-4)
        print("REMOTE-OK")
        """
    assert "REMOTE-OK" in run_without_looped_hf(script, tmp_path)
