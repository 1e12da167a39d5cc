"""Test-time compute on a trained checkpoint: KV budget, adaptive exit, self-speculative decoding.

    looped-hf train recipes/tiny.yaml --train_tokens 614400 --output_dir runs/tiny_long   # ~4 min
    python benchmarks/bench_test_time.py runs/tiny_long
    python benchmarks/bench_test_time.py runs/tiny_long --only exit --blocks 8 --repeats 5

Three tables, all on the run's own held-out split (rebuilt from its recipe):

* KV budget at the trained r and at ``--budget-r`` (default 8x): cache bytes after a block, the
  held-out loss as decoding sees it (``decoding_heldout_loss``: one token at a time through the
  cache, since a budget only acts through the cache), and the greedy continuation of a held-out
  prompt, for k = 1, 2, 4 and k = r.
* Adaptive exit with r capped at the trained r and at 2x: per criterion and threshold, the mean
  recurrences per decoded token, the held-out decoding loss, and greedy decode tokens/s (batch 1)
  against fixed r in the same interleaved run.
* Self-speculative decoding: per r, draft k and draft length (``num_assistant_tokens``, with the
  confidence stop off, and transformers' defaults 20 / 0.4), the acceptance rate, drafted tokens
  per new token, and greedy decode tokens/s against plain greedy at r (the sequences are asserted
  identical).

Timings: the sides take turns (plain, variant, plain, ...) ``--repeats`` times; the table shows the
median and, as the spread, min-max of the per-repeat ratios. One torch thread by default: a
shared machine's load then moves both sides alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from looped_hf.recurrence_curves import decoding_heldout_loss, load_run


def cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))  # fmt: skip


def timed_pairs(base: Callable[[], object], variant: Callable[[], object], repeats: int) -> tuple[float, float, list]:
    """Median seconds of ``base`` and ``variant`` run in turns, and the per-repeat ratios base/variant."""
    tb, tv = [], []
    for _ in range(repeats):
        for fn, out in ((base, tb), (variant, tv)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(tb), statistics.median(tv), [b / v for b, v in zip(tb, tv)]


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def kv_budget_table(model, tokenizer, heldout, args) -> None:
    trained = model.config.num_recurrences
    prompt = torch.as_tensor(heldout[0]["input_ids"][:16]).unsqueeze(0)
    print(f"\n## KV budget (trained r = {trained}); loss: {args.blocks} held-out blocks decoded token by token; "
          "cache after one block")  # fmt: skip
    print(f"{'r':>4} {'k':>4} {'slots':>6} {'cache KiB':>10} {'loss':>9}  greedy continuation")
    settings = [(r, k) for r in (trained, args.budget_r or 8 * trained) for k in sorted({1, 2, 4, r}) if k <= r]
    for r, k in settings:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.as_tensor(heldout[1]["input_ids"]).unsqueeze(0), cache=cache, use_cache=True, num_recurrences=r, kv_budget=k)
        loss = decoding_heldout_loss(model, heldout, args.batch, max_blocks=args.blocks, num_recurrences=r, kv_budget=k)
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, num_recurrences=r, kv_budget=k,
                             pad_token_id=model.config.eos_token_id)  # fmt: skip
        text = tokenizer.decode(out[0, prompt.shape[1]:]).replace("\n", " ")
        print(f"{r:>4} {k:>4} {len(cache.layers):>6} {cache_bytes(cache) / 1024:>10.1f} {loss['loss']:>9.5f}  {text!r}")


def exit_table(model, heldout, args) -> None:
    trained = model.config.num_recurrences
    prompt = torch.as_tensor(heldout[0]["input_ids"][:16]).unsqueeze(0)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
    grid = [("kl", t) for t in (1e-4, 1e-3, 1e-2, 1e-1)] + [("cosine", t) for t in (1e-5, 1e-4, 1e-3)]
    grid += [("latent_diff", t) for t in (0.01, 0.03, 0.1)]
    print(f"\n## Adaptive exit: {args.blocks} held-out blocks decoded token by token; decode {args.new_tokens} tokens, "
          f"batch 1, {args.repeats} interleaved repeats")  # fmt: skip
    print(f"{'r cap':>5} {'criterion':>11} {'threshold':>9} {'mean r':>7} {'loss':>8} {'d loss':>8} "
          f"{'tok/s':>8} {'fixed tok/s':>11} {'speedup':>8} {'spread':>10}")  # fmt: skip
    for cap in (trained, 2 * trained):
        fixed = decoding_heldout_loss(model, heldout, args.batch, max_blocks=args.blocks, num_recurrences=cap)
        print(f"{cap:>5} {'(fixed)':>11} {'':>9} {cap:>7.2f} {fixed['loss']:>8.4f} {0:>+8.4f}")
        for criterion, threshold in grid:
            call = dict(num_recurrences=cap, exit_criterion=criterion, exit_threshold=threshold)
            res = decoding_heldout_loss(model, heldout, args.batch, max_blocks=args.blocks, **call)
            base_s, var_s, ratios = timed_pairs(
                lambda cap=cap: model.generate(prompt, num_recurrences=cap, **gen),
                lambda call=call: model.generate(prompt, **call, **gen),
                args.repeats,
            )
            n = args.new_tokens
            print(f"{cap:>5} {criterion:>11} {threshold:>9.0e} {res['mean_recurrences']:>7.2f} {res['loss']:>8.4f} "
                  f"{res['loss'] - fixed['loss']:>+8.4f} {n / var_s:>8.1f} {n / base_s:>11.1f} {base_s / var_s:>8.2f} "
                  f"{spread(ratios):>10}")  # fmt: skip


def speculative_table(model, heldout, args) -> None:
    trained = model.config.num_recurrences
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
    print(f"\n## Self-speculative greedy decoding: {args.new_tokens} new tokens from {args.prompts} held-out prompts, "
          f"batch 1, {args.repeats} interleaved repeats")  # fmt: skip
    print(f"{'r':>4} {'draft k':>7} {'draft len':>9} {'confidence':>10} {'accept':>7} {'drafted/token':>13} {'tok/s':>8} {'plain tok/s':>11} "
          f"{'speedup':>8} {'spread':>10}")  # fmt: skip
    prompts = [torch.as_tensor(heldout[i]["input_ids"][:16]).unsqueeze(0) for i in range(args.prompts)]
    for r in (trained, 4 * trained):
        for k in sorted({1, max(1, r // 4), max(1, r // 2)}):
            for length, confidence in ((2, 0.0), (4, 0.0), (20, 0.4)):  # the last: transformers' defaults
                drafted = accepted = n_checked = 0
                for p in prompts:  # exactness and acceptance, once
                    out = model.generate(p, num_recurrences=r, draft_num_recurrences=k, num_assistant_tokens=length,
                                         assistant_confidence_threshold=confidence, return_dict_in_generate=True,
                                         **gen)  # fmt: skip
                    plain = model.generate(p, num_recurrences=r, **gen)
                    if not torch.equal(out.sequences, plain):
                        raise AssertionError(f"r={r} k={k}: self-speculative greedy differs from plain greedy")
                    drafted += out.num_draft_tokens
                    accepted += out.num_accepted_draft_tokens
                    n_checked += out.sequences.shape[1] - p.shape[1]
                base_s, var_s, ratios = timed_pairs(
                    lambda r=r: [model.generate(p, num_recurrences=r, **gen) for p in prompts],
                    lambda r=r, k=k, length=length, confidence=confidence: [
                        model.generate(p, num_recurrences=r, draft_num_recurrences=k, num_assistant_tokens=length,
                                       assistant_confidence_threshold=confidence, **gen)
                        for p in prompts
                    ],
                    args.repeats,
                )  # fmt: skip
                n = args.new_tokens * len(prompts)
                print(f"{r:>4} {k:>7} {length:>9} {confidence:>10} {accepted / max(drafted, 1):>7.2f} "
                      f"{drafted / n_checked:>13.2f} {n / var_s:>8.1f} "
                      f"{n / base_s:>11.1f} {base_s / var_s:>8.2f} {spread(ratios):>10}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--only", choices=["budget", "exit", "speculative"], action="append")
    parser.add_argument("--blocks", type=int, default=16, help="held-out blocks decoded token by token")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-r", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer, heldout, record = load_run(args.run_dir)
    print(f"# {args.run_dir}: trained r = {model.config.num_recurrences}, "
          f"recurrence_sampling = {record.get('recurrence_sampling') or 'fixed'}, recorded loss {record['loss']:.4f}, "
          f"{len(heldout)} held-out blocks of {len(heldout[0]['input_ids'])}, torch threads {torch.get_num_threads()}")
    only = set(args.only or ["budget", "exit", "speculative"])
    if "budget" in only:
        kv_budget_table(model, tokenizer, heldout, args)
    if "exit" in only:
        exit_table(model, heldout, args)
    if "speculative" in only:
        speculative_table(model, heldout, args)


if __name__ == "__main__":
    main()
