"""Downstream evaluation: the study's bundle format and scoring, at every r, checked by hand."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_looped_model

from looped_hf.data import load_tokenizer
from looped_hf.evaluation import (
    RESULTS_JSON,
    RESULTS_MD,
    RESULTS_PNG,
    BundleError,
    centered_score,
    evaluate_model,
    load_bundle,
    load_results,
    prepare_task,
    write_builtin_bundle,
)
from looped_hf.evaluation.bundle import Task
from looped_hf.evaluation.scoring import (
    SequenceScores,
    _score_decoding,
    aggregate,
    fewshot_indices,
    render_prompts,
    score_sequences,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIXTURE = REPO / "tests" / "fixtures" / "eval_bundle"
BOS = 256  # the byte tokenizer's BOS (= EOS): one token per UTF-8 byte below it


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bytes")


@pytest.fixture(scope="module")
def model():
    return tiny_looped_model(vocab_size=258, pad_token_id=257, eos_token_id=256, bos_token_id=256,
                             max_position_embeddings=512, noise=0.5)  # fmt: skip


# --------------------------------------------------------------------------------------------
# By hand: the study's rules written out on bytes, the model run one sequence at a time, unpadded
# --------------------------------------------------------------------------------------------
def _rows(name: str) -> list[dict]:
    rows = [
        json.loads(line) for line in (FIXTURE / "eval_data" / "toy" / name).read_text().splitlines() if line
    ]
    random.Random(1337).shuffle(rows)  # the study shuffles every task before indexing it
    return rows


def _token_losses(model, text: str, r: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    ids = [BOS, *text.encode()]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), num_recurrences=r).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    # loss[t] = -log p(ids[t] | ids[:t]) for t >= 1; argmax[t] = the greedy guess for ids[t]
    loss = torch.cat(
        [torch.zeros(1, dtype=torch.double), -logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]]
    )
    guess = torch.cat([torch.tensor([-1]), logits[:-1].argmax(-1)])
    return ids, loss, guess


def _by_hand(model, r: int) -> dict[str, dict[str, float]]:
    out = {}
    # multiple choice: "<query> <gold choice>\n\n" per shot, then "<query> <choice>"; the options
    # share everything up to the choice, and the lowest mean loss over the choice's bytes wins.
    items = _rows("capitals_mc.jsonl")
    correct, nats, tokens = 0, 0.0, 0
    for idx, item in enumerate(items):
        shot = items[random.Random(1234 + idx).sample([i for i in range(len(items)) if i != idx], 1)[0]]
        head = f"{shot['query']} {shot['choices'][shot['gold']]}\n\n{item['query']} "
        means, sums = [], []
        for choice in item["choices"]:
            ids, loss, _ = _token_losses(model, head + choice, r)
            span = loss[1 + len(head.encode()) :]
            means.append(float(span.mean()))
            sums.append((float(span.sum()), len(span)))
        correct += means.index(min(means)) == item["gold"]
        nats, tokens = nats + sums[item["gold"]][0], tokens + sums[item["gold"]][1]
    out["capitals_mc"] = {"accuracy": correct / len(items), "loss": nats / tokens}
    # schema: the options are contexts; the shared continuation " <continuation>" is scored.
    items = _rows("pronoun_schema.jsonl")
    correct, nats, tokens = 0, 0.0, 0
    for idx, item in enumerate(items):
        shot = items[random.Random(1234 + idx).sample([i for i in range(len(items)) if i != idx], 1)[0]]
        head = f"{shot['context_options'][shot['gold']]} {shot['continuation']}\n\n"
        tail = f" {item['continuation']}"
        means, sums = [], []
        for option in item["context_options"]:
            ids, loss, _ = _token_losses(model, head + option + tail, r)
            span = loss[len(ids) - len(tail.encode()) :]
            means.append(float(span.mean()))
            sums.append((float(span.sum()), len(span)))
        correct += means.index(min(means)) == item["gold"]
        nats, tokens = nats + sums[item["gold"]][0], tokens + sums[item["gold"]][1]
    out["pronoun_schema"] = {"accuracy": correct / len(items), "loss": nats / tokens}
    # language modelling: 2 shots "<context trimmed> <continuation>\n\n"; correct when greedy
    # decoding reproduces every byte of the continuation.
    items = _rows("echo_lm.jsonl")
    correct, nats, tokens = 0, 0.0, 0
    for idx, item in enumerate(items):
        picks = random.Random(1234 + idx).sample([i for i in range(len(items)) if i != idx], 2)
        shots = "".join(f"{items[i]['context'].strip()} {items[i]['continuation']}\n\n" for i in picks)
        head = f"{shots}{item['context'].strip()}"  # the context-only prompt, stripped
        ids, loss, guess = _token_losses(model, f"{head} {item['continuation']}", r)
        start = 1 + len(head.encode())  # the delimiter's space belongs to the continuation here
        correct += bool((guess[start:] == torch.tensor(ids[start:])).all())
        nats, tokens = nats + float(loss[start:].sum()), tokens + len(ids) - start
    out["echo_lm"] = {"accuracy": correct / len(items), "loss": nats / tokens}
    return out


def test_fixture_bundle_scores_match_the_study_rules_computed_by_hand(model, tokenizer):
    bundle = load_bundle(FIXTURE)
    results = evaluate_model(model, tokenizer, [bundle], [1, 3])
    baselines = {t.label: t.random_baseline for t in bundle.tasks}
    for row in results["rows"]:
        expected = _by_hand(model, row["num_recurrences"])
        for label, want in expected.items():
            got = row["tasks"][label]
            assert got["accuracy"] == want["accuracy"], (label, row["num_recurrences"])
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), label
            assert got["centered"] == pytest.approx(
                (want["accuracy"] - 0.01 * baselines[label]) / (1 - 0.01 * baselines[label])
            )
            assert got["mean_recurrences"] == row["num_recurrences"]  # no exit: every token runs r
        centered = [row["tasks"][t]["centered"] for t in expected]
        agg = row["bundles"]["toy"]
        assert agg["mean_centered"] == pytest.approx(sum(centered) / 3)
        reading = (row["tasks"]["pronoun_schema"]["centered"] + row["tasks"]["echo_lm"]["centered"]) / 2
        assert agg["groups"]["reading"]["centered"] == pytest.approx(reading)
        assert agg["group_mean"] == pytest.approx((row["tasks"]["capitals_mc"]["centered"] + reading) / 2)
    # r reaches the model: the losses move with r.
    assert (
        results["rows"][0]["tasks"]["capitals_mc"]["loss"]
        != results["rows"][1]["tasks"]["capitals_mc"]["loss"]
    )


def test_prompts_render_as_the_study_templates():
    mc = {"query": "Q?", "choices": ["a", "b"], "gold": 1}
    assert render_prompts(mc, "multiple_choice", " ", [mc]) == ["Q? b\n\nQ? a", "Q? b\n\nQ? b"]
    schema = {"context_options": ["x1", "x2"], "continuation": "end", "gold": 0}
    assert render_prompts(schema, "schema", ": ", [schema]) == ["x1: end\n\nx1: end", "x1: end\n\nx2: end"]
    lm = {"context": "  say hi  ", "continuation": "hi"}
    # contexts trimmed; the context-only prompt stripped (its trailing delimiter too)
    assert render_prompts(lm, "language_modeling", " ", [lm]) == [
        "say hi hi\n\nsay hi",
        "say hi hi\n\nsay hi hi",
    ]


def test_fewshot_draw_is_reproducible_and_never_the_item_itself(tokenizer):
    for idx in range(12):
        picks = fewshot_indices(12, idx, 5)
        assert idx not in picks and len(set(picks)) == 5
        assert picks == random.Random(1234 + idx).sample([i for i in range(12) if i != idx], 5)
    task = load_bundle(FIXTURE).tasks[2]
    first, second = prepare_task(task, tokenizer), prepare_task(task, tokenizer)
    assert [s.ids for s in first.sequences] == [s.ids for s in second.sequences]


def test_max_per_task_takes_the_first_items_of_the_seeded_shuffle(tokenizer):
    task = load_bundle(FIXTURE).tasks[0]
    shuffled = list(task.rows)
    random.Random(1337).shuffle(shuffled)
    assert task.items(2) == shuffled[:2] and task.items() == shuffled
    assert prepare_task(task, tokenizer, max_per_task=2).num_items == 2


def test_centered_score_and_core_mean():
    assert centered_score(0.75, 50.0) == pytest.approx(0.5)
    assert centered_score(0.25, 25.0) == pytest.approx(0.0)
    assert centered_score(0.4, 0.0) == pytest.approx(0.4)
    tasks = {
        "a": {"centered": 0.5, "accuracy": 0.75, "loss": 1.0},
        "b": {"centered": 0.1, "accuracy": 0.1, "loss": 3.0},
        "c": {"centered": -0.3, "accuracy": 0.2, "loss": 2.0},
    }
    agg = aggregate(tasks, {"a": "g1", "b": "g1", "c": "g2"})
    assert agg["mean_centered"] == pytest.approx(0.1)  # CORE: the mean over tasks
    assert agg["groups"]["g1"]["centered"] == pytest.approx(0.3) and agg["groups"]["g1"]["loss"] == 2.0
    assert agg["group_mean"] == pytest.approx(0.0)  # the Saunshi suite's: the mean over groups


def test_core_layout_reads_baselines_groups_and_fewshot_lists():
    bundle = load_bundle(FIXTURE / "core" / "core.yaml")
    assert [(t.label, t.group, t.random_baseline, t.num_fewshot) for t in bundle.tasks] == [
        ("tiny_lambada", "reading", 0.0, 0),
        ("tiny_copa", "reading", 50.0, 0),
    ]
    assert bundle.tasks[0].continuation_delimiter == " " and bundle.name == "core"


# --------------------------------------------------------------------------------------------
# Bad bundles: the error names the file, the line and the field
# --------------------------------------------------------------------------------------------
@pytest.fixture
def bundle_copy(tmp_path: Path) -> Path:
    dest = tmp_path / "bundle"
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("core"))
    return dest


def test_unknown_task_type_names_yaml_file_line_and_field(bundle_copy):
    yaml_path = bundle_copy / "toy.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("task_type: schema", "task_type: cloze"))
    with pytest.raises(BundleError) as err:
        load_bundle(bundle_copy)
    lines = yaml_path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "label: pronoun_schema" in text)
    assert f"{yaml_path}, line {line}" in str(err.value)
    assert "'task_type'" in str(err.value) and "'cloze'" in str(err.value)


def test_missing_data_file_names_the_file_and_field(bundle_copy):
    (bundle_copy / "eval_data" / "toy" / "echo_lm.jsonl").unlink()
    with pytest.raises(
        BundleError, match=r"toy\.yaml, line \d+ .*'dataset_uri' = 'toy/echo_lm.jsonl'.*missing"
    ):
        load_bundle(bundle_copy)


def test_gold_out_of_range_names_the_jsonl_line_and_field(bundle_copy):
    path = bundle_copy / "eval_data" / "toy" / "capitals_mc.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2].replace('"gold": 2', '"gold": 3')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BundleError) as err:
        load_bundle(bundle_copy)
    assert f"{path}, line 3: field 'gold' = 3 out of range" in str(err.value)


def test_malformed_rows_name_their_line(bundle_copy):
    path = bundle_copy / "eval_data" / "toy" / "echo_lm.jsonl"
    path.write_text(path.read_text() + '{"context": "x"}\n')
    with pytest.raises(BundleError, match=r"echo_lm\.jsonl, line 5: field 'continuation' missing"):
        load_bundle(bundle_copy)
    path.write_text('{"context": "x", \n')
    with pytest.raises(BundleError, match=r"echo_lm\.jsonl, line 1: not valid JSON"):
        load_bundle(bundle_copy)


# --------------------------------------------------------------------------------------------
# Batching, exit and KV-budget settings
# --------------------------------------------------------------------------------------------
def test_batched_padded_scores_equal_one_sequence_at_a_time(model, tokenizer):
    task = load_bundle(FIXTURE).tasks[1]
    prepared = prepare_task(task, tokenizer)
    batched = score_sequences(model, prepared.sequences, 2)
    alone = score_sequences(model, prepared.sequences, 2, batch_tokens=1)  # every sequence on its own
    assert batched.loss_sum == pytest.approx(alone.loss_sum, rel=1e-5)
    assert batched.greedy_ok == alone.greedy_ok


def test_decoding_through_the_cache_matches_the_full_forward(model, tokenizer):
    task = load_bundle(FIXTURE).tasks[2]
    seqs = prepare_task(task, tokenizer).sequences
    full = score_sequences(model, seqs, 3)
    decoded = SequenceScores([0.0] * len(seqs), [0] * len(seqs), [False] * len(seqs), [0.0] * len(seqs))
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            _score_decoding(model, seq, i, 3, {}, decoded, torch.device("cpu"))
    assert decoded.loss_sum == pytest.approx(full.loss_sum, rel=1e-4)
    # A KV budget below r acts only through the cache: scoring then decodes, and the numbers move.
    budget = score_sequences(model, seqs, 3, call_kwargs={"kv_budget": 1})
    assert budget.loss_sum != pytest.approx(full.loss_sum, rel=1e-6)


def test_adaptive_exit_reports_mean_recurrences_used(model, tokenizer):
    bundle = load_bundle(FIXTURE)
    # A cosine distance never exceeds 2: with that threshold every token stops after one recurrence.
    early = evaluate_model(
        model, tokenizer, [bundle], [4], settings={"exit_criterion": "cosine", "exit_threshold": 2.0}
    )
    never = evaluate_model(
        model, tokenizer, [bundle], [4], settings={"exit_criterion": "cosine", "exit_threshold": 0.0}
    )
    for label in ("capitals_mc", "pronoun_schema", "echo_lm"):
        assert early["rows"][0]["tasks"][label]["mean_recurrences"] == pytest.approx(1.0)
        assert never["rows"][0]["tasks"][label]["mean_recurrences"] == pytest.approx(4.0)
    assert early["adaptive"] and early["rows"][0]["mean_recurrences"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="settings.*unknown"):
        evaluate_model(model, tokenizer, [bundle], [1], settings={"exit_treshold": 0.1})


# --------------------------------------------------------------------------------------------
# The built-in bundle and the command
# --------------------------------------------------------------------------------------------
def test_builtin_bundle_is_deterministic_and_reads_as_a_bundle(tmp_path):
    first = write_builtin_bundle(tmp_path / "a", n_examples=20)
    second = write_builtin_bundle(tmp_path / "b", n_examples=20)
    for path in sorted((tmp_path / "a").rglob("*.jsonl")):
        assert path.read_bytes() == (tmp_path / "b" / path.relative_to(tmp_path / "a")).read_bytes()
    bundle = load_bundle(first.parent)
    assert load_bundle(second).name == "builtin"
    labels = {t.label: t for t in bundle.tasks}
    assert {"induction_head", "var_assign_d0_math", "var_assign_d1_code", "p_hop_2", "addition_3d"} <= set(
        labels
    )
    row = labels["induction_head"].rows[0]
    key = row["context"].splitlines()[-1].removesuffix(" ->")
    assert f"{key} -> {row['continuation']}" in row["context"]  # the asked key's line holds the answer
    hop = labels["p_hop_2"].rows[0]
    links = dict(line.split(" -> ") for line in hop["query"].splitlines()[:-1])
    start = hop["query"].splitlines()[-1].split()[2].rstrip(",")
    assert links[links[start]] == hop["choices"][hop["gold"]]
    add = labels["addition_2d"].rows[0]
    assert eval(add["context"].rstrip("=")) == int(add["continuation"])  # noqa: S307 - digits and '+'


def test_eval_command_writes_json_markdown_and_plot(model, tokenizer, tmp_path):
    from looped_hf.evaluation.cli import main

    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    argv = [str(ckpt), "--bundle", str(FIXTURE), "--bundle", str(FIXTURE / "core"), "--recurrences", "1", "2"]
    assert main([*argv, "--max-per-task", "3", "--exit-criterion", "cosine", "--exit-threshold", "2"]) == 0
    results = load_results(ckpt)
    assert results["recurrences"] == [1, 2] and results["rows"][0]["tasks"]["capitals_mc"]["num_items"] == 3
    core = results["rows"][1]["bundles"]["core"]
    copa, lambada = (results["rows"][1]["tasks"][t]["centered"] for t in ("tiny_copa", "tiny_lambada"))
    assert core["mean_centered"] == pytest.approx((copa + lambada) / 2)
    assert results["weights_sha256"] and results["settings"]["exit_criterion"] == "cosine"
    text = (ckpt / RESULTS_MD).read_text()
    assert (
        "| capitals_mc | knowledge |" in text
        and "Mean recurrences used" in text
        and "| **CORE** | core |" in text
    )
    assert (ckpt / RESULTS_PNG).stat().st_size > 0
    assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]  # written whole: no temp files left
    assert load_results(ckpt, weights_sha256="0" * 64) is None  # stale results (other weights) are ignored
    assert main([str(ckpt), "--bundle", str(tmp_path / "nope")]) == 2
    assert json.loads((ckpt / RESULTS_JSON).read_text())["run_id"] == "ckpt"


# --------------------------------------------------------------------------------------------
# A tiny model trained on the primitives: r matters on tasks
# --------------------------------------------------------------------------------------------
def test_tiny_model_trained_on_primitives_scores_differently_at_r1_and_its_trained_r(tokenizer, tmp_path):
    from looped_hf.evaluation.builtin import training_text

    torch.manual_seed(0)
    trained_r, seq_len = 3, 64
    model = tiny_looped_model(vocab_size=258, pad_token_id=257, eos_token_id=256, bos_token_id=256,
                              max_position_embeddings=512, num_recurrences=trained_r, num_recurrent_layers=1,
                              hidden_size=32, noise=0.0).train()  # fmt: skip
    stream: list[int] = []
    for doc in training_text(1500, seed=1):
        stream += [BOS, *doc.encode()]
    blocks = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = blocks[torch.randint(len(blocks), (8,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1.6  # it learned the documents (bytes: chance is ~5.5 nats)
    model.eval()
    labels = ["induction_head", "p_hop_2", "addition_2d"]
    bundle = load_bundle(write_builtin_bundle(tmp_path / "builtin", n_examples=40)).select(labels)
    results = evaluate_model(model, tokenizer, [bundle], [1, trained_r], max_per_task=24)
    at1, at_trained = (row["tasks"] for row in results["rows"])
    for label in labels:
        assert abs(at_trained[label]["loss"] - at1[label]["loss"]) > 0.02, label
    # The loop was trained at r = 3: one recurrence is a different, worse network on the tasks.
    mean = {r: sum(row["tasks"][x]["loss"] for x in labels) / 3 for r, row in zip((1, 3), results["rows"])}
    assert mean[3] < mean[1] - 0.02


def test_task_items_index_after_the_seeded_shuffle():
    rows = [{"context": str(i), "continuation": "x"} for i in range(6)]
    task = Task("t", "language_modeling", 1, " ", "g", 0.0, Path("t.jsonl"), rows)
    shuffled = list(rows)
    random.Random(1337).shuffle(shuffled)
    assert task.items() == shuffled and task.items(4) == shuffled[:4] and task.items(0) == shuffled
