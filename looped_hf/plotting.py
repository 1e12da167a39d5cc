"""The project's plots (matplotlib, Agg, no pyplot).

Every function builds its own :class:`matplotlib.figure.Figure` on an Agg canvas, so nothing
touches pyplot's global state (no stray figures, no backend switching in a user's notebook),
writes one PNG and returns its path. The fit plots take a
:class:`~looped_hf.scaling.ScalingLawFit` and, optionally, the runs to draw (default: the runs
the fit was made on).

- :func:`plot_loss_vs_flops`: runs by r, with the law's compute-optimal frontier for each r;
- :func:`plot_phi_bootstrap`: the bootstrap distribution of phi with its 95% interval;
- :func:`plot_residuals`: log residuals against training FLOPs, by r;
- :func:`plot_isoflop_study`: IsoFLOP curves as the study draws them (a panel per variant);
- :func:`plot_fit`: all of the above into a folder;
- :func:`plot_metric_vs_r`: a metric against the r run at inference, a line per series, the
  trained r circled (``looped-hf eval``'s task scores, ``looped-hf test-time``'s held-out loss);
- :func:`write_result_triple`: one result as ``<stem>.json`` + ``<stem>.md`` + ``<stem>.png``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from looped_hf.fileio import write_json_atomic, write_text_atomic
from looped_hf.scaling.diagnose import SEARCH_FACTOR, compute_optimal, law_loss, size_family
from looped_hf.scaling.formatting import flop_budget, interval, si
from looped_hf.scaling.law import PHI, effective_params
from looped_hf.scaling.runs import load_runs

if TYPE_CHECKING:
    from looped_hf.scaling import Runs, ScalingLawFit

PathLike = str | os.PathLike[str]
# What Runs.flops computes when a run has no train_flops: 6 FLOPs per applied parameter per token.
_FALLBACK = {"looped": "6 (N_once + r N_rec) D", "plain": "6 N D"}


def _compact_count(value: float, _pos: int | None = None) -> str:
    """6000 -> "6k", 2e6 -> "2M": tick labels for parameter counts (a FuncFormatter's signature)."""
    return si(value, 6)


def _new_figure(width: float = 6.4, height: float = 4.4) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def _runs_of(fit: ScalingLawFit, runs: Any) -> Runs:
    if runs is not None:
        return load_runs(runs)
    if fit.runs is None:
        raise ValueError("this fit carries no runs; pass runs=... to plot them")
    return fit.runs


def _colors(values: np.ndarray) -> dict[float, Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    uniq = list(np.unique(values))
    return {v: cmap(0.1 + 0.8 * i / max(1, len(uniq) - 1)) for i, v in enumerate(uniq)}


def _frontier(fit: ScalingLawFit, runs: Runs, r: float, flops: np.ndarray) -> np.ndarray:
    """Loss of the law at the compute-optimal size for each FLOP budget, at recurrence r.

    The models at r are the sweep's (:func:`~looped_hf.scaling.diagnose.size_family`); sizes range
    over the sweep's, x1/3 .. x3.
    """
    family = size_family(runs, r)
    m = runs.num_recurrences == r
    sizes = np.geomspace(runs.params[m].min() / 3, runs.params[m].max() * 3, 300)
    return np.array([np.min(law_loss(fit.params, family, float(c), sizes)) for c in flops])


def _n_eff(fit: ScalingLawFit, n_once: np.ndarray, n_rec: np.ndarray, r: np.ndarray | float) -> np.ndarray:
    return np.asarray(effective_params(n_once, n_rec, r, fit.params.get("phi")), float)


def plot_isoflop(fit: ScalingLawFit, path: PathLike, runs: Any = None) -> Path:
    """IsoFLOP curves: one panel per budget, loss against N_eff = N_once + r^phi N_rec.

    Points: the runs, coloured by r. Lines: the fitted law along the sweep's models at each r
    (:class:`~looped_hf.scaling.diagnose.SizeFamily`: tokens = budget / FLOPs per token), over
    the sweep's sizes and out to the compute-optimal one, which is marked with a star. A minimum
    between a budget's widths is what pins the law down; points that only fall or only rise
    mean the widths sit on one side of the optimum. Needs a ``budget`` column.
    """
    runs = _runs_of(fit, runs)
    if runs.budget is None:
        raise ValueError("IsoFLOP curves need a 'budget' column in the runs")
    budgets = np.unique(runs.budget)
    ncols = min(3, len(budgets))
    nrows = int(np.ceil(len(budgets) / ncols))
    fig = _new_figure(4.0 * ncols, 3.3 * nrows + 0.4)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = _colors(runs.num_recurrences)
    families = {r: size_family(runs, r) for r in colors}
    lo_all, hi_all = runs.params.min() / SEARCH_FACTOR, runs.params.max() * SEARCH_FACTOR
    for k, budget in enumerate(budgets):
        ax = axes[k // ncols][k % ncols]
        mb = runs.budget == budget
        for r, color in colors.items():
            m = mb & (runs.num_recurrences == r)
            if not m.any():
                continue
            x = _n_eff(fit, runs.n_once[m], runs.n_rec[m], r)
            label = f"r = {r:g}" if k == 0 else None
            ax.scatter(
                x, runs.loss[m], s=22, color=color, zorder=3, label=label, edgecolors="white", linewidths=0.5
            )
            fam = families[r]
            opt = compute_optimal(fit.params, fam, float(budget), lo_all, hi_all)
            n_lo = min(runs.params[m].min() / 1.5, opt["n"] / 1.5)
            n_hi = max(runs.params[m].max() * 1.5, opt["n"] * 1.5)
            sizes = np.geomspace(n_lo, n_hi, 200)
            n_once, n_rec = fam.split(sizes)
            ax.plot(
                _n_eff(fit, n_once, n_rec, r),
                law_loss(fit.params, fam, float(budget), sizes),
                color=color,
                lw=1.3,
            )
            ax.scatter([opt["n_eff"]], [opt["loss"]], marker="*", s=110, color=color, edgecolors="k", linewidths=0.6,
                       zorder=4, label="compute-optimal (law)" if k == 0 and r == max(colors) else None)  # fmt: skip
        ax.set_xscale("log")
        # A sweep spans less than a decade of N: label 1-2-5 ticks compactly (6k, 10k, 20k), not
        # matplotlib's overlapping minor-tick labels.
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(_compact_count))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"budget {flop_budget(budget)} FLOPs", fontsize=9)
        ax.grid(True, which="both", alpha=0.25)
        ax.set_xlabel(
            "N_eff = N_once + r^phi N_rec" if fit.params.get("phi") is not None else "N", fontsize=8
        )
        if k % ncols == 0:
            ax.set_ylabel("final eval loss (nats/token)", fontsize=8)
        ax.tick_params(labelsize=7)
    for k in range(len(budgets), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    phi = fit.params.get("phi")
    fig.suptitle(
        "IsoFLOP curves: runs (dots), fitted law (lines), compute-optimal size (stars)"
        + (f"; phi = {phi:.3f}" if phi is not None else ""),
        fontsize=10,
    )
    fig.legend(loc="outside lower center", ncols=len(colors) + 1, fontsize=8)
    return _save(fig, path)


#: Line style per r in the study's IsoFLOP figure (other r get dash patterns of their own).
_STUDY_LINESTYLES: dict[float, Any] = {1.0: "-", 2.0: "--", 4.0: "-.", 8.0: ":"}


def _study_linestyle(r: float, k: int) -> Any:
    return _STUDY_LINESTYLES.get(float(r), (0, (5, 1 + k, 1, 1)))


def _isoflop_curve(
    fit: ScalingLawFit, runs: Runs, budget: float, r: float, m: np.ndarray, curves: str
) -> tuple[np.ndarray, np.ndarray, tuple[float, float]] | None:
    """One (budget, r) curve of the study-style figure over unique parameters N, and its minimum.

    ``"parabola"``: loss quadratic in log N through the runs (at least 3 widths); the star is the
    vertex when the parabola opens upwards and its vertex lies within 1.5x of the widths, else the
    lowest run. ``"law"``: the fitted law along the sweep's models at r, the star at its
    compute-optimal size (``None``: nothing to draw).
    """
    n = runs.params[m]
    lo, hi = float(n.min()) / 1.3, float(n.max()) * 1.3
    if curves == "law":
        fam = size_family(runs, r)
        opt = compute_optimal(fit.params, fam, float(budget), lo / 1.2, hi * 1.2)
        lo, hi = min(lo, opt["n"] / 1.1), max(hi, opt["n"] * 1.1)
        grid = np.geomspace(lo, hi, 200)
        return grid, law_loss(fit.params, fam, float(budget), grid), (opt["n"], opt["loss"])
    if len(np.unique(n)) < 3:
        return None
    x = np.log(n)
    c2, c1, c0 = np.polyfit(x, runs.loss[m], 2)
    grid = np.geomspace(lo, hi, 200)
    best = int(np.argmin(runs.loss[m]))
    star = (float(n[best]), float(runs.loss[m][best]))
    if c2 > 0:
        v = -c1 / (2 * c2)
        if np.log(n.min() / 1.5) <= v <= np.log(n.max() * 1.5):
            star = (float(np.exp(v)), float(c0 + c1 * v + c2 * v * v))
            grid = np.geomspace(min(lo, star[0] / 1.1), max(hi, star[0] * 1.1), 200)
    lg = np.log(grid)
    return grid, c0 + c1 * lg + c2 * lg**2, star


def plot_isoflop_study(
    fits: ScalingLawFit | list[tuple[str, ScalingLawFit]], path: PathLike, *, curves: str = "parabola"
) -> Path:
    """IsoFLOP curves drawn as the study draws them, to set beside the paper's figure.

    One panel per ``(title, fit)`` (a probe and its base side by side; one fit: one panel),
    sharing the y axis; x: unique parameters N (= N_once + N_rec, not N_eff); colour: compute
    budget (one colour per budget across all panels); line style: r (solid 1, dashed 2,
    dash-dot 4, dotted 8); stars: each curve's minimum. ``curves="parabola"`` fits loss to a
    quadratic in log N per (budget, r) through the runs, ``"law"`` draws the fitted law along the
    sweep's models (see :func:`_isoflop_curve`). Panel titles carry each fit's phi. Needs a
    ``budget`` column.
    """
    if curves not in ("parabola", "law"):
        raise ValueError(f"curves must be 'parabola' or 'law', got {curves!r}")
    panels = [("", fits)] if not isinstance(fits, list) else list(fits)
    if not panels:
        raise ValueError("plot_isoflop_study needs at least one fit")
    all_runs = []
    for title, fit in panels:
        runs = _runs_of(fit, None)
        if runs.budget is None:
            raise ValueError(f"panel {title or 0!r}: IsoFLOP curves need a 'budget' column in the runs")
        all_runs.append(runs)
    colors = _colors(np.concatenate([r.budget for r in all_runs]))
    r_all = np.unique(np.concatenate([r.num_recurrences for r in all_runs]))
    styles = {float(r): _study_linestyle(r, k) for k, r in enumerate(r_all)}
    fig = _new_figure(5.2 * len(panels), 4.2)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (title, fit), runs in zip(axes, panels, all_runs):
        for budget in np.unique(runs.budget):
            color = colors[budget]
            for r in np.unique(runs.num_recurrences):
                m = (runs.budget == budget) & (runs.num_recurrences == r)
                if not m.any():
                    continue
                ax.scatter(
                    runs.params[m], runs.loss[m], s=22, color=color, alpha=0.45, linewidths=0, zorder=2
                )
                curve = _isoflop_curve(fit, runs, float(budget), float(r), m, curves)
                if curve is None:
                    continue
                grid, loss, star = curve
                ax.plot(grid, loss, color=color, ls=styles[float(r)], lw=1.3, alpha=0.9, zorder=3)
                ax.scatter([star[0]], [star[1]], marker="*", s=120, color=color, edgecolors="k",
                           linewidths=0.4, zorder=4)  # fmt: skip
        phi = fit.params.get("phi")
        head = title or "IsoFLOP curves"
        ax.set_title(head + (f", phi = {phi:.2f}" if phi is not None else ""), fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("unique parameters N")
        ax.grid(True, which="both", alpha=0.2)
        arch = [
            Line2D([], [], color="k", ls=styles[float(r)], label=f"r = {r:g}")
            for r in np.unique(runs.num_recurrences)
        ]
        leg = ax.legend(handles=arch, title="architecture", fontsize=7, title_fontsize=7, loc="upper right")
        ax.add_artist(leg)
        budgets = [
            Line2D([], [], color=colors[b], lw=2, label=flop_budget(b))
            for b in np.unique(runs.budget)
        ]
        ax.legend(handles=budgets, title="FLOPs budget", fontsize=7, title_fontsize=7, loc="lower left")
    axes[0].set_ylabel("held-out loss L (nats/token)")
    return _save(fig, path)


def plot_phi_profile(fit: ScalingLawFit, path: PathLike) -> Path:
    """The profile of the objective over phi (every other parameter refitted at each phi).

    y: the LR statistic ``2 (f_prof(phi) - f_min) / kappa`` (:mod:`looped_hf.scaling.profile`);
    the dashed line is its 95% cut, and the phi below it form the profile-likelihood interval
    (shaded). The bootstrap interval is the bar at the bottom. A flat curve is a phi the runs
    do not determine.
    """
    prof = fit.profile
    if prof is None:
        raise ValueError("no profile of phi: fit with checks=True (or a bootstrap) on runs that identify phi")
    lr = prof.lr
    fig = _new_figure(6.0, 3.9)
    ax = fig.add_subplot()
    top = 6.0 * prof.cut
    focus = prof.phi[lr <= top]
    x_lo = min(0.0, float(focus.min()) if focus.size else 0.0) - 0.15
    x_hi = max(1.0, float(focus.max()) if focus.size else 1.0) + 0.15
    ax.plot(
        prof.phi, np.minimum(lr, top * 1.5), color="#4c72b0", lw=1.6, marker=".", ms=3, label="profile (LR)"
    )
    ax.axhline(prof.cut, color="k", ls="--", lw=0.9, label=f"95% cut ({prof.cut:.2f})")
    lo, hi = prof.interval
    ax.axvspan(prof.phi.min() if lo is None else lo, prof.phi.max() if hi is None else hi, color="orange",
               alpha=0.25, label=f"profile 95% CI {interval((lo, hi), '.3f', 'open')}")  # fmt: skip
    phi = fit.params.get("phi")
    if phi is not None:
        ax.axvline(phi, color="k", lw=1.2, label=f"estimate {phi:.3f}")
    if "phi" in fit.ci:
        b_lo, b_hi = fit.ci["phi"]
        y = -0.06 * top
        ax.plot([b_lo, b_hi], [y, y], color="#c44e52", lw=4, solid_capstyle="butt",
                label=f"bootstrap 95% CI {interval((b_lo, b_hi), '.3f')}")  # fmt: skip
    for ref in (0.0, 1.0):
        ax.axvline(ref, color="0.6", lw=0.8, ls=":")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(-0.12 * top, top)
    ax.set_xlabel("phi (held fixed; every other parameter refitted)")
    ax.set_ylabel("2 (f(phi) - f_min) / kappa")
    ax.set_title("profile of the fit's objective over phi (flat = phi not determined)", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(True, alpha=0.25)
    return _save(fig, path)


def plot_loss_vs_flops(fit: ScalingLawFit, path: PathLike, runs: Any = None) -> Path:
    """Final loss against training FLOPs, one colour per r; lines: the fitted law at the
    compute-optimal model size for each r (runs off the optimum sit above their line)."""
    runs = _runs_of(fit, runs)
    fig = _new_figure()
    ax = fig.add_subplot()
    flops = runs.flops
    colors = _colors(runs.num_recurrences)
    grid = np.geomspace(flops.min() / 1.3, flops.max() * 1.3, 80)
    for r, color in colors.items():
        m = runs.num_recurrences == r
        label = f"r = {r:g} runs" if runs.kind == "looped" else "runs"
        ax.scatter(flops[m], runs.loss[m], s=18, color=color, alpha=0.8, label=label)
        ax.plot(grid, _frontier(fit, runs, r, grid), color=color, lw=1.6)
    ax.set_xscale("log")
    xl = "training FLOPs" + (
        f" ({_FALLBACK[runs.kind]}: no train_flops recorded)" if runs.flops_is_fallback else ""
    )
    ax.set_xlabel(xl)
    ax.set_ylabel("final eval loss (nats/token)")
    phi = fit.params.get("phi")
    sub = f"phi = {phi:.3f}" if phi is not None else "Chinchilla form"
    ax.set_title(f"loss vs compute; lines: fitted law at the compute-optimal size ({sub})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.25)
    return _save(fig, path)


def plot_phi_bootstrap(fit: ScalingLawFit, path: PathLike) -> Path:
    """Histogram of the bootstrap phi draws, with the point estimate and the 95% interval."""
    if fit.bootstrap_samples is None or fit.params.get("phi") is None or "phi" not in fit.ci:
        raise ValueError("no bootstrap distribution of phi: fit with bootstrap > 0 on runs that identify phi")
    phis = fit.bootstrap_samples[:, PHI]
    fig = _new_figure(5.6, 3.8)
    ax = fig.add_subplot()
    ax.hist(phis, bins=min(40, max(10, len(phis) // 5)), color="#4c72b0", alpha=0.9, zorder=2)
    lo, hi = fit.ci["phi"]
    ax.axvline(float(fit.params["phi"]), color="k", lw=1.5, label=f"estimate {fit.params['phi']:.3f}")
    ax.axvspan(lo, hi, color="orange", alpha=0.25, zorder=0, label=f"95% CI {interval((lo, hi), '.3f')}")
    method = fit.settings.get("bootstrap_method_used", fit.settings.get("bootstrap_method", ""))
    ax.set_title(f"phi over {len(phis)} {method} bootstrap resamples", fontsize=10)
    ax.set_xlabel("phi")
    ax.set_ylabel("resamples")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_residuals(fit: ScalingLawFit, path: PathLike, runs: Any = None) -> Path:
    """Residuals ``log L - log L_hat`` (in %) against training FLOPs, one colour per r.

    With ``runs`` given, residuals are recomputed from the fitted law on those runs.
    """
    data = _runs_of(fit, runs)
    if runs is None:
        res = fit.residuals
    else:
        pred = fit.predict(
            tokens=data.tokens, n_once=data.n_once, n_rec=data.n_rec, num_recurrences=data.num_recurrences
        )
        res = np.log(data.loss) - np.log(pred)
    fig = _new_figure(6.4, 3.8)
    ax = fig.add_subplot()
    colors = _colors(data.num_recurrences)
    for i, (r, color) in enumerate(colors.items()):
        m = data.num_recurrences == r
        # A small per-r horizontal offset keeps runs at the same budget from hiding each other.
        offset = 1.0 + 0.03 * (i - (len(colors) - 1) / 2)
        rms = float(np.sqrt(np.mean(res[m] ** 2)))
        ax.scatter(
            data.flops[m] * offset, 100 * res[m], s=16, color=color, label=f"r = {r:g} (RMS {100 * rms:.2f}%)"
        )
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs" + (f" ({_FALLBACK[data.kind]})" if data.flops_is_fallback else ""))
    ax.set_ylabel("log L - log L_hat (%)")
    ax.set_title("residuals of the fitted law by r", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.25)
    return _save(fig, path)


def plot_plan_frontier(frontier: dict[str, Any], path: PathLike) -> Path:
    """Predicted loss against training FLOPs along each r's compute-optimal frontier, with its 95%
    band (``looped_hf.planner.frontier``'s arrays); budgets beyond the sweep's are shaded."""
    fig = _new_figure()
    ax = fig.add_subplot()
    budgets = np.asarray(frontier["budgets"], float)
    rs = np.array(sorted(frontier["lines"]), float)
    colors = _colors(rs)
    for r in rs:
        line = frontier["lines"][int(r)]
        ax.plot(budgets, line["loss"], color=colors[r], lw=1.6, label=f"r = {r:g}")
        if all(v is not None for v in line["low"]):
            ax.fill_between(budgets, line["low"], line["high"], color=colors[r], alpha=0.12, lw=0)
    sweep = frontier.get("sweep_budgets")
    if sweep:
        ax.axvspan(sweep[1], budgets.max(), color="0.5", alpha=0.08, lw=0, label="beyond the sweep (extrapolated)")
        ax.axvline(sweep[1], color="0.4", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("predicted loss at the compute-optimal width (nats/token)")
    phi = frontier.get("phi")
    band = f"bands: 95% over {frontier['n_resamples']} resamples" if frontier.get("n_resamples") else "no bootstrap"
    ax.set_title(f"compute-optimal frontier per r (phi = {phi:.3g}; {band})" if phi is not None
                 else f"compute-optimal frontier ({band})", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.25)
    return _save(fig, path)


def plot_fit(
    fit: ScalingLawFit,
    out_dir: PathLike,
    runs: Any = None,
    *,
    isoflop_style: str = "law",
    compare: Mapping[str, ScalingLawFit] | None = None,
) -> list[Path]:
    """All fit plots that apply into ``out_dir``; their paths.

    Always: ``loss_vs_flops.png``, ``residuals.png``; with a ``budget`` column: ``isoflop.png``
    (``isoflop_style="law"``: :func:`plot_isoflop`; ``"study"``: :func:`plot_isoflop_study` of the
    fit's own runs, with a panel per ``compare`` entry, title -> a probe's fit); with a profile of
    phi: ``phi_profile.png``; with bootstrap draws of phi: ``phi_bootstrap.png``.
    """
    out = Path(out_dir)
    data = _runs_of(fit, runs)
    paths = []
    if data.budget is not None:
        if isoflop_style == "study" and runs is None:
            panels = [("base" if compare else "", fit), *(compare or {}).items()]
            paths.append(plot_isoflop_study(panels, out / "isoflop.png"))
        else:
            paths.append(plot_isoflop(fit, out / "isoflop.png", runs))
    if fit.profile is not None and fit.params.get("phi") is not None:
        paths.append(plot_phi_profile(fit, out / "phi_profile.png"))
    paths += [
        plot_loss_vs_flops(fit, out / "loss_vs_flops.png", runs),
        plot_residuals(fit, out / "residuals.png", runs),
    ]
    if fit.bootstrap_samples is not None and fit.params.get("phi") is not None and "phi" in fit.ci:
        paths.append(plot_phi_bootstrap(fit, out / "phi_bootstrap.png"))
    return paths


# --- a metric against the r run at inference ---------------------------------------------------
@dataclass(frozen=True)
class RSeries:
    """One line of :func:`plot_metric_vs_r`: ``values[i]`` measured at ``rs[i]``; ``trained`` (the
    r the model was trained at) is circled when measured."""

    label: str
    rs: Sequence[float]
    values: Sequence[float]
    trained: float | None = None


def plot_metric_vs_r(
    series: Sequence[RSeries],
    path: PathLike,
    *,
    ylabel: str,
    title: str,
    xlabel: str = "recurrences r at inference",
    zero_line: bool = False,
) -> Path:
    """A metric against the r run at inference, one line per series, each series' trained r
    hollow-circled; log2 r axis (when more than one r) ticked at the measured r; ``zero_line``
    draws y = 0 (chance, for centered scores)."""
    if not series:
        raise ValueError("plot_metric_vs_r: no series to draw")
    fig = _new_figure(6.4, 4.2)
    ax = fig.add_subplot()
    for s in series:
        rs, values = np.asarray(s.rs, float), np.asarray(s.values, float)
        (line,) = ax.plot(rs, values, marker="o", ms=3.5, lw=1.6, label=s.label)
        at = rs == s.trained
        if at.any():
            ax.scatter(rs[at], values[at], s=90, facecolors="none", edgecolors=line.get_color(),
                       linewidths=1.5, zorder=3)  # fmt: skip
    if zero_line:
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
    ticks = sorted({float(r) for s in series for r in s.rs})
    if len(ticks) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{r:g}" for r in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_depth_grid(
    values: Sequence[Sequence[float]],
    rows: Sequence[int],
    cols: Sequence[int],
    path: PathLike,
    *,
    row_label: str,
    col_label: str,
    title: str,
    trained: tuple[int, int] | None = None,
    value_label: str = "held-out loss (nats/token)",
) -> Path:
    """A heat map of a metric over two depth axes (HRM-Text's H_cycles x L_cycles): ``values[i][j]``
    at (``rows[i]``, ``cols[j]``), each cell annotated, lower = darker; the trained cell boxed."""
    grid = np.asarray(values, float)
    if grid.shape != (len(rows), len(cols)) or grid.size == 0:
        raise ValueError(
            f"plot_depth_grid: values of shape {list(grid.shape)} for {len(rows)} x {len(cols)} cells"
        )
    fig = _new_figure(1.6 + 0.62 * len(cols), 1.4 + 0.5 * len(rows))
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    fig.colorbar(image, ax=ax, label=value_label)
    finite = grid[np.isfinite(grid)]
    middle = float(np.median(finite)) if finite.size else 0.0
    for i in range(len(rows)):
        for j in range(len(cols)):
            ax.text(j, i, f"{grid[i, j]:.3f}", ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] < middle else "black")  # fmt: skip
    if trained is not None and trained[0] in rows and trained[1] in cols:
        i, j = list(rows).index(trained[0]), list(cols).index(trained[1])
        ax.add_patch(_rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(col_label)
    ax.set_ylabel(row_label)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


def _rectangle(*args: Any, **kwargs: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(*args, **kwargs)


def write_result_triple(
    out_dir: PathLike, stem: str, result: Mapping[str, Any], markdown: str, plot: Callable[[Path], Path]
) -> list[Path]:
    """Write one result into ``out_dir`` as ``<stem>.png`` (``plot(path)`` draws it),
    ``<stem>.md`` (``markdown``, which links the PNG) and ``<stem>.json`` (``result``); returns
    the three paths, JSON first. The markdown and the JSON are written atomically, the JSON last: a
    reader that finds it (the checkpoint card, a sweep card) finds the whole set."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(out / f"{stem}.png")
    write_text_atomic(out / f"{stem}.md", markdown)
    write_json_atomic(out / f"{stem}.json", dict(result))
    return [out / f"{stem}.json", out / f"{stem}.md", png]
