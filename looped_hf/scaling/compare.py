"""phi of a probe sweep against its baseline: ``compare_fits`` and its ``FitComparison``.

A probe (truncated backprop, hyperconnections, ...) is judged by delta phi = phi_probe - phi_base
with two 95% intervals:

- a percentile bootstrap. Independent sweeps: the difference of independent bootstrap draws. A
  probe without r = 1 runs of its own (the study's layout): fitted with the base's r = 1 runs,
  and the bootstrap is paired, so the correlation the shared runs create is in the interval.
  Every resample's two fits are checked (:func:`~.resample.refit_checked`); a pair whose fit
  still fails after a refit from more starts is dropped and counted;
- a profile-likelihood interval from the joint fit in which the probe's phi is the base's phi
  + delta (:func:`~.profile.delta_profile`): it needs no resample fits, so degenerate resamples
  cannot drag it.

The verdict (:func:`comparison_verdict`) says whether the comparison decides the sign of delta
and, when the two intervals disagree, which one it trusts and why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import law
from .diagnose import diagnose
from .fit import BootstrapMethod, ScalingLawFit, _free_mask, _law_data, _set_bootstrap, fit_scaling_law
from .formatting import interval
from .law import LawData
from .optimize import single_threaded_blas
from .profile import DeltaProfile, delta_profile, profile_phi
from .resample import RESAMPLE_METHODS, RefitStatus, paired_resample_problems, refit_checked
from .runs import Runs, load_runs, share_base_r1
from .trust import sign_of, trusted_interval


@dataclass
class FitComparison:
    """phi of a probe sweep minus phi of its baseline, with a bootstrap interval.

    Two layouts:

    - the probe has r = 1 runs of its own: the sweeps are independent, and the difference of
      independent bootstrap draws (``phi_probe[b] - phi_base[b]``) samples the difference;
    - the probe has none (the study's truncated and hyperconnection sweeps): as in the study,
      the probe is fitted with the base's r = 1 runs (``shared_r1`` of them), and the bootstrap
      is paired: each resample draws the cells (or runs) of both sweeps at once, a shared r = 1
      cell entering both fits with the same count, so the correlation the shared runs create
      between the two phi is in the interval.
    """

    base: ScalingLawFit
    probe: ScalingLawFit
    delta_phi: float
    ci: tuple[float, float]
    samples: np.ndarray
    shared_r1: int = 0
    """Runs in both fits (the base's r = 1 runs a probe without any shares; 0: independent sweeps)."""
    bootstrap_method: str = ""
    profile: DeltaProfile | None = None
    """The profile-likelihood interval of delta from the joint fit (None: a fit has no phi profile)."""
    checks: RefitStatus | None = None
    """What the checks of the resample fits found (paired layout; None for stored draws)."""
    n_resamples: int = 0
    """Resamples drawn (``len(samples)`` is those kept after the fit checks)."""

    @property
    def verdict(self) -> dict[str, Any]:
        """Does the comparison decide, and which interval it trusts (:func:`comparison_verdict`)."""
        return comparison_verdict(self)

    def report(self) -> str:
        b, p = self.base.params["phi"], self.probe.params["phi"]
        verdict = "excludes 0" if sign_of(self.ci) else "includes 0"
        lines = [
            f"phi: base {b:.3f} {_fmt_ci(self.base.ci.get('phi'))}, probe {p:.3f} {_fmt_ci(self.probe.ci.get('phi'))}"
        ]
        if self.shared_r1 and self.probe.runs is not None and self.probe.runs.n_shared:
            lines.append(
                f"probe: r = 1 runs shared from the base ({self.shared_r1} runs); the probe sweep has none, so its "
                "phi is fitted against the base's r = 1 runs, as in the study"
            )
            how = f"paired {self.bootstrap_method} resamples: the shared r = 1 runs drawn once for both fits"
        elif self.shared_r1:
            lines.append(f"{self.shared_r1} runs are in both sweeps (same model, tokens, seed and loss)")
            how = (
                f"paired {self.bootstrap_method} resamples: the runs in both sweeps drawn once for both fits"
            )
        else:
            how = f"independent {self.bootstrap_method} resamples of the two sweeps".replace("  ", " ")
        lines.append(
            f"delta phi (probe - base) = {self.delta_phi:+.3f}, 95% bootstrap CI {interval(self.ci, '+.3f')} "
            f"({len(self.samples)} {how}; the interval {verdict})"
        )
        if self.checks is not None:
            lines.append(f"  fit checks: {self.checks.summary('resamples (pairs of fits)')}")
        if self.profile is not None:
            pv = "excludes 0" if sign_of(self.profile.interval) else "includes 0"
            lines.append(
                f"delta phi 95% profile-likelihood CI {interval(self.profile.interval, '+.3f')} (joint fit, probe phi = "
                f"base phi + delta, each sweep with its own E, A, alpha, B, beta; the interval {pv})"
            )
        lines.append(f"verdict: {self.verdict['line']}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "delta_phi": self.delta_phi,
            "ci": list(self.ci),
            "n_bootstrap": int(len(self.samples)),
            "n_resamples": int(self.n_resamples or len(self.samples)),
            "shared_r1": self.shared_r1,
            "paired": bool(self.shared_r1),
            "bootstrap_method": self.bootstrap_method,
            "bootstrap_checks": None if self.checks is None else self.checks.to_dict(),
            "profile": None if self.profile is None else self.profile.to_dict(),
            "verdict": self.verdict,
        }


def comparison_verdict(c: FitComparison) -> dict[str, Any]:
    """Whether the comparison decides the sign of delta phi, and which interval it trusts.

    Each 95% interval either excludes 0 (it decides a sign) or not; which of the two is followed
    when they differ is the one rule of :func:`~.trust.trusted_interval`, the fit report's too.
    """
    lo, hi = c.ci
    prof = None if c.profile is None else tuple(c.profile.interval)
    n, n_dropped = (None, None) if c.checks is None else (c.checks.n, c.checks.n_dropped)
    t = trusted_interval(prof, (lo, hi), sign_of, n_resamples=n, n_dropped=n_dropped)
    sign = int(t.answer or 0)
    out: dict[str, Any] = {"bootstrap": [lo, hi], "profile": None if prof is None else list(prof)}
    if prof is None:
        # The rule's own answer: the bootstrap, unless it is suspect (then nothing is trusted).
        out.update(decides=bool(sign), trusted=t.trusted, sign=sign)
        what = _SIGN_WORDS[sign] if sign else "no sign"
        why = "bootstrap only, no phi profiles" if t.trusted == "bootstrap" else t.why
        out["line"] = f"{'decides' if sign else 'does not decide'}: {what} ({why})"
        return out
    dropped = 0.0 if not n else (n_dropped or 0) / n
    out.update(decides=bool(sign), trusted=t.trusted, sign=sign, dropped_share=dropped)
    what = _SIGN_WORDS[sign] if sign else "0 is inside the trusted interval"
    out["line"] = f"{'decides' if sign else 'does not decide'}: {what} ({t.why})"
    return out


_SIGN_WORDS = {1: "delta phi > 0", -1: "delta phi < 0"}


def _fmt_ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else interval(ci, ".3f")


def _runs_of(x: Any, variant: str | None) -> Runs | None:
    """The runs behind a fit or a fit's input (``None`` for a fit stored without its runs)."""
    if isinstance(x, ScalingLawFit):
        return x.runs
    return load_runs(x, variant=variant)


def _run_keys(runs: Runs) -> list[tuple[float, ...]]:
    seed = runs.seed if runs.seed is not None else np.full(len(runs), np.nan)
    cols = (runs.n_once, runs.n_rec, runs.num_recurrences, runs.tokens, seed, runs.loss)
    return [tuple(-1.0 if math.isnan(v) else float(v) for v in row) for row in zip(*cols)]


def _match_rows(base: Runs, probe: Runs) -> np.ndarray:
    """For each probe run, the index of the same run (model, tokens, seed, loss) in ``base``; -1: none."""
    where = {k: i for i, k in enumerate(_run_keys(base))}
    return np.array([where.get(k, -1) for k in _run_keys(probe)], dtype=int)


def _paired_units(
    base: Runs, probe: Runs, match: np.ndarray, method: str
) -> tuple[np.ndarray, np.ndarray, str]:
    """Resampling units of both sweeps in one index space: (budget, r) cells (``"cell"``, when
    both have budgets) or runs; a shared run is in its base unit. Returns the unit of every
    base run, of every probe run, and the method used."""
    if method == "cell" and base.budget is not None and probe.budget is not None:
        kb: list[tuple[Any, ...]] = [("base", b, r) for b, r in zip(base.budget, base.num_recurrences)]
        kp = [
            kb[m] if m >= 0 else ("probe", b, r)
            for m, b, r in zip(match, probe.budget, probe.num_recurrences)
        ]
    else:
        method = "run"
        kb = [("base", i) for i in range(len(base))]
        kp = [kb[m] if m >= 0 else ("probe", j) for j, m in enumerate(match)]
    ids = {k: i for i, k in enumerate(dict.fromkeys(kb + kp))}
    return np.array([ids[k] for k in kb]), np.array([ids[k] for k in kp]), method


def _bootstrap_extra(fit: ScalingLawFit, data: LawData, seed: int) -> list[np.ndarray]:
    """Shared starts of a fit's resamples: its phi profile's valley (profiled here if missing)."""
    if fit.profile is None:
        residuals = data.log_l - law.predict_log_loss(fit.theta, data)[0]
        fit.profile = profile_phi(data, fit.theta, residuals, np.random.default_rng([seed, 2]))
    return fit.profile.valley()


def _paired_bootstrap(
    fb: ScalingLawFit, fp: ScalingLawFit, match: np.ndarray, method: BootstrapMethod, n: int, seed: int,
    n_starts: int = 16,
) -> tuple[np.ndarray, np.ndarray, str, RefitStatus, RefitStatus]:  # fmt: skip
    """Refit both sweeps on ``n`` joint resamples (see :class:`FitComparison`): the thetas of
    the base and of the probe, ``(n, 6)`` each, the method used and each sweep's fit checks."""
    assert fb.runs is not None and fp.runs is not None
    data_b, data_p = _law_data(fb.runs, True), _law_data(fp.runs, True)
    free = _free_mask(True)
    rng = np.random.default_rng([seed, 3])
    if method == "residual":
        units_b = units_p = None
        used = "residual"
    else:
        units_b, units_p, used = _paired_units(fb.runs, fp.runs, match, method)
    prob_b, prob_p = paired_resample_problems(
        used, n, rng, data_b, data_p, fb.theta, fp.theta, units_b, units_p, match, int(free.sum())
    )
    thetas, statuses = [], []
    for f, data, prob in ((fb, data_b, prob_b), (fp, data_p, prob_p)):
        th, _, status = refit_checked(
            data, prob, f.theta, free, rng, n_starts=n_starts, extra=_bootstrap_extra(f, data, seed)
        )
        thetas.append(th)
        statuses.append(status)
    return thetas[0], thetas[1], used, statuses[0], statuses[1]


def compare_fits(
    base: Any,
    probe: Any,
    *,
    bootstrap: int = 200,
    seed: int = 0,
    bootstrap_method: BootstrapMethod = "cell",
    base_variant: str | None = None,
    probe_variant: str | None = None,
) -> FitComparison:
    """phi(probe) - phi(base) with a 95% percentile bootstrap interval.

    ``base`` and ``probe`` are fits or anything :func:`fit_scaling_law` accepts (then fitted
    here, seeds ``seed`` and ``seed + 1``).

    A probe without r = 1 runs is fitted, as in the study, with the base's r = 1 runs
    (:func:`~looped_hf.scaling.runs.share_base_r1`; a probe fit made without them is refitted),
    and the bootstrap is paired: both sweeps are resampled at once and the shared runs keep one
    count in both fits. ``bootstrap`` resamples are drawn here; fits made here carry these paired
    draws as their own bootstrap. A probe with its own r = 1 runs is an independent sweep: its
    stored bootstrap draws (and the base's) are reused when there are at least ``bootstrap``.
    """
    if bootstrap < 2:
        raise ValueError("compare_fits needs bootstrap >= 2")
    if bootstrap_method not in RESAMPLE_METHODS:
        raise ValueError(f"bootstrap_method must be one of {RESAMPLE_METHODS}, got {bootstrap_method!r}")
    base_runs, probe_runs = _runs_of(base, base_variant), _runs_of(probe, probe_variant)
    if (
        base_runs is not None
        and probe_runs is not None
        and base_runs.kind == probe_runs.kind == "looped"
        and base_runs.non_looped.any()
        and not probe_runs.non_looped.any()
    ):
        probe = probe_runs = share_base_r1(probe_runs, base_runs, variant=probe_variant)
    match = (
        _match_rows(base_runs, probe_runs)
        if base_runs is not None and probe_runs is not None
        else np.zeros(0, int)
    )
    if (match >= 0).any():
        return _compare_paired(
            base, probe, match, bootstrap, seed, bootstrap_method, base_variant, probe_variant
        )

    def ensure(x: Any, s: int, variant: str | None) -> ScalingLawFit:
        if (
            isinstance(x, ScalingLawFit)
            and x.bootstrap_samples is not None
            and len(x.bootstrap_samples) >= bootstrap
        ):
            return x
        if isinstance(x, ScalingLawFit):
            if x.runs is None:
                raise ValueError("a fit without its runs and without bootstrap draws cannot be compared")
            x = x.runs
        # No restricted fits / holdout: the comparison only needs phi's bootstrap draws.
        return fit_scaling_law(
            x, bootstrap=bootstrap, seed=s, bootstrap_method=bootstrap_method, variant=variant, checks=False
        )

    fb = ensure(base, seed, base_variant)
    fp = ensure(probe, seed + 1, probe_variant)
    phis = [_compared_phi("base", fb), _compared_phi("probe", fp)]
    assert fb.bootstrap_samples is not None and fp.bootstrap_samples is not None
    n = min(len(fb.bootstrap_samples), len(fp.bootstrap_samples))
    diff = fp.bootstrap_samples[:n, law.PHI] - fb.bootstrap_samples[:n, law.PHI]
    methods = {
        f.settings.get("bootstrap_method_used", f.settings.get("bootstrap_method", "")) for f in (fb, fp)
    }
    n_runs = sum(len(f.runs) for f in (fb, fp) if f.runs is not None)
    return _comparison(fb, fp, phis, diff, bootstrap_method="/".join(sorted(str(m) for m in methods)),
                       n_resamples=n, profile=_delta_profile(fb, fp, n_runs))  # fmt: skip


def _comparison(
    fb: ScalingLawFit, fp: ScalingLawFit, phis: list[float], diff: np.ndarray, **extra: Any
) -> FitComparison:
    """The comparison from the two fitted phi and the bootstrap draws of their difference."""
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return FitComparison(base=fb, probe=fp, delta_phi=phis[1] - phis[0], ci=(float(lo), float(hi)), samples=diff,
                         **extra)  # fmt: skip


def _compared_phi(name: str, fit: ScalingLawFit) -> float:
    phi = fit.params["phi"]
    if phi is None or fit.fixed_phi is not None:
        raise ValueError(
            f"the {name} sweep has no fitted phi (not identifiable or fixed): nothing to compare"
        )
    return float(phi)


def _compare_paired(
    base: Any, probe: Any, match: np.ndarray, bootstrap: int, seed: int, method: BootstrapMethod,
    base_variant: str | None, probe_variant: str | None,
) -> FitComparison:  # fmt: skip
    """The comparison of a probe that shares runs with its base (see :class:`FitComparison`)."""
    fitted_here = []
    fits = []
    for x, s, variant in ((base, seed, base_variant), (probe, seed + 1, probe_variant)):
        if isinstance(x, ScalingLawFit):
            fits.append(x)
        else:
            fits.append(fit_scaling_law(x, seed=s, bootstrap_method=method, variant=variant, checks=False))
            fitted_here.append(fits[-1])
    fb, fp = fits
    phis = [_compared_phi("base", fb), _compared_phi("probe", fp)]
    with single_threaded_blas():
        th_b, th_p, used, st_b, st_p = _paired_bootstrap(fb, fp, match, method, bootstrap, seed)
    for f, th, st in ((fb, th_b, st_b), (fp, th_p, st_p)):
        if any(f is g for g in fitted_here):
            # The marginal of the joint resample is this sweep's bootstrap (its CIs, its verdict).
            _set_bootstrap(f, th, _free_mask(True), st)
            f.settings.update(bootstrap=bootstrap, bootstrap_method_used=f"paired {used}")
            f.diagnostics = diagnose(f)
    # A pair counts only when both of its fits passed; "refitted": pairs with either fit refitted.
    refitted = int(np.count_nonzero(_refitted_mask(st_b) | _refitted_mask(st_p)))
    status = st_b.combine(st_p, refitted)
    keep = ~status.failed
    assert fp.runs is not None and fb.runs is not None
    shared = int((match >= 0).sum())
    return _comparison(fb, fp, phis, th_p[keep, law.PHI] - th_b[keep, law.PHI], shared_r1=shared, bootstrap_method=used,
                       checks=status, n_resamples=bootstrap,
                       profile=_delta_profile(fb, fp, len(fb.runs) + len(fp.runs) - shared))  # fmt: skip


def _refitted_mask(status: RefitStatus) -> np.ndarray:
    return status.refitted_mask if status.refitted_mask is not None else np.zeros(status.n, bool)


def _delta_profile(fb: ScalingLawFit, fp: ScalingLawFit, n_runs: int) -> DeltaProfile | None:
    """The joint-fit profile interval of delta phi from the two fits' phi profiles (None without them)."""
    if fb.profile is None or fp.profile is None:
        return None
    return delta_profile(fb.profile, fp.profile, n_runs)
