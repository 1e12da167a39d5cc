"""Fit the looped scaling law ``L = E + A (N_once + r^phi N_rec)^-alpha + B D^-beta``.

numpy/scipy only (pandas optional): no module of this package imports torch or transformers, so it
runs where they are not installed (``looped_hf/__init__.py`` imports them only where they are).

>>> from looped_hf.scaling import fit_scaling_law
>>> fit = fit_scaling_law("sweep/results.jsonl", bootstrap=200, seed=0)  # doctest: +SKIP
>>> fit.params["phi"], fit.ci["phi"], fit.profile.interval  # doctest: +SKIP
>>> fit.diagnostics["verdict"]["line"]  # doctest: +SKIP
'phi is identified: 0.46, 95% CI profile [0.42, 0.51], bootstrap [0.41, 0.53].'
"""

from .compare import FitComparison, compare_fits
from .diagnose import diagnose
from .fit import fit_scaling_law, rebootstrap
from .result import ScalingLawFit
from .runs import Runs, load_chinchilla_svg, load_runs

__all__ = [
    "FitComparison",
    "Runs",
    "ScalingLawFit",
    "compare_fits",
    "diagnose",
    "fit_scaling_law",
    "load_chinchilla_svg",
    "load_runs",
    "rebootstrap",
]
