"""``looped-hf fit``: fit the looped scaling law to a sweep's results and report phi.

    looped-hf fit RESULTS [--bootstrap N] [--seed S] [--out fit.json] [--plots DIR]
                          [--compare PROBE_RESULTS] [--fix-phi X] [--variant NAME]
                          [--bootstrap-method cell|run|residual]

Prints the report, which ends its fit section with the identifiability verdict (is phi pinned
down, and if not, what to add to the sweep). With ``--compare``, a probe sweep without r = 1
runs (the study's truncated and hyperconnection probes) is fitted with the base's r = 1 runs,
as the study does; the phi difference gets a paired-bootstrap interval (every resample fit
checked, failures refitted or dropped and counted) and a profile-likelihood interval from the
joint fit, and a verdict that says whether the comparison decides and which interval it trusts.
numpy/scipy only: this command runs where torch and transformers are not installed. Bad input
(a ValueError naming row and column) exits with status 2 and writes nothing; ``--out`` is
written atomically (temp file + ``os.replace``) after the fit and plots succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..fileio import check_output_path, write_text_atomic
from .compare import compare_fits
from .fit import fit_scaling_law


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="looped-hf fit", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="results.jsonl (or .csv) of a sweep")
    p.add_argument("--bootstrap", type=int, default=0, metavar="N", help="bootstrap resamples (default 0)")
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of starts and resamples (default 0)"
    )
    p.add_argument("--out", type=Path, default=None, metavar="FIT_JSON", help="write the fit as JSON")
    p.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument(
        "--compare", default=None, metavar="PROBE_RESULTS", help="probe sweep: report phi(probe) - phi(base)"
    )
    p.add_argument(
        "--fix-phi", type=float, default=None, metavar="X", help="hold phi at X instead of fitting it"
    )
    p.add_argument("--variant", default=None, metavar="NAME", help="fit only runs of this variant")
    p.add_argument(
        "--bootstrap-method",
        choices=("cell", "run", "residual"),
        default="cell",
        help="resample (budget, r) cells, runs, or residuals on the fixed design (default cell)",
    )
    return p


def main(argv: list[str]) -> int:
    """Run ``looped-hf fit``; returns the exit status (0 ok, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        # Output paths first: an unwritable --out must cost seconds, not a finished fit.
        if args.out is not None:
            check_output_path(args.out, "--out")
        if args.plots is not None:
            check_output_path(args.plots, "--plots", directory=True)
        if args.compare is not None and args.bootstrap < 2:
            raise ValueError("--compare needs --bootstrap N (N >= 2) for the interval of the phi difference")
        fit = fit_scaling_law(
            args.results,
            bootstrap=args.bootstrap,
            seed=args.seed,
            fix_phi=args.fix_phi,
            variant=args.variant,
            bootstrap_method=args.bootstrap_method,
        )
        comparison = None
        if args.compare is not None:
            # A probe without r = 1 runs is fitted with the base's (the study's probe fit).
            comparison = compare_fits(
                fit,
                args.compare,
                bootstrap=args.bootstrap,
                seed=args.seed,
                bootstrap_method=args.bootstrap_method,
                probe_variant=args.variant,
            )
    except ValueError as exc:
        print(f"looped-hf fit: error: {exc}", file=sys.stderr)
        return 2

    print(fit.report(), end="")
    if comparison is not None:
        print(f"\ncomparison with {args.compare}:")
        print(comparison.report())
    # Both were checked before the fit, but a disk can fill or a folder vanish meanwhile.
    flag = "--plots"
    try:
        if args.plots is not None:
            from looped_hf.plotting import plot_fit  # matplotlib only when plots are asked for

            for path in plot_fit(fit, args.plots):
                print(f"wrote {path}")
        if args.out is not None:
            flag = "--out"
            obj = fit.to_dict()
            if comparison is not None:
                obj["comparison"] = {
                    "probe_results": str(args.compare),
                    **comparison.to_dict(),
                    "probe": comparison.probe.to_dict(),
                }
            write_text_atomic(args.out, json.dumps(obj, indent=2))
    except OSError as err:
        where = args.plots if flag == "--plots" else args.out
        print(f"looped-hf fit: error: {flag} {where}: cannot be written ({err.strerror or err})", file=sys.stderr)
        return 2
    if args.out is not None:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
