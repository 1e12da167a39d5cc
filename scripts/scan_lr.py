"""Learning-rate scan for a sweep recipe: train chosen cells of its plan at several lrs, print a table.

Before a sweep, check that its learning rate is near the optimum of each architecture: at small
scale the lr moves the loss more than the width does, and a phi fitted over runs at a poor lr
measures the lr, not the loop. Every cell is trained exactly as the sweep would train it (the
plan's own per-run recipe; only `learning_rate` and the output directory change).

    python scripts/scan_lr.py recipes/iso_depth_tiny.yaml --budget 1 --widths 12 --recurrences 1 8 \
        --lrs 0.01 0.03 --out runs/lr_scan

Writes `<out>/scan.jsonl` (one record per run, appended, so a rerun skips what is done) and prints
loss by (r, width) x lr with the best lr of each row marked. AdamW / Muon recipes only (muonh's lrs
come from HyperP).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from looped_hf.arguments import parse_recipe
from looped_hf.sweep import append_jsonl, make_plan, read_jsonl
from looped_hf.train import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="sweep recipe (YAML with a sweep: section)")
    parser.add_argument("--budget", type=int, default=0, help="index into sweep.budgets (default 0)")
    parser.add_argument("--widths", type=int, nargs="+", help="widths of that budget to scan (default: all)")
    parser.add_argument("--recurrences", type=int, nargs="+", help="values of r to scan (default: all)")
    parser.add_argument("--lrs", type=float, nargs="+", required=True, help="learning rates to try")
    parser.add_argument("--out", default="runs/lr_scan", help="scan directory (default runs/lr_scan)")
    args = parser.parse_args(argv)

    plan = make_plan(args.recipe)
    if plan.base_recipe.get("optimizer") == "muonh":
        parser.error("optimizer muonh: its lrs are HyperP's per run; scan an adamw or muon recipe")
    cells = [
        run for run in plan.runs
        if run.budget_index == args.budget
        and (args.widths is None or run.hidden_size in args.widths)
        and (args.recurrences is None or run.num_recurrences in args.recurrences)
    ]  # fmt: skip
    if not cells:
        parser.error(f"no run of the plan matches budget {args.budget}, widths {args.widths}, r {args.recurrences}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "scan.jsonl"
    done = {rec["run_id"] for rec in read_jsonl(results)} if results.exists() else set()
    for run in cells:
        for lr in args.lrs:
            run_id = f"{run.run_id}-lr{lr:g}"
            if run_id in done:
                continue
            recipe = {k: v for k, v in run.recipe.items() if k not in ("save_strategy", "save_steps", "save_total_limit")}
            recipe.update(learning_rate=lr, run_id=run_id, output_dir=str(out / run_id), save_strategy="no")
            record = train(*parse_recipe(recipe))
            append_jsonl(results, {
                "run_id": run_id, "cell": run.run_id, "hidden_size": run.hidden_size,
                "num_recurrences": run.num_recurrences, "budget": run.budget, "learning_rate": lr,
                "loss": record["loss"], "status": record["status"],
            })  # fmt: skip
    rows: dict[tuple[int, int], dict[float, float]] = {}
    for rec in read_jsonl(results):
        if rec["status"] == "ok" and rec["budget"] == cells[0].budget:
            rows.setdefault((rec["num_recurrences"], rec["hidden_size"]), {})[rec["learning_rate"]] = rec["loss"]
    lrs = sorted({lr for row in rows.values() for lr in row})
    print(f"held-out loss at budget {cells[0].budget:.3g} FLOPs (* = best lr of the row)")
    print(f"{'r':>3} {'width':>6} " + " ".join(f"{lr:>10g}" for lr in lrs))
    for (r, width), row in sorted(rows.items()):
        best = min(row, key=row.get)
        cells_txt = " ".join(
            f"{row[lr]:>9.4f}{'*' if lr == best else ' '}" if lr in row else f"{'-':>10}" for lr in lrs
        )
        print(f"{r:>3} {width:>6} {cells_txt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
