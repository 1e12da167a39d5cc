"""Looped model vs transformers' Llama at equal FLOPs per token, measured side by side.

    python benchmarks/bench_model.py            # CPU fp32 (and CUDA bf16 when a GPU is present)
    python benchmarks/bench_model.py --quick    # fewer repeats

Rows: training tokens/s (LoopedForCausalLM prelude 2 + block 4 x r=4 + coda 2 vs a 20-layer
LlamaForCausalLM of the same width and MLP), decode tokens/s through ``generate()`` with cache
(batch 1, 32-token prompt, 64 new tokens), and peak training activation memory at r = 8 with
``backprop_recurrences=1`` vs full backprop. Ratios are looped / reference; targets in the last
column. Activation memory on CPU is the bytes of tensors autograd saves for backward (exact, and
what the truncation removes); on CUDA it is ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from looped_hf import LoopedConfig, LoopedForCausalLM

WIDTH, HEADS, VOCAB, FFN = 256, 4, 4096, 704


# The layer Llama has (SwiGLU, no extra norms), so the ratio isolates the cost of looping;
# the study's stabilisers (QK-norm, soft-cap, extra norms) are measured as a second row.
LLAMA_BLOCK = dict(qk_norm=False, logit_softcap=None, embedding_norm=False, recurrence_norm=False)


def looped(r: int = 4, study_block: bool = False, **kw) -> LoopedForCausalLM:
    switches = {} if study_block else LLAMA_BLOCK
    cfg = LoopedConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=FFN,
                       hidden_act="silu", num_prelude_layers=2, num_recurrent_layers=4, num_coda_layers=2,
                       num_recurrences=r, max_position_embeddings=1024, **switches, **kw)
    return LoopedForCausalLM(cfg)


def llama(layers: int = 20) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=FFN,
                      num_hidden_layers=layers, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg)


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train_tokens_per_s(model, batch: int, seq: int, repeats: int, device, dtype) -> float:
    model = model.to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return batch * seq / _time(step, repeats)


@torch.no_grad()
def decode_tokens_per_s(model, repeats: int, device, dtype, new_tokens: int = 64) -> float:
    model = model.to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, VOCAB, (1, 32), device=device)

    def gen():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return new_tokens / _time(gen, repeats)


def activation_bytes(model, batch: int, seq: int, device, dtype) -> int:
    model = model.to(device=device, dtype=dtype).train()
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        return torch.cuda.max_memory_allocated() - base
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def run(device: torch.device, dtype: torch.dtype, quick: bool) -> list[tuple]:
    repeats = 3 if quick else 7
    torch.manual_seed(0)
    rows = []
    lp, ll = looped(4), llama(20)
    with torch.device("meta"):
        f_loop = looped(4).training_flops_per_token(256)
    f_llama = 6 * sum(p.numel() for n, p in ll.named_parameters() if "embed" not in n) + 12 * WIDTH * 256 * 20
    rows.append(("train FLOPs/token (analytic)", f_loop, f_llama, f_loop / f_llama, "~1.0"))
    ls = looped(4, study_block=True)
    # Interleave the measurements so load drifts hit both sides of each ratio alike.
    t_llama = train_tokens_per_s(ll, 8, 256, repeats, device, dtype)
    t_loop = train_tokens_per_s(lp, 8, 256, repeats, device, dtype)
    t_study = train_tokens_per_s(ls, 8, 256, repeats, device, dtype)
    rows.append(("train tokens/s (b8 x 256)", t_loop, t_llama, t_loop / t_llama, ">= 1.0"))
    rows.append(("  same, study block (qk-norm, cap, norms)", t_study, t_llama, t_study / t_llama, "info"))
    d_llama = decode_tokens_per_s(ll, repeats, device, dtype)
    d_loop = decode_tokens_per_s(lp, repeats, device, dtype)
    d_study = decode_tokens_per_s(ls, repeats, device, dtype)
    rows.append(("decode tokens/s (b1, 32+64)", d_loop, d_llama, d_loop / d_llama, ">= 1.0"))
    rows.append(("  same, study block (qk-norm, cap, norms)", d_study, d_llama, d_study / d_llama, "info"))
    m_trunc = activation_bytes(looped(8, backprop_recurrences=1), 4, 256, device, dtype)
    m_full = activation_bytes(looped(8), 4, 256, device, dtype)
    rows.append(("train activations MB, r=8 k=1 / full", m_trunc / 2**20, m_full / 2**20, m_trunc / m_full, "<= 0.5"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    targets = [(torch.device("cpu"), torch.float32)]
    if torch.cuda.is_available():
        targets.append((torch.device("cuda"), torch.bfloat16))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, width {WIDTH}, vocab {VOCAB}")
    for device, dtype in targets:
        print(f"\n{device.type} {str(dtype).replace('torch.', '')}")
        print(f"{'metric':<44}{'looped':>14}{'reference':>14}{'ratio':>9}  target")
        for name, a, b, ratio, target in run(device, dtype, args.quick):
            print(f"{name:<44}{a:>14.4g}{b:>14.4g}{ratio:>9.3f}  {target}")


if __name__ == "__main__":
    main()
