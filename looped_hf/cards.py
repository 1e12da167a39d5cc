"""Model cards: one for a checkpoint (what a Hub user loads), one for a sweep (phi and its evidence).

    looped-hf card runs/iso_depth_tiny --fit runs/iso_depth_tiny/fit.json      # -> runs/iso_depth_tiny/card/
    looped-hf card runs/iso_depth_tiny --bootstrap 200 --out model_cards/iso_depth_tiny

Both cards are Jinja templates in ``model_cards/templates/`` rendered with
``huggingface_hub.ModelCard.from_template``; the YAML front matter is a ``ModelCardData`` so it
parses back with ``ModelCard.load`` and carries what the Hub indexes (``library_name``,
``pipeline_tag``, tags, ``model-index``) plus a ``looped:`` block with the loop's shape and
counts. Nothing here touches the network (``card.validate()`` would: it is never called).

The held-out loss in a card is the run record's ``loss``: the token-weighted mean NLL over the
held-out blocks (``looped_hf.train.heldout_loss``); perplexity is ``exp`` of it, the same
quantity the shipped ``evaluate`` metric ``looped_hf/metrics/token_perplexity`` computes from NLL
sums and token counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from looped_hf.fileio import replace_dir

if TYPE_CHECKING:
    from looped_hf.scaling import ScalingLawFit

PathLike = str | os.PathLike[str]

#: Where the templates live: ``model_cards/templates`` in a source checkout. An installed wheel
#: has no ``model_cards/``; ``LOOPED_HF_CARD_TEMPLATES`` points elsewhere if needed.
TEMPLATES_DIR = Path(
    os.environ.get(
        "LOOPED_HF_CARD_TEMPLATES", Path(__file__).resolve().parents[1] / "model_cards" / "templates"
    )
)
CHECKPOINT_TEMPLATE = "checkpoint.md"
SWEEP_TEMPLATE = "sweep.md"
#: Project URL for the cards' links; empty (no link, plain "looped_hf") until the project has one.
LOOPED_HF_URL = os.environ.get("LOOPED_HF_URL", "")
CARD_NAME = "README.md"
FIT_NAME = "fit.json"
PLOTS_DIR = "plots"
# Recipe fields that are machine-local (paths, output places) or operational (logging, progress
# bars) and say nothing about the model or its training; left out of the card's recipe.
_LOCAL_RECIPE_FIELDS = ("output_dir", "data_cache_dir", "results_file", "logging_dir", "resume_from_checkpoint",
                        "accelerator_config", "debug", "report_to", "disable_tqdm", "logging_steps",
                        "dataloader_num_workers", "save_strategy", "save_steps", "save_total_limit")  # fmt: skip
# Training fields the resolved recipe omits when they are at their default (looped_hf.arguments).
_TRAINING_DEFAULTS = {"optimizer": "adamw", "lr_schedule": "study"}


# --------------------------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------------------------
def si(x: float | None, digits: int = 3) -> str:
    """``12.3M``-style number; ``-`` for missing values."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    for div, unit in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.{digits}g}{unit}"
    return f"{x:.{digits}g}"


def _num(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-" if x is None else str(x)
    return f"{x:.{digits}g}"


def _ci(ci: Iterable[float] | None, digits: int = 3) -> str:
    if not ci:
        return "-"
    lo, hi = ci
    return f"[{lo:.{digits}g}, {hi:.{digits}g}]"


def _count(n: int | float | None) -> str:
    return "-" if n is None else f"{int(n):,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _round(x: float | None, digits: int = 6) -> float | None:
    """``digits`` significant digits, for YAML metadata a person reads."""
    return None if x is None else float(f"{x:.{digits}g}")


def _project_link() -> str:
    return f"[looped_hf]({LOOPED_HF_URL})" if LOOPED_HF_URL else "looped_hf"


def sha256_file(path: PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _template(name: str) -> Path:
    path = TEMPLATES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"model card template {path} not found (set LOOPED_HF_CARD_TEMPLATES to the folder holding {name})"
        )
    return path


def perplexity_from_loss(loss: float) -> float:
    """exp(token-weighted mean NLL); ``inf`` where exp overflows."""
    return math.exp(loss) if loss < 709 else math.inf


def heldout_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The card's held-out numbers from a run record: ``loss``, ``perplexity``, ``eval_tokens``.

    Raises ``ValueError`` naming the field when the record lacks a finite loss."""
    loss = record.get("loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise ValueError(f"run record field 'loss'={loss!r}: need a finite held-out loss for the card")
    ppl = record.get("eval_perplexity")
    if not isinstance(ppl, (int, float)):
        ppl = perplexity_from_loss(float(loss))
    return {"loss": float(loss), "perplexity": float(ppl), "eval_tokens": record.get("eval_tokens")}


# --------------------------------------------------------------------------------------------
# Checkpoint card
# --------------------------------------------------------------------------------------------
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
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()) or "-",
        "trainer_total_flos": f"{record['trainer_total_flos']:.3g}"
        if record.get("trainer_total_flos")
        else "-",
        "recipe_yaml": yaml.safe_dump(_public_recipe(recipe), sort_keys=False).rstrip() or "{}",
        "recurrences": _training_recurrences(record),
    }


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
) -> ModelCard:
    """The model card of one checkpoint (``model``: the loaded ``LoopedForCausalLM``).

    ``test_time``: the checkpoint's test-time scaling curve (``looped-hf test-time``: a result of
    ``looped_hf.test_time.evaluate_recurrences`` or the path of its JSON). ``None``: the
    ``test_time_scaling.json`` next to the checkpoint the model was loaded from, if there is one
    measured on these weights. The card then shows the held-out loss at every r measured, and
    ``test_time_plot`` (a path relative to the card, e.g. ``test_time_scaling.png`` copied beside
    it) as an image.
    """
    from looped_hf import __version__

    config = model.config
    curve = _test_time_curve(model, test_time)
    params = model.num_scaling_params()
    model_name = repo_id.split("/")[-1]
    data = checkpoint_card_data(record, config, params, model_name=model_name, license=license, fit=fit)
    seq_len = int(record.get("seq_len") or config.max_position_embeddings)
    per_r = model.inference_flops_per_token(seq_len, 2) - model.inference_flops_per_token(seq_len, 1)
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
    return ModelCard.from_template(
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
        transformers_spec=">=5.24,<5.25",
        looped_hf_link=_project_link(),
        looped_hf_version=__version__,
    )


def _test_time_curve(model: Any, test_time: Mapping[str, Any] | PathLike | None) -> Mapping[str, Any] | None:
    """The test-time curve to show: the one given, or the one saved beside the loaded checkpoint."""
    from looped_hf.test_time import CURVE_JSON, load_curve

    if isinstance(test_time, Mapping):
        return test_time
    if test_time is not None:
        path = Path(test_time)
        if not path.is_file():
            raise FileNotFoundError(f"test_time={str(test_time)!r}: no such file (write it with `looped-hf test-time`)")
        return json.loads(path.read_text(encoding="utf-8"))
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    if not (source / CURVE_JSON).is_file():
        return None
    weights = source / "model.safetensors"
    # Only a curve measured on exactly these weights (a retrained run leaves a stale one behind).
    return load_curve(source, sha256_file(weights) if weights.is_file() else None)


def _test_time_summary(curve: Mapping[str, Any]) -> str:
    from looped_hf.test_time import summary_sentence

    return summary_sentence(curve)


def _test_time_table(curve: Mapping[str, Any]) -> str:
    from looped_hf.test_time import markdown_table

    return markdown_table(curve)


# --------------------------------------------------------------------------------------------
# Sweep card
# --------------------------------------------------------------------------------------------
def _equivalence_sentences(fit: ScalingLawFit) -> list[str]:
    """The study's sentence for the largest model at each r > 1 (as ``fit.report()`` says it)."""
    return [
        f"At r = {eq['r']:g}, a looped model with {si(eq['unique'])} unique parameters performs like a non-looped "
        f"model of **{si(eq['performs_like'])}** and costs the training compute of one of {si(eq['costs_like'])}."
        for eq in fit.equivalences()
    ]


def _residual_rows(fit: ScalingLawFit) -> list[dict[str, str]]:
    if fit.runs is None:
        return []
    import numpy as np

    rows = []
    for r in np.unique(fit.runs.num_recurrences):
        m = fit.runs.num_recurrences == r
        res = fit.residuals[m]
        rows.append({"r": f"{r:g}", "n": str(int(m.sum())), "mean": f"{res.mean():+.2e}",
                     "rms": f"{float(np.sqrt(np.mean(res**2))):.2e}"})  # fmt: skip
    return rows


def _holdout_sentence(fit: ScalingLawFit) -> str | None:
    h = fit.holdout
    if not h:
        return None
    text = (f"the fit without budget {h['held_out_budget']:.3g} predicts its {h['n_held_out']} runs with mean error "
            f"{100 * h['mean_rel_error']:+.2f}% (max |error| {100 * h['max_abs_rel_error']:.2f}%)")  # fmt: skip
    if h.get("phi_without") is not None:
        text += f"; phi without it = {h['phi_without']:.3f}"
    return text + "."


def phi_caveat(fit: ScalingLawFit) -> str | None:
    """A warning when the runs do not pin phi down, so the card does not oversell the estimate.

    With the fit's identifiability diagnosis (``fit.diagnostics``, fits since v0.2) it is the
    verdict line when phi is not identified. Without one (an older ``fit.json``) it falls back to
    the interval alone: one that reaches the search box or is wider than the whole 0 .. 1 range.
    """
    if fit.params.get("phi") is None:
        return "phi is not identifiable from these runs (no run has r > 1 and N_rec > 0)."
    verdict = (fit.diagnostics or {}).get("verdict")
    if verdict is not None:
        if verdict.get("identified") is False:
            return verdict["line"] + " See *Is phi identified?* below."
        return None
    ci = fit.ci.get("phi")
    if not ci:
        return "no bootstrap interval: refit with bootstrap resamples before reading much into phi."
    bounds = (fit.settings.get("bounds") or [[-3.0, 3.0]] * 6)[5]
    at_bound = min(abs(ci[0] - bounds[0]), abs(ci[1] - bounds[1])) < 1e-3
    if at_bound or ci[1] - ci[0] > 1.0:
        return (f"the 95% interval of phi, [{ci[0]:.3g}, {ci[1]:.3g}], "
                + ("reaches the search bounds " if at_bound else "is wider than the whole range 0 .. 1 ")
                + "- these runs do not pin phi down; more runs, budgets or widths are needed.")  # fmt: skip
    return None


def _open_interval(interval: Iterable[float | None]) -> str:
    lo, hi = interval
    return f"[{'open' if lo is None else f'{lo:.3g}'}, {'open' if hi is None else f'{hi:.3g}'}]"


def identifiability_summary(fit: ScalingLawFit) -> dict[str, Any] | None:
    """The fit's identifiability diagnosis, formatted for the sweep card (None without one)."""
    d = fit.diagnostics or {}
    verdict = d.get("verdict")
    if not verdict:
        return None
    prof = d.get("profile")
    tests = []
    for ref, key in (("0", "lr_phi0"), ("1", "lr_phi1")):
        x = (prof or {}).get(key)
        if x is not None:
            tests.append(f"phi = {ref} is {'excluded' if x > prof['cut'] else 'inside'} (LR {x:.3g})")
    rows = []
    for row in d.get("budgets") or []:
        tpp = f"{si(row['tokens_per_param'][0], 2)} - {si(row['tokens_per_param'][1], 2)}"
        for k, p in enumerate(row["per_r"]):
            side = {"below": "below the widths", "above": "above the widths", "inside": "inside"}[p["optimal_vs_widths"]]
            rows.append({
                "budget": f"{row['budget']:.3g}".replace("e+", "e") if k == 0 else "",
                "tokens_per_param": tpp if k == 0 else "", "r": f"{p['r']:g}", "best": p["best"],
                "position": f"**{p['position']}**" if p["position"] in ("smallest", "largest") else p["position"],
                "optimum": f"{si(p['optimal_params'])} ({p['optimal_tokens_per_param']:.3g} tokens/param, {side})",
            })  # fmt: skip
    boot = d.get("bootstrap") or {}
    return {
        "identified": verdict.get("identified"),
        "line": verdict["line"],
        "reasons": list(verdict.get("reasons") or []),
        "profile_ci": _open_interval(prof["interval"]) if prof else None,
        "profile_tests": "; ".join(tests),
        "profile_cut": f"{prof['cut']:.3g}" if prof else None,
        "at_bound": [b["text"] for b in d.get("at_bound") or []],
        "boot_at_bound": ", ".join(f"{k} {100 * v:.0f}%" for k, v in (boot.get("at_bound_by_param") or {}).items()),
        "isoflop_rows": rows,
    }


def fit_summary(fit: ScalingLawFit) -> dict[str, Any]:
    """Everything the sweep template shows about the fit, formatted."""
    phi = fit.params.get("phi")
    boot = fit.bootstrap_samples
    s = fit.settings
    rows = []
    for name in ("E", "A", "alpha", "B", "beta", "phi"):
        if name == "phi" and fit.kind == "plain":
            continue
        value = fit.params.get(name)
        ci = (
            _ci(fit.ci.get(name), 4)
            if fit.ci.get(name)
            else ("fixed" if name == "phi" and fit.fixed_phi is not None else "-")
        )
        rows.append({"name": name, "value": "not identifiable" if value is None else _num(value), "ci": ci})
    restricted = [
        {"name": key, "r2": f"{res['r2']:.4f}", "objective": f"{res['objective']:.4g}",
         "ratio": f"{res['objective'] / fit.objective:.2f}" if fit.objective else "-"}
        for key, res in fit.restricted.items()
    ]  # fmt: skip
    method = s.get("bootstrap_method_used", s.get("bootstrap_method", ""))
    return {
        "phi": "not identifiable" if phi is None else f"{phi:.3f}",
        "phi_value": phi,
        "phi_ci": _ci(fit.ci.get("phi")) if fit.ci.get("phi") else None,
        "bootstrap_desc": f"{len(boot)} {method} bootstrap resamples" if boot is not None else "",
        "n_runs": len(fit.residuals),
        "param_rows": rows,
        "r2": f"{fit.r2:.4f}",
        "objective": f"{fit.objective:.4g}",
        "huber_delta": f"{s.get('huber_delta', 1e-3):g}",
        "n_starts": s.get("n_starts", "?"),
        "seed": s.get("seed", "?"),
        "restricted_rows": restricted,
        "equivalences": _equivalence_sentences(fit),
        "residual_rows": _residual_rows(fit),
        "holdout": _holdout_sentence(fit),
        "notes": list(fit.notes),
        "caveat": phi_caveat(fit),
        "identifiability": identifiability_summary(fit),
    }


def _run_rows(records: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for rec in sorted(
        records,
        key=lambda r: (r.get("budget") or 0, r.get("hidden_size") or 0, r.get("num_recurrences") or 0),
    ):
        cfg = rec.get("config") or {}
        pkc = "/".join(
            str(cfg.get(k, "?")) for k in ("num_prelude_layers", "num_recurrent_layers", "num_coda_layers")
        )
        loss = rec.get("loss")
        ok = rec.get("status") == "ok" and isinstance(loss, (int, float)) and math.isfinite(loss)
        rows.append({
            "run_id": str(rec.get("run_id")), "arch": str(rec.get("arch", "-")), "r": str(rec.get("num_recurrences", "-")),
            "width": str(rec.get("hidden_size", "-")), "pkc": pkc, "n_once": _count(rec.get("n_once")),
            "n_rec": _count(rec.get("n_rec")), "tokens": _count(rec.get("tokens")),
            "flops": f"{rec['train_flops']:.3g}" if rec.get("train_flops") else "-",
            "loss": f"{loss:.4f}" if ok else "-",
            "ppl": f"{heldout_metrics(rec)['perplexity']:.2f}" if ok else "-",
            "status": "ok" if rec.get("status") == "ok" else f"**{rec.get('status', '?')}**",
        })  # fmt: skip
    return rows


def best_run(records: Iterable[Mapping[str, Any]], looped_only: bool = True) -> Mapping[str, Any] | None:
    """The ok run with the lowest held-out loss (among r > 1 runs when ``looped_only`` and any exist)."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok" and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])
    ]
    looped = [r for r in ok if (r.get("num_recurrences") or 1) > 1 and (r.get("n_rec") or 0) > 0]
    pool = looped if (looped_only and looped) else ok
    return min(pool, key=lambda r: r["loss"]) if pool else None


def _plots(fit: ScalingLawFit, plots_dir: Path) -> list[dict[str, str]]:
    """Write the fit's figures with ``looped_hf.plotting`` and describe them for the template."""
    from looped_hf import plotting

    captions = {
        "isoflop.png": ("IsoFLOP curves: loss against effective parameters per budget",
                        "IsoFLOP curves: held-out loss against N_eff = N_once + r^phi N_rec, one panel per budget, one "
                        "colour per r; lines: the fitted law along the sweep's models at that budget; stars: its "
                        "compute-optimal size. A minimum between a budget's widths is what pins the law down."),
        "phi_profile.png": ("profile of the objective over phi",
                            "The fit's objective with phi held fixed and every other parameter refitted (as a "
                            "likelihood-ratio statistic); phi below the dashed cut form the profile-likelihood 95% "
                            "interval (shaded); the bar is the bootstrap interval. Flat means not determined."),
        "loss_vs_flops.png": ("held-out loss against training FLOPs by r",
                              "Held-out loss against training FLOPs, one colour per r; lines: the fitted law at the "
                              "compute-optimal size for each r."),
        "phi_bootstrap.png": ("bootstrap distribution of phi",
                              "phi over the bootstrap resamples, with the point estimate and the 95% interval."),
        "residuals.png": ("residuals of the fit by r", "Residuals log L - log L_hat (%) against training FLOPs, by r."),
    }  # fmt: skip
    out = []
    for path in plotting.plot_fit(fit, plots_dir):
        alt, caption = captions.get(path.name, (path.stem.replace("_", " "), path.stem.replace("_", " ")))
        out.append({"path": f"{PLOTS_DIR}/{path.name}", "alt": alt, "caption": caption})
    return out


def _versions() -> dict[str, str]:
    from looped_hf.train import versions

    return versions(extra=("huggingface_hub", "numpy", "scipy"))


def default_commands(sweep_dir: PathLike, bootstrap: int, seed: int = 0) -> list[str]:
    """The commands that rebuild this card; the sweep's own ``sweep.yaml`` is its exact recipe."""
    path = Path(sweep_dir).resolve()
    try:
        sweep = str(path.relative_to(Path.cwd()))
    except ValueError:  # outside the working directory: the absolute path is the honest one
        sweep = str(path)
    return [
        f"looped-hf sweep {sweep}/sweep.yaml --output {sweep}        # resumable",
        f"looped-hf fit {sweep}/results.jsonl --bootstrap {bootstrap} --seed {seed} --out {sweep}/fit.json",
        f"looped-hf card {sweep} --fit {sweep}/fit.json --out model_cards/{path.name}",
    ]


def render_sweep_card(
    sweep_dir: PathLike,
    fit: ScalingLawFit,
    plots: list[dict[str, str]],
    *,
    commands: list[str] | None = None,
    best: Mapping[str, Any] | None = None,
    best_where: str = "",
    license: str = "apache-2.0",
) -> ModelCard:
    """The sweep's card (``plots``: template entries from :func:`_plots`, paths relative to the card)."""
    from looped_hf import __version__
    from looped_hf.sweep import RECIPE_COPY, RESULTS_NAME, read_jsonl

    sweep = Path(sweep_dir)
    records = read_jsonl(sweep / RESULTS_NAME)
    recipe = sweep / RECIPE_COPY
    summary = fit_summary(fit)
    ok = [r for r in records if r.get("status") == "ok"]
    flops = [r["train_flops"] for r in ok if r.get("train_flops")]
    span = f"{min(flops):.2g} to {max(flops):.2g} training FLOPs" if flops else "unknown compute"
    looped_meta: dict[str, Any] = {
        "phi": _round(summary["phi_value"]),
        "phi_ci95": [_round(v) for v in fit.ci["phi"]] if fit.ci.get("phi") else None,
        "r2": _round(fit.r2),
        "restricted_r2": {k: _round(v["r2"]) for k, v in fit.restricted.items()},
        "params": {k: _round(v) for k, v in fit.params.items()},
        "n_runs": len(fit.residuals),
        "recurrences": sorted({int(r.get("num_recurrences")) for r in ok if r.get("num_recurrences")}),
        "train_flops_range": [min(flops), max(flops)] if flops else None,
    }
    data = ModelCardData(
        language="en",
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["looped", "depth-recurrent", "custom_code", "looped_hf", "scaling-laws"],
        looped_sweep=looped_meta,
    )
    if best is not None:
        best_info = {"run_id": best.get("run_id"), "loss": f"{best['loss']:.4f}", "where": best_where}
    else:
        best_info = None
    n_failed = len(records) - len(ok)
    return ModelCard.from_template(
        data,
        template_path=str(_template(SWEEP_TEMPLATE)),
        title=f"Iso-depth sweep `{sweep.name}`: what one recurrence is worth",
        fit=summary,
        scale_note=(
            f"this sweep spans {span}, so its phi is a small-scale measurement with the same method, "
            "not a replication."
        ),  # fmt: skip
        plots=plots,
        runs=_run_rows(records),
        runs_summary=f"{len(records)} runs recorded, {len(ok)} ok"
        + (f", {n_failed} failed (not fitted)" if n_failed else "")
        + ".",
        best=best_info,
        commands=commands
        or default_commands(sweep, int(fit.settings.get("bootstrap", 0)), int(fit.settings.get("seed", 0))),
        repro={
            "recipe_name": RECIPE_COPY if recipe.exists() else "(missing)",
            "recipe_sha256": sha256_file(recipe) if recipe.exists() else "-",
            "versions": _versions(),
            "fit_settings": ", ".join(
                f"{k}={fit.settings[k]}"
                for k in ("seed", "starts", "n_starts", "bootstrap", "bootstrap_method")
                if k in fit.settings
            ),
        },  # fmt: skip
        looped_hf_link=_project_link(),
        looped_hf_version=__version__,
    )


def write_sweep_card(
    sweep_dir: PathLike,
    fit: ScalingLawFit,
    out_dir: PathLike,
    *,
    commands: list[str] | None = None,
    best: Mapping[str, Any] | None = None,
    best_where: str = "",
    license: str = "apache-2.0",
) -> Path:
    """Write ``out_dir/README.md`` + ``plots/*.png`` + ``fit.json``; returns the card's path.

    The folder is built next to ``out_dir`` and moved into place at the end, so a failure
    leaves the previous card (or nothing), never half a card.
    """
    from looped_hf.sweep import RESULTS_NAME

    sweep = Path(sweep_dir)
    if not (sweep / RESULTS_NAME).is_file():
        raise FileNotFoundError(f"{sweep / RESULTS_NAME} not found: is {sweep} a sweep directory?")
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        plots = _plots(fit, tmp / PLOTS_DIR)
        card = render_sweep_card(
            sweep, fit, plots, commands=commands, best=best, best_where=best_where, license=license
        )
        card.save(tmp / CARD_NAME)
        fit.to_json(tmp / FIT_NAME)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out / CARD_NAME


def card_image_links(card_path: PathLike) -> list[str]:
    """Relative image paths referenced by a card (``![alt](path)``), for checks and tests."""
    import re

    text = Path(card_path).read_text(encoding="utf-8")
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf card", description="Write a sweep's model card: phi with its CI, plots, runs."
    )
    p.add_argument("sweep_dir", help="sweep directory (holds results.jsonl and sweep.yaml)")
    p.add_argument(
        "--fit", default=None, metavar="FIT_JSON", help="a fit from `looped-hf fit --out` (default: fit now)"
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=200,
        metavar="N",
        help="bootstrap resamples when fitting here (default 200)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed when fitting here (default 0)")
    p.add_argument("--out", default=None, metavar="DIR", help="card folder (default: SWEEP_DIR/card)")
    p.add_argument(
        "--license", default="apache-2.0", help="license id in the card metadata (default apache-2.0)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``looped-hf card``; returns 0, or 2 on bad input (message names the file)."""
    args = _parser().parse_args(argv)
    from looped_hf.scaling import ScalingLawFit, fit_scaling_law
    from looped_hf.sweep import RESULTS_NAME, read_jsonl

    sweep = Path(args.sweep_dir)
    try:
        if args.fit is not None:
            if not Path(args.fit).is_file():
                raise FileNotFoundError(f"--fit {args.fit}: no such file")
            fit = ScalingLawFit.from_json(args.fit)
        else:
            print(
                f"[card] fitting {sweep / RESULTS_NAME} with {args.bootstrap} bootstrap resamples ...",
                flush=True,
            )
            fit = fit_scaling_law(sweep / RESULTS_NAME, bootstrap=args.bootstrap, seed=args.seed)
        out = Path(args.out) if args.out else sweep / "card"
        best = best_run(read_jsonl(sweep / RESULTS_NAME))
        where = (f"Publish it with `looped-hf publish {sweep / str(best['run_id'])} --repo-id ORG/NAME`."
                 if best is not None else "")  # fmt: skip
        path = write_sweep_card(sweep, fit, out, best=best, best_where=where, license=args.license)
    except (FileNotFoundError, ValueError) as err:
        print(f"looped-hf card: error: {err}", file=sys.stderr)
        return 2
    print(f"[card] wrote {path} (+ {PLOTS_DIR}/, {FIT_NAME})")
    phi = fit.params.get("phi")
    if phi is not None:
        print(f"phi = {phi:.3f}" + (f"  95% CI {_ci(fit.ci['phi'])}" if fit.ci.get("phi") else ""))
    return 0


__all__ = [
    "architecture_diagram",
    "best_run",
    "card_image_links",
    "checkpoint_card_data",
    "fit_summary",
    "identifiability_summary",
    "heldout_metrics",
    "main",
    "render_checkpoint_card",
    "render_sweep_card",
    "write_sweep_card",
]


if __name__ == "__main__":
    sys.exit(main())
