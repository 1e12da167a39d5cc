"""Synthetic sweeps in the reference study's iso-depth design (for tests, benchmarks, validation).

Design (looped-method.md, section 3): effective depth 20 layer applications, width d = 64 s,
12 d^2 parameters per layer, r in {1, 2, 4, 8}, six budgets 4.64e17 .. 2.15e19 FLOPs, five widths
per budget (four at the largest): 29 runs per arch, 116 in all.

Parameter split (our documented convention):

- r > 1 (prelude 2 + block 16/r x r + coda 2, linear injection):
  ``n_once = 4 * 12 d^2``, ``n_rec = (16 / r) * 12 d^2 + 2 d^2`` (the adapter is recurrent).
- r = 1 (a plain 20-layer decoder, no injection): ``n_once = 20 * 12 d^2``, ``n_rec = 0``.
  Nothing is recurrent, and since ``1^phi = 1`` the split cannot change the fit anyway.

Tokens ``D = budget / flops_per_token`` with ``flops_per_token = 6 (n_once + r n_rec)``
(attention, embeddings and the head ignored: the synthetic law does not need them).
Noise is multiplicative: ``loss = L_true * exp(noise * z)``, z standard normal.
"""

from __future__ import annotations

import numpy as np

#: Ground truth: Chinchilla's refit (Besiroglu et al. 2024) and the study's phi.
TRUE_PARAMS: dict[str, float] = {
    "E": 1.817,
    "A": 482.01,
    "alpha": 0.3478,
    "B": 2085.43,
    "beta": 0.3658,
    "phi": 0.46,
}
BUDGETS: tuple[float, ...] = (4.64e17, 1.0e18, 2.15e18, 4.64e18, 1.0e19, 2.15e19)
RECURRENCES: tuple[int, ...] = (1, 2, 4, 8)
WIDTH_FACTORS: tuple[float, ...] = (0.55, 0.75, 1.0, 1.35, 1.8)


def split_params(d: int, r: int) -> tuple[float, float]:
    """``(n_once, n_rec)`` of the iso-depth model of width ``d`` at ``r`` recurrences."""
    layer = 12.0 * d * d
    if r == 1:
        return 20.0 * layer, 0.0
    return 4.0 * layer, (16.0 / r) * layer + 2.0 * d * d


def true_loss(params: dict[str, float], n_once: float, n_rec: float, r: float, tokens: float) -> float:
    n_eff = n_once + r ** params["phi"] * n_rec
    return params["E"] + params["A"] * n_eff ** -params["alpha"] + params["B"] * tokens ** -params["beta"]


def study_runs(
    *,
    params: dict[str, float] | None = None,
    noise: float = 0.005,
    seed: int = 0,
    recurrences: tuple[int, ...] = RECURRENCES,
    budgets: tuple[float, ...] = BUDGETS,
    variant: str | None = None,
) -> list[dict[str, object]]:
    """116 run records shaped like ``results.jsonl`` rows (for the default design)."""
    p = dict(TRUE_PARAMS if params is None else params)
    rng = np.random.default_rng(seed)
    runs: list[dict[str, object]] = []
    for k, budget in enumerate(budgets):
        # Widths bracket the 20-tokens-per-parameter optimum of a plain model at this budget.
        s_opt = np.sqrt(np.sqrt(budget / 120.0) / 240.0) / 64.0
        factors = WIDTH_FACTORS if k < len(budgets) - 1 else WIDTH_FACTORS[:4]
        widths = sorted({max(2, int(round(s_opt * f))) for f in factors})
        for r in recurrences:
            for s in widths:
                d = 64 * s
                n_once, n_rec = split_params(d, r)
                fpt = 6.0 * (n_once + r * n_rec)
                tokens = budget / fpt
                loss = true_loss(p, n_once, n_rec, r, tokens) * float(np.exp(noise * rng.standard_normal()))
                rec: dict[str, object] = {
                    "loss": loss,
                    "tokens": tokens,
                    "n_once": n_once,
                    "n_rec": n_rec,
                    "num_recurrences": r,
                    "train_flops": budget,
                    "budget": budget,
                    "arch": "noloop" if r == 1 else f"loop{r}",
                    "hidden_size": d,
                    "seed": 0,
                    "status": "ok",
                }
                if variant is not None:
                    rec["variant"] = variant
                runs.append(rec)
    return runs
