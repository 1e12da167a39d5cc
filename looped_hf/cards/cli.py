"""``looped-hf card SWEEP_DIR``: fit (or read a fit) and write the sweep's card."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looped_hf.fileio import check_output_path

from .common import FIT_NAME, PLOTS_DIR, _ci
from .sweep import ISOFLOP_STYLES, best_run, write_sweep_card


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="looped-hf card", description="Write a sweep's model card: phi with its CI, plots, runs."
    )
    p.add_argument("sweep_dir", help="sweep directory (holds results.jsonl and sweep.yaml)")
    p.add_argument(
        "--fit", default=None, metavar="FIT_JSON", help="a fit from `looped-hf fit --out` (default: fit now)"
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=200,
        metavar="N",
        help="bootstrap resamples when fitting here (default 200)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed when fitting here (default 0)")
    p.add_argument("--out", default=None, metavar="DIR", help="card folder (default: SWEEP_DIR/card)")
    p.add_argument(
        "--license", default="apache-2.0", help="license id in the card metadata (default apache-2.0)"
    )
    p.add_argument(
        "--isoflop-style",
        choices=ISOFLOP_STYLES,
        default="law",
        help="isoflop.png: 'law' (a panel per budget, loss vs N_eff with the law; default) or 'study' "
        "(the paper's figure: loss vs unique parameters, colour = budget, line style = r)",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="TITLE=FIT_JSON",
        help="a probe's fit (`looped-hf fit --out`) drawn as one more panel of the study-style figure "
        "(implies --isoflop-style study; repeatable), e.g. 'truncated backprop=runs/trunc/fit.json'",
    )
    return p


def _compare_fits(specs: list[str]) -> dict:
    """``TITLE=FIT_JSON`` entries -> {title: fit}; a malformed entry or missing file names itself."""
    from looped_hf.scaling import ScalingLawFit

    out = {}
    for spec in specs:
        title, sep, path = spec.partition("=")
        if not sep or not title.strip() or not path:
            raise ValueError(f"--compare {spec!r}: expected TITLE=FIT_JSON")
        if not Path(path).is_file():
            raise FileNotFoundError(f"--compare {spec!r}: no such file {path}")
        out[title.strip()] = ScalingLawFit.from_json(path)
    return out


def main(argv: list[str] | None = None) -> int:
    """``looped-hf card``; returns 0, or 2 on bad input (message names the file)."""
    args = _parser().parse_args(argv)
    from looped_hf.scaling import ScalingLawFit, fit_scaling_law
    from looped_hf.sweep import RESULTS_NAME, read_jsonl

    sweep = Path(args.sweep_dir)
    out = Path(args.out) if args.out else sweep / "card"
    try:
        if sweep.is_dir():  # else the results check below names the missing sweep
            check_output_path(out, "--out", directory=True)  # before a fit of minutes, not after
        if args.fit is not None:
            if not Path(args.fit).is_file():
                raise FileNotFoundError(f"--fit {args.fit}: no such file")
            fit = ScalingLawFit.from_json(args.fit)
        else:
            print(
                f"[card] fitting {sweep / RESULTS_NAME} with {args.bootstrap} bootstrap resamples ...",
                flush=True,
            )
            fit = fit_scaling_law(sweep / RESULTS_NAME, bootstrap=args.bootstrap, seed=args.seed)
        best = best_run(read_jsonl(sweep / RESULTS_NAME))
        where = (f"Publish it with `looped-hf publish {sweep / str(best['run_id'])} --repo-id ORG/NAME`."
                 if best is not None else "")  # fmt: skip
        compare = _compare_fits(args.compare)
        style = "study" if compare else args.isoflop_style
        path = write_sweep_card(sweep, fit, out, best=best, best_where=where, license=args.license,
                                isoflop_style=style, compare=compare or None)  # fmt: skip
    except (FileNotFoundError, ValueError) as err:
        print(f"looped-hf card: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # checked before the fit, but a disk can fill or a folder vanish meanwhile
        print(f"looped-hf card: error: --out {out}: cannot be written ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"[card] wrote {path} (+ {PLOTS_DIR}/, {FIT_NAME})")
    phi = fit.params.get("phi")
    if phi is not None:
        print(f"phi = {phi:.3f}" + (f"  95% CI {_ci(fit.ci['phi'])}" if fit.ci.get("phi") else ""))
    return 0
