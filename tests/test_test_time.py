"""`looped-hf test-time`: held-out loss at r = 1 .. 4x the trained r, its files, and the checkpoint card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_recipe_in

from looped_hf import LoopedForCausalLM
from looped_hf.arguments import parse_recipe
from looped_hf.cards import card_image_links, render_checkpoint_card
from looped_hf.cli import main as cli_main
from looped_hf.recurrence_curves import (
    CURVE_JSON,
    CURVE_MD,
    CURVE_PNG,
    TestTimeError,
    decoding_heldout_loss,
    evaluate_recurrences,
    heldout_curve,
    load_run,
    plot_test_time_scaling,
    recurrence_grid,
    write_curve,
)
from looped_hf.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained_run(small_corpus: Path, data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny recipe trained once for the module (a second or so per training)."""
    recipe = tiny_recipe_in(small_corpus, data_cache, tmp_path_factory.mktemp("test_time") / "run")
    record = train(*parse_recipe(recipe))
    assert record["status"] == "ok"
    return Path(record["run_dir"])


@pytest.fixture
def run_dir(trained_run: Path, tmp_path: Path) -> str:
    """A test's own copy of the module's trained run: the tests write curves and cards into it."""
    return str(shutil.copytree(trained_run, tmp_path / "trained"))


def test_cli_writes_the_curve_and_the_trained_r_reproduces_the_recorded_loss(run_dir, capsys, tmp_path):
    assert cli_main(["test-time", run_dir, "--max-factor", "2", "--compare", str(tmp_path / "both.png")]) == 0
    out = Path(run_dir)
    curve = json.loads((out / CURVE_JSON).read_text())
    record = json.loads((out / "run_record.json").read_text())
    assert [row["num_recurrences"] for row in curve["rows"]] == [1, 2, 3, 4]  # trained r = 2, x2
    assert curve["trained_num_recurrences"] == 2 and curve["recurrence_sampling"] == "fixed"
    # Same held-out split, same token weighting: r = 2 gives exactly the run record's loss.
    assert curve["loss_at_trained_r"] == pytest.approx(record["loss"], abs=1e-6)
    losses = [row["loss"] for row in curve["rows"]]
    assert len(set(losses)) == 4  # r really changes the forward
    assert all(row["eval_tokens"] == record["eval_tokens"] for row in curve["rows"])
    flops = [row["inference_flops_per_token"] for row in curve["rows"]]
    assert flops == sorted(flops) and curve["rows"][1]["relative_compute"] == pytest.approx(1.0)
    table = (out / CURVE_MD).read_text()
    assert "| **2** (trained) |" in table and f"{losses[3]:.4f}" in table
    assert (out / CURVE_PNG).stat().st_size > 1000 and (tmp_path / "both.png").stat().st_size > 1000
    assert "lowest held-out loss" in capsys.readouterr().out


def test_decoding_loss_is_the_forward_loss_and_sees_the_kv_budget_and_exit(run_dir):
    """Token-by-token decoding through a cache gives the plain forward's held-out loss; a KV budget
    and adaptive exit, which act only there, change it (and exit lowers the mean recurrences)."""
    model, _, heldout, record = load_run(run_dir)
    plain = heldout_curve(model, heldout, [4], batch_size=8)[0]
    decoded = decoding_heldout_loss(model, heldout, batch_size=8, num_recurrences=4)
    assert decoded["loss"] == pytest.approx(plain["loss"], abs=1e-5)
    assert decoded["eval_tokens"] == plain["eval_tokens"] and decoded["mean_recurrences"] == 4
    budget = decoding_heldout_loss(model, heldout, batch_size=8, max_blocks=4, num_recurrences=4, kv_budget=1)
    assert budget["eval_tokens"] == 4 * (len(heldout[0]["input_ids"]) - 1)
    assert budget["loss"] != decoding_heldout_loss(model, heldout, batch_size=8, max_blocks=4, num_recurrences=4)["loss"]
    stop = decoding_heldout_loss(model, heldout, batch_size=8, max_blocks=4, num_recurrences=4,
                                 exit_criterion="cosine", exit_threshold=2.0, min_recurrences=2)  # fmt: skip
    assert stop["mean_recurrences"] == 2


def test_checkpoint_card_shows_the_curve_measured_on_its_weights(run_dir):
    record = json.loads((Path(run_dir) / "run_record.json").read_text())
    model = LoopedForCausalLM.from_pretrained(run_dir)
    card = str(render_checkpoint_card(record, model, repo_id="me/tiny"))
    assert "held-out loss at each r" not in card  # nothing measured yet

    curve = evaluate_recurrences(run_dir, recurrences=[1, 2, 8])
    write_curve(curve, run_dir)
    card = str(render_checkpoint_card(record, model, repo_id="me/tiny", test_time_plot=CURVE_PNG))
    assert "held-out loss at each r" in card and f"{curve['rows'][2]['loss']:.4f}" in card
    assert f"![held-out loss vs r]({CURVE_PNG})" in card

    # A curve measured on other weights (a retrained run) is not shown.
    stale = dict(curve, weights_sha256="0" * 64)
    (Path(run_dir) / CURVE_JSON).write_text(json.dumps(stale))
    assert "held-out loss at each r" not in str(render_checkpoint_card(record, model, repo_id="me/tiny"))
    # Given explicitly, it is shown (the caller vouches for it).
    assert "held-out loss at each r" in str(
        render_checkpoint_card(record, model, repo_id="me/tiny", test_time=curve)
    )


def test_card_images_resolve_when_the_plot_is_beside_the_card(run_dir, tmp_path):
    write_curve(evaluate_recurrences(run_dir, recurrences=[1, 2]), run_dir)
    record = json.loads((Path(run_dir) / "run_record.json").read_text())
    card = render_checkpoint_card(
        record, LoopedForCausalLM.from_pretrained(run_dir), repo_id="me/tiny", test_time_plot=CURVE_PNG
    )
    card.save(tmp_path / "README.md")
    shutil.copy(Path(run_dir) / CURVE_PNG, tmp_path / CURVE_PNG)
    assert all((tmp_path / link).is_file() for link in card_image_links(tmp_path / "README.md"))


def test_a_hyperconnection_checkpoint_is_refused(tiny_recipe, capsys):
    record = train(*parse_recipe({**tiny_recipe, "input_injection": "hyperconnection"}))
    assert record["status"] == "ok"
    assert cli_main(["test-time", record["run_dir"]]) == 2
    err = capsys.readouterr().err
    assert "input_injection='hyperconnection'" in err and "indexed by recurrence step" in err
    with pytest.raises(TestTimeError, match="hyperconnection"):
        evaluate_recurrences(record["run_dir"])


def test_not_a_run_directory_and_bad_grids_are_named(tmp_path):
    with pytest.raises(TestTimeError, match="no run_record.json"):
        evaluate_recurrences(tmp_path)
    with pytest.raises(TestTimeError, match="max_factor=0"):
        recurrence_grid(4, 0)
    assert recurrence_grid(3, 4) == list(range(1, 13))


def test_plot_refuses_an_empty_curve(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        plot_test_time_scaling({"run_id": "x", "rows": []}, tmp_path / "x.png")


def test_the_old_module_name_still_imports_with_a_deprecation_warning():
    import importlib
    import sys

    import looped_hf.recurrence_curves as curves

    sys.modules.pop("looped_hf.test_time", None)
    with pytest.warns(DeprecationWarning, match="looped_hf.recurrence_curves"):
        old = importlib.import_module("looped_hf.test_time")
    assert old is curves
    from looped_hf.test_time import evaluate_recurrences  # the names old code imports

    assert evaluate_recurrences is curves.evaluate_recurrences


def test_data_names_the_held_out_text_instead_of_the_runs_recipe(run_dir, tiny_recipe):
    """``data`` (the CLI's --data) builds the held-out split from those fields: given the recipe's own
    data fields it is the run's split again, so the trained r gives the recorded loss, but the curve
    does not claim the record's loss as its own."""
    fields = {k: tiny_recipe[k] for k in ("dataset", "seq_len", "eval_blocks", "data_cache_dir")}
    curve = evaluate_recurrences(run_dir, recurrences=[2], data=fields)
    record = json.loads((Path(run_dir) / "run_record.json").read_text())
    assert curve["loss_at_trained_r"] == pytest.approx(record["loss"], abs=1e-6)
    assert curve["recorded_loss"] is None and curve["heldout_data"] == fields
    shorter = evaluate_recurrences(run_dir, recurrences=[2], data={**fields, "seq_len": 16, "eval_blocks": 3})
    assert shorter["seq_len"] == 16 and shorter["heldout_blocks"] == 3
    assert shorter["rows"][0]["eval_tokens"] == 3 * 15
