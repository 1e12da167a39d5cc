"""The sweep card: phi and its evidence (fit, identifiability, plots, every run, how to rebuild it).

``looped-hf card`` and ``looped-hf demo`` write it with :func:`write_sweep_card`.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCard, ModelCardData

from looped_hf.fileio import make_temp_dir, replace_dir
from looped_hf.scaling.diagnose import OPTIMAL_VS_WIDTHS
from looped_hf.scaling.formatting import flop_budget, interval

from .common import (
    CARD_NAME,
    FIT_NAME,
    PLOTS_DIR,
    SWEEP_TEMPLATE,
    PathLike,
    _ci,
    _count,
    _num,
    _project_link,
    _round,
    _template,
    heldout_metrics,
    phi_caveat,
    sha256_file,
    si,
)

if TYPE_CHECKING:
    from looped_hf.scaling import ScalingLawFit


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
            side = OPTIMAL_VS_WIDTHS[p["optimal_vs_widths"]]
            rows.append({
                "budget": flop_budget(row["budget"]) if k == 0 else "",
                "tokens_per_param": tpp if k == 0 else "", "r": f"{p['r']:g}", "best": p["best"],
                "position": f"**{p['position']}**" if p["position"] in ("smallest", "largest") else p["position"],
                "optimum": f"{si(p['optimal_params'])} ({p['optimal_tokens_per_param']:.3g} tokens/param, {side})",
            })  # fmt: skip
    boot = d.get("bootstrap") or {}
    return {
        "identified": verdict.get("identified"),
        "line": verdict["line"],
        "reasons": list(verdict.get("reasons") or []),
        "profile_ci": interval(prof["interval"], ".3g", "open") if prof else None,
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


ISOFLOP_STYLES = ("law", "study")


def _plots(
    fit: ScalingLawFit,
    plots_dir: Path,
    isoflop_style: str = "law",
    compare: Mapping[str, ScalingLawFit] | None = None,
) -> list[dict[str, str]]:
    """Write the fit's figures with ``looped_hf.plotting`` and describe them for the template.

    ``isoflop_style="study"`` draws ``isoflop.png`` as the study's figure
    (:func:`looped_hf.plotting.plot_isoflop_study`), with one more panel per ``compare`` entry
    (title -> fit of a probe sweep).
    """
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
    paths = plotting.plot_fit(fit, plots_dir, isoflop_style=isoflop_style, compare=compare)
    if isoflop_style == "study":
        captions["isoflop.png"] = (
            "IsoFLOP curves as the study draws them",
            "IsoFLOP curves drawn as the study's figure: held-out loss against unique parameters N, one colour "
            "per compute budget, one line style per r (solid 1, dashed 2, dash-dot 4, dotted 8), a quadratic "
            "in log N through each budget's runs at each r, a star at each curve's minimum"
            + ("; one panel per variant." if compare else "."),
        )
    for path in paths:
        alt, caption = captions.get(path.name, (path.stem.replace("_", " "), path.stem.replace("_", " ")))
        out.append({"path": f"{PLOTS_DIR}/{path.name}", "alt": alt, "caption": caption})
    return out


PLAN_PLOT = "plan_frontier.png"


def plan_section(fit: ScalingLawFit, recipe: PathLike, plots_dir: PathLike) -> str | None:
    """The card's "what this phi means for you" section (markdown), and its plot into ``plots_dir``.

    The plan (``looped_hf.planner``) at the sweep's largest budget and at 10x and 100x beyond it,
    over the sweep's r, from the sweep's own recipe. None when there is nothing to plan (no phi, no
    runs with budgets); a short statement when the recipe cannot give the family."""
    import numpy as np

    from looped_hf import plotting
    from looped_hf.planner import ArchitectureFamily, frontier, plan

    runs = fit.runs
    if fit.params.get("phi") is None or runs is None or runs.budget is None:
        return None
    try:
        family = ArchitectureFamily.from_recipe(recipe)
        top = float(np.max(runs.budget))
        budgets = [top, 10 * top, 100 * top]
        result = plan(fit, budgets, family=family)
        line = frontier(fit, list(np.geomspace(float(np.min(runs.budget)), 100 * top, 25)), family=family)
    except (ValueError, FileNotFoundError) as err:
        return f"No plan: the sweep recipe `{Path(recipe).name}` does not give the model family ({err})."
    plotting.plot_plan_frontier(line, Path(plots_dir) / PLAN_PLOT)
    fit_path = f"{FIT_NAME} --recipe SWEEP_DIR/{Path(recipe).name}"
    return "\n".join([
        f"The fitted law, read as a decision: for a training budget C, the compute-optimal width, tokens and "
        f"predicted loss at each r, for this sweep's model family. Budgets above {top:.3g} FLOPs (the sweep's "
        "largest) are extrapolations of the law and are marked so; the band is the spread of the optimal loss over "
        "the bootstrap resamples, each planning its own optimum.",
        "",
        result.to_markdown(),
        "",
        f"![predicted loss against training FLOPs along each r's compute-optimal frontier]({PLOTS_DIR}/{PLAN_PLOT})",
        "",
        "*Predicted loss against training FLOPs, one line per r along its compute-optimal frontier (the width "
        "with the lowest predicted loss at each budget), with the 95% band; shaded: beyond the sweep's budgets.*",
        "",
        f"Other budgets, r, tokens to serve (`--inference-tokens`), a KV budget or a target loss: "
        f"`looped-hf plan {fit_path} --budget {budgets[1]:.3g}`.",
    ])  # fmt: skip


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
    plan: str | None = None,
    evaluation: str | None = None,
    machine_note: str | None = None,
) -> ModelCard:
    """The sweep's card (``plots``: template entries from :func:`_plots`, paths relative to the card;
    ``plan``: the markdown of :func:`plan_section`; ``evaluation``: the markdown of
    :func:`evaluation_section`, placed before the citation; ``machine_note``: how far the card's figures
    move between machines, a paragraph of its Reproduce section)."""
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
    card = ModelCard.from_template(
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
            "machine_note": machine_note,
        },  # fmt: skip
        looped_hf_link=_project_link(),
        looped_hf_version=__version__,
        plan_section=plan,
    )
    if evaluation:
        at = card.text.find("\n## Citation")
        card.text = (
            card.text.rstrip() + "\n\n" + evaluation
            if at < 0
            else card.text[: at + 1] + evaluation + "\n" + card.text[at + 1 :]
        )
    return card


EVAL_PLOT = "eval_score_vs_flops.png"


def evaluation_section(sweep_dir: PathLike, plots_dir: PathLike) -> str | None:
    """Downstream scores of the sweep's runs (those with ``eval_results.json`` from ``looped-hf
    eval``, measured on their current weights): mean centered score against training FLOPs, per r
    at inference, as a plot (written into ``plots_dir``) and a table. None when no run has results."""
    from looped_hf.evaluation.report import collect_sweep_results, plot_score_vs_flops, sweep_score_table

    collected = collect_sweep_results(sweep_dir)
    if not collected:
        return None
    plot = plot_score_vs_flops(collected, Path(plots_dir) / EVAL_PLOT)
    return "\n".join([
        "## Downstream tasks against training compute",
        "",
        f"{len(collected)} runs were scored with `looped-hf eval` (mean centered score of each bundle: 0 is "
        "chance, 1 perfect), at their trained r and at other r at inference.",
        "",
        f"![task score vs training FLOPs]({PLOTS_DIR}/{plot.name})",
        "",
        sweep_score_table(collected),
        "",
    ])  # fmt: skip


def write_sweep_card(
    sweep_dir: PathLike,
    fit: ScalingLawFit,
    out_dir: PathLike,
    *,
    commands: list[str] | None = None,
    best: Mapping[str, Any] | None = None,
    best_where: str = "",
    license: str = "apache-2.0",
    isoflop_style: str = "law",
    compare: Mapping[str, ScalingLawFit] | None = None,
    machine_note: str | None = None,
) -> Path:
    """Write ``out_dir/README.md`` + ``plots/*.png`` + ``fit.json``; returns the card's path.
    ``machine_note``: how far the figures move between machines (``render_sweep_card``).

    ``isoflop_style``: ``"law"`` (the default: a panel per budget, loss against N_eff with the
    fitted law) or ``"study"`` (as the paper's figure, to hold beside it); ``compare``: probe fits
    by panel title (e.g. ``{"truncated backprop": fit}``), drawn as extra panels of the study-style
    figure. The folder is built next to ``out_dir`` and moved into place at the end, so a failure
    leaves the previous card (or nothing), never half a card.
    """
    from looped_hf.sweep import RESULTS_NAME

    if isoflop_style not in ISOFLOP_STYLES:
        raise ValueError(f"isoflop_style must be one of {ISOFLOP_STYLES}, got {isoflop_style!r}")
    if compare and isoflop_style != "study":
        raise ValueError("compare= draws extra panels of the study-style figure: pass isoflop_style='study'")

    sweep = Path(sweep_dir)
    if not (sweep / RESULTS_NAME).is_file():
        raise FileNotFoundError(f"{sweep / RESULTS_NAME} not found: is {sweep} a sweep directory?")
    out = Path(out_dir)
    tmp = make_temp_dir(out)  # with the user's umask: mkdtemp's 0700 would stay once renamed into place
    try:
        plots = _plots(fit, tmp / PLOTS_DIR, isoflop_style, compare)
        from looped_hf.sweep import RECIPE_COPY

        plan = plan_section(fit, sweep / RECIPE_COPY, tmp / PLOTS_DIR)
        evaluation = evaluation_section(sweep, tmp / PLOTS_DIR)
        card = render_sweep_card(
            sweep, fit, plots, commands=commands, best=best, best_where=best_where, license=license, plan=plan,
            evaluation=evaluation, machine_note=machine_note,
        )  # fmt: skip
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
