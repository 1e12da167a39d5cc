"""The study's training recipe: MuonH, its parameter groups, HyperP per-run lrs, exact resume."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from looped_hf import LoopedConfig, LoopedForCausalLM
from looped_hf.arguments import LoopedTrainingArguments, RecipeError, parse_recipe
from looped_hf.modeling_looped import LoopedRMSNorm
from looped_hf.optim import (
    HYPERP_BATCH_REF,
    MuonH,
    build_optimizer,
    hyperp_learning_rates,
    hyperp_reference_config,
    hyperp_reference_tokens,
    learning_rates,
    muonh_parameter_groups,
    polar_express,
)
from looped_hf.sweep import make_plan
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(**kw) -> LoopedForCausalLM:
    cfg = dict(vocab_size=96, hidden_size=64, head_dim=16, num_attention_heads=4, num_prelude_layers=1,
               num_recurrent_layers=1, num_coda_layers=1, num_recurrences=2, init_scheme="study")  # fmt: skip
    cfg.update(kw)
    torch.manual_seed(0)
    return LoopedForCausalLM(LoopedConfig(**cfg))


def _args(tmp_path, **kw) -> LoopedTrainingArguments:
    return LoopedTrainingArguments(output_dir=str(tmp_path), optimizer="muonh", **kw)


def _train_steps(model: LoopedForCausalLM, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 24), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --- MuonH ---------------------------------------------------------------------------------------
def test_polar_express_gives_nearly_orthogonal_updates_for_wide_and_tall_stacks():
    torch.manual_seed(0)
    for shape in [(3, 32, 128), (3, 128, 32)]:
        g = torch.randn(*shape)
        x = polar_express(g).float()
        assert x.shape == g.shape and polar_express(g).dtype == torch.bfloat16
        sv = torch.linalg.svdvals(x)
        assert sv.min() > 0.7 and sv.max() < 1.3, (shape, sv.min(), sv.max())
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        polar = u @ vh
        cosine = (x * polar).sum((-2, -1)) / (x.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
        assert cosine.min() > 0.99


def test_muonh_keeps_every_matrix_on_its_initial_frobenius_sphere(tmp_path):
    model = _model()
    optimizer = build_optimizer(model, _args(tmp_path, lr_scaling="none", muon_learning_rate=0.05))
    matrices = muonh_parameter_groups(model)["matrix"]
    before = [p.detach().clone() for p in matrices]
    _train_steps(model, optimizer, 5)
    muonh = optimizer.optimizers[1]
    assert isinstance(muonh, MuonH)
    for p, w0 in zip(matrices, before):
        assert not torch.equal(p, w0)  # it trained
        assert torch.linalg.matrix_norm(p).item() == pytest.approx(
            torch.linalg.matrix_norm(w0).item(), rel=1e-6
        )
        # The sphere's radius is kept in the optimizer state (and so in checkpoints).
        assert muonh.state[p]["initial_norm"].item() == pytest.approx(
            torch.linalg.matrix_norm(w0).item(), rel=1e-6
        )
        assert muonh.state[p]["momentum_buffer"].shape == p.shape


def test_muonh_refuses_a_zero_matrix_and_non_matrices():
    w = torch.nn.Parameter(torch.zeros(4, 8))
    w.grad = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"\(4, 8\) matrix has Frobenius norm 0"):
        MuonH([w]).step()
    with pytest.raises(ValueError, match="2-D matrices"):
        MuonH([torch.nn.Parameter(torch.ones(3))])


# --- groups and lrs --------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", ["linear", "hyperconnection"])
def test_muonh_groups_are_the_studys_and_cover_every_parameter_once(tmp_path, injection):
    model = _model(input_injection=injection, qk_norm="learnable_before_rope")
    base = model.model
    # At the reference batch and D_REF tokens only the width factor (d / 640)^-0.5 remains.
    d_ref = hyperp_reference_tokens(model.config)
    optimizer = build_optimizer(model, _args(tmp_path), tokens_per_step=HYPERP_BATCH_REF, train_tokens=d_ref)
    groups = {}
    for group in optimizer.param_groups:
        groups.setdefault(group["name"], []).extend(group["params"])
    width = (64 / 640) ** -0.5
    expected = {"lm_head": 0.004 * width, "embedding": 0.3 * width, "norm": 0.005 * width, "matrix": 0.014}
    if injection == "hyperconnection":
        expected["hyperconnection"] = 0.01 * width
    assert learning_rates(optimizer) == pytest.approx(expected)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(groups["lm_head"]) == {id(model.lm_head.weight)}
    assert ids(groups["embedding"]) == {id(base.embed_tokens.weight)}
    norms = [m.weight for m in model.modules() if isinstance(m, LoopedRMSNorm)]
    assert ids(groups["norm"]) == ids(norms) and len(norms) > 6  # incl. the learnable QK-norm scales
    layers = [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers]
    matrices = [p for layer in layers for p in layer.parameters() if p.ndim == 2]
    if injection == "linear":
        matrices.append(base.injection.weight)
        assert "hyperconnection" not in groups
    else:
        assert ids(groups["hyperconnection"]) == ids(base.hyperconnection.parameters())
    assert ids(groups["matrix"]) == ids(matrices)
    # Exactly one group per parameter, and every parameter has one.
    counts = Counter(id(p) for group in optimizer.param_groups for p in group["params"])
    assert set(counts) == ids(model.parameters()) and set(counts.values()) == {1}
    # MuonH groups hold one shape each (one batched orthogonalisation), sorted as the study's.
    muon_groups = optimizer.optimizers[1].param_groups
    shapes = [tuple(g["params"][0].shape) for g in muon_groups]
    assert shapes == sorted(shapes) and all(len({p.shape for p in g["params"]}) == 1 for g in muon_groups)
    adam = optimizer.optimizers[0]
    assert adam.defaults["betas"] == (0.8, 0.95) and adam.defaults["eps"] == 1e-10
    assert all(g["weight_decay"] == 0.0 for g in adam.param_groups)


def test_hyperp_scales_every_lr_by_batch_and_the_matrix_lr_by_data(tmp_path):
    config = _model().config
    d_ref = hyperp_reference_tokens(config)
    rates = hyperp_learning_rates(
        _args(tmp_path), config, tokens_per_step=2 * HYPERP_BATCH_REF, train_tokens=d_ref / 4
    )
    batch, data, width = 2**0.558, 4**0.32, (64 / 640) ** -0.5
    assert rates.scaling == "hyperp" and rates.batch_scale == pytest.approx(batch)
    assert rates.matrix == pytest.approx(0.014 * batch * data)
    assert rates.embedding == pytest.approx(0.3 * batch * width)
    assert rates.lm_head == pytest.approx(0.004 * batch * width)
    assert rates.norm == pytest.approx(0.005 * batch * width)
    assert rates.hyperconnection == pytest.approx(0.01 * batch * width)
    # lr_scaling none: exactly the lrs given, whatever the batch.
    fixed = hyperp_learning_rates(
        _args(tmp_path, lr_scaling="none"), config, tokens_per_step=7, train_tokens=7
    )
    assert fixed.groups() == {"matrix": 0.014, "lm_head": 0.004, "embedding": 0.3, "norm": 0.005,
                              "hyperconnection": 0.01}  # fmt: skip


def test_reference_model_is_the_studys_size_10_model_counted_at_the_runs_r():
    # scripts/base_train.py: looped runs -> 2-4x4-2 linear injection, others -> 0-20x1-0, width 640;
    # its get_scaling_params counts N_once + r N_rec of that reference at the TRAINING run's r
    # (model_config.num_recur), so D_REF depends on r, not r = 4 for every looped run;
    # tests/fixtures/study_plan/study_plan.csv has the study's D_REF per r.
    # Closed form at d = 640: a layer has 12 d^2 weights + 2 d norm scales; the adapter 2 d^2; the
    # model-level norms (embedding, recurrence, final) 3 d, counted once as the study's "scalars".
    d = 640
    layer = 12 * d * d + 2 * d
    looped = lambda r: 4 * layer + 3 * d + r * (4 * layer + 2 * d * d)  # noqa: E731
    plain = 20 * layer + 3 * d
    for kw, params in [({"num_recurrences": 2}, looped(2)), ({"num_recurrences": 8}, looped(8)),
                       ({"num_recurrences": 4, "backprop_recurrences": 2}, looped(4)),
                       ({"num_recurrences": 4, "input_injection": "hyperconnection"}, looped(4)),
                       ({"num_recurrences": 1, "num_prelude_layers": 0, "num_coda_layers": 0, "input_injection": "none"},
                        plain)]:  # fmt: skip
        config = _model(**kw).config
        ref = hyperp_reference_config(config)
        assert ref.hidden_size == 640 and ref.head_dim == config.head_dim
        assert hyperp_reference_tokens(config) == 10 * params, kw


# --- bad settings --------------------------------------------------------------------------------
def test_bad_optimizer_settings_are_named(tmp_path):
    with pytest.raises(RecipeError, match="optimizer='sgd'"):
        LoopedTrainingArguments(output_dir=str(tmp_path), optimizer="sgd")
    with pytest.raises(RecipeError, match=r"learning_rate=0.003: not used by optimizer 'muonh'"):
        _args(tmp_path, learning_rate=3e-3)
    with pytest.raises(RecipeError, match=r"weight_decay=0.1: optimizer 'muonh' has no weight decay"):
        _args(tmp_path, weight_decay=0.1)
    with pytest.raises(RecipeError, match=r"lr_scaling='hyperp': only optimizer 'muonh'"):
        LoopedTrainingArguments(output_dir=str(tmp_path), lr_scaling="hyperp")
    with pytest.raises(RecipeError, match=r"embedding_learning_rate=0.1: used only by optimizer 'muonh'"):
        LoopedTrainingArguments(output_dir=str(tmp_path), embedding_learning_rate=0.1)
    with pytest.raises(RecipeError, match=r"norm_learning_rate=-1: must be a finite number > 0"):
        _args(tmp_path, norm_learning_rate=-1)
    with pytest.raises(ValueError, match="give tokens_per_step"):
        build_optimizer(_model(), _args(tmp_path))
    with pytest.raises(ValueError, match="untied lm_head"):
        build_optimizer(_model(tie_word_embeddings=True), _args(tmp_path, lr_scaling="none"))
    with pytest.raises(ValueError, match=r"no group for \[.*q_proj.bias"):
        build_optimizer(_model(attention_bias=True), _args(tmp_path, lr_scaling="none"))
    # muonh's AdamW: the study's betas / eps unless the recipe sets its own.
    assert (_args(tmp_path).adam_beta1, _args(tmp_path).adam_beta2, _args(tmp_path).adam_epsilon) == (
        0.8,
        0.95,
        1e-10,
    )
    assert _args(tmp_path, adam_beta1=0.85).adam_beta1 == 0.85


# --- training runs -----------------------------------------------------------------------------------
def _muonh_recipe(tiny_recipe: dict, **kw) -> dict:
    recipe = {k: v for k, v in tiny_recipe.items() if k != "learning_rate"}
    recipe.update(optimizer="muonh", init_scheme="study", max_grad_norm=0.0, **kw)
    return recipe


class _Crash(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("killed")


def test_muonh_resume_from_a_checkpoint_equals_an_uninterrupted_run_bit_for_bit(tiny_recipe, tmp_path):
    recipe = _muonh_recipe(tiny_recipe, max_steps=6, save_strategy="steps", save_steps=3)
    whole = train(*parse_recipe(dict(recipe, output_dir=str(tmp_path / "whole"))))
    assert whole["status"] == "ok", whole.get("traceback")
    killed = dict(recipe, output_dir=str(tmp_path / "killed"))
    first = train(*parse_recipe(killed), callbacks=[_Crash(4)])  # step 4 done, checkpoint-3 on disk
    assert first["status"] == "failed" and "killed" in first["error"]
    resumed = train(*parse_recipe(killed))
    assert resumed["status"] == "ok" and resumed["resumed_from"].endswith("checkpoint-3")
    a, b = (
        load_file(tmp_path / "whole" / "model.safetensors"),
        load_file(tmp_path / "killed" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["loss"] == whole["loss"]
    # The run record stores the lrs used: HyperP at this run's batch (4 x 32 tokens) and tokens.
    lrs = whole["learning_rates"]
    batch = (4 * 32 / HYPERP_BATCH_REF) ** 0.558
    assert lrs["scaling"]["scaling"] == "hyperp" and lrs["scaling"]["batch_scale"] == pytest.approx(batch)
    assert lrs["scaling"]["train_tokens"] == 6 * 4 * 32
    assert lrs["lm_head"] == pytest.approx(0.004 * batch * (32 / 640) ** -0.5)
    assert lrs["matrix"] == pytest.approx(lrs["scaling"]["matrix"])


def test_sweep_plans_the_lrs_a_single_run_gets_by_itself(tiny_recipe, tmp_path):
    base = {k: v for k, v in _muonh_recipe(tiny_recipe).items()
            if k not in ("max_steps", "output_dir", "hidden_size", "head_dim") and not k.startswith("num_")}  # fmt: skip
    sweep = {"effective_depth": 6, "prelude": 1, "coda": 1, "recurrences": [1, 2], "head_dim": 16,
             "budgets": [3e8], "widths": [32, 48]}  # fmt: skip
    plan = make_plan({"sweep": sweep, **base}, tmp_path / "sweep")
    assert "lr_mat" in plan.table() and "(B / 262,144)^0.558" in plan.table()
    for run in plan.runs:
        assert (
            run.recipe["lr_scaling"] == "none"
            and run.recipe["muon_learning_rate"] == run.learning_rates["matrix"]
        )
        # The planned run's recipe trains at the planned lrs ...
        _, _, planned_args = parse_recipe(run.recipe)
        assert planned_args.embedding_learning_rate == run.learning_rates["embedding"]
    # ... and a single run of the same model, batch and budget computes the same lrs itself.
    run = next(r for r in plan.runs if r.num_recurrences == 2 and r.hidden_size == 48)
    single = {k: v for k, v in run.recipe.items() if k not in ("muon_learning_rate", "embedding_learning_rate",
              "lm_head_learning_rate", "norm_learning_rate", "hyperconnection_learning_rate", "lr_scaling")}  # fmt: skip
    single.update(output_dir=str(tmp_path / "single"), save_strategy="no")
    record = train(*parse_recipe(single))
    assert record["status"] == "ok", record.get("traceback")
    for group in ("matrix", "embedding", "lm_head", "norm"):
        assert record["learning_rates"][group] == pytest.approx(run.learning_rates[group], rel=1e-12), group
    assert math.isfinite(record["loss"])
