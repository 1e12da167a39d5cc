"""Training a retrofit through the Trainer: the curriculum over the mean r, the distillation loss,
the paper's optimizer split, a frozen backbone, LoRA, the teacher's FLOPs, resume (docs/retrofit.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_optim import _Crash  # kills a run after a given optimizer step, as the muonh resume test does
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import RecipeError, parse_recipe
from looped_hf.data import load_tokenizer
from looped_hf.optim import build_optimizer, learning_rates
from looped_hf.recurrence import RecurrenceCurriculum, draw_num_recurrences
from looped_hf.train import train
from looped_hf.trainer import distillation_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH, HEADS, HEAD_DIM, FFN = 32, 2, 16, 64


# --- the curriculum ---------------------------------------------------------------------------
# 100 steps, fraction 0.75: W = 75 warm-up steps. 1-sqrt, 1 -> 4: f = 1 - sqrt(1 - s/75), mean = max(1, ceil(4 f)).
#   s = 0: f = 0 -> 1;  s = 30: f = 1 - sqrt(0.6) = 0.2254 -> ceil(0.90) = 1;  s = 40: f = 1 - sqrt(0.4667) = 0.3169
#   -> ceil(1.27) = 2;  s = 60: f = 1 - sqrt(0.2) = 0.5528 -> ceil(2.21) = 3;  s = 70: f = 0.7418 -> ceil(2.97) = 3;
#   s = 74: f = 0.8845 -> ceil(3.54) = 4;  s >= 75: 4.
# linear, 1 -> 4: mean = max(1, ceil(4 s / 75)).  s = 18: 0.96 -> 1;  s = 19: 1.01 -> 2;  s = 56: 2.99 -> 3;
#   s = 57: 3.04 -> 4.  Start 2 (the paper's adapter-only run): a floor, max(2, ceil(4 f)).
@pytest.mark.parametrize(
    ("shape", "start", "expected"),
    [
        ("1-sqrt", 1, {0: 1, 30: 1, 40: 2, 60: 3, 70: 3, 74: 4, 75: 4, 99: 4}),
        ("linear", 1, {0: 1, 18: 1, 19: 2, 56: 3, 57: 4, 75: 4}),
        ("1-sqrt", 2, {0: 2, 30: 2, 40: 2, 60: 3, 74: 4}),
    ],
)
def test_curriculum_mean_at_chosen_steps_matches_hand_values(shape, start, expected):
    curriculum = RecurrenceCurriculum(shape, start, 4, 0.75, 100)
    assert curriculum.warmup_steps == 75
    assert {step: curriculum.mean_at(step) for step in expected} == expected


def test_curriculum_of_exactly_representable_products_does_not_round_up_past_them():
    # linear, 1 -> 4 over 4 steps: s = 3 gives 4 x 0.75 = 3 exactly (3.0000000000000004 in floats).
    assert [RecurrenceCurriculum("linear", 1, 4, 1.0, 4).mean_at(s) for s in range(5)] == [1, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [({"shape": "cosine"}, "recurrence_curriculum='cosine'"), ({"start": 5}, "curriculum_start=5"),
     ({"fraction": 0.0}, "curriculum_fraction=0.0")],
)  # fmt: skip
def test_bad_curriculum_arguments_are_named(kwargs, names):
    args = {"shape": "linear", "start": 1, "maximum": 4, "fraction": 0.75, "max_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=names):
        RecurrenceCurriculum(**args)


def test_a_mean_of_one_runs_r_one_and_larger_means_use_the_sampler():
    assert {draw_num_recurrences(1, step, 0, "poisson_lognormal") for step in range(50)} == {1}
    assert len({draw_num_recurrences(4, step, 0, "poisson_lognormal") for step in range(50)}) > 2


# --- the distillation loss ----------------------------------------------------------------------
def test_distillation_loss_matches_a_hand_computation_on_fixed_logits():
    # One sequence of 3 tokens, vocabulary 3. Positions 0 and 1 predict labels 1 and 2; label 2 is
    # -100, so only position 0 counts (and position 2, the last, never does).
    student = torch.tensor([[[1.0, 2.0, 0.0], [5.0, 5.0, 5.0], [9.0, 0.0, 0.0]]])
    teacher = torch.tensor([[[0.0, 2.0, 4.0], [0.0, 0.0, 9.0], [0.0, 9.0, 0.0]]])
    labels = torch.tensor([[7, 1, -100]])
    ce = torch.tensor(1.25)
    alpha, T = 0.5, 2.0

    def softmax(xs):
        exps = [math.exp(x / T) for x in xs]
        return [e / sum(exps) for e in exps]

    p_t, p_s = softmax([0.0, 2.0, 4.0]), softmax([1.0, 2.0, 0.0])
    kl = sum(t * (math.log(t) - math.log(s)) for t, s in zip(p_t, p_s))  # KL(teacher || student) at T
    loss, got_kl = distillation_loss(student, teacher, labels, ce, alpha=alpha, temperature=T)
    assert got_kl.item() == pytest.approx(kl, rel=1e-6)
    assert loss.item() == pytest.approx(alpha * 1.25 + (1 - alpha) * T**2 * kl, rel=1e-6)
    # Two valid positions: the mean of the two per-position KLs (the paper's batchmean).
    labels2 = torch.tensor([[7, 1, 2]])
    p_t2, p_s2 = softmax([0.0, 0.0, 9.0]), softmax([5.0, 5.0, 5.0])
    kl2 = sum(t * (math.log(t) - math.log(s)) for t, s in zip(p_t2, p_s2))
    assert distillation_loss(student, teacher, labels2, ce)[1].item() == pytest.approx(
        (kl + kl2) / 2, rel=1e-6
    )


# --- tiny parents and looped folders ----------------------------------------------------------
def _vocab() -> int:
    return len(load_tokenizer("bytes"))


@pytest.fixture
def looped_folder(tmp_path: Path) -> Path:
    """A saved tiny looped model (prelude 1, block 1, coda 1, linear adapter) + the bytes tokenizer."""
    torch.manual_seed(0)
    config = LoopedConfig(
        vocab_size=_vocab(), hidden_size=WIDTH, num_attention_heads=HEADS, head_dim=HEAD_DIM,
        intermediate_size=FFN, num_prelude_layers=1, num_recurrent_layers=1, num_coda_layers=1,
        num_recurrences=4, input_injection="linear",
    )  # fmt: skip
    folder = tmp_path / "looped"
    LoopedForCausalLM(config).save_pretrained(folder)
    load_tokenizer("bytes").save_pretrained(folder)
    return folder


def _llama_parent(folder: Path, num_layers: int, seed: int) -> Path:
    """A tiny dense LlamaForCausalLM (transformers' own class) with the bytes tokenizer, saved."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=_vocab(), hidden_size=WIDTH, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=HEAD_DIM, intermediate_size=FFN, num_hidden_layers=num_layers, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer("bytes").save_pretrained(folder)
    return folder


@pytest.fixture
def dense_parent(tmp_path: Path) -> Path:
    return _llama_parent(tmp_path / "parent", num_layers=2, seed=1)


def _recipe(tiny_recipe: dict, folder: Path, **changes) -> dict:
    recipe = {k: v for k, v in tiny_recipe.items() if k not in {"hidden_size", "head_dim", "num_prelude_layers",
                                                                "num_recurrent_layers", "num_coda_layers"}}  # fmt: skip
    recipe.update(init_from=str(folder), num_recurrences=4, backprop_recurrences=2)
    recipe.update(changes)
    return recipe


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


# --- the optimizer split ----------------------------------------------------------------------
def test_the_papers_optimizer_split_muon_for_the_body_adamw_for_embeddings_head_and_norms(
    tiny_recipe, looped_folder
):
    _, _, args = parse_recipe(_recipe(tiny_recipe, looped_folder, optimizer="muon", muon_learning_rate=1e-3,
                                      learning_rate=5e-5))  # fmt: skip
    model = LoopedForCausalLM.from_pretrained(looped_folder)
    optimizer = build_optimizer(model, args)
    assert learning_rates(optimizer) == {"muon": 1e-3, "adamw": 5e-5}
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {g["name"]: {names[id(p)] for p in g["params"]} for g in optimizer.param_groups}
    assert all(n.endswith(("proj.weight", "injection.weight")) for n in by_group["muon"])
    assert "model.injection.weight" in by_group["muon"]
    assert any("recurrent_layers.0.mlp" in n for n in by_group["muon"])
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= by_group["adamw"]
    assert all(n in {"model.embed_tokens.weight", "lm_head.weight"} or "norm" in n for n in by_group["adamw"])
    assert by_group["muon"] | by_group["adamw"] == set(names.values())


def test_lora_with_muon_is_refused_naming_the_optimizer(tiny_recipe, looped_folder):
    with pytest.raises(RecipeError, match="optimizer='muon'"):
        parse_recipe(_recipe(tiny_recipe, looped_folder, optimizer="muon", lora_rank=4))


@pytest.mark.parametrize(
    ("changes", "names"),
    [({"curriculum_start": 2}, "curriculum_start=2"), ({"lora_alpha": 8}, "lora_alpha=8"),
     ({"distill_alpha": 0.3}, "distill_alpha=0.3"), ({"freeze_backbone": True, "lora_rank": 4}, "lora_rank=4"),
     ({"init_from": "/no/such/folder"}, "init_from")],
)  # fmt: skip
def test_retrofit_fields_out_of_context_are_refused_naming_the_field(
    tiny_recipe, looped_folder, changes, names
):
    with pytest.raises(RecipeError, match=names):
        parse_recipe(_recipe(tiny_recipe, looped_folder, **changes))


def test_curriculum_start_above_num_recurrences_is_refused_by_check(tiny_recipe, looped_folder):
    from looped_hf.train import check_recipe

    with pytest.raises(RecipeError, match="curriculum_start=5"):
        check_recipe(_recipe(tiny_recipe, looped_folder, recurrence_curriculum="linear", curriculum_start=5))


# --- runs ---------------------------------------------------------------------------------------
def test_a_run_starts_from_the_folders_weights(tiny_recipe, looped_folder, tmp_path):
    record = train(*parse_recipe(_recipe(tiny_recipe, looped_folder, max_steps=1, learning_rate=1e-12,
                                         output_dir=str(tmp_path / "run"))))  # fmt: skip
    assert record["status"] == "ok", record.get("traceback")
    before, after = _weights(looped_folder), _weights(tmp_path / "run")
    assert all(torch.allclose(before[k], after[k], atol=1e-6) for k in before)
    assert record["init_from"] == str(looped_folder) and record["config"]["num_recurrences"] == 4


def test_frozen_backbone_trains_only_the_adapter(tiny_recipe, looped_folder, tmp_path):
    record = train(*parse_recipe(_recipe(tiny_recipe, looped_folder, freeze_backbone=True, max_steps=3,
                                         output_dir=str(tmp_path / "run"))))  # fmt: skip
    assert record["status"] == "ok", record.get("traceback")
    before, after = _weights(looped_folder), _weights(tmp_path / "run")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"model.injection.weight"}
    assert record["trainable"] == {
        "parameters": 2 * WIDTH * WIDTH,
        "of": record["trainable"]["of"],
        "mode": "adapter",
    }


def test_lora_through_the_trainer_saves_the_merged_looped_model(tiny_recipe, looped_folder, tmp_path):
    record = train(*parse_recipe(_recipe(tiny_recipe, looped_folder, lora_rank=4, max_steps=3, learning_rate=1e-2,
                                         output_dir=str(tmp_path / "run"))))  # fmt: skip
    assert record["status"] == "ok", record.get("traceback")
    assert (
        record["trainable"]["mode"] == "lora"
        and record["trainable"]["parameters"] < record["trainable"]["of"] / 5
    )
    before, after = _weights(looped_folder), _weights(tmp_path / "run")
    assert before.keys() == after.keys()  # a plain looped folder: no lora_A / lora_B left
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert "model.recurrent_layers.0.self_attn.q_proj.weight" in changed  # LoRA merged into a linear layer
    assert not any(k in changed for k in ("model.embed_tokens.weight", "lm_head.weight"))  # not targeted
    reloaded = LoopedForCausalLM.from_pretrained(tmp_path / "run")
    assert reloaded.config.num_recurrences == 4


def test_curriculum_run_logs_the_r_of_every_step(tiny_recipe, looped_folder, tmp_path):
    recipe = _recipe(tiny_recipe, looped_folder, recurrence_curriculum="1-sqrt", recurrence_sampling="poisson_lognormal",
                     max_steps=8, logging_steps=1, output_dir=str(tmp_path / "run"))  # fmt: skip
    log = _LogRecorder()
    record = train(*parse_recipe(recipe), callbacks=[log])
    assert record["status"] == "ok", record.get("traceback")
    curriculum = RecurrenceCurriculum("1-sqrt", 1, 4, 0.75, 8)
    expected = [draw_num_recurrences(curriculum.mean_at(s), s, 0, "poisson_lognormal") for s in range(8)]
    ran = record["sampled_recurrences"]
    assert ran["per_step"] == expected and ran["curriculum"]["shape"] == "1-sqrt"
    assert expected[0] == 1 and record["variant"] == "curriculum_sampled_r"
    assert [e["step_num_recurrences"] for e in log.entries] == expected  # logging_steps 1: every step


class _LogRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.entries: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.entries.append(state.log_history[-1])


def _teacher_flops_by_hand(seq_len: int) -> float:
    """The tiny parent's forward: per layer q, k, v, o (4 d^2), gate, up, down (3 d F), two norms
    (2 d); the final norm (d); the head V d; x2; + 4 h q T per layer."""
    layer = 4 * WIDTH * WIDTH + 3 * WIDTH * FFN + 2 * WIDTH
    body = 2 * layer + WIDTH
    return 2 * (body + _vocab() * WIDTH) + 4 * HEADS * HEAD_DIM * seq_len * 2


def test_distillation_run_counts_the_teachers_forward_in_the_flops(
    tiny_recipe, looped_folder, dense_parent, tmp_path
):
    recipe = _recipe(tiny_recipe, looped_folder, distill_from=str(dense_parent), max_steps=2,
                     output_dir=str(tmp_path / "run"))  # fmt: skip
    record = train(*parse_recipe(recipe))
    assert record["status"] == "ok", record.get("traceback")
    student = LoopedForCausalLM.from_pretrained(
        looped_folder, backprop_recurrences=2
    ).training_flops_per_token(32)
    teacher = _teacher_flops_by_hand(32)
    assert record["distillation"]["teacher_flops_per_token"] == teacher
    assert record["train_flops"] == pytest.approx((student + teacher) * record["tokens"], rel=1e-12)
    assert math.isfinite(record["loss"])


def test_a_killed_retrofit_run_resumes_to_the_same_weights_loss_and_flops(
    tiny_recipe, looped_folder, dense_parent, tmp_path
):
    """The paper's recipe at toy size (curriculum, sampler, truncated backprop, Muon split,
    distillation) killed after step 4 resumes from checkpoint-3 to the unkilled run's result."""
    recipe = _recipe(tiny_recipe, looped_folder, recurrence_curriculum="1-sqrt", recurrence_sampling="poisson_lognormal",
                     optimizer="muon", muon_learning_rate=1e-3, learning_rate=5e-5, distill_from=str(dense_parent),
                     max_steps=6, save_strategy="steps", save_steps=3)  # fmt: skip
    whole = train(*parse_recipe(dict(recipe, output_dir=str(tmp_path / "whole"))))
    assert whole["status"] == "ok", whole.get("traceback")
    killed = dict(recipe, output_dir=str(tmp_path / "killed"))
    first = train(*parse_recipe(killed), callbacks=[_Crash(4)])
    assert first["status"] == "failed" and "killed" in first["error"]
    resumed = train(*parse_recipe(killed))
    assert resumed["status"] == "ok" and resumed["resumed_from"].endswith("checkpoint-3")
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "killed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["loss"] == whole["loss"]
    assert resumed["train_flops"] == whole["train_flops"]
    assert resumed["sampled_recurrences"] == whole["sampled_recurrences"]


# --- what a user sees afterwards ----------------------------------------------------------------
def test_a_retrofit_runs_card_shows_the_parent_its_loss_at_every_r_and_scores_beside_the_parents(
    tiny_recipe, small_corpus, tmp_path
):
    """`looped-hf retrofit` -> `looped-hf train --init_from` -> `looped-hf test-time` and `eval` on the
    run (and test-time on the retrofit folder itself, with --data) -> the card: the parent named
    by its sha256 and layer map, the loss at every r beside the parent's on the same blocks, and
    the task scores at every r beside the parent's (`eval` of its loop-in-place retrofit at r = 1)."""
    from looped_hf.cards.checkpoint import render_checkpoint_card
    from looped_hf.evaluation.cli import main as eval_main
    from looped_hf.recurrence_curves import main as test_time_main
    from looped_hf.retrofit import main as retrofit_main

    parent = _llama_parent(tmp_path / "parent", num_layers=6, seed=2)
    assert retrofit_main([str(parent), "--layers", "1,2,1", "--out", str(tmp_path / "retro")]) == 0
    assert retrofit_main([str(parent), "--loop-in-place", "--out", str(tmp_path / "inplace")]) == 0
    assert test_time_main([str(tmp_path / "retro"), "--data", str(small_corpus), "--seq-len", "32",
                           "--eval-blocks", "4", "--max-factor", "2"]) == 0  # fmt: skip

    run = tmp_path / "run"
    record = train(*parse_recipe(_recipe(tiny_recipe, tmp_path / "retro", max_steps=2, output_dir=str(run))))
    assert record["status"] == "ok", record.get("traceback")
    lineage = json.loads((run / "retrofit.json").read_text())
    assert record["retrofit"] == lineage and lineage["layer_map"]["dropped"] == [1, 2]
    parent_loss = record["parent_loss"]["loss"]
    assert math.isfinite(parent_loss) and parent_loss != record["loss"]
    assert record["parent_loss"]["eval_tokens"] == record["eval_tokens"]  # the same held-out blocks

    assert test_time_main([str(run), "--max-factor", "2"]) == 0
    tasks = ["--bundle", "builtin", "--tasks", "induction_head", "--max-per-task", "2"]
    assert eval_main([str(run), *tasks, "--recurrences", "1", "2"]) == 0
    assert (
        eval_main([str(tmp_path / "inplace"), *tasks, "--recurrences", "1", "--out", str(tmp_path / "pe")])
        == 0
    )
    card = render_checkpoint_card(record, LoopedForCausalLM.from_pretrained(run), repo_id="me/retro",
                                  parent_evaluation=tmp_path / "pe" / "eval_results.json").text  # fmt: skip
    section = card[card.index("## Retrofitted from a dense parent") :]
    sha = lineage["parent"]["weights_sha256"]["model.safetensors"]
    assert f"{sha[:16]}..." in section and "recurrent 3-4; coda 5; dropped 1-2 of 6" in section
    assert f"parent's ({parent_loss:.4f} nats/token" in section
    curve = json.loads((run / "test_time_scaling.json").read_text())
    for row in curve["rows"]:
        delta = f"{round(row['loss'] - parent_loss, 4) + 0.0:+.4f}"
        assert f"| {row['num_recurrences']} | {row['loss']:.4f} | {parent_loss:.4f} | {delta} |" in section
    assert "| task | parent | r = 1 | r = 2 |" in section and "| induction_head |" in section
    assert f"{record['train_flops']:.3g} training FLOPs" in section


def test_a_loop_lora_retrofit_takes_eval_test_time_training_and_publish(
    tiny_recipe, small_corpus, tmp_path, capsys
):
    """The RRT share with per-loop LoRA (model type ``looped_loop_lora``) goes where a plain retrofit
    goes, loaded by looped_hf's registered classes (no remote code): eval and test-time at the r of
    each of its loops, eval with a KV budget below r refused in one line before anything is written,
    training from it, and publishing the run with its card and its own remote code."""
    from transformers import AutoModelForCausalLM

    from looped_hf.evaluation.cli import main as eval_main
    from looped_hf.publish import main as publish_main
    from looped_hf.recurrence_curves import main as test_time_main
    from looped_hf.retrofit import main as retrofit_main
    from looped_hf.retrofit.loop_lora import LoopLoRAForCausalLM

    parent = _llama_parent(tmp_path / "parent", num_layers=4, seed=3)
    folder = tmp_path / "rrt"  # 2 shared layers looped twice, a rank-4 LoRA per loop
    share = ["--share", "lower", "--blocks", "2", "--lora-rank", "4"]
    assert retrofit_main([str(parent), *share, "--out", str(folder)]) == 0
    assert type(AutoModelForCausalLM.from_pretrained(folder)) is LoopLoRAForCausalLM

    tasks = ["--bundle", "builtin", "--tasks", "induction_head", "--max-per-task", "2"]
    # The default r grid stops at the loops.
    assert eval_main([str(folder), *tasks, "--out", str(tmp_path / "eval")]) == 0
    results = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
    assert results["recurrences"] == [1, 2] and {row["num_recurrences"] for row in results["rows"]} == {1, 2}
    capsys.readouterr()
    assert eval_main([str(folder), *tasks, "--kv-budget", "1", "--out", str(tmp_path / "kv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "kv_budget=1: a per-loop LoRA model needs every recurrence's KV slots" in err and "\n" not in err
    assert not (tmp_path / "kv").exists()

    assert test_time_main([str(folder), "--data", str(small_corpus), "--seq-len", "32", "--eval-blocks", "4",
                           "--max-factor", "1"]) == 0  # fmt: skip
    curve = json.loads((folder / "test_time_scaling.json").read_text())
    assert [row["num_recurrences"] for row in curve["rows"]] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in curve["rows"])

    run = tmp_path / "run"
    recipe = _recipe(tiny_recipe, folder, num_recurrences=2, backprop_recurrences=None, max_steps=2,
                     output_dir=str(run))  # fmt: skip
    record = train(*parse_recipe(recipe))
    assert record["status"] == "ok", record.get("traceback")
    trained = AutoModelForCausalLM.from_pretrained(run)
    assert type(trained) is LoopLoRAForCausalLM
    trained_b = trained.loop_lora.steps[1][0]["q_proj"].B
    assert not torch.equal(trained_b, _weights(folder)["loop_lora.steps.1.0.q_proj.B"])  # the LoRA trained
    assert publish_main([str(run), "--repo-id", "me/rrt", "--out", str(tmp_path / "pub")]) == 0
    published = tmp_path / "pub"
    assert json.loads((published / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "loop_lora.LoopLoRAForCausalLM"
    )
    assert (published / "loop_lora.py").is_file() and "me/rrt" in (published / "README.md").read_text()


def test_a_recipe_that_adds_weights_to_its_init_from_folder_is_refused_before_training(
    tiny_recipe, looped_folder, tmp_path
):
    # transformers would draw the second coda layer at random, with a report, and train on.
    recipe = _recipe(tiny_recipe, looped_folder, num_coda_layers=2, max_steps=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(RecipeError, match=r"init_from=.*the weights are not the model its config\.json builds: "
                                          r"'model\.coda_layers\.1\.[\w.]+' \(and \d+ more\) is in no weight file"):  # fmt: skip
        train(*parse_recipe(recipe))
    assert not (tmp_path / "run" / "model.safetensors").exists()


# --- a sampled r is bounded by the model's ceiling (no run dies mid-training) ----------------------
RETROFIT_TINY = Path(__file__).resolve().parents[1] / "recipes" / "retrofit_tiny.yaml"
SAMPLING_FIELDS = ("recurrence_sampling", "recurrence_curriculum", "curriculum_start", "curriculum_fraction")


def test_a_loop_lora_folder_trained_with_retrofit_tiny_sampling_clamps_draws_above_its_ceiling(tiny_recipe, tmp_path):
    """A per-loop LoRA retrofit of 2 loops has max_recurrences = 2; retrofit_tiny.yaml's curriculum and
    Poisson-lognormal draw are unbounded. Seed 9 draws r = 4 at step 4 of 6: the run used to die there
    ("exceeds this model's ceiling"); now the draw is clamped and the run record says so."""
    import yaml

    from looped_hf.retrofit import main as retrofit_main

    sampling = {key: value for key, value in yaml.safe_load(RETROFIT_TINY.read_text()).items() if key in SAMPLING_FIELDS}
    assert sampling["recurrence_sampling"] == "poisson_lognormal" and sampling["recurrence_curriculum"] != "none"
    parent = _llama_parent(tmp_path / "parent", num_layers=4, seed=3)
    folder = tmp_path / "rrt"
    assert retrofit_main([str(parent), "--share", "lower", "--blocks", "2", "--lora-rank", "4", "--out", str(folder)]) == 0
    assert json.loads((folder / "config.json").read_text())["max_recurrences"] == 2
    seed, steps = 9, 6
    curriculum = RecurrenceCurriculum(sampling["recurrence_curriculum"], sampling["curriculum_start"], 2,
                                      sampling["curriculum_fraction"], steps)  # fmt: skip
    raw = [draw_num_recurrences(curriculum.mean_at(s), s, seed, sampling["recurrence_sampling"]) for s in range(steps)]
    assert max(raw) > 2  # the seed draws above the ceiling: the test would fail without the clamp
    recipe = _recipe(tiny_recipe, folder, num_recurrences=2, backprop_recurrences=None, max_steps=steps, seed=seed,
                     output_dir=str(tmp_path / "run"), **sampling)  # fmt: skip
    record = train(*parse_recipe(recipe))
    assert record["status"] == "ok", record.get("error")
    drawn = record["sampled_recurrences"]
    assert drawn["ceiling"] == 2 and drawn["clamped"] == sum(r > 2 for r in raw) and drawn["max"] == 2
    assert drawn["per_step"] == [min(r, 2) for r in raw]


@pytest.mark.parametrize(("max_recurrences", "num_recurrences"), [(2, 2), (3, 2), (5, 4)])
def test_the_sampler_never_draws_above_a_max_recurrences_folders_ceiling(max_recurrences, num_recurrences):
    """Any folder with max_recurrences (a converted Ouro, a retrofit): over 300 steps the raw draw
    passes the ceiling, the callback's never does, and a mean above it is refused before step 0."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from looped_hf.recurrence import RecurrenceSamplingCallback

    config = LoopedConfig(vocab_size=_vocab(), hidden_size=WIDTH, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                          intermediate_size=FFN, num_prelude_layers=1, num_recurrent_layers=1, num_coda_layers=1,
                          num_recurrences=num_recurrences, max_recurrences=max_recurrences)  # fmt: skip
    with torch.device("meta"):
        model = LoopedForCausalLM(config)
    sampler = RecurrenceSamplingCallback(seed=1)
    sampler.on_train_begin(TrainingArguments("unused", report_to=[]), TrainerState(), TrainerControl(), model=model)
    raw = [draw_num_recurrences(num_recurrences, s, 1, "poisson_lognormal") for s in range(300)]
    drawn = [sampler.num_recurrences_at(s) for s in range(300)]
    assert max(raw) > max_recurrences and max(drawn) == max_recurrences
    assert drawn == [min(r, max_recurrences) for r in raw]
    assert sampler.summary(300)["clamped"] == sum(r > max_recurrences for r in raw)
    sampler.on_train_end(None, None, None)
    too_deep = RecurrenceSamplingCallback(seed=1, mean=max_recurrences + 1)
    with pytest.raises(ValueError, match=rf"num_recurrences={max_recurrences + 1}: the mean r is above this model's ceiling"):
        too_deep.on_train_begin(TrainingArguments("unused", report_to=[]), TrainerState(), TrainerControl(), model=model)
