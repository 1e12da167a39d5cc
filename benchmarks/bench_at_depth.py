"""What ``looped_hf.at_depth(model, r)`` costs per call against a model built at r, for the looped
classes transformers ships (HRM-Text, Inkling2Loop), on the zoo2 fixtures.

    python benchmarks/bench_at_depth.py [--repeats 5] [--calls 5] [--threads 1]

Two sides per row, the same weights:

- **at_depth**: the model loaded at its trained depth, every call wrapped in its own
  ``with at_depth(model, r):`` (the block is entered and left per call, the worst case: the config
  fields are set and restored and the cache-check hook added and removed each time);
- **built at r**: ``from_pretrained(folder, <depth field>=r)`` (HRM-Text's ``num_hidden_layers``
  set to its slots too, so its cache fits: transformers leaves it at the trained count).

Workloads: a forward over a batch (``use_cache=False``) and ``generate`` of 8 tokens with the
cache (greedy). The sides run interleaved, ``--repeats`` rounds, the order flipped every round;
each cell is the median per-call time with the min-max spread of the rounds, and the ratio column is
the median of the per-round ratios (at_depth / built) with its spread. The tiny fixtures make the
model's own work small, so a per-call overhead shows here if anywhere. The outputs of the two
sides are checked equal first (a benchmark of two different computations would mean nothing).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "zoo2"
CASES = {  # folder -> the depths to run (an int: r, the other axes as trained)
    "hrm-text-tiny": [3, 1, (4, 2)],
    "inkling2-loop-tiny": [1, 4, 6],
}


def built_at(folder: Path, entry, depth):
    import torch
    from transformers import AutoModelForCausalLM

    values = dict(zip(entry.fields, depth))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **values).eval()
    if (
        entry.derived is not None
    ):  # HRM-Text: the cache slots of the cycles, which transformers left as trained
        for name, value in entry.derived(model.config).items():
            setattr(model.config, name, value)
    return model


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def cell(values: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(values) * scale:.3f} ({min(values) * scale:.3f}-{max(values) * scale:.3f})"


def measure_pair(
    model, other, values, ids, prompt, args
) -> dict[str, tuple[list[float], list[float] | None]]:
    """Per-call seconds of each workload, at_depth side and built side, interleaved rounds."""
    from looped_hf.depth import at_depth

    def fwd_at():
        with at_depth(model, values):
            model(ids, use_cache=False)

    def gen_at():
        with at_depth(model, values):
            model.generate(prompt, max_new_tokens=8, do_sample=False)

    sides = {
        "forward": (fwd_at, lambda: other(ids, use_cache=False)),
        "generate": (gen_at, lambda: other.generate(prompt, max_new_tokens=8, do_sample=False)),
    }

    def enter_exit():
        with at_depth(model, values):
            pass

    out = {"enter+exit": ([timed(enter_exit, 1000) for _ in range(args.repeats)], None)}
    for work, (a, b) in sides.items():
        a(), b()  # warm-up
        ta, tb = [], []
        for k in range(args.repeats):
            pair = [(ta, a), (tb, b)] if k % 2 == 0 else [(tb, b), (ta, a)]
            for sink, fn in pair:
                sink.append(timed(fn, args.calls))
        out[work] = (ta, tb)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=5, help="calls per timing")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=48)
    args = p.parse_args()

    sys.path.insert(0, str(REPO))
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from looped_hf.depth import at_depth, entry_for

    torch.set_num_threads(args.threads)
    print(f"python {' '.join(sys.argv)}")
    print(f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} ({args.threads} thread), transformers {transformers.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} at the start")  # fmt: skip
    print(
        f"ms per call: median (min-max) of {args.repeats} interleaved rounds of {args.calls} calls; "
        f"forward: batch {args.batch} x {args.seq_len} tokens, no cache; generate: 1 x 8 prompt + 8 new, cache"
    )
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for name, depths in CASES.items():
            folder = FIXTURES / name
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            entry = entry_for(model)
            vocab = int(getattr(model.config, "unpadded_vocab_size", None) or model.config.vocab_size)
            ids = torch.randint(3, vocab, (args.batch, args.seq_len), generator=gen)
            prompt = ids[:1, :8]
            for depth in depths:
                values = entry.resolve(model.config, depth)
                other = built_at(folder, entry, values)
                with at_depth(model, values):
                    same = torch.equal(model(ids, use_cache=False).logits, other(ids, use_cache=False).logits)
                    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False)
                assert same and torch.equal(tokens, other.generate(prompt, max_new_tokens=8, do_sample=False))

                label = f"{entry.name} {', '.join(f'{f}={v}' for f, v in zip(entry.fields, values))}"
                for work, (ta, tb) in measure_pair(model, other, values, ids, prompt, args).items():
                    if tb is None:  # the block alone, no model call: its whole per-call cost
                        rows.append((label, work, cell(ta) + " ", "-", "-"))
                        continue
                    ratios = [x / y for x, y in zip(ta, tb)]
                    rows.append((label, work, cell(ta), cell(tb), cell(ratios, 1.0)))
    width = max(len(r[0]) for r in rows) + 2
    print(
        f"\n{'model at depth':<{width}}{'work':<12}{'at_depth ms':>30}{'built at r ms':>30}{'ratio at/built':>24}"
    )
    for label, work, a, b, ratio in rows:
        print(f"{label:<{width}}{work:<12}{a:>30}{b:>30}{ratio:>24}")
    print(
        "enter+exit: `with at_depth(model, r): pass` alone, 1000 times a round: what the block adds to a call"
    )
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
