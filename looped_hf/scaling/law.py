"""The looped scaling law, its fitting objective and the objective's analytic gradient.

The law (Schwethelm et al. 2026, "How Much Is One Recurrence Worth?")::

    L(N_once, N_rec, r, D) = E + A * N_eff^(-alpha) + B * D^(-beta),   N_eff = N_once + r^phi * N_rec

With ``N_rec = 0`` (or ``r = 1``) it is the Chinchilla form ``E + A N^-alpha + B D^-beta``
(Hoffmann et al. 2022, Approach 3).

Parametrisation. As in Chinchilla Approach 3 we fit in log space with ``a = log A``,
``b = log B``, ``e = log E``, so every term is an exponential and the prediction is a
log-sum-exp::

    log L_hat = LSE(u1, u2, u3),  u1 = a - alpha * log N_eff,  u2 = b - beta * log D,  u3 = e

and the residual of run i is ``rho_i = log L_i - log L_hat_i``. The objective is the Huber loss
(delta = 1e-3) of the residuals, SUMMED over runs (weights ``w_i`` are bootstrap counts)::

    f(theta) = sum_i w_i * H_delta(rho_i),   H(x) = x^2/2 if |x| <= delta else delta(|x| - delta/2)

Why a sum: the residuals are ~1e-2, so a mean makes the objective ~1e-6 and L-BFGS's gradient
test passes at the starting point (the known "stops after one step" pitfall).

Gradient. With softmax weights ``s_k = exp(u_k - LSE)`` (the share of each term in L_hat),
``dLSE/du_k = s_k`` and ``H'(x) = clip(x, -delta, delta)``, so with ``g_i = -w_i H'(rho_i)``::

    df/da     = sum g s1          df/dalpha = -sum g s1 log N_eff
    df/db     = sum g s2          df/dbeta  = -sum g s2 log D
    df/de     = sum g s3
    df/dphi   = -alpha * sum g s1 dlogN_eff/dphi,  dlogN_eff/dphi = log(r) r^phi N_rec / N_eff

Everything here is vectorised over a batch of parameter vectors (shape ``(S, 6)``) so that
hundreds of starts are screened in one numpy call; the per-start L-BFGS-B polish uses the same
function with ``S = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Parameter order of the internal vector ``theta``.
PARAM_NAMES: tuple[str, ...] = ("a", "alpha", "b", "beta", "e", "phi")
#: Parameter order of the natural vectors (a fit's ``bootstrap_samples``, the planner's sets).
NATURAL_NAMES: tuple[str, ...] = ("E", "A", "alpha", "B", "beta", "phi")
#: Where phi sits in ``theta`` (and, by the same position, in the natural vectors).
PHI = PARAM_NAMES.index("phi")
assert NATURAL_NAMES.index("phi") == PHI


def effective_params(n_once: Any, n_rec: Any, r: Any, phi: Any) -> Any:
    """``N_eff = N_once + r^phi N_rec``: the size of the non-looped model the law says performs
    alike. ``phi`` None (a plain fit) counts every parameter once. Broadcasts like numpy."""
    if phi is None:
        return np.add(n_once, n_rec)
    return np.add(n_once, np.power(np.asarray(r, float), phi) * np.asarray(n_rec, float))


def natural_loss(params: Any, n_eff: Any, tokens: Any) -> Any:
    """The law's loss ``E + A n_eff^-alpha + B tokens^-beta`` from the user's parameters
    (``params["E"]``, ...; see :func:`effective_params` for ``n_eff``). Broadcasts like numpy."""
    return params["E"] + params["A"] * n_eff ** -params["alpha"] + params["B"] * tokens ** -params["beta"]


#: Bounds of the start box and of L-BFGS-B (the study's appendix: a, b in [-5, 35],
#: alpha, beta in [0, 2.5], e in [-3, 2], phi in [-3, 3]).
BOUNDS: tuple[tuple[float, float], ...] = (
    (-5.0, 35.0),
    (0.0, 2.5),
    (-5.0, 35.0),
    (0.0, 2.5),
    (-3.0, 2.0),
    (-3.0, 3.0),
)

HUBER_DELTA = 1e-3


@dataclass(frozen=True)
class LawData:
    """The arrays the objective needs, precomputed once per data set.

    ``log_r`` is 0 and ``n_rec`` is 0 for plain (Chinchilla-form) data, which makes
    ``N_eff = n_once`` and the phi-gradient exactly zero.
    """

    n_once: np.ndarray
    n_rec: np.ndarray
    log_r: np.ndarray
    log_d: np.ndarray
    log_l: np.ndarray

    @property
    def n(self) -> int:
        """Number of runs (``log_l`` may carry one row of losses per problem: ``(S, n)``)."""
        return int(self.log_l.shape[-1])


def log_n_eff(data: LawData, phi: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """``log N_eff`` and ``d log N_eff / d phi`` for each phi (shape ``(S, n)``)."""
    phi = np.asarray(phi, dtype=float).reshape(-1, 1)
    r_phi_rec = np.exp(phi * data.log_r) * data.n_rec  # r^phi * N_rec
    n_eff = data.n_once + r_phi_rec
    return np.log(n_eff), data.log_r * r_phi_rec / n_eff


def predict_log_loss(theta: np.ndarray, data: LawData) -> np.ndarray:
    """``log L_hat`` for parameter vectors ``theta`` (``(6,)`` or ``(S, 6)``) -> ``(S, n)``."""
    theta = np.atleast_2d(theta)
    lne, _ = log_n_eff(data, theta[:, PHI])
    u1 = theta[:, [0]] - theta[:, [1]] * lne
    u2 = theta[:, [2]] - theta[:, [3]] * data.log_d
    u3 = np.broadcast_to(theta[:, [4]], u1.shape)
    return np.logaddexp(np.logaddexp(u1, u2), u3)


def objective(
    theta: np.ndarray, data: LawData, weights: np.ndarray | None = None, delta: float = HUBER_DELTA
) -> tuple[np.ndarray, np.ndarray]:
    """Summed Huber objective and its analytic gradient, batched over starts.

    Args:
        theta: ``(S, 6)`` parameter vectors in :data:`PARAM_NAMES` order.
        data: the precomputed arrays.
        weights: per-run weights (bootstrap counts); ``None`` means all ones.
        delta: Huber threshold on the log residual.

    Returns:
        ``f`` of shape ``(S,)`` and ``grad`` of shape ``(S, 6)``.
    """
    theta = np.atleast_2d(np.asarray(theta, dtype=float))
    lne, dlne = log_n_eff(data, theta[:, PHI])
    u1 = theta[:, [0]] - theta[:, [1]] * lne
    u2 = theta[:, [2]] - theta[:, [3]] * data.log_d
    u3 = theta[:, [4]]
    # Stable LSE: subtract the running max before exponentiating.
    m = np.maximum(np.maximum(u1, u2), u3)
    e1, e2, e3 = np.exp(u1 - m), np.exp(u2 - m), np.exp(u3 - m)
    tot = e1 + e2 + e3
    rho = data.log_l - (m + np.log(tot))
    arho = np.abs(rho)
    h = np.where(arho <= delta, 0.5 * rho * rho, delta * (arho - 0.5 * delta))
    g = -np.clip(rho, -delta, delta) / tot  # -H'(rho) / sum(exp), softmax folded in below
    if weights is not None:
        h = h * weights
        g = g * weights
    g1, g2, g3 = g * e1, g * e2, g * e3
    grad = np.empty_like(theta)
    grad[:, 0] = g1.sum(axis=1)
    grad[:, 1] = -(g1 * lne).sum(axis=1)
    grad[:, 2] = g2.sum(axis=1)
    grad[:, 3] = -(g2 * data.log_d).sum(axis=1)
    grad[:, 4] = g3.sum(axis=1)
    grad[:, PHI] = -theta[:, 1] * (g1 * dlne).sum(axis=1)
    return h.sum(axis=1), grad


def objective_single(
    theta: np.ndarray, data: LawData, weights: np.ndarray | None = None, delta: float = HUBER_DELTA
) -> tuple[float, np.ndarray]:
    """:func:`objective` for one parameter vector, with fewer numpy calls (the L-BFGS-B polish
    calls it ~100 times per start, and at 116 runs numpy's per-call overhead dominates).

    Uses ``H(rho) = c (rho - c/2)`` with ``c = clip(rho, -delta, delta)``, which equals both
    branches of the Huber loss, and one matrix-vector product for the six gradient sums.
    """
    alpha = float(theta[1])
    lne, dlne, e1, e2, e3, tot, rho = lse_terms(*(float(x) for x in theta), data)
    c = np.clip(rho, -delta, delta)
    h = c * (rho - 0.5 * c)
    g = -c / tot
    if weights is not None:
        h = h * weights
        g = g * weights
    rows = np.stack((e1, -e1 * lne, e2, -e2 * data.log_d, e3, -alpha * e1 * dlne))
    return float(h.sum()), rows @ g


def lse_terms(a, alpha, b, beta, e, phi, data: LawData) -> tuple[np.ndarray, ...]:
    """The law's forward pass, shared by the objectives and the batched Jacobian.

    ``a .. phi`` are floats (one parameter vector) or ``(S, 1)`` columns (S vectors at once).
    Returns ``log N_eff``, ``d log N_eff / d phi``, the three max-shifted LSE terms ``e1, e2, e3``
    (model, data, irreducible), their sum ``tot`` and the residual ``rho = log L - log L_hat``.
    """
    r_phi_rec = np.exp(phi * data.log_r) * data.n_rec  # r^phi * N_rec
    n_eff = data.n_once + r_phi_rec
    lne = np.log(n_eff)
    u1 = a - alpha * lne
    u2 = b - beta * data.log_d
    m = np.maximum(np.maximum(u1, u2), e)  # stable LSE: subtract the running max
    e1, e2, e3 = np.exp(u1 - m), np.exp(u2 - m), np.exp(e - m)
    tot = e1 + e2 + e3
    return lne, data.log_r * r_phi_rec / n_eff, e1, e2, e3, tot, data.log_l - m - np.log(tot)


def objective_value(theta: np.ndarray, data: LawData, weights: np.ndarray | None = None) -> np.ndarray:
    """Objective only (for screening many starts)."""
    return objective(theta, data, weights)[0]


def to_natural(theta: np.ndarray, phi_identifiable: bool = True) -> dict[str, float | None]:
    """Internal vector -> the user's parameters ``E, A, alpha, B, beta, phi``."""
    a, alpha, b, beta, e, phi = (float(x) for x in theta)
    return {
        "E": float(np.exp(e)),
        "A": float(np.exp(a)),
        "alpha": alpha,
        "B": float(np.exp(b)),
        "beta": beta,
        "phi": phi if phi_identifiable else None,
    }


def from_natural(params: dict[str, float | None]) -> np.ndarray:
    """The user's parameters -> internal vector (phi ``None`` is stored as 0: it is inert)."""
    phi = params.get("phi")
    return np.array(
        [
            np.log(params["A"]),
            params["alpha"],
            np.log(params["B"]),
            params["beta"],
            np.log(params["E"]),
            0.0 if phi is None else phi,
        ],
        dtype=float,
    )
