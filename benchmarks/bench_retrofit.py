"""Equal extra training FLOPs on a dense parent: train it on, or retrofit it into a looped model.

    python benchmarks/bench_retrofit.py                           # the docs/retrofit.md table (~30 min, 1 idle core)
    python benchmarks/bench_retrofit.py --quick --out /tmp/rq     # a smoke run of every arm (~2 min)
    nice -n 10 python benchmarks/bench_retrofit.py --out runs/bench_retrofit > bench.log 2>&1 &

1. The parent: a dense `LlamaForCausalLM` (transformers' own class; 10 layers, width 128) trained
   with the plain `transformers.Trainer` on the embedded corpus and its 4096-token BPE, saved with
   its tokenizer in ``OUT/parent`` (made here, never committed; reused when present). Ten layers,
   so that ``--layers 2,4,2`` drops two as the paper's retrofits drop some (at eight it would be
   ``--loop-in-place``'s default split).
2. Its extra budget B = ``--extra-fraction`` x the FLOPs of its pretraining, spent by each arm:
   (a) the parent trained on (plain Trainer, the paper's optimizer split built from
       `looped_hf.optim`: Muon 1e-3 on the layers' matrices, AdamW 5e-5 on the rest);
   (b) ``looped-hf retrofit --layers 2,4,2`` (layers 0-1 / 4-7 / 8-9, 2-3 dropped) trained with the paper's recipe (`looped_hf.train`:
       curriculum 1 -> 4 over 75% of the steps, 1-sqrt, Poisson-lognormal r, Muon/AdamW split);
   (c) ``--loop-in-place`` (every layer kept, the middle span looped), the same recipe;
   (d) (b) with distillation from the parent (a = 0.5, T = 2; the parent's forward counts in B);
   (e) ``--share stepwise --blocks 5`` (RRT: 5 shared layers looped twice), trained at its r = 2.
   A looped arm's step count is the largest whose exact FLOPs (every step's r is a function of
   the seed and the step, `looped_hf.recurrence`) stay within B.
3. Held-out loss (the same blocks for every model, `looped_hf.train.heldout_loss`) at r = 1, 2, 4, 8,
   per seed (``--seeds``; the seed moves data order, the r draws and the adapter's training). The
   table gives the mean over seeds and half the range between them (the spread), the FLOPs and
   tokens each arm spent, and the parent before any extra training.

Every finished (arm, seed) is a row of ``OUT/results.jsonl``; a rerun skips them (resumable). All
arms of the first seed run before the second's, so a cut-off run still gives a whole table.

Where the time goes: a parent step (8 x 64 tokens) is ~0.10 s on an idle core, of which the model's
forward, backward and optimizer step are ~0.098 s (the Trainer's own bookkeeping ~3%, collation
0.1 ms; no evaluation during training: the held-out curve is measured once at the end). Looped
arms run at the same FLOP/s (~5e10 on this CPU). So the wall time is the FLOPs over the machine's
share for this process; each row keeps the load average it ran under.
The FLOPs are the library's counts (`accounting_looped`): 6 N per trained token + attention,
truncated backprop and the teacher's forward included; a dense model's training is 3 x its forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH, EVAL_BLOCKS = 64, 8, 128
RS = (1, 2, 4, 8)
#: The parent (`--quick`: the smoke size).
PARENT = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 10, "num_attention_heads": 4}
QUICK_PARENT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 10, "num_attention_heads": 2}
#: The paper's retrofit recipe (McLeish et al. 2025; recipes/retrofit_tiny.yaml).
PAPER = {
    "optimizer": "muon", "muon_learning_rate": 1e-3, "learning_rate": 5e-5, "weight_decay": 0.0,
    "lr_schedule": "study", "final_lr_ratio": 0.1, "max_grad_norm": 1.0,
}  # fmt: skip
CURRICULUM = {
    "num_recurrences": 4, "backprop_recurrences": 4, "recurrence_curriculum": "1-sqrt", "curriculum_start": 1,
    "curriculum_fraction": 0.75, "recurrence_sampling": "poisson_lognormal",
}  # fmt: skip
ARMS = {
    "a": "parent trained on",
    "b": "--layers 2,4,2 + curriculum",
    "c": "--loop-in-place + curriculum",
    "d": "(b) + distillation",
    "e": "--share stepwise --blocks 5 (r = 2)",
}
RETROFITS = {
    "b": ["--layers", "2,4,2"],
    "c": ["--loop-in-place"],
    "e": ["--share", "stepwise", "--blocks", "5"],
}


def data(out: Path) -> tuple[Any, Any, Any, Any]:
    """(data_args, tokenizer, train blocks, held-out blocks) of the embedded corpus."""
    from looped_hf.data import DataArguments, TokenBlocks, build_datasets, load_tokenizer

    args = DataArguments(seq_len=SEQ_LEN, eval_blocks=EVAL_BLOCKS, data_cache_dir=str(out / "data_cache"))
    tokenizer = load_tokenizer(None)
    train_ds, eval_ds = build_datasets(args, tokenizer)
    return args, tokenizer, TokenBlocks.wrap(train_ds), eval_ds


def unigram_loss(train_ds, eval_ds, vocab_size: int) -> float:
    """The held-out loss of the training set's unigram distribution (add-one smoothed), on the
    tokens `heldout_loss` predicts (every block's 2nd .. last): the floor a model below which has
    learned context, the yardstick for "the parent is trained"."""
    import numpy as np

    train_ids = np.asarray(train_ds.dataset.with_format("numpy")["input_ids"]).reshape(-1)
    counts = 1.0 + np.bincount(train_ids, minlength=vocab_size)[:vocab_size]
    log_p = np.log(counts / counts.sum())
    targets = np.asarray(eval_ds[:]["input_ids"])[:, 1:].reshape(-1)
    return float(-log_p[targets].mean())


def dense_train_flops_per_token(model: torch.nn.Module) -> float:
    """A dense model's training FLOPs per token: 3 x its forward (`teacher_flops_per_token`)."""
    from looped_hf.accounting_looped import teacher_flops_per_token

    return 3 * teacher_flops_per_token(model, SEQ_LEN)


def paper_split(model: torch.nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The paper's split for a dense Llama (their train.py, non_recurrent_model + muon): Muon 1e-3
    for every 2-D weight of the decoder layers, AdamW 5e-5 for embeddings, head and norms; the
    study schedule as the looped arms (`looped_hf.optim`)."""
    from looped_hf.optim import CombinedOptimizer, study_schedule

    body = [p for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2]
    ids = {id(p) for p in body}
    rest = [p for p in model.parameters() if id(p) not in ids]
    optimizer = CombinedOptimizer([
        torch.optim.Muon([{"params": body, "name": "muon"}], lr=PAPER["muon_learning_rate"], weight_decay=0.0),
        torch.optim.AdamW([{"params": rest, "name": "adamw"}], lr=PAPER["learning_rate"], weight_decay=0.0),
    ])  # fmt: skip
    return optimizer, study_schedule(optimizer, steps, 0, PAPER["final_lr_ratio"])


def train_dense(model, folder: Path, steps: int, seed: int, data_args, tokenizer, train_ds, optimizers=(None, None),
                lr: float = 3e-3) -> dict[str, Any]:  # fmt: skip
    """Train a dense model with the plain `transformers.Trainer`; save it; its FLOPs and tokens."""
    from transformers import Trainer, TrainingArguments

    from looped_hf.data import collator

    args = TrainingArguments(
        output_dir=str(folder / "trainer"), max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=lr,
        warmup_steps=max(1, steps // 20), lr_scheduler_type="linear", weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=max(1, steps // 10), save_strategy="no", report_to="none", seed=seed, disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, data_collator=collator(tokenizer, data_args),
                      optimizers=optimizers)  # fmt: skip
    trainer.train()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    tokens = steps * BATCH * SEQ_LEN
    return {"tokens": tokens, "train_flops": tokens * dense_train_flops_per_token(model)}


def make_parent(
    out: Path, steps: int, shape: dict[str, int], data_args, tokenizer, train_ds
) -> dict[str, Any]:
    """Train the parent once (``OUT/parent/pretrain.json`` marks it done)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder, done = out / "parent", out / "parent" / "pretrain.json"
    if done.exists():
        return json.loads(done.read_text())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, tie_word_embeddings=False,
                         num_key_value_heads=shape["num_attention_heads"], bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)  # fmt: skip
    started = time.time()
    info = train_dense(LlamaForCausalLM(config), folder, steps, 0, data_args, tokenizer, train_ds)
    info.update(steps=steps, wall_s=round(time.time() - started, 1), shape=shape)
    done.write_text(json.dumps(info))
    return info


def retrofit(out: Path, arm: str) -> Path:
    """``looped-hf retrofit OUT/parent ...`` (the CLI, as a user runs it) into OUT/retrofit_<arm>."""
    folder = out / f"retrofit_{arm}"
    if not (folder / "config.json").exists():
        cmd = [sys.executable, "-m", "looped_hf", "retrofit", str(out / "parent"), "--out", str(folder),
               "--overwrite", *RETROFITS[arm]]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO)
    return folder


def looped_flops(folder: Path, settings: dict[str, Any], steps: int, seed: int, teacher_fpt: float) -> float:
    """The exact training FLOPs of ``steps`` steps of a looped arm (the r of each step is known in advance)."""
    from looped_hf import LoopedConfig, LoopedForCausalLM
    from looped_hf.recurrence import RecurrenceCurriculum, draw_num_recurrences

    config = LoopedConfig.from_pretrained(folder, **{k: settings[k] for k in ("num_recurrences", "backprop_recurrences")
                                                     if k in settings})  # fmt: skip
    with torch.device("meta"):
        model = LoopedForCausalLM(config)
    fpt: dict[int, float] = {}
    step_tokens = BATCH * SEQ_LEN
    if settings.get("recurrence_curriculum", "none") == "none":
        return steps * step_tokens * (model.training_flops_per_token(SEQ_LEN) + teacher_fpt)
    curriculum = RecurrenceCurriculum(settings["recurrence_curriculum"], settings["curriculum_start"],
                                      config.num_recurrences, settings["curriculum_fraction"], steps)  # fmt: skip
    total = 0.0
    for step in range(steps):
        r = draw_num_recurrences(curriculum.mean_at(step), step, seed, settings["recurrence_sampling"])
        if r not in fpt:
            fpt[r] = model.training_flops_per_token(SEQ_LEN, r)
        total += step_tokens * (fpt[r] + teacher_fpt)
    return total


def steps_within(budget: float, flops_of) -> int:
    """The largest step count whose FLOPs stay within ``budget`` (bisection; FLOPs grow with steps)."""
    low, high = 1, 2
    while flops_of(high) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if flops_of(mid) <= budget else (low, mid)
    return low


def curve(folder: Path, eval_ds, looped: bool) -> dict[str, float]:
    """Held-out loss at every r in RS (a dense model: its one loss, at every r)."""
    from transformers import AutoModelForCausalLM

    from looped_hf import LoopedForCausalLM
    from looped_hf.train import heldout_loss

    if not looped:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        loss = heldout_loss(model, eval_ds, 16)[0]
        return {str(r): loss for r in RS}
    model = LoopedForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {str(r): heldout_loss(model, eval_ds, 16, num_recurrences=r)[0] for r in RS}


def run_arm(
    out: Path, arm: str, seed: int, budget: float, data_args, tokenizer, train_ds, eval_ds
) -> dict[str, Any]:
    """Spend ``budget`` FLOPs on one arm; return its results row."""
    from transformers import AutoModelForCausalLM

    from looped_hf.arguments import parse_recipe
    from looped_hf.train import teacher_flops, train

    run_dir = out / f"arm_{arm}_seed{seed}"
    started = time.time()
    if arm == "a":
        model = AutoModelForCausalLM.from_pretrained(out / "parent", dtype=torch.float32)
        per_step = BATCH * SEQ_LEN * dense_train_flops_per_token(model)
        steps = max(1, int(budget // per_step))
        torch.manual_seed(seed)
        info = train_dense(
            model, run_dir, steps, seed, data_args, tokenizer, train_ds, paper_split(model, steps)
        )
        row = {"steps": steps, **info}
    else:
        folder = retrofit(out, "b" if arm == "d" else arm)
        settings = dict(CURRICULUM) if arm in "bcd" else {"recurrence_sampling": "fixed"}
        teacher_fpt = 0.0
        if arm == "d":
            settings["distill_from"] = str(out / "parent")
            from looped_hf import LoopedConfig

            teacher_fpt = teacher_flops(str(out / "parent"), LoopedConfig.from_pretrained(folder), SEQ_LEN)
        steps = steps_within(budget, lambda n: looped_flops(folder, settings, n, seed, teacher_fpt))
        recipe = {
            "dataset": None, "tokenizer": None, "seq_len": SEQ_LEN, "eval_blocks": EVAL_BLOCKS,
            "data_cache_dir": data_args.data_cache_dir, "output_dir": str(run_dir), "init_from": str(folder),
            "max_steps": steps, "per_device_train_batch_size": BATCH, "per_device_eval_batch_size": 16,
            "logging_steps": max(1, steps // 10), "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
            "dataloader_num_workers": 0, "torch_num_threads": 1, "seed": seed, **PAPER, **settings,
        }  # fmt: skip
        record = train(*parse_recipe(recipe))
        if record["status"] != "ok":
            raise RuntimeError(f"arm {arm} seed {seed}: {record['error']}")
        row = {"steps": steps, "tokens": record["tokens"], "train_flops": record["train_flops"],
               "sampled_recurrences": {k: v for k, v in (record["sampled_recurrences"] or {}).items()
                                       if k != "per_step"}}  # fmt: skip
    # The load average beside the wall time: the machine is shared, so a slow arm can be read as such.
    row.update(arm=arm, seed=seed, budget=budget, loss=curve(run_dir, eval_ds, looped=arm != "a"),
               wall_s=round(time.time() - started, 1), load_avg=round(os.getloadavg()[1], 2))  # fmt: skip
    return row


def untrained_curves(out: Path, eval_ds) -> dict[str, dict[str, float]]:
    """Each retrofit folder's loss at every r before any extra training (the retrofit alone)."""
    curves = {}
    for arm in RETROFITS:
        folder = out / f"retrofit_{arm}"
        if (folder / "config.json").exists():
            curves[arm] = curve(folder, eval_ds, looped=True)
    return curves


def table(
    rows: list[dict[str, Any]],
    parent_loss: float,
    parent: dict[str, Any],
    untrained: dict[str, dict[str, float]],
    unigram: float,
) -> str:
    """The markdown table: per arm the mean over seeds +- half their range, FLOPs and tokens; the
    retrofits before training at 0 extra FLOPs."""
    lines = [
        "| arm | extra FLOPs | tokens | steps | " + " | ".join(f"loss r={r}" for r in RS) + " |",
        "|---|---|---|---|" + "---|" * len(RS),
        "| the training set's unigram distribution | | | | " + " | ".join(f"{unigram:.3f}" for _ in RS) + " |",
        f"| parent before ({parent['steps']} steps, {parent['train_flops']:.3g} FLOPs) | 0 | 0 | 0 | "
        + " | ".join(f"{parent_loss:.3f}" for _ in RS) + " |",
    ]  # fmt: skip
    for arm, losses in untrained.items():
        lines.append(f"| retrofit {' '.join(RETROFITS[arm])}, before training | 0 | 0 | 0 | "
                     + " | ".join(f"{losses[str(r)]:.3f}" for r in RS) + " |")  # fmt: skip
    for arm, name in ARMS.items():
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue

        def cell(values: list[float], fmt: str = ".3f") -> str:
            mean = sum(values) / len(values)
            half = (max(values) - min(values)) / 2
            return f"{mean:{fmt}} ± {half:{fmt}}" if len(values) > 1 else f"{mean:{fmt}}"

        losses = " | ".join(cell([r["loss"][str(k)] for r in mine]) for k in RS)
        flops = sum(r["train_flops"] for r in mine) / len(mine)
        tokens = sum(r["tokens"] for r in mine) / len(mine)
        steps = "/".join(str(r["steps"]) for r in mine)
        lines.append(f"| ({arm}) {name} | {flops:.3g} | {tokens:,.0f} | {steps} | {losses} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/bench_retrofit", help="working folder (parent, arms, results)")
    parser.add_argument("--parent-steps", type=int, default=3000, help="the parent's pretraining steps")
    parser.add_argument("--extra-fraction", type=float, default=0.3,
                        help="extra budget B as a fraction of the parent's pretraining FLOPs")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", default="abcde", help="which arms to run (letters)")
    parser.add_argument("--quick", action="store_true", help="a smoke size: width 32, 30 parent steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = QUICK_PARENT if args.quick else PARENT
    parent_steps = 30 if args.quick else args.parent_steps
    print(f"$ {' '.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}")
    print(f"device: CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, 1 thread")
    data_args, tokenizer, train_ds, eval_ds = data(out)
    parent = make_parent(out, parent_steps, shape, data_args, tokenizer, train_ds)
    print(
        f"[parent] {parent['steps']} steps, {parent['train_flops']:.3g} FLOPs, {parent.get('wall_s')} s",
        flush=True,
    )
    parent_loss = curve(out / "parent", eval_ds, looped=False)["1"]
    unigram = unigram_loss(train_ds, eval_ds, len(tokenizer))
    print(f"[parent] held-out loss {parent_loss:.4f} (the unigram distribution's: {unigram:.4f})", flush=True)
    budget = args.extra_fraction * parent["train_flops"]
    results = out / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    for seed in args.seeds:
        for arm in args.arms:
            if any(r["arm"] == arm and r["seed"] == seed for r in rows):
                continue
            row = run_arm(out, arm, seed, budget, data_args, tokenizer, train_ds, eval_ds)
            rows.append(row)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[arm {arm} seed {seed}] {row['steps']} steps, {row['train_flops']:.3g} FLOPs, "
                  f"loss {row['loss']}, {row['wall_s']} s", flush=True)  # fmt: skip
    text = table(rows, parent_loss, parent, untrained_curves(out, eval_ds), unigram)
    print(f"\nextra budget B = {budget:.3g} FLOPs ({args.extra_fraction:g} x the parent's pretraining)\n")
    print(text)
    (out / "table.md").write_text(text + "\n")
    return 0 if all(math.isfinite(r["loss"]["1"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
