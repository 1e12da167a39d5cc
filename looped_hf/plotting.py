"""The project's plots (matplotlib, Agg, no pyplot).

Every function builds its own :class:`matplotlib.figure.Figure` on an Agg canvas, so nothing
touches pyplot's global state (no stray figures, no backend switching in a user's notebook),
writes one PNG and returns its path. The fit plots take a
:class:`~looped_hf.scaling.ScalingLawFit` and, optionally, the runs to draw (default: the runs
the fit was made on).

- :func:`plot_loss_vs_flops`: runs by r, with the law's compute-optimal frontier for each r;
- :func:`plot_phi_bootstrap`: the bootstrap distribution of phi with its 95% interval;
- :func:`plot_residuals`: log residuals against training FLOPs, by r;
- :func:`plot_fit`: all of the above into a folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    from looped_hf.scaling import Runs, ScalingLawFit

PathLike = str | os.PathLike[str]
# What Runs.flops computes when a run has no train_flops: 6 FLOPs per applied parameter per token.
_FALLBACK = {"looped": "6 (N_once + r N_rec) D", "plain": "6 N D"}


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
    from looped_hf.scaling import load_runs

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

    The architecture at r is the sweep's: ``N_once / N`` and the FLOPs per token per applied
    parameter are their medians over the runs at r (iso-depth sweeps scale every part as d^2,
    so one ratio describes all widths). Sizes range over the sweep's, x1/3 .. x3.
    """
    m = runs.num_recurrences == r
    frac_once = float(np.median(runs.n_once[m] / runs.params[m]))
    applied = runs.n_once[m] + r * runs.n_rec[m]
    per_token = float(np.median(runs.flops[m] / (runs.tokens[m] * applied)))
    sizes = np.geomspace(runs.params[m].min() / 3, runs.params[m].max() * 3, 300)
    n_once, n_rec = frac_once * sizes, (1 - frac_once) * sizes
    tokens = flops[:, None] / (per_token * (n_once + r * n_rec))[None, :]
    if fit.kind == "looped" and fit.params.get("phi") is not None:
        loss = fit.predict(tokens=tokens, n_once=n_once, n_rec=n_rec, num_recurrences=r)
    else:
        loss = fit.predict(tokens=tokens, params=sizes)
    return np.min(loss, axis=1)


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
    phis = fit.bootstrap_samples[:, 5]
    fig = _new_figure(5.6, 3.8)
    ax = fig.add_subplot()
    ax.hist(phis, bins=min(40, max(10, len(phis) // 5)), color="#4c72b0", alpha=0.9, zorder=2)
    lo, hi = fit.ci["phi"]
    ax.axvline(float(fit.params["phi"]), color="k", lw=1.5, label=f"estimate {fit.params['phi']:.3f}")
    ax.axvspan(lo, hi, color="orange", alpha=0.25, zorder=0, label=f"95% CI [{lo:.3f}, {hi:.3f}]")
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


def plot_fit(fit: ScalingLawFit, out_dir: PathLike, runs: Any = None) -> list[Path]:
    """All fit plots into ``out_dir`` (the phi histogram only when there is one); their paths."""
    out = Path(out_dir)
    paths = [
        plot_loss_vs_flops(fit, out / "loss_vs_flops.png", runs),
        plot_residuals(fit, out / "residuals.png", runs),
    ]
    if fit.bootstrap_samples is not None and fit.params.get("phi") is not None and "phi" in fit.ci:
        paths.append(plot_phi_bootstrap(fit, out / "phi_bootstrap.png"))
    return paths
