"""Synthetic sweeps with a known law (for tests, benchmarks and the coverage validation).

Two designs, each a fixed list of (budget, width, r) cells with the parameter split and the
training FLOPs per token of the iso-depth model at that cell:

- :data:`STUDY` -- the reference study's design (looped-method.md, section 3): effective depth 20,
  d = 64 s, r in {1, 2, 4, 8}, six budgets 4.64e17 .. 2.15e19 FLOPs, five widths per budget (four
  at the largest) that bracket the compute-optimal size of a Chinchilla-like law: 116 runs. FLOPs
  per token ``6 (n_once + r n_rec)`` (at these widths attention and the head are a few percent).
- :data:`TINY_V0` -- the first CPU demo sweep (``recipes/iso_depth_tiny.yaml`` as committed in
  v0.1: effective depth 12 = prelude 2 + block 8/r + coda 2, widths 32..96, budgets 1.25e11 /
  3e11 / 7.5e11, byte vocabulary 256 + 2 specials, 64-token rows): 36 runs. At these widths the
  head and attention are 30% of the FLOPs, so they are counted as the model does
  (``6 N_applied + 6 V d + 12 L_eff d T``). Every width is far above the compute-optimal size:
  the design that leaves phi weakly identified.

Parameter split (the documented convention, norm scales ignored: within 1% of the counts the
model reports): a layer is ``12 d^2``; r = 1 is a plain decoder with everything in ``n_rec``
(``1^phi = 1``, so the split cannot change the fit); r > 1 has ``n_once`` = prelude + coda layers
and ``n_rec`` = block layers + the ``2 d^2`` linear injection adapter.

Tokens ``D = budget / flops_per_token``; noise is multiplicative, ``loss = L_true exp(noise z)``.
:func:`sample_truth` draws a random law for a design: the coverage validation
(``scripts/validate_phi_coverage.py``) fits many such sweeps and counts how often the interval
covers the truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .law import effective_params, natural_loss

#: Ground truth of the default study sweep: Chinchilla's refit (Besiroglu et al. 2024) and the
#: study's phi.
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


@dataclass(frozen=True)
class Cell:
    """One planned run: its budget, width, r, parameter split and FLOPs per token."""

    budget: float
    width: int
    r: int
    n_once: float
    n_rec: float
    flops_per_token: float


@dataclass(frozen=True)
class Design:
    """A sweep design and the prior :func:`sample_truth` draws its random laws from.

    The prior fixes the *share* of each term at the design's median run rather than A and B
    themselves: ``A N_ref^-alpha`` (the capacity term) and ``B D_ref^-beta`` (the data term) are
    drawn in ``capacity`` and ``data``, so a draw is a law under which the design is as (badly)
    placed as intended.
    """

    name: str
    cells: tuple[Cell, ...]
    noise: float
    E: tuple[float, float]
    alpha: tuple[float, float]
    beta: tuple[float, float]
    capacity: tuple[float, float]
    data: tuple[float, float]
    phi: tuple[float, float] = (0.0, 1.0)

    def reference(self) -> tuple[float, float]:
        """Median unique parameters and median tokens of the design (where the prior is set)."""
        n = np.array([c.n_once + c.n_rec for c in self.cells])
        d = np.array([c.budget / c.flops_per_token for c in self.cells])
        return float(np.median(n)), float(np.median(d))


def split_params(d: int, r: int) -> tuple[float, float]:
    """``(n_once, n_rec)`` of the study's iso-depth model (depth 20) of width ``d`` at ``r``."""
    layer = 12.0 * d * d
    if r == 1:
        return 20.0 * layer, 0.0
    return 4.0 * layer, (16.0 / r) * layer + 2.0 * d * d


def training_flops_per_param(r: int, truncated: bool = False) -> float:
    """FLOPs per token per recurrent parameter: ``6 r``, or with truncated backprop (the last
    ``k = ceil(r / 2)`` recurrences with gradient) ``2 (r - k) + 6 k`` (a no-grad pass costs 2)."""
    if not truncated:
        return 6.0 * r
    k = -(-r // 2)
    return 2.0 * (r - k) + 6.0 * k


def _study_cells(
    budgets: tuple[float, ...],
    recurrences: tuple[int, ...],
    width_factors: tuple[float, ...] = WIDTH_FACTORS,
    truncated: bool = False,
    last_widths: int | None = 4,
) -> tuple[Cell, ...]:
    cells = []
    for k, budget in enumerate(budgets):
        # Widths bracket the 20-tokens-per-parameter optimum of a plain model at this budget.
        s_opt = np.sqrt(np.sqrt(budget / 120.0) / 240.0) / 64.0
        factors = width_factors if k < len(budgets) - 1 else width_factors[:last_widths]
        widths = sorted({max(2, int(round(s_opt * f))) for f in factors})
        for r in recurrences:
            for s in widths:
                n_once, n_rec = split_params(64 * s, r)
                fpt = 6.0 * n_once + training_flops_per_param(r, truncated) * n_rec
                cells.append(Cell(budget, 64 * s, r, n_once, n_rec, fpt))
    return tuple(cells)


def _tiny_v0_cells() -> tuple[Cell, ...]:
    vocab, seq_len, depth = 258, 64, 12  # bytes + 2 specials; 64-token rows; effective depth
    widths = {1.25e11: (32, 48, 64), 3.0e11: (48, 64, 80), 7.5e11: (64, 80, 96)}
    cells = []
    for budget, ws in widths.items():
        for d in ws:
            for r in RECURRENCES:
                layer = 12.0 * d * d
                n_once, n_rec = (0.0, depth * layer) if r == 1 else (4 * layer, (8 / r) * layer + 2.0 * d * d)
                # 6 per applied parameter, the untied head, attention 12 d T per layer application.
                fpt = 6.0 * (n_once + r * n_rec) + 6.0 * vocab * d + 12.0 * depth * d * seq_len
                cells.append(Cell(budget, d, r, n_once, n_rec, fpt))
    return tuple(cells)


#: The reference study's 116-run design; the prior is centred on Chinchilla's law (capacity term
#: 0.86, data term 0.68 at the median run), whose compute-optimal sizes these widths bracket.
STUDY = Design(
    name="study",
    cells=_study_cells(BUDGETS, RECURRENCES),
    noise=0.005,
    E=(1.6, 2.0),
    alpha=(0.28, 0.42),
    beta=(0.28, 0.42),
    capacity=(0.6, 1.1),
    data=(0.5, 0.9),
)

#: The v0.1 CPU demo's 36-run design. Prior: wide enough to hold the law fitted to the committed
#: runs (E 0.05 on its bound, alpha 0.29, beta 0.12, at the median run a capacity term of 0.24 and
#: a data term of 2.0), i.e. byte-level losses of 2 .. 3 nats that are mostly the data term, with
#: slow data scaling; noise 0.7% (the committed fit's RMS residual, 0.63%, times sqrt(n / (n - 6))).
TINY_V0 = Design(
    name="tiny_v0",
    cells=_tiny_v0_cells(),
    noise=0.007,
    E=(0.05, 1.0),
    alpha=(0.2, 0.45),
    beta=(0.1, 0.35),
    capacity=(0.15, 0.4),
    data=(1.0, 2.0),
)

DESIGNS: dict[str, Design] = {d.name: d for d in (STUDY, TINY_V0)}


def true_loss(params: dict[str, float], n_once: float, n_rec: float, r: float, tokens: float) -> float:
    """``E + A (n_once + r^phi n_rec)^-alpha + B tokens^-beta``."""
    return natural_loss(params, effective_params(n_once, n_rec, r, params["phi"]), tokens)


def sample_truth(design: Design, rng: np.random.Generator) -> dict[str, float]:
    """A random law from ``design``'s prior (uniform in each range; see :class:`Design`)."""
    n_ref, d_ref = design.reference()
    alpha, beta = rng.uniform(*design.alpha), rng.uniform(*design.beta)
    return {
        "E": float(rng.uniform(*design.E)),
        "A": float(rng.uniform(*design.capacity) * n_ref**alpha),
        "alpha": float(alpha),
        "B": float(rng.uniform(*design.data) * d_ref**beta),
        "beta": float(beta),
        "phi": float(rng.uniform(*design.phi)),
    }


def design_runs(
    design: Design,
    params: dict[str, float],
    *,
    noise: float | None = None,
    seed: int = 0,
    variant: str | None = None,
) -> list[dict[str, object]]:
    """Run records shaped like ``results.jsonl`` rows for every cell of ``design``.

    Args:
        design: the cells to run.
        params: the true law (``E, A, alpha, B, beta, phi``).
        noise: multiplicative noise (standard deviation of ``log loss``); default the design's.
        seed: seeds the noise.
        variant: written into each record when given.
    """
    rng = np.random.default_rng(seed)
    sigma = design.noise if noise is None else noise
    runs: list[dict[str, object]] = []
    for c in design.cells:
        tokens = c.budget / c.flops_per_token
        loss = true_loss(params, c.n_once, c.n_rec, c.r, tokens) * float(
            np.exp(sigma * rng.standard_normal())
        )
        rec: dict[str, object] = {
            "loss": loss,
            "tokens": tokens,
            "n_once": c.n_once,
            "n_rec": c.n_rec,
            "num_recurrences": c.r,
            "train_flops": c.budget,
            "budget": c.budget,
            "arch": "base" if c.r == 1 else f"loop{c.r}",  # as looped_hf.train.arch_name names them
            "hidden_size": c.width,
            "seed": 0,
            "status": "ok",
        }
        if variant is not None:
            rec["variant"] = variant
        runs.append(rec)
    return runs


def study_runs(
    *,
    params: dict[str, float] | None = None,
    noise: float = 0.005,
    seed: int = 0,
    recurrences: tuple[int, ...] = RECURRENCES,
    budgets: tuple[float, ...] = BUDGETS,
    width_factors: tuple[float, ...] = WIDTH_FACTORS,
    variant: str | None = None,
    truncated: bool = False,
) -> list[dict[str, object]]:
    """The study's design (116 runs for the defaults) under ``params`` (default :data:`TRUE_PARAMS`).

    ``width_factors``: the widths of a budget as multiples of the compute-optimal width of a
    plain model (20 tokens per parameter); the last budget uses the first four. Records are
    ordered budget, then r, then width. ``truncated``: the FLOPs per token of truncated backprop
    (:func:`training_flops_per_param`), so each run trains on more tokens at its budget, as in the
    study's truncated probe (``recurrences=(2, 4, 8)``, ``variant="truncated"``).
    """
    cells = _study_cells(budgets, recurrences, width_factors, truncated)
    custom = Design("study", cells, noise, *([(0.0, 0.0)] * 5))
    return design_runs(custom, dict(TRUE_PARAMS if params is None else params), seed=seed, variant=variant)


def tiny_v0_runs(
    *, params: dict[str, float] | None = None, noise: float | None = None, seed: int = 0
) -> list[dict[str, object]]:
    """The v0.1 demo design (36 runs) under ``params`` (default: a draw from its prior, seed 0)."""
    p = sample_truth(TINY_V0, np.random.default_rng(0)) if params is None else params
    return design_runs(TINY_V0, p, noise=noise, seed=seed)


#: The study's truncated-backprop probe as a synthetic design: 4 budgets, r in {2, 4, 8}, six
#: widths per budget (one wider than the base sweep's), 72 cells of which :func:`probe_runs`
#: drops some at random (the study's probe has 61 of its 69 runs).
PROBE_BUDGETS: tuple[float, ...] = BUDGETS[:4]
PROBE_WIDTH_FACTORS: tuple[float, ...] = (0.55, 0.75, 1.0, 1.35, 1.8, 2.4)


def probe_runs(
    *,
    params: dict[str, float] | None = None,
    phi: float = 0.35,
    noise_nats: float = 0.001,
    missing: int = 8,
    seed: int = 0,
    variant: str = "truncated",
) -> list[dict[str, object]]:
    """A truncated-backprop probe shaped like the study's: no r = 1 runs, r in {2, 4, 8} over
    :data:`PROBE_BUDGETS`, the FLOPs per token of truncated backprop, ``missing`` runs dropped
    at random, additive loss noise of ``noise_nats`` (the study's IsoFLOP losses scatter by
    0.0004-0.002 nats). The law is ``params`` (default :data:`TRUE_PARAMS`) with phi ``phi``.
    """
    rng = np.random.default_rng([seed, 7])
    cells = _study_cells(PROBE_BUDGETS, (2, 4, 8), PROBE_WIDTH_FACTORS, truncated=True, last_widths=None)
    keep = np.sort(rng.choice(len(cells), size=len(cells) - missing, replace=False))
    design = Design("probe", tuple(cells[i] for i in keep), 0.0, *([(0.0, 0.0)] * 5))
    law = {**(TRUE_PARAMS if params is None else params), "phi": phi}
    runs = design_runs(design, law, noise=0.0, seed=seed, variant=variant)
    for rec in runs:
        rec["loss"] = float(rec["loss"]) + noise_nats * float(rng.standard_normal())  # type: ignore[arg-type]
    return runs


def base_runs_nats(
    *, params: dict[str, float] | None = None, noise_nats: float = 0.001, seed: int = 0, variant: str = "base"
) -> list[dict[str, object]]:
    """The study's 116-run base sweep (:func:`study_runs`) with additive loss noise in nats."""
    rng = np.random.default_rng([seed, 8])
    runs = study_runs(params=params, noise=0.0, seed=seed, variant=variant)
    for rec in runs:
        rec["loss"] = float(rec["loss"]) + noise_nats * float(rng.standard_normal())  # type: ignore[arg-type]
    return runs
