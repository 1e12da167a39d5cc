"""The checkpoint card: what a Hub user loads (architecture, parameters, training, held-out loss).

``looped-hf publish`` writes it next to the weights (:func:`render_checkpoint_card`); its YAML
front matter is :func:`checkpoint_card_data`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from looped_hf.fileio import weights_sha256

from .common import (
    CHECKPOINT_TEMPLATE,
    PathLike,
    _ci,
    _count,
    _duration,
    _project_link,
    _round,
    _template,
    heldout_metrics,
    phi_caveat,
    si,
)

if TYPE_CHECKING:
    from looped_hf.scaling import ScalingLawFit

# Recipe fields that are machine-local (paths, output places) or operational (logging, progress
# bars) and say nothing about the model or its training; left out of the card's recipe.
_LOCAL_RECIPE_FIELDS = ("output_dir", "data_cache_dir", "results_file", "logging_dir", "resume_from_checkpoint",
                        "accelerator_config", "debug", "report_to", "disable_tqdm", "logging_steps",
                        "dataloader_num_workers", "save_strategy", "save_steps", "save_total_limit")  # fmt: skip
# Training fields the resolved recipe omits when they are at their default (looped_hf.arguments).
_TRAINING_DEFAULTS = {"optimizer": "adamw", "lr_schedule": "study"}


def architecture_diagram(config: Any) -> str:
    """The loop in one ASCII picture, with this model's layer counts and r."""
    p, k, c, r = (
        config.num_prelude_layers,
        config.num_recurrent_layers,
        config.num_coda_layers,
        config.num_recurrences,
    )
    inj = config.input_injection
    step = f"h = block(inject_{inj}(h, e))" if inj != "none" else "h = block(h)"
    lines = [
        f"tokens -> embed -> [prelude: {p} layer{'s' if p != 1 else ''}, once] = e",
        f"         h_0 = {getattr(config, 'state_init', 'prelude').replace('prelude', 'e')}",
        f"         repeat r = {r}:  {step}    [block: {k} shared layer{'s' if k != 1 else ''}]",
        f"         -> [coda: {c} layer{'s' if c != 1 else ''}, once] -> norm -> lm_head",
        f"         = {config.num_layer_applications()} layer applications per token from "
        f"{p + k + c} unique layers",
    ]
    return "\n".join(lines)


def _dataset_info(recipe: Mapping[str, Any]) -> tuple[str | None, str, str]:
    """(Hub dataset id or None, dataset type for model-index, human-readable description)."""
    name = recipe.get("dataset")
    if name in (None, "embedded"):
        return (
            None,
            "looped_hf/embedded-classics",
            (
                "the embedded public-domain classics of looped_hf (Shakespeare, King James Bible, Austen; "
                "see `looped_hf/assets/ATTRIBUTION.md`)"
            ),
        )
    name = str(name)
    suffixes = (".json", ".jsonl", ".txt", ".csv", ".parquet", ".gz", ".xz", ".bz2", ".zst")
    looks_local = (os.path.isabs(name) or name.startswith(".") or os.path.exists(name) or name.count("/") > 1
                   or name.endswith(suffixes))  # fmt: skip
    if looks_local:
        return None, "local", f"a local dataset (`{Path(name).name}`)"
    return name, name, f"[`{name}`](https://huggingface.co/datasets/{name})"


def tokenizer_description(recipe: Mapping[str, Any], vocab_size: int) -> str:
    """What the recipe's ``tokenizer`` field means, for a reader of the card."""
    name = recipe.get("tokenizer")
    if name in (None, "embedded"):
        return f"looped_hf's embedded byte-level BPE ({vocab_size} tokens, trained on the embedded corpus)"
    if name == "bytes":
        return f"byte-level: one token per UTF-8 byte plus EOS and PAD ({vocab_size} tokens)"
    return f"`{Path(str(name)).name if os.path.isabs(str(name)) else name}` ({vocab_size} tokens)"


def _public_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The training recipe without machine-local fields (paths, output places)."""
    out = {k: v for k, v in recipe.items() if k not in _LOCAL_RECIPE_FIELDS and v is not None and v != []}
    if isinstance(out.get("dataset"), str) and os.path.isabs(out["dataset"]):
        out["dataset"] = Path(out["dataset"]).name
    return out


def _effective(fit: ScalingLawFit | None, n_once: int, n_rec: int, r: int) -> dict[str, Any] | None:
    if fit is None or fit.params.get("phi") is None or fit.kind != "looped":
        return None
    eq = fit.equivalence(n_once, n_rec, r)
    phi = float(fit.params["phi"])
    return {
        "phi": f"{phi:.3f}",
        "phi_value": phi,
        "phi_ci": _ci(fit.ci.get("phi")) if fit.ci.get("phi") else None,
        "n_eff": si(eq["performs_like"]),
        "n_eff_value": float(eq["performs_like"]),
        "unique": si(eq["unique"]),
        "costs_like": si(eq["costs_like"]),
        "caveat": phi_caveat(fit),
    }


def checkpoint_card_data(
    record: Mapping[str, Any],
    config: Any,
    params: Mapping[str, int],
    *,
    model_name: str,
    license: str = "apache-2.0",
    fit: ScalingLawFit | None = None,
) -> ModelCardData:
    """YAML metadata of a checkpoint card: Hub fields, ``model-index`` and a ``looped:`` block."""
    recipe = record.get("recipe") or {}
    hub_dataset, dataset_type, _ = _dataset_info(recipe)
    metrics = heldout_metrics(record)
    common = dict(task_type="text-generation", task_name="Causal language modeling", dataset_type=dataset_type,
                  dataset_name="held-out documents of the training corpus", dataset_split="held-out")  # fmt: skip
    eval_results = [
        EvalResult(
            metric_type="loss",
            metric_name="held-out loss (nats/token)",
            metric_value=round(metrics["loss"], 6),
            **common,
        ),
        EvalResult(
            metric_type="perplexity",
            metric_name="held-out perplexity",
            metric_value=round(metrics["perplexity"], 6),
            **common,
        ),
    ]
    looped: dict[str, Any] = {
        "num_recurrences": config.num_recurrences,
        "num_prelude_layers": config.num_prelude_layers,
        "num_recurrent_layers": config.num_recurrent_layers,
        "num_coda_layers": config.num_coda_layers,
        "effective_num_layers": config.effective_num_layers,
        "input_injection": config.input_injection,
        "backprop_recurrences": config.backprop_recurrences,
        "recurrence_locked": config.input_injection == "hyperconnection",
        "n_once": int(params["once"]),
        "n_rec": int(params["recurrent"]),
        "n_embedding": int(params["embedding"]),
        "n_lm_head": int(params["lm_head"]),
        "train_flops": record.get("train_flops"),
        "train_tokens": record.get("tokens"),
        "flop_budget": record.get("budget"),
    }
    effective = _effective(fit, int(params["once"]), int(params["recurrent"]), config.num_recurrences)
    if effective is not None:
        looped["phi"] = _round(effective["phi_value"])
        if fit is not None and fit.ci.get("phi"):
            looped["phi_ci95"] = [_round(float(v)) for v in fit.ci["phi"]]
        looped["n_effective"] = round(effective["n_eff_value"])
    return ModelCardData(
        language="en",
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["looped", "depth-recurrent", "custom_code", "looped_hf", "text-generation"],
        datasets=[hub_dataset] if hub_dataset else None,
        model_name=model_name,
        eval_results=eval_results,
        looped=looped,
    )


def _training_section(record: Mapping[str, Any], tokenizer_name: str) -> dict[str, Any]:
    recipe = record.get("recipe") or {}
    _, _, dataset_desc = _dataset_info(recipe)
    versions = record.get("versions") or {}
    return {
        "dataset": dataset_desc,
        "tokenizer": tokenizer_name,
        "tokens": _count(record.get("tokens")),
        "train_flops": f"{record['train_flops']:.3g}" if record.get("train_flops") else "-",
        "budget": f"{record['budget']:.3g}" if record.get("budget") else None,
        "max_steps": _count(record.get("max_steps")),
        "tokens_per_step": _count(record.get("tokens_per_step")),
        "seq_len": record.get("seq_len", recipe.get("seq_len", "-")),
        "optimizer": recipe.get("optimizer", _TRAINING_DEFAULTS["optimizer"]),
        "learning_rate": recipe.get("learning_rate", "-"),
        "lr_schedule": recipe.get("lr_schedule", _TRAINING_DEFAULTS["lr_schedule"]),
        "seed": record.get("seed", "-"),
        "wall_time": _duration(record.get("wall_time_s")),
        "throughput": _throughput(record),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "-",
        "trainer_total_flos": f"{record['trainer_total_flos']:.3g}"
        if record.get("trainer_total_flos")
        else "-",
        "recipe_yaml": yaml.safe_dump(_public_recipe(recipe), sort_keys=False).rstrip() or "{}",
        "recurrences": _training_recurrences(record),
    }


def _throughput(record: Mapping[str, Any]) -> str | None:
    """'12.3k tokens/s, 4.56 TFLOP/s model FLOPs, MFU 38.2% (of 989 TFLOP/s per device)' from the run
    record; MFU only where the record has one (a device with a known peak); None for older records."""
    tokens = record.get("tokens_per_second")
    if not tokens:
        return None
    text = f"{si(tokens)} tokens/s"
    if record.get("model_flops_per_second"):
        text += f", {si(record['model_flops_per_second'])}FLOP/s model FLOPs"
    if record.get("mfu") is not None and record.get("peak_flops"):
        text += f", MFU {record['mfu']:.1%} (of {si(record['peak_flops'])}FLOP/s bf16 peak per device)"
    return text


def _training_recurrences(record: Mapping[str, Any]) -> str | None:
    """How r was chosen during training, for a run with a sampled r (None: fixed r)."""
    sampling = record.get("recurrence_sampling") or (record.get("recipe") or {}).get("recurrence_sampling")
    if sampling in (None, "fixed"):
        return None
    ran = record.get("sampled_recurrences") or {}
    seen = ""
    if ran.get("steps"):
        seen = f"; ran mean {ran['mean']:.2f}, min {ran['min']}, max {ran['max']} over {ran['steps']} steps"
    return f"sampled per optimizer step (`{sampling}`, mean r = {record.get('num_recurrences')}{seen})"


def render_checkpoint_card(
    record: Mapping[str, Any],
    model: Any,
    *,
    repo_id: str,
    tokenizer_name: str | None = None,
    license: str = "apache-2.0",
    fit: ScalingLawFit | None = None,
    prompt: str = "To be, or not to be",
    test_time: Mapping[str, Any] | PathLike | None = None,
    test_time_plot: str | None = None,
    evaluation: Mapping[str, Any] | PathLike | None = None,
    evaluation_plot: str | None = None,
    parent_evaluation: Mapping[str, Any] | PathLike | None = None,
) -> ModelCard:
    """The model card of one checkpoint (``model``: the loaded ``LoopedForCausalLM``).

    ``test_time``: the checkpoint's test-time scaling curve (``looped-hf test-time``: a result of
    ``looped_hf.recurrence_curves.evaluate_recurrences`` or the path of its JSON). ``None``: the
    ``test_time_scaling.json`` next to the checkpoint the model was loaded from, if there is one
    measured on these weights. The card then shows the held-out loss at every r measured, and
    ``test_time_plot`` (a path relative to the card, e.g. ``test_time_scaling.png`` copied beside
    it) as an image.

    ``evaluation``: the checkpoint's downstream results (``looped-hf eval``: a results dict of
    ``looped_hf.evaluation.evaluate_model`` or the path of its ``eval_results.json``). ``None``: the
    ``eval_results.json`` beside the loaded checkpoint, if measured on these weights. The card then
    shows the task x r table of centered scores, ``evaluation_plot`` (a path relative to the card,
    e.g. ``eval_results.png`` copied beside it), and ``model-index`` gets each task's accuracy at
    the trained r.

    A retrofit run (its record has the ``retrofit`` lineage of the folder it started from, or a
    ``parent_loss``: `looped_hf.train`) gets a section on the dense parent: which one (class,
    weights sha256, layer map, method), how it was retrofitted and trained (curriculum,
    distillation, what trained, tokens and FLOPs), the held-out loss at every r of the test-time
    curve beside the parent's on the same blocks, and, with ``parent_evaluation`` (the parent's
    ``eval_results.json``: ``looped-hf eval`` of its ``--loop-in-place`` retrofit at r = 1, which
    is the parent exactly), each task's score at every r beside the parent's.
    """
    from looped_hf import __version__
    from looped_hf.accounting_looped import inference_flops_per_token, num_scaling_params
    from looped_hf.interface_looped import SUPPORTED_TRANSFORMERS

    config = model.config
    curve = _test_time_curve(model, test_time)
    params = num_scaling_params(model)
    model_name = repo_id.split("/")[-1]
    data = checkpoint_card_data(record, config, params, model_name=model_name, license=license, fit=fit)
    evaluated = _evaluation_results(model, evaluation)
    if evaluated is not None:
        data.eval_results = [*(data.eval_results or []), *evaluation_model_index(evaluated)]
    seq_len = int(record.get("seq_len") or config.max_position_embeddings)
    per_r = inference_flops_per_token(model, seq_len, 2) - inference_flops_per_token(model, seq_len, 1)
    k = config.backprop_recurrences
    arch = {
        "num_recurrences": config.num_recurrences,
        "num_prelude_layers": config.num_prelude_layers,
        "num_recurrent_layers": config.num_recurrent_layers,
        "num_coda_layers": config.num_coda_layers,
        "effective_num_layers": config.effective_num_layers,
        "num_unique_layers": config.num_unique_layers,
        "input_injection": config.input_injection,
        "backprop": "all r" if k is None else f"last {k} of r (truncated)",
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": config.hidden_act,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "r_locked": config.input_injection == "hyperconnection",
    }
    metrics = heldout_metrics(record)
    summary = (
        f"held-out loss {metrics['loss']:.4f} nats/token after {si(record.get('tokens'))} tokens, "
        f"{si(record.get('train_flops'))} training FLOPs"
    )
    card = ModelCard.from_template(
        data,
        template_path=str(_template(CHECKPOINT_TEMPLATE)),
        model_name=model_name,  # to_dict() drops it once eval_results are set
        repo_id=repo_id,
        summary=summary,
        diagram=architecture_diagram(config),
        arch=arch,
        params={key: _count(value) for key, value in params.items()},
        effective=_effective(fit, int(params["once"]), int(params["recurrent"]), config.num_recurrences),
        inference={"per_extra_r": si(per_r)},
        training=_training_section(
            record, tokenizer_name or tokenizer_description(record.get("recipe") or {}, config.vocab_size)
        ),
        results={
            "loss": f"{metrics['loss']:.4f}",
            "perplexity": f"{metrics['perplexity']:.2f}",
            "eval_tokens": _count(metrics["eval_tokens"]),
        },  # fmt: skip
        prompt=prompt,
        test_time=None if curve is None else {
            "summary": _test_time_summary(curve),
            "table": _test_time_table(curve),
            "plot": test_time_plot,
            "sampling": curve.get("recurrence_sampling") or "fixed",
        },
        transformers_spec=SUPPORTED_TRANSFORMERS,
        looped_hf_link=_project_link(),
        looped_hf_version=__version__,
    )
    if evaluated is not None:
        section = _evaluation_section(evaluated, evaluation_plot)
        card.text = _insert_section(card.text, section, before="## Limitations")
    retrofit = _retrofit_section(record, curve, evaluated, _parent_results(parent_evaluation))
    if retrofit is not None:
        card.text = _insert_section(card.text, retrofit, before="## Limitations")
    return card


def _parent_results(parent_evaluation: Mapping[str, Any] | PathLike | None) -> Mapping[str, Any] | None:
    if parent_evaluation is None or isinstance(parent_evaluation, Mapping):
        return parent_evaluation
    path = Path(parent_evaluation)
    if not path.is_file():
        raise FileNotFoundError(
            f"parent_evaluation={str(parent_evaluation)!r}: no such file (`looped-hf eval`)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def _span(layers: list[int]) -> str:
    """[4, 5, 6, 7] -> '4-7'; [] -> 'none'; non-contiguous lists as written."""
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ", ".join(map(str, layers))


def _retrofit_lines(record: Mapping[str, Any]) -> list[str]:
    """Where the model came from and how it was trained after the retrofit, one bullet each."""
    lineage = record.get("retrofit") or {}
    parent = lineage.get("parent") or {}
    recipe = record.get("recipe") or {}
    lines = []
    if parent:
        shas = ", ".join(
            f"`{name}` {sha[:16]}..." for name, sha in (parent.get("weights_sha256") or {}).items()
        )
        arch = ", ".join(parent.get("architectures") or []) or parent.get("family", "?")
        lines.append(
            f"- **Parent:** `{arch}` (`{Path(str(parent.get('path', '?'))).name}`; weights sha256 {shas or '-'})"
        )
    layer_map = lineage.get("layer_map") or {}
    if layer_map:
        parts = [
            f"{name} {_span(layer_map[name])}"
            for name in ("prelude", "recurrent", "coda", "dropped")
            if name in layer_map
        ]
        lines.append(f"- **Method:** {lineage.get('method', '?')} ({lineage.get('paper', '')}); parent layers "
                     f"{'; '.join(parts)} of {layer_map.get('num_parent_layers', '?')}; adapter init "
                     f"`{lineage.get('adapter_init', '?')}`, initial state `{lineage.get('state_init', '?')}`")  # fmt: skip
    ran = record.get("sampled_recurrences") or {}
    curriculum = ran.get("curriculum")
    if curriculum:
        lines.append(f"- **Curriculum:** mean r {curriculum['start']} -> {curriculum['max']} over the first "
                     f"{curriculum['warmup_steps']} of {ran.get('steps')} steps (`{curriculum['shape']}`), r drawn "
                     f"`{ran.get('scheme')}`; ran mean {ran.get('mean', 0):.2f}, max {ran.get('max')}")  # fmt: skip
    trainable = record.get("trainable") or {}
    if trainable:
        lines.append(f"- **Trained:** {trainable['mode']} ({_count(trainable['parameters'])} of "
                     f"{_count(trainable['of'])} parameters); optimizer `{recipe.get('optimizer', 'adamw')}`, lrs "
                     + ", ".join(f"{k} {v:g}" for k, v in (record.get("learning_rates") or {}).items()
                                 if isinstance(v, (int, float))))  # fmt: skip
    distillation = record.get("distillation")
    if distillation:
        lines.append(f"- **Distillation:** from the frozen parent, loss = {distillation['alpha']:g} x CE + "
                     f"{1 - distillation['alpha']:g} x T^2 x KL(teacher || student), T = {distillation['temperature']:g}; "
                     f"its forward ({si(distillation['teacher_flops_per_token'])}FLOPs/token) counted below")  # fmt: skip
    lines.append(f"- **Spent:** {_count(record.get('tokens'))} tokens, "
                 f"{record['train_flops']:.3g} training FLOPs" if record.get("train_flops") else "- **Spent:** -")  # fmt: skip
    return lines


def _retrofit_section(
    record: Mapping[str, Any],
    curve: Mapping[str, Any] | None,
    evaluated: Mapping[str, Any] | None,
    parent_results: Mapping[str, Any] | None,
) -> str | None:
    """The card's section on a retrofit's dense parent (None for a run that is not a retrofit)."""
    if not record.get("retrofit") and not record.get("parent_loss"):
        return None
    lines = ["## Retrofitted from a dense parent", "", *_retrofit_lines(record), ""]
    parent = record.get("parent_loss")
    same_blocks = curve is not None and curve.get("heldout_data") is None
    rows = (
        curve["rows"]
        if same_blocks
        else [{"num_recurrences": record.get("num_recurrences"), "loss": record.get("loss")}]
    )
    if parent is not None and parent.get("loss") is not None:
        ref = float(parent["loss"])
        lines += [f"Held-out loss against r beside the parent's ({ref:.4f} nats/token on the same "
                  f"{_count(parent.get('eval_tokens'))} held-out tokens):", "",
                  "| r | held-out loss (nats/token) | parent | vs parent |", "|---|---|---|---|"]  # fmt: skip
        for row in rows:
            loss = row.get("loss")
            delta = "-" if loss is None else f"{round(loss - ref, 4) + 0.0:+.4f}"
            shown = "-" if loss is None else f"{loss:.4f}"
            lines.append(f"| {row['num_recurrences']} | {shown} | {ref:.4f} | {delta} |")
        if not same_blocks:
            lines += ["", "(The trained r only: `looped-hf test-time` on this folder adds every r.)"]
        lines.append("")
    if evaluated is not None and parent_results is not None:
        lines += _parent_score_table(evaluated, parent_results)
    return "\n".join(lines).rstrip() + "\n"


def _parent_score_table(evaluated: Mapping[str, Any], parent_results: Mapping[str, Any]) -> list[str]:
    """Centered score per task at every r, beside the parent's (its results' first row)."""
    parent_row = (parent_results.get("rows") or [{}])[0].get("tasks", {})
    rows = evaluated["rows"]
    head = "| task | parent | " + " | ".join(f"r = {row['num_recurrences']}" for row in rows) + " |"
    lines = [
        "Downstream centered score at every r beside the parent's:",
        "",
        head,
        "|---|---:|" + "---:|" * len(rows),
    ]

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.4f}"

    for task in evaluated.get("tasks", []):
        label = task["label"]
        cells = [fmt(row["tasks"].get(label, {}).get("centered")) for row in rows]
        lines.append(
            f"| {label} | {fmt(parent_row.get(label, {}).get('centered'))} | " + " | ".join(cells) + " |"
        )
    return [*lines, ""]


def _evaluation_results(
    model: Any, evaluation: Mapping[str, Any] | PathLike | None
) -> Mapping[str, Any] | None:
    """The downstream results to show: the ones given, or those saved beside the loaded checkpoint."""
    from looped_hf.evaluation.report import RESULTS_JSON, load_results

    if isinstance(evaluation, Mapping):
        return evaluation
    if evaluation is not None:
        path = Path(evaluation)
        if not path.is_file():
            raise FileNotFoundError(
                f"evaluation={str(evaluation)!r}: no such file (write it with `looped-hf eval`)"
            )
        return json.loads(path.read_text(encoding="utf-8"))
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if not (source / RESULTS_JSON).is_file():
        return None
    # Only results measured on exactly these weights (a retrained run leaves stale ones behind).
    return load_results(source, weights_sha256(source))


def evaluation_model_index(results: Mapping[str, Any]) -> list[EvalResult]:
    """``model-index`` entries: each task's accuracy (and centered score) at the trained r; none when
    the trained r was not among those evaluated."""
    from looped_hf.evaluation.report import row_at

    trained = int(results["trained_num_recurrences"])
    row = row_at(results, trained)
    if row is None:
        return []
    out = []
    for task in results.get("tasks", []):
        label = task["label"]
        metrics = row["tasks"].get(label)
        if metrics is None:
            continue
        common = dict(task_type="text-generation", task_name="Downstream evaluation", dataset_name=label,
                      dataset_type=f"{task.get('bundle') or task.get('source', 'eval')}/{label}")  # fmt: skip
        out.append(EvalResult(metric_type="accuracy", metric_name=f"accuracy (r = {trained})",
                              metric_value=round(float(metrics["accuracy"]), 6), **common))  # fmt: skip
        if metrics.get("centered") is not None and task.get("source") != "lm-eval":
            out.append(EvalResult(metric_type="centered_accuracy", metric_name=f"centered accuracy (r = {trained})",
                                  metric_value=round(float(metrics["centered"]), 6), **common))  # fmt: skip
    return out


def _evaluation_section(results: Mapping[str, Any], plot: str | None) -> str:
    from looped_hf.evaluation.report import score_table, summary_line

    lines = [
        "## Downstream tasks at every r",
        "",
        f"{summary_line(results)} Scored as the study scores its bundles (few-shot prompts, lowest mean "
        "continuation loss for multiple choice, greedy match for language modelling); the centered score "
        "rescales accuracy so chance is 0 and perfect is 1. `looped-hf eval` measures it.",
        "",
        score_table(results, "centered"),
    ]
    if results.get("adaptive"):
        recurrences = score_table(results, "mean_recurrences", False)
        lines += ["", "Mean recurrences used per scored token:", "", recurrences]
    if plot:
        lines += ["", f"![task score vs r]({plot})"]
    return "\n".join(lines) + "\n"


def _insert_section(text: str, section: str, before: str) -> str:
    """``section`` placed before the heading ``before`` (at the end when there is none)."""
    at = text.find(f"\n{before}")
    if at < 0:
        return text.rstrip() + "\n\n" + section
    return text[: at + 1] + section + "\n" + text[at + 1 :]


def _test_time_curve(model: Any, test_time: Mapping[str, Any] | PathLike | None) -> Mapping[str, Any] | None:
    """The test-time curve to show: the one given, or the one saved beside the loaded checkpoint."""
    from looped_hf.recurrence_curves import CURVE_JSON, load_curve

    if isinstance(test_time, Mapping):
        return test_time
    if test_time is not None:
        path = Path(test_time)
        if not path.is_file():
            raise FileNotFoundError(
                f"test_time={str(test_time)!r}: no such file (write it with `looped-hf test-time`)"
            )
        return json.loads(path.read_text(encoding="utf-8"))
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if not (source / CURVE_JSON).is_file():
        return None
    # Only a curve measured on exactly these weights (a retrained run leaves a stale one behind).
    return load_curve(source, weights_sha256(source))


def _test_time_summary(curve: Mapping[str, Any]) -> str:
    from looped_hf.recurrence_curves import summary_sentence

    return summary_sentence(curve)


def _test_time_table(curve: Mapping[str, Any]) -> str:
    from looped_hf.recurrence_curves import markdown_table

    return markdown_table(curve)
