"""Fit the looped scaling law ``L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta``.

numpy/scipy only (pandas optional): importing this package never imports torch or transformers.

>>> from looped_hf.scaling import fit_scaling_law
>>> fit = fit_scaling_law("sweep/results.jsonl", bootstrap=200, seed=0)  # doctest: +SKIP
>>> fit.params["phi"], fit.ci["phi"]  # doctest: +SKIP
"""

from .data import Runs, load_chinchilla_svg, load_runs
from .fit import FitComparison, ScalingLawFit, compare_fits, fit_scaling_law

__all__ = [
    "FitComparison",
    "Runs",
    "ScalingLawFit",
    "compare_fits",
    "fit_scaling_law",
    "load_chinchilla_svg",
    "load_runs",
]
