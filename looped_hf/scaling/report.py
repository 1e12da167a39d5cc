"""Plain-text report of a :class:`~looped_hf.scaling.fit.ScalingLawFit`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .diagnose import OPTIMAL_VS_WIDTHS
from .formatting import flop_budget, interval, si

if TYPE_CHECKING:
    from .fit import ScalingLawFit


def _num(x: float | None) -> str:
    if x is None:
        return "not identifiable"
    return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.3e}"


def _diagnosis_lines(fit: ScalingLawFit) -> list[str]:
    """Identifiability: phi's two intervals, parameters on bounds, IsoFLOP placement, verdict."""
    d = fit.diagnostics
    if not d:
        return []
    lines: list[str] = []
    prof, boot = d.get("profile"), d.get("bootstrap")
    if prof is not None:
        lr0, lr1 = prof.get("lr_phi0"), prof.get("lr_phi1")
        tests = ", ".join(
            f"at phi = {v}: {x:.3g} ({'excluded' if x > prof['cut'] else 'inside'})"
            for v, x in (("0", lr0), ("1", lr1))
            if x is not None
        )
        lines.append(f"phi 95% profile-likelihood interval {interval(prof['interval'], '.3f', 'open (box)')}")
        lines.append(f"  (LR statistic, cut {prof['cut']:.3g}; {tests})")
    if "phi" in fit.ci:
        lo, hi = fit.ci["phi"]
        lines.append(f"phi 95% bootstrap interval          {interval((lo, hi), '.3f')} (percentile)")
    if boot is not None and boot.get("at_bound_by_param"):
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in boot["at_bound_by_param"].items())
        lines.append(f"  resamples with a parameter on a bound of the search box: {shares}")
    for b in d.get("at_bound", []):
        lines.append(f"on a bound: {b['text']}")
    if lines:
        lines.append("")
    budgets = d.get("budgets") or []
    if budgets:
        lines.append(
            "IsoFLOP placement: per budget, tokens per unique parameter across its widths; for each r the"
        )
        lines.append(
            "width with the lowest loss (interior = an IsoFLOP minimum) and the law's compute-optimal size"
        )
        lines.append(
            f"  {'budget':<9} {'tokens/param':<13} {'r':>3}  {'lowest loss':<12} {'position':<9} law's optimum"
        )
        for row in budgets:
            tpp = f"{si(row['tokens_per_param'][0])}-{si(row['tokens_per_param'][1])}"
            for k, p in enumerate(row["per_r"]):
                opt = f"{si(p['optimal_params'])} ({p['optimal_tokens_per_param']:.3g} tok/param, "
                opt += (
                    OPTIMAL_VS_WIDTHS[p["optimal_vs_widths"]]
                    + (", beyond the search range" if p.get("optimal_edge") else "")
                    + ")"
                )
                head = f"{flop_budget(row['budget']):<9} {tpp:<13}" if k == 0 else " " * 23
                lines.append(f"  {head} {p['r']:>3g}  {p['best']:<12} {p['position']:<9} {opt}")
        lines.append("")
    v = d.get("verdict")
    if v:
        lines.append(f"verdict: {v['line']}")
        if not v.get("identified"):
            lines += [f"  - {reason}" for reason in v.get("reasons", [])]
        lines.append("")
    return lines


def render_report(fit: ScalingLawFit) -> str:
    runs = fit.runs
    lines: list[str] = []
    form = (
        "L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta"
        if fit.kind == "looped" and fit.phi_identifiable
        else "L = E + A N^-alpha + B D^-beta (Chinchilla form)"
    )
    n = len(fit.residuals)
    lines.append(f"Scaling-law fit: {form}")
    src = f" from {runs.source}" if runs is not None else ""
    s = fit.settings
    lines.append(
        f"{n} runs{src}; Huber delta {s.get('huber_delta', 1e-3):g} on log residuals, summed; "
        f"{s.get('n_starts', '?')} {s.get('starts', '')} starts screened, the best {s.get('n_polish', '?')} "
        f"descended together (batched Levenberg-Marquardt), the best distinct end points polished with "
        f"L-BFGS-B (analytic gradient), seed {s.get('seed', '?')}"
    )
    bounds = s.get("bounds")
    if bounds:
        names = ("log A", "alpha", "log B", "beta", "log E", "phi")
        box = ", ".join(f"{n} [{lo:g}, {hi:g}]" for n, (lo, hi) in zip(names, bounds))
        lines.append(f"search box (starts and L-BFGS-B bounds): {box}")
    lines.append("")

    # Parameters.
    boot = fit.bootstrap_samples
    hdr = "param      estimate      95% CI"
    if boot is not None:
        hdr += (
            f" ({len(boot)} resamples, {s.get('bootstrap_method_used', s.get('bootstrap_method'))} bootstrap)"
        )
    lines.append(hdr)
    for name in ("E", "A", "alpha", "B", "beta", "phi"):
        if name == "phi" and fit.kind == "plain":
            continue
        val = fit.params.get(name)
        ci = fit.ci.get(name)
        ci_s = (
            f"[{_num(ci[0])}, {_num(ci[1])}]"
            if ci
            else ("(fixed)" if name == "phi" and fit.fixed_phi is not None else "-")
        )
        lines.append(f"{name:<8} {_num(val):>12}      {ci_s}")
    lines.append(f"R^2 (loss) = {fit.r2:.4f}   objective = {fit.objective:.6g}")
    if fit.bootstrap_checks:
        lines.append(f"bootstrap fit checks: {fit.bootstrap_checks.get('summary', '')}")
    lines.append("")
    lines += _diagnosis_lines(fit)

    # Restricted fits.
    if fit.restricted:
        lines.append("restricted fits (how much worse than the fit above):")
        for key, res in fit.restricted.items():
            lines.append(
                f"  {key:<6} R^2 {res['r2']:.4f} (delta {res['r2'] - fit.r2:+.4f})   objective {res['objective']:.6g} "
                f"(x{res['objective'] / fit.objective:.2f})"
            )
        lines.append("")

    # Residuals by r.
    if runs is not None:
        lines.append("residuals log L - log L_hat by r:  r   runs   mean       RMS")
        for r in np.unique(runs.num_recurrences):
            m = runs.num_recurrences == r
            res = fit.residuals[m]
            lines.append(
                f"{'':35}{r:>3g} {int(m.sum()):>6}   {res.mean():+.2e}  {np.sqrt(np.mean(res**2)):.2e}"
            )
        lines.append("")

    # Equivalences: the study's sentence, for the largest model at each r > 1.
    equivalences = fit.equivalences()
    for eq in equivalences:
        lines.append(
            f"at r = {eq['r']:g} a looped model of {si(eq['unique'])} unique parameters performs like a "
            f"non-looped model of {si(eq['performs_like'])}, and costs the training compute of one of "
            f"{si(eq['costs_like'])}"
        )
    if equivalences:
        lines.append(
            "  (performs like: N_once + r^phi N_rec; costs like: N_once + r N_rec, i.e. 6 FLOPs per "
            "parameter application per token, attention/embeddings/head ignored)"
        )
        lines.append("")

    if fit.holdout:
        h = fit.holdout
        lines.append(
            f"leave-one-budget-out: fit without budget {h['held_out_budget']:.3g} predicts its {h['n_held_out']} runs "
            f"with mean error {100 * h['mean_rel_error']:+.2f}% (mean |error| {100 * h['mean_abs_rel_error']:.2f}%, "
            f"max {100 * h['max_abs_rel_error']:.2f}%)"
            + (f"; phi without it = {h['phi_without']:.3f}" if h.get("phi_without") is not None else "")
        )
        lines.append("")
    if fit.notes:
        lines.append("notes:")
        lines += [f"  - {note}" for note in fit.notes]
    return "\n".join(lines).rstrip() + "\n"
