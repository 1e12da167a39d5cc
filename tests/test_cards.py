"""Model cards: checkpoint and sweep cards parse back with the Hub's metadata, plots resolve,
and the shipped token-perplexity metric loads offline by path."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from huggingface_hub import ModelCard

from looped_hf import LoopedForCausalLM, cards
from looped_hf.metrics import TOKEN_PERPLEXITY_PATH
from looped_hf.scaling import fit_scaling_law

sys.path.insert(0, str(Path(__file__).parent))
from test_publish import make_run_dir  # noqa: E402

TRUE_PHI = 0.5


# --------------------------------------------------------------------------------------------
# A synthetic sweep (losses drawn from the law itself), so the fit has something to find
# --------------------------------------------------------------------------------------------
def law_loss(n_once: float, n_rec: float, r: int, tokens: float, phi: float = TRUE_PHI) -> float:
    return 1.8 + 400.0 * (n_once + r**phi * n_rec) ** -0.34 + 400.0 * tokens**-0.28


def synthetic_records(budgets=(1e15, 1e16, 1e17), widths=(64, 128), recurrences=(1, 2, 4), depth: int = 8,
                      noise: float = 0.003, seed: int = 0) -> list[dict]:  # fmt: skip
    """Iso-depth runs (12 d^2 per layer, 2 d^2 linear injection) with losses from the law."""
    rng = np.random.default_rng(seed)
    records = []
    for b, budget in enumerate(budgets):
        for d in widths:
            for r in recurrences:
                layer = 12 * d * d
                if r == 1:
                    n_once, n_rec, pkc = 2 * d, depth * layer, (0, depth, 0)
                else:
                    n_once, n_rec, pkc = (
                        4 * layer,
                        (depth - 4) // r * layer + 2 * d * d,
                        (2, (depth - 4) // r, 2),
                    )
                tokens = budget / (6 * (n_once + r * n_rec))
                loss = law_loss(n_once, n_rec, r, tokens) * math.exp(noise * rng.standard_normal())
                arch = "base" if r == 1 else f"loop{r}"
                records.append({
                    "run_id": f"{arch}-w{d}-b{b}", "loss": loss, "tokens": tokens, "n_once": n_once, "n_rec": n_rec,
                    "num_recurrences": r, "train_flops": budget, "budget": budget, "arch": arch, "variant": "base",
                    "hidden_size": d, "seed": 0, "status": "ok", "eval_perplexity": math.exp(loss), "eval_tokens": 2048,
                    "config": dict(zip(("num_prelude_layers", "num_recurrent_layers", "num_coda_layers"), pkc)),
                })  # fmt: skip
    return records


def write_sweep_dir(path: Path, records: list[dict], recipe: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "sweep.yaml").write_text(yaml.safe_dump(recipe or {"sweep": {"budgets": [1e15, 1e16, 1e17]}}))
    with open(path / "results.jsonl", "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture(scope="module")
def sweep_and_fit(tmp_path_factory: pytest.TempPathFactory):
    records = synthetic_records()
    records.append(
        {**records[-1], "run_id": "loop4-w128-b9", "status": "failed", "loss": None, "error": "OOM"}
    )
    sweep = write_sweep_dir(tmp_path_factory.mktemp("sweep") / "iso_depth_synth", records)
    fit = fit_scaling_law(sweep / "results.jsonl", bootstrap=12, seed=0, n_starts=64, n_polish=8)
    return sweep, fit


@pytest.fixture(scope="module")
def sweep_card(sweep_and_fit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep, fit = sweep_and_fit
    best = cards.best_run([json.loads(line) for line in (sweep / "results.jsonl").read_text().splitlines()])
    return cards.write_sweep_card(sweep, fit, tmp_path_factory.mktemp("cards") / "iso_depth_synth", best=best,
                                  best_where="(test)")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Checkpoint card
# --------------------------------------------------------------------------------------------
def _render_checkpoint(run: Path, fit=None, repo_id: str = "me/looped-tiny") -> Path:
    record = json.loads((run / "run_record.json").read_text())
    model = LoopedForCausalLM.from_pretrained(run)
    card = cards.render_checkpoint_card(record, model, repo_id=repo_id, fit=fit)
    path = run.parent / f"{run.name}-README.md"
    card.save(path)
    return path


def test_checkpoint_card_metadata_parses_back_as_the_hub_reads_it(tmp_path: Path):
    run = make_run_dir(tmp_path / "loop2-w32-b0", loss=4.25)
    path = _render_checkpoint(run)
    card = ModelCard.load(path)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"looped", "custom_code"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0"
    # model-index: name, task, dataset, and both metrics with the token-weighted values.
    (entry,) = meta["model-index"]
    assert entry["name"] == "looped-tiny"
    (result,) = entry["results"]
    assert result["task"]["type"] == "text-generation"
    assert result["dataset"]["type"] and result["dataset"]["name"]
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    assert metrics["loss"] == pytest.approx(4.25)
    assert metrics["perplexity"] == pytest.approx(math.exp(4.25), rel=1e-6)
    assert {e.metric_type for e in card.data.eval_results} == {"loss", "perplexity"}
    looped = meta["looped"]
    assert looped["num_recurrences"] == 2 and looped["input_injection"] == "linear"
    assert (looped["num_prelude_layers"], looped["num_recurrent_layers"], looped["num_coda_layers"]) == (
        1,
        1,
        1,
    )
    assert looped["effective_num_layers"] == 4 and looped["n_once"] > 0 and looped["n_rec"] > 0
    assert looped["train_flops"] > 0 and looped["train_tokens"] == 4096
    assert "phi" not in looped  # no fit given
    body = card.text
    assert "trust_remote_code=True" in body and "num_recurrences=4" in body
    assert "transformers >=5.16.1,<5.26" in body  # the range the remote code supports
    assert "repeat r = 2" in body and "2604.21106" in body and "Limitations" in body
    assert "/tmp/x" not in body  # machine-local recipe paths stay out of the card


def test_checkpoint_card_with_a_fit_shows_phi_and_effective_parameters(tmp_path: Path, sweep_and_fit):
    _, fit = sweep_and_fit
    run = make_run_dir(tmp_path / "loop2-w32-b0")
    meta = ModelCard.load(_render_checkpoint(run, fit=fit)).data.to_dict()
    looped = meta["looped"]
    assert looped["phi"] == pytest.approx(fit.params["phi"], rel=1e-5)
    assert looped["phi_ci95"] == pytest.approx(list(fit.ci["phi"]), rel=1e-5, abs=1e-6)
    expected = looped["n_once"] + 2 ** fit.params["phi"] * looped["n_rec"]
    assert looped["n_effective"] == pytest.approx(expected, abs=1)


def test_checkpoint_card_names_a_hub_dataset_in_its_metadata(tmp_path: Path):
    recipe = {"dataset": "roneneldan/TinyStories", "tokenizer": None, "seq_len": 32}
    run = make_run_dir(tmp_path / "loop2-ts", record_extra={"recipe": recipe})
    card = ModelCard.load(_render_checkpoint(run))
    meta = card.data.to_dict()
    assert meta["datasets"] == ["roneneldan/TinyStories"]
    assert meta["model-index"][0]["results"][0]["dataset"]["type"] == "roneneldan/TinyStories"
    assert "embedded byte-level BPE" in card.text  # tokenizer: None means the embedded one


def test_hyperconnection_card_says_the_model_is_locked_to_its_r(tmp_path: Path):
    run = make_run_dir(tmp_path / "hyper-loop2", injection="hyperconnection")
    card = ModelCard.load(_render_checkpoint(run))
    assert card.data.to_dict()["looped"]["recurrence_locked"] is True
    assert "runs only at its trained r = 2" in card.text
    assert "num_recurrences=4" not in card.text


def test_card_refuses_a_record_without_a_finite_loss():
    with pytest.raises(ValueError, match="'loss'=nan"):
        cards.heldout_metrics({"loss": float("nan")})


# --------------------------------------------------------------------------------------------
# Sweep card
# --------------------------------------------------------------------------------------------
def test_sweep_card_carries_phi_its_interval_and_the_restricted_fits(sweep_card: Path, sweep_and_fit):
    sweep, fit = sweep_and_fit
    assert abs(fit.params["phi"] - TRUE_PHI) < 0.15  # the synthetic sweep is informative
    card = ModelCard.load(sweep_card)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and "looped" in meta["tags"]
    info = meta["looped_sweep"]
    assert info["phi"] == pytest.approx(fit.params["phi"], rel=1e-5)
    assert info["phi_ci95"] == pytest.approx(list(fit.ci["phi"]), rel=1e-5, abs=1e-6)
    assert set(info["restricted_r2"]) == {"phi=0", "phi=1"}
    text = card.text
    lo, hi = fit.ci["phi"]
    assert f"**phi = {fit.params['phi']:.3f}** (95% CI [{lo:.3g}, {hi:.3g}]" in text
    assert "| phi=0 |" in text and "| phi=1 |" in text
    assert "performs like a non-looped model of" in text
    assert "### Residuals by r" in text and "| 4 | 6 |" in text  # r = 4: six runs
    assert ("**Caveat:**" in text) == (cards.phi_caveat(fit) is not None)  # a warning only when phi is loose


def test_sweep_card_lists_every_run_and_the_reproducibility_block(sweep_card: Path, sweep_and_fit):
    sweep, _ = sweep_and_fit
    text = sweep_card.read_text()
    for line in (sweep / "results.jsonl").read_text().splitlines():
        assert f"`{json.loads(line)['run_id']}`" in text
    assert "**failed**" in text and "1 failed (not fitted)" in text
    assert hashlib.sha256((sweep / "sweep.yaml").read_bytes()).hexdigest() in text
    assert "| transformers |" in text and "| looped_hf |" in text
    assert "looped-hf fit" in text


def test_sweep_card_plots_exist_and_are_referenced_relatively(sweep_card: Path):
    links = cards.card_image_links(sweep_card)
    assert links[:2] == ["plots/isoflop.png", "plots/phi_profile.png"]  # the identifiability plots first
    assert sorted(links) == ["plots/isoflop.png", "plots/loss_vs_flops.png", "plots/phi_bootstrap.png",
                             "plots/phi_profile.png", "plots/residuals.png"]  # fmt: skip
    for link in links:
        target = sweep_card.parent / link
        assert target.is_file() and target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (sweep_card.parent / "fit.json").is_file()
    assert not [p for p in sweep_card.parent.parent.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_sweep_card_renders_to_html_with_its_images_and_tables(sweep_card: Path):
    from markdown_it import MarkdownIt

    card = ModelCard.load(sweep_card)
    html = MarkdownIt("commonmark").enable("table").render(card.text)  # the body the Hub renders
    assert html.count("<img ") == 5 and 'src="plots/phi_bootstrap.png"' in html
    assert 'src="plots/isoflop.png"' in html and 'src="plots/phi_profile.png"' in html
    assert html.count("<table>") >= 6  # fit, phi intervals, IsoFLOP placement, restricted, residuals, runs
    assert "{{" not in html and "{%" not in html  # no unrendered template code


def test_phi_caveat_is_the_verdict_and_falls_back_to_the_interval_for_old_fits(sweep_and_fit):
    import dataclasses

    _, fit = sweep_and_fit
    verdict = fit.diagnostics["verdict"]
    ok = {**fit.diagnostics, "verdict": {**verdict, "identified": True}}
    assert cards.phi_caveat(dataclasses.replace(fit, diagnostics=ok)) is None
    bad = {**fit.diagnostics, "verdict": {**verdict, "identified": False, "line": "phi is NOT identified (x)"}}
    assert cards.phi_caveat(dataclasses.replace(fit, diagnostics=bad)).startswith("phi is NOT identified (x)")

    def old_fit_with_ci(lo: float, hi: float):  # a fit.json from before the diagnosis, no profile
        return dataclasses.replace(fit, ci={**fit.ci, "phi": (lo, hi)}, diagnostics={}, profile=None)

    # Diagnosed now by the one rule: the bootstrap interval must be closed and at most 0.5 wide.
    assert cards.phi_caveat(old_fit_with_ci(0.41, 0.53)) is None
    assert "the bootstrap interval is open below" in cards.phi_caveat(old_fit_with_ci(-3.0, 0.6))
    assert "the bootstrap interval is 0.6 wide" in cards.phi_caveat(old_fit_with_ci(0.1, 0.7))
    assert "See *Is phi identified?*" not in cards.phi_caveat(old_fit_with_ci(0.1, 0.7))
    assert "no interval for phi" in cards.phi_caveat(dataclasses.replace(fit, ci={}, diagnostics={}, profile=None))


def test_sweep_card_says_whether_phi_is_identified_and_why(sweep_card: Path, sweep_and_fit):
    _, fit = sweep_and_fit
    text = ModelCard.load(sweep_card).text
    d = fit.diagnostics
    assert "### Is phi identified?" in text and f"**Verdict:** {d['verdict']['line']}" in text
    lo, hi = d["profile"]["interval"]
    assert "| profile likelihood" in text and f"[{lo:.3g}, {hi:.3g}]" in text
    assert "| budget (FLOPs) | tokens / parameter | r | lowest loss | position |" in text
    # This sweep has two widths per budget: phi is pinned by the law's form, but no IsoFLOP minimum
    # can be located, and the card says so.
    assert d["verdict"]["identified"] is True
    assert "fewer than 3 widths per r" in d["verdict"]["line"] and "fewer than 3 widths per r" in text
    assert "What would make the measurement sturdier:" in text
    assert "| 1e15 | 67 - 1.5k | 1 | d=128 | **largest** |" in text


def test_noisy_sweep_card_warns_that_phi_is_not_pinned_down(tmp_path: Path):
    records = synthetic_records(
        budgets=(1e15, 1e16), widths=(64, 128), recurrences=(1, 2), noise=0.08, seed=3
    )
    sweep = write_sweep_dir(tmp_path / "noisy", records)
    fit = fit_scaling_law(sweep / "results.jsonl", bootstrap=8, seed=0, n_starts=32, n_polish=4)
    if cards.phi_caveat(fit) is None:
        pytest.skip(f"this draw happened to pin phi down: CI {fit.ci['phi']}")
    path = cards.write_sweep_card(sweep, fit, tmp_path / "card")
    assert "**Caveat:**" in path.read_text()


def test_card_cli_writes_the_card_from_a_fit_file(sweep_and_fit, tmp_path: Path, capsys):
    sweep, fit = sweep_and_fit
    fit.to_json(tmp_path / "fit.json")
    out = tmp_path / "cli-card"
    assert cards.main([str(sweep), "--fit", str(tmp_path / "fit.json"), "--out", str(out)]) == 0
    assert (out / "README.md").is_file() and (out / "plots" / "loss_vs_flops.png").is_file()
    assert f"phi = {fit.params['phi']:.3f}" in capsys.readouterr().out
    assert (
        cards.main([str(sweep), "--fit", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    )
    assert "missing.json" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_card_cli_draws_the_study_style_figure_with_probe_panels(sweep_and_fit, tmp_path: Path, capsys):
    """--isoflop-style study draws the paper's figure; --compare TITLE=FIT_JSON adds a panel per
    probe (and implies the study style); bad entries name themselves and write nothing."""
    from PIL import Image

    sweep, fit = sweep_and_fit
    fit.to_json(tmp_path / "fit.json")
    law = tmp_path / "law"
    assert cards.main([str(sweep), "--fit", str(tmp_path / "fit.json"), "--out", str(law)]) == 0
    study = tmp_path / "study"
    assert cards.main([str(sweep), "--fit", str(tmp_path / "fit.json"), "--out", str(study),
                       "--isoflop-style", "study"]) == 0  # fmt: skip
    assert "IsoFLOP curves drawn as the study's figure" in (study / "README.md").read_text()
    assert "IsoFLOP curves drawn as the study's figure" not in (law / "README.md").read_text()
    two = tmp_path / "two"
    assert cards.main([str(sweep), "--fit", str(tmp_path / "fit.json"), "--out", str(two),
                       "--compare", f"probe={tmp_path / 'fit.json'}"]) == 0  # fmt: skip
    one_panel = Image.open(study / "plots" / "isoflop.png").size
    two_panels = Image.open(two / "plots" / "isoflop.png").size
    assert two_panels[0] > 1.5 * one_panel[0] and two_panels[1] == one_panel[1]
    capsys.readouterr()
    for bad, named in (("probe", "expected TITLE=FIT_JSON"), (f"p={tmp_path / 'nope.json'}", "nope.json")):
        assert cards.main([str(sweep), "--fit", str(tmp_path / "fit.json"), "--out", str(tmp_path / "bad"),
                           "--compare", bad]) == 2  # fmt: skip
        assert named in capsys.readouterr().err and not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------------------------
# Downstream evaluation results (looped-hf eval) in the cards
# --------------------------------------------------------------------------------------------
EVAL_FIXTURE = Path(__file__).parent / "fixtures" / "eval_bundle"


def test_checkpoint_card_shows_task_scores_at_every_r_and_indexes_them_at_the_trained_r(tmp_path: Path):
    from looped_hf.evaluation import evaluate_model, load_bundle, load_checkpoint, write_results

    run = make_run_dir(tmp_path / "loop2-w32-b0")
    model, tokenizer, info = load_checkpoint(run)
    results = {**info, **evaluate_model(model, tokenizer, [load_bundle(EVAL_FIXTURE)], [1, 2, 4])}
    write_results(results, run)
    record = json.loads((run / "run_record.json").read_text())
    plot = "eval_results.png"
    card = cards.render_checkpoint_card(record, model, repo_id="me/looped-tiny", evaluation_plot=plot)
    card.save(tmp_path / "README.md")
    text = (tmp_path / "README.md").read_text()
    assert "## Downstream tasks at every r" in text
    assert text.index("## Downstream") < text.index("## Limitations")
    assert "| capitals_mc | knowledge |" in text and "| r = 4 |" in text
    assert "![task score vs r](eval_results.png)" in text
    index = ModelCard.load(tmp_path / "README.md").data.eval_results
    accuracy = {e.dataset_name: e.metric_value for e in index if e.metric_type == "accuracy"}
    at_trained = results["rows"][1]["tasks"]
    assert accuracy == {label: pytest.approx(at_trained[label]["accuracy"]) for label in at_trained}
    assert all("r = 2" in e.metric_name for e in index if e.metric_type == "accuracy")
    # Results measured on other weights are not shown.
    stale = json.loads((run / "eval_results.json").read_text())
    (run / "eval_results.json").write_text(json.dumps({**stale, "weights_sha256": "0" * 64}))
    assert "## Downstream" not in cards.render_checkpoint_card(record, model, repo_id="me/looped-tiny").text


def test_sweep_card_plots_task_scores_against_training_flops_per_r(sweep_and_fit, tmp_path: Path):
    import shutil

    from looped_hf.evaluation.report import RESULTS_JSON

    source, fit = sweep_and_fit
    sweep = tmp_path / source.name
    shutil.copytree(source, sweep)
    records = [json.loads(line) for line in (sweep / "results.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if r["status"] == "ok" and r["hidden_size"] == 64][:4]
    for k, rec in enumerate(evaluated):
        rows = [{"num_recurrences": r, "tasks": {}, "bundles": {"builtin": {"mean_centered": 0.1 * k + 0.01 * r,
                 "group_mean": 0.0, "groups": {}}}} for r in (1, rec["num_recurrences"])]  # fmt: skip
        (sweep / rec["run_id"]).mkdir()
        (sweep / rec["run_id"] / RESULTS_JSON).write_text(json.dumps({"trained_num_recurrences": rec["num_recurrences"],
                                                                      "rows": rows, "tasks": []}))  # fmt: skip
    path = cards.write_sweep_card(sweep, fit, tmp_path / "card")
    text = path.read_text()
    assert "## Downstream tasks against training compute" in text and "4 runs were scored" in text
    assert "plots/eval_score_vs_flops.png" in cards.card_image_links(path)
    assert (tmp_path / "card" / "plots" / "eval_score_vs_flops.png").stat().st_size > 0
    first = evaluated[0]
    row = f"| {first['run_id']} | {first['num_recurrences']} | {first['train_flops']:.3g} | builtin |"
    assert row in text
    assert text.index("## Downstream") < text.index("## Citation")


# --------------------------------------------------------------------------------------------
# The evaluate metric shipped in the package
# --------------------------------------------------------------------------------------------
def test_token_perplexity_metric_loads_offline_by_path_and_weights_by_tokens(tmp_path: Path, monkeypatch):
    import evaluate

    # evaluate copies the script into its modules cache: keep that (and its metric cache) in tmp.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_MODULES_CACHE", tmp_path / "modules")
    monkeypatch.setattr(evaluate.config, "HF_METRICS_CACHE", tmp_path / "metrics")
    monkeypatch.setattr(sys, "path", list(sys.path))  # evaluate appends its modules cache to sys.path
    metric = evaluate.load(TOKEN_PERPLEXITY_PATH, cache_dir=str(tmp_path / "metrics"))
    # Two batches with very different token counts: token weighting != batch weighting.
    out = metric.compute(nll_sum=[300.0, 20.0], num_tokens=[100, 40])
    assert out["loss"] == pytest.approx(320.0 / 140, rel=1e-12)
    assert out["perplexity"] == pytest.approx(math.exp(320.0 / 140), rel=1e-12)
    assert out["num_tokens"] == 140
    assert abs(out["loss"] - (300.0 / 100 + 20.0 / 40) / 2) > 0.1
    for nll, n in [(1.5, 3), (2.5, 5)]:
        metric.add_batch(nll_sum=[nll], num_tokens=[n])
    assert metric.compute()["loss"] == pytest.approx(0.5)
    # The card's perplexity is the same quantity, from the run record's token-weighted loss.
    assert cards.heldout_metrics({"loss": out["loss"]})["perplexity"] == pytest.approx(out["perplexity"])
    assert (tmp_path / "modules").is_dir()  # it really went through evaluate's module loader
