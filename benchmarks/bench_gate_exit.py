"""Recurrences the exit gate saves when it stops tokens (``exit_criterion="gate"``), on the converted Ouro
fixture (``tests/fixtures/zoo/ouro-tiny``, random weights) or any gated checkpoint.

    python benchmarks/bench_gate_exit.py                    # the docs' table (seconds)
    python benchmarks/bench_gate_exit.py runs/ouro --r 4 --thresholds 0.3 0.5

Per r and threshold, over prompts of 1 to 64 tokens plus ``--new-tokens`` greedy tokens each (decoded one
forward at a time through a cache, which is ``generate()``, tests/test_gate_exit.py), three ratios to every
token running all r recurrences:

* ``readout``: the threshold readout's exit steps (``exit_gate_output="threshold"``: every recurrence runs,
  each token reads its exit step), the recurrences a stopping engine would need on that model;
* ``gate exit, per token``: the gate criterion's own exit steps (``recurrences_used``), what an engine that
  drops each stopped token would run;
* ``generate() ran``: block passes x tokens of each forward, what ``generate()`` really computed (a forward
  runs a recurrence while any of its tokens still runs, so a prompt costs its slowest token's; a decoded
  token costs its own, counted with a hook on the block's first layer).

Counts, not timings: no spread to report.

    python benchmarks/bench_gate_exit.py --engine           # in the serving environment (vLLM)
    python benchmarks/bench_gate_exit.py --engine --width 512 --r 8 --thresholds 0.5 0.9

``--engine`` serves the converted fixture with ``vllm.LLM`` (float32, CPU, eager) and sends the
same 32 requests (prompts of 1 to 70 tokens, 8 greedy tokens each) at r and threshold twice,
interleaved ``--repeats`` times after one warm-up: with the threshold readout (every recurrence runs)
and with ``exit_criterion="gate"``. It reports the block rows the engine ran (tokens x recurrences
through the loop, counted on the block's recurrence; a partly stopped prefill's stopped tokens count
as run) and the wall time of the gate side over the readout's (median, min .. max).

``--width W`` replaces the fixture by the same design at hidden size ``W`` (heads of 64, MLP 3W, the
fixture's 2 recurrent layers, seeded random weights), where the loop, not the engine's per-step work,
is most of a step. Its exit gate's weights are redrawn with standard deviation ``1.5 / sqrt(W)``, so
that the gate's logits differ between tokens (about 1.5 apart) as a trained gate's do; at the
initializer's 0.02 every token would stop at the same step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (1, 3, 8, 16, 24, 32, 48, 64)


def measure(model, r: int, threshold: float, new_tokens: int) -> tuple[int, int, int, int]:
    """(tokens, readout recurrences, gate-exit recurrences, block passes x tokens run) over the prompts."""
    from transformers import DynamicCache

    passes = []
    hook = model.model.recurrent_layers[0].register_forward_hook(lambda *_: passes.append(1))
    tokens = readout = stopped = ran = 0
    gate = dict(num_recurrences=r, exit_criterion="gate", exit_threshold=threshold)
    try:
        for i, length in enumerate(PROMPT_LENGTHS):
            ids = torch.randint(
                0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(i)
            )
            cache, chunk = DynamicCache(config=model.config), ids
            for _ in range(new_tokens + 1):
                before = len(passes)
                with torch.no_grad():
                    out = model(chunk, cache=cache, use_cache=True, **gate)
                ran += (len(passes) - before) * chunk.shape[1]
                stopped += int(out.recurrences_used.sum())
                ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)
                chunk = ids[:, -1:]
            ids = ids[:, :-1]  # the prompt and the tokens fed back: every token one forward ran
            hook.remove()
            with torch.no_grad():
                steps = model(
                    ids, num_recurrences=r, exit_gate_output="threshold", exit_gate_threshold=threshold
                )
            hook = model.model.recurrent_layers[0].register_forward_hook(lambda *_: passes.append(1))
            tokens += ids.shape[1]
            readout += int(steps.recurrences_used.sum())
    finally:
        hook.remove()
    return tokens, readout, stopped, ran


def widened(fixture: str, width: int, out: Path) -> None:
    """Save the converted fixture's design at hidden size ``width`` (``--width``) into ``out``."""
    from looped_hf import LoopedConfig, LoopedForCausalLM

    config = LoopedConfig.from_pretrained(fixture)
    config.hidden_size, config.intermediate_size = width, 3 * width
    config.num_attention_heads = config.num_key_value_heads = width // 64
    config.head_dim = 64
    torch.manual_seed(0)
    model = LoopedForCausalLM(config)
    with torch.no_grad():
        model.model.exit_gate.weight.normal_(0.0, 1.5 / width**0.5)
    model.save_pretrained(out)


def engine_table(folder: str, rs: list[int], thresholds: list[float], repeats: int) -> None:
    """The ``--engine`` table (see the module docstring)."""
    import statistics
    import time

    sys.path.insert(0, str(ROOT / "tests"))
    from serving_helpers import vllm_env
    from test_serving_depth import NEW_TOKENS, SERVER, mix_prompts, mixed_greedy
    from test_serving_parity import close, make_llm

    from looped_hf.serving import vllm_model

    rows = [0]
    recurrence = vllm_model._VllmRecurrentBlock.recurrence

    def counting(self, step, h, *args):
        rows[0] += h.shape[0]
        return recurrence(self, step, h, *args)

    vllm_model._VllmRecurrentBlock.recurrence = counting
    workdir = tempfile.TemporaryDirectory(prefix="bench-gate-exit-")  # vLLM's sockets and cache
    os.environ.update(vllm_env(Path(workdir.name)))
    prompts = mix_prompts(5, 256)
    llm = make_llm(Path(folder), SERVER, max_num_seqs=32, max_model_len=128)
    print("| r | threshold | requests | gate rows / readout rows | gate time / readout time (min .. max) |")
    print("|---|---|---|---|---|")
    try:
        mixed_greedy(llm, prompts, [{"exit_criterion": "gate"}] * len(prompts))  # warm-up, not timed
        for r in rs:
            for threshold in thresholds:
                readout = [{"num_recurrences": r, "exit_threshold": threshold}] * len(prompts)
                gate = [{**d, "exit_criterion": "gate"} for d in readout]
                counts, ratios = {}, []
                for _ in range(repeats):
                    seconds = {}
                    for name, depths in (("readout", readout), ("gate", gate)):
                        rows[0], start = 0, time.perf_counter()
                        mixed_greedy(llm, prompts, depths)
                        seconds[name], counts[name] = time.perf_counter() - start, rows[0]
                    ratios.append(seconds["gate"] / seconds["readout"])
                print(f"| {r} | {threshold} | {len(prompts)} x ({NEW_TOKENS} new) | "
                      f"{counts['gate'] / counts['readout']:.2f} | {statistics.median(ratios):.2f} "
                      f"({min(ratios):.2f} .. {max(ratios):.2f}) |")  # fmt: skip
    finally:
        close(llm)
        workdir.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", nargs="?", default=None, help="a gated checkpoint (default: the Ouro fixture)"
    )
    parser.add_argument("--r", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.9, 1.0])
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--engine", action="store_true", help="serve with vllm.LLM (the serving environment)")
    parser.add_argument("--repeats", type=int, default=3, help="--engine: interleaved repeats")
    parser.add_argument("--width", type=int, default=None, help="the fixture's design at this hidden size")
    args = parser.parse_args(argv)
    if args.width is not None and (args.checkpoint is not None or args.width < 64 or args.width % 64):
        parser.error(f"--width {args.width}: a multiple of 64, and only with the fixture (no checkpoint)")
    sys.path.insert(0, str(ROOT))
    from looped_hf import LoopedForCausalLM
    from looped_hf.convert import main as convert

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.checkpoint
        if folder is None:
            folder = str(Path(tmp) / "ouro")
            assert convert(["ouro", str(ROOT / "tests/fixtures/zoo/ouro-tiny"), "--out", folder]) == 0
            if args.width is not None:
                widened(folder, args.width, Path(tmp) / "wide")
                folder = str(Path(tmp) / "wide")
        print("python benchmarks/bench_gate_exit.py " + " ".join(argv if argv is not None else sys.argv[1:]))
        fixture = "tests/fixtures/zoo/ouro-tiny (converted)" + (
            f" at width {args.width}" if args.width else ""
        )
        print(f"{args.checkpoint or fixture}, float32, CPU")
        if args.engine:
            sys.path.insert(0, str(ROOT / "tests"))
            from test_serving_zoo import save_tokenizer  # vLLM loads a tokenizer with the checkpoint

            save_tokenizer(Path(folder))
            engine_table(folder, args.r, args.thresholds, args.repeats)
            return
        model = LoopedForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print("| r | threshold | tokens | readout | gate exit, per token | generate() ran |")
    print("|---|---|---|---|---|---|")
    for r in args.r:
        for threshold in args.thresholds:
            tokens, readout, stopped, ran = measure(model, r, threshold, args.new_tokens)
            full = tokens * r
            ratios = " | ".join(f"{count / full:.2f}" for count in (readout, stopped, ran))
            print(f"| {r} | {threshold} | {tokens} | {ratios} |")


if __name__ == "__main__":
    main()
