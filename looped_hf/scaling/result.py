"""The result of a scaling-law fit, :class:`ScalingLawFit`: its numbers, its JSON form and its
plain-text report.

Its own module, below everything that makes or reads a fit: :mod:`.fit` builds it,
:mod:`.diagnose` and :mod:`.compare` read it, :mod:`looped_hf.plotting` draws it, and this module
imports none of them (not even for type hints), so the scaling package has no import circle.
The report lives here because ``fit.report()`` needs it and it needs nothing but the fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..fileio import read_json, write_text_atomic
from . import law
from .formatting import OPTIMAL_VS_WIDTHS, flop_budget, interval, si
from .profile import PhiProfile
from .runs import Runs, load_runs

_FORMAT = "looped_hf.scaling/1"


@dataclass
class ScalingLawFit:
    """The result of :func:`~.fit.fit_scaling_law`.

    Attributes:
        params: ``E, A, alpha, B, beta, phi`` (``phi`` is ``None`` when the data cannot identify
            it, and the fixed value under ``fix_phi``).
        ci: name -> (low, high), 95% percentile bootstrap intervals (empty without bootstrap);
            phi's profile-likelihood interval is ``profile.interval``.
        r2: coefficient of determination of the loss (linear space) over the fitted runs.
        objective: summed Huber objective at the optimum.
        residuals: ``log L - log L_hat`` per run, in the order of ``runs``.
        kind: ``"looped"`` or ``"plain"`` (Chinchilla form).
        phi_identifiable: whether the data identify phi.
        fixed_phi: the value phi was held at, if any.
        runs: the fitted runs (kept for reports, plots and the JSON round trip).
        bootstrap_samples: ``(n_ok, 6)`` natural parameters of the bootstrap fits that passed
            the fit checks (see ``bootstrap_checks``).
        bootstrap_checks: what the checks of every resample's fit found
            (:class:`~.resample.RefitStatus` as a dict: ``n``, ``refitted``, ``dropped``,
            ``reasons``, ``summary``); ``None`` without a bootstrap.
        restricted: ``{"phi=0": {...}, "phi=1": {...}}`` with each restricted fit's ``r2``,
            ``objective`` and ``params``.
        holdout: leave-one-budget-out check (fit without the largest budget, error on it).
        profile: the profile of the objective over phi and its interval (when phi is free and
            the fit ran with ``checks`` or a bootstrap).
        diagnostics: is phi identified? Per-budget IsoFLOP placement, parameters on bounds,
            both intervals, the verdict line (:func:`looped_hf.scaling.diagnose.diagnose`).
        notes: what the fitter did that a reader should know (dropped rows, fallbacks).
        settings: the options used (seed, starts, bootstrap method, ...).
    """

    params: dict[str, float | None]
    ci: dict[str, tuple[float, float]]
    r2: float
    objective: float
    residuals: np.ndarray
    kind: Literal["looped", "plain"]
    phi_identifiable: bool
    fixed_phi: float | None = None
    runs: Runs | None = None
    bootstrap_samples: np.ndarray | None = None
    bootstrap_checks: dict[str, Any] | None = None
    restricted: dict[str, dict[str, Any]] = field(default_factory=dict)
    holdout: dict[str, Any] | None = None
    profile: PhiProfile | None = None
    diagnostics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------------------- law
    @property
    def theta(self) -> np.ndarray:
        return law.from_natural(self.params)

    def _phi(self) -> float:
        if self.params["phi"] is None:
            raise ValueError(
                "phi is not identifiable from these runs (no run has r > 1 and n_rec > 0); "
                "the fit is the Chinchilla form in N = n_once + n_rec"
            )
        return float(self.params["phi"])

    def effective_params(
        self, n_once: float | np.ndarray, n_rec: float | np.ndarray, num_recurrences: float | np.ndarray
    ) -> np.ndarray | float:
        """``N_eff = N_once + r^phi N_rec``: the size of the non-looped model that the law says
        performs alike. Raises ``ValueError`` when phi is not identifiable."""
        phi = self._phi() if self.kind == "looped" else 0.0
        out = np.asarray(law.effective_params(n_once, n_rec, num_recurrences, phi), float)
        return float(out) if out.ndim == 0 else out

    def predict(
        self,
        *,
        tokens: float | np.ndarray,
        n_once: float | np.ndarray | None = None,
        n_rec: float | np.ndarray = 0.0,
        num_recurrences: float | np.ndarray = 1.0,
        params: float | np.ndarray | None = None,
    ) -> np.ndarray | float:
        """Predicted loss ``E + A N_eff^-alpha + B D^-beta``.

        Pass ``params=N`` for a plain model, or ``n_once``, ``n_rec``, ``num_recurrences`` for a
        looped one (broadcast like numpy).
        """
        if params is not None:
            n_eff = np.asarray(params, float)
        elif n_once is None:
            raise ValueError("predict needs params=N (plain) or n_once/n_rec/num_recurrences (looped)")
        else:
            # phi None (not identifiable; a plain fit's phi is inert) counts every parameter once.
            phi = self.params["phi"] if self.kind == "looped" else None
            n_once, n_rec = np.asarray(n_once, float), np.asarray(n_rec, float)
            n_eff = np.asarray(law.effective_params(n_once, n_rec, num_recurrences, phi), float)
        out = law.natural_loss(self.params, n_eff, np.asarray(tokens, float))
        return float(out) if np.ndim(out) == 0 else out

    def equivalence(self, n_once: float, n_rec: float, num_recurrences: float) -> dict[str, float]:
        """The study's sentence as numbers for one looped model.

        - ``unique``: ``N_once + N_rec``, the parameters it stores;
        - ``performs_like``: ``M = N_once + r^phi N_rec``, the non-looped size with the same loss
          at equal tokens (the law's N_eff);
        - ``costs_like``: ``K = N_once + r N_rec``, the non-looped size with the same training
          FLOPs per token. Convention: FLOPs per token are 6 per parameter application (forward
          + backward through every recurrence), attention, embeddings and the head ignored,
          so a block looped r times costs r blocks.
        """
        return {
            "unique": float(n_once + n_rec),
            "performs_like": float(self.effective_params(n_once, n_rec, num_recurrences)),
            "costs_like": float(n_once + num_recurrences * n_rec),
        }

    def equivalences(self) -> list[dict[str, float]]:
        """``equivalence`` for the largest fitted model at each r > 1 (with ``r`` added): the
        study's sentences, as the report and the sweep card state them."""
        runs = self.runs
        if runs is None or self.kind != "looped" or self.params.get("phi") is None:
            return []
        out = []
        for r in np.unique(runs.num_recurrences):
            m = (runs.num_recurrences == r) & (runs.n_rec > 0)
            if r <= 1 or not m.any():
                continue
            i = np.flatnonzero(m)[np.argmax(runs.params[m])]
            out.append(
                {"r": float(r), **self.equivalence(float(runs.n_once[i]), float(runs.n_rec[i]), float(r))}
            )
        return out

    # ----------------------------------------------------------------------------- output
    def report(self) -> str:
        """A plain-text report: parameters with CIs, restricted fits, residuals by r, checks."""
        return render_report(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "params": self.params,
            "ci": {k: list(v) for k, v in self.ci.items()},
            "r2": self.r2,
            "objective": self.objective,
            "residuals": [float(x) for x in self.residuals],
            "kind": self.kind,
            "phi_identifiable": self.phi_identifiable,
            "fixed_phi": self.fixed_phi,
            "bootstrap_samples": None if self.bootstrap_samples is None else self.bootstrap_samples.tolist(),
            "bootstrap_checks": self.bootstrap_checks,
            "restricted": self.restricted,
            "holdout": self.holdout,
            "profile": None if self.profile is None else self.profile.to_dict(),
            "diagnostics": self.diagnostics,
            "notes": self.notes,
            "settings": self.settings,
            "runs": None
            if self.runs is None
            else {"kind": self.runs.kind, "source": self.runs.source, "records": self.runs.to_records()},
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """JSON text; written atomically to ``path`` (temp file + ``os.replace``) if given."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=True)
        if path is not None:
            write_text_atomic(path, text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> ScalingLawFit:
        """Inverse of :meth:`to_json` (accepts the JSON text or a path to it)."""
        s = str(text_or_path)
        is_text = s.lstrip().startswith(("{", "["))
        where = "" if is_text else f"{s}: "
        try:
            obj = json.loads(s) if is_text else read_json(s)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err.msg}, line {err.lineno})") from None
        except OSError as err:
            raise ValueError(f"{where}cannot read the fit ({err.__class__.__name__}: {err})") from None
        if not isinstance(obj, dict):
            raise ValueError(
                f"{where}not a looped_hf scaling fit: expected a JSON object, got {type(obj).__name__}"
            )
        if obj.get("format") != _FORMAT:
            raise ValueError(f"{where}not a looped_hf scaling fit (format {obj.get('format')!r})")
        for key, kind in _FIT_FIELDS.items():
            if key not in obj:
                raise ValueError(f"{where}not a looped_hf scaling fit: field {key!r} is missing")
            if not isinstance(obj[key], kind):
                raise ValueError(f"{where}field {key!r} is {obj.get(key)!r}: a looped_hf fit records it "
                                 f"as {kind.__name__ if isinstance(kind, type) else 'a number'}")  # fmt: skip
        runs = None
        if obj.get("runs"):
            recs = obj["runs"]["records"]
            runs = load_runs([{k: v for k, v in r.items() if k != "label"} for r in recs])
            runs.labels = [r["label"] for r in recs]
            runs.source = obj["runs"]["source"]
        bs = obj.get("bootstrap_samples")
        return cls(
            params=obj["params"],
            ci={k: (float(v[0]), float(v[1])) for k, v in obj["ci"].items()},
            r2=obj["r2"],
            objective=obj["objective"],
            residuals=np.asarray(obj["residuals"], float),
            kind=obj["kind"],
            phi_identifiable=obj["phi_identifiable"],
            fixed_phi=obj.get("fixed_phi"),
            runs=runs,
            bootstrap_samples=None if bs is None else np.asarray(bs, float).reshape(-1, len(law.NATURAL_NAMES)),
            bootstrap_checks=obj.get("bootstrap_checks"),
            restricted=obj.get("restricted", {}),
            holdout=obj.get("holdout"),
            profile=PhiProfile.from_dict(obj["profile"]) if obj.get("profile") else None,
            diagnostics=obj.get("diagnostics") or {},
            notes=list(obj.get("notes", [])),
            settings=obj.get("settings", {}),
        )


#: The fields every saved fit has, and their JSON types (what from_json reads without a default).
_FIT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "params": dict, "ci": dict, "r2": (int, float), "objective": (int, float), "residuals": list,
    "kind": str, "phi_identifiable": bool,
}  # fmt: skip


# --------------------------------------------------------------------------------- report
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
