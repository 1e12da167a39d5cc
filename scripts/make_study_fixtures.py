"""Regenerate the study fixtures in tests/fixtures with the study's own code.

    python scripts/make_study_fixtures.py --study-src DIR                 # writes tests/fixtures/study_checkpoints
    python scripts/make_study_fixtures.py --study-src DIR --out /tmp/ck   # somewhere else
    python scripts/make_study_fixtures.py --study-src DIR --verify        # reload what is there, compare
    python scripts/make_study_fixtures.py --study-src DIR --prepacked /tmp/pp  # repack tests/fixtures/study_prepacked

DIR is a checkout of kschwethelm/looped-lm-scaling at commit ad7d8f3 (the study's nanochat fork,
MIT). Its `nanochat` package is imported from there at run time; nothing of it is in this
repository. Without `--study-src` the script says what it needs and exits 2.

For every variant (one folder each, the folder name is base_train's `--model-tag`) the script
does what the study's scripts/base_train.py does, on a CPU and at a tiny shape:

1. `nanochat.common.compute_init("cpu")` (seeds torch with 42), the study's `GPT(GPTConfig(...))`
   on the meta device, `to_empty(cpu)`, `init_weights()`;
2. `model.setup_optimizer(...)` (MuonAdamW) and 20 training steps on random tokens, each with
   base_train's body: `loss = model(x, y, num_recur=R)`, `backward()`, the learning-rate
   multiplier of base_train's default schedule, `optimizer.step()`, `zero_grad`;
3. `nanochat.loss_eval.evaluate_loss` on 2 random batches for `val_loss`;
4. `nanochat.checkpoint_manager.save_checkpoint(dir, 20, model.state_dict(), None, meta)` with
   base_train's meta layout (`user_config` is the namespace of base_train's own argparse parser,
   read from its source and run on the flags the variant stands for);
5. reference outputs of the study's forward: logits at the trained r, at other r, and through
   its KV-cache decode (`nanochat.engine.KVCache` sized by `Engine._get_kv_config`), stored in
   `reference.safetensors`, described in `reference.json`;
6. a reload check: `checkpoint_manager.build_model(dir, 20, cpu, "eval")` must reproduce every
   reference tensor and the loss bit for bit.

`--prepacked OUT` repacks the documents of tests/fixtures/study_prepacked/docs.json.xz with the
study's scripts/prepack.py (`_pack_split`: BOS-aligned best-fit packing, per-shard shuffle, parquet
shards, `meta_{split}.json`; `random.seed(0)` before each split), a stand-in tokenizer returning the
stored token ids, and writes the shards, metas and the rows in packing order (before the shuffle) to
OUT, then compares them with the fixture's: equal tables, metas and rows, or exit 1.

The output is byte-for-byte reproducible (torch 2.13 CPU, one thread): `total_training_time` in
the meta is written as 0.0 where base_train records wall-clock seconds.

Stubs, none of which changes the study's files: `torch.compile` is the identity while nanochat
is imported (nanochat/optim.py decorates its fused AdamW and MuonH steps with it, so they run
eagerly), and `checkpoint_manager.get_tokenizer` is replaced during `build_model` by one that only
reports the model's vocabulary size (the original loads the Llama-2 tokenizer just to compare it).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import lzma
import platform
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "study_checkpoints"
STUDY = "kschwethelm/looped-lm-scaling"
STUDY_COMMIT = "ad7d8f3055501e4c84ced7797f772dce2f8e2107"

# The tiny shape every variant shares. base_train's flags --size 1 --aspect-ratio 32 --head-dim 16
# give model_dim = ceil(1 * 32 / 16) * 16 = 32 and n_head = 2.
WIDTH, HEAD_DIM, SEQ_LEN, VOCAB = 32, 16, 64, 256
STEPS, BATCH = 20, 4
LRS = {"unembedding_lr": 0.02, "embedding_lr": 0.3, "matrix_lr": 0.05}  # raised so 20 steps move the weights
REF_SHAPE, REF_SEED, TRAIN_SEED, VAL_SEED, VAL_STEPS = (2, 48), 1234, 0, 1, 2
PREFILL = 16  # the KV decode prefills ids[:, :16], then feeds one token at a time


@dataclasses.dataclass(frozen=True)
class Variant:
    """One fixture: a folder of base_train's layout and the reference outputs stored beside it."""

    name: str
    n_prelude: int
    n_recur_block: int
    n_coda: int
    num_recur: int
    bptt_k: int
    input_injection: str
    vocab_size: int = VOCAB
    extra_num_recur: tuple[int, ...] = ()
    extra_kv_budget: tuple[int, ...] = ()


VARIANTS = (
    Variant(
        "loop4_linear", 2, 4, 2, 4, 4, "inject_init_prelude", extra_num_recur=(8, 2), extra_kv_budget=(1, 4)
    ),
    Variant("loop2_additive", 2, 8, 2, 2, 2, "additive", extra_num_recur=(4,), extra_kv_budget=(1,)),
    # Hyperconnect cannot run more recurrences than it was trained with: its lane parameters are per step.
    Variant("loop8_hyperconnect", 2, 2, 2, 8, 8, "hyperconnect", extra_kv_budget=(1,)),
    Variant("noloop", 0, 20, 0, 1, 1, "passthrough"),
    Variant("loop4_linear_trunc", 2, 4, 2, 4, 2, "inject_init_prelude"),
    # vocab 250 is padded by the study to 256 rows: the fixture holds untrained padded rows.
    Variant("loop4_linear_padvocab", 2, 4, 2, 4, 4, "inject_init_prelude", vocab_size=250),
)


# ---------------------------------------------------------------------------------------------
# The study's code, imported at run time
# ---------------------------------------------------------------------------------------------
def import_study(src: Path) -> SimpleNamespace:
    """The study's nanochat modules imported from ``src``, with eager optimizer kernels."""
    if not (src / "nanochat" / "gpt.py").is_file() or not (src / "scripts" / "base_train.py").is_file():
        raise SystemExit(f"--study-src {src}: no nanochat/gpt.py and scripts/base_train.py there "
                         f"(a checkout of {STUDY} @ {STUDY_COMMIT[:7]})")  # fmt: skip
    sys.path.insert(0, str(src))
    real = torch.compile

    def identity(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compile = identity
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its "Flash Attention backend" banner
            mods = {name: importlib.import_module(f"nanochat.{name}")
                    for name in ("gpt", "common", "engine", "loss_eval", "checkpoint_manager")}  # fmt: skip
    finally:
        torch.compile = real
    return SimpleNamespace(**mods, src=src)


def base_train_parser(src: Path) -> argparse.ArgumentParser:
    """base_train's own argparse parser, built from its source: only the statements that create
    the parser and add arguments run (the script itself would start training on import)."""
    tree = ast.parse((src / "scripts" / "base_train.py").read_text())
    keep = []
    for node in tree.body:
        target = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Attribute):
            if (isinstance(node, ast.Assign) and target.func.attr == "ArgumentParser") or (
                isinstance(target.func.value, ast.Name) and target.func.value.id == "parser"
                and target.func.attr == "add_argument"
            ):  # fmt: skip
                keep.append(node)
    namespace: dict[str, Any] = {"argparse": argparse}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "base_train.py (parser only)", "exec"), namespace)
    return namespace["parser"]


def base_train_flags(v: Variant) -> list[str]:
    """The base_train command line this variant stands for."""
    return [
        "--device-type", "cpu", "--size", "1", "--aspect-ratio", str(WIDTH), "--head-dim", str(HEAD_DIM),
        "--max-seq-len", str(SEQ_LEN), "--n-prelude", str(v.n_prelude), "--n-recur-block", str(v.n_recur_block),
        "--n-coda", str(v.n_coda), "--num-recur", str(v.num_recur), "--bptt-k", str(v.bptt_k),
        "--input-injection", v.input_injection, "--num-iterations", str(STEPS),
        "--device-batch-size", str(BATCH), "--total-batch-size", str(BATCH * SEQ_LEN),
        "--embedding-lr", str(LRS["embedding_lr"]), "--unembedding-lr", str(LRS["unembedding_lr"]),
        "--matrix-lr", str(LRS["matrix_lr"]), "--eval-every", "-1", "--core-metric-every", "-1",
        "--sample-every", "-1", "--model-tag", v.name,
    ]  # fmt: skip


def lr_multiplier(step: int, args: argparse.Namespace) -> float:
    """base_train's schedule: linear warmup, constant, then a linear warmdown to final_lr_frac."""
    n = args.num_iterations
    warmup, warmdown = round(args.warmup_ratio * n), round(args.warmdown_ratio * n)
    if step < warmup:
        return (step + 1) / warmup
    if step <= n - warmdown:
        return 1.0
    progress = (n - step) / warmdown
    return progress + (1 - progress) * args.final_lr_frac


def random_batches(seed: int, vocab: int):
    """Rows of seq_len + 1 uniform random tokens, split as base_train's loader does (x = row[:-1])."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        rows = torch.randint(0, vocab, (BATCH, SEQ_LEN + 1), generator=gen)
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------------
# One variant
# ---------------------------------------------------------------------------------------------
def train_variant(study: SimpleNamespace, v: Variant, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Train, save and return what reference.json records about the training."""
    with contextlib.redirect_stdout(sys.stderr):
        study.common.compute_init("cpu")  # torch.manual_seed(42), as base_train
        config = study.gpt.GPTConfig(
            sequence_len=SEQ_LEN, vocab_size=v.vocab_size, size=1, n_head=WIDTH // HEAD_DIM,
            n_kv_head=WIDTH // HEAD_DIM, n_embd=WIDTH, n_prelude=v.n_prelude, n_recur_block=v.n_recur_block,
            n_coda=v.n_coda, num_recur=v.num_recur, bptt_k=v.bptt_k, input_injection=v.input_injection,
            num_lanes=2, logit_softcap=15.0,
        )  # fmt: skip
        with torch.device("meta"):
            model = study.gpt.GPT(config)
        model.to_empty(device="cpu")
        model.init_weights()
        init = {k: t.detach().clone() for k, t in model.state_dict().items()}
        optimizer = model.setup_optimizer(**LRS, d_ref=10 * WIDTH)
    model.train()
    batches = random_batches(TRAIN_SEED, v.vocab_size)
    losses, smooth = [], 0.0
    for step in range(STEPS):
        x, y = next(batches)
        loss = model(x, y, num_recur=v.num_recur)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(step, args)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
        smooth = 0.9 * smooth + 0.1 * losses[-1]  # base_train's EMA of the training loss
    model.eval()
    val_loss = study.loss_eval.evaluate_loss(model, random_batches(VAL_SEED, v.vocab_size), VAL_STEPS).loss
    meta = {
        "step": STEPS, "tokens": STEPS * BATCH * SEQ_LEN, "val_loss": val_loss,
        "model_config": dataclasses.asdict(config), "user_config": vars(args).copy(),
        "device_batch_size": BATCH, "max_seq_len": SEQ_LEN, "dataloader_state_dict": None,
        "loop_state": {"min_val_loss": val_loss, "smooth_train_loss": smooth, "total_training_time": 0.0},
    }  # fmt: skip
    with contextlib.redirect_stderr(sys.stderr):
        study.checkpoint_manager.save_checkpoint(str(out), STEPS, model.state_dict(), None, meta)
    state = model.state_dict()
    rel = {k: float((state[k] - init[k]).norm() / init[k].norm().clamp_min(1e-12)) for k in state}
    return {
        "train": {
            "steps": STEPS, "batch": [BATCH, SEQ_LEN], "token_generator_seed": TRAIN_SEED, "global_seed": 42,
            "first_loss": losses[0], "last_loss": losses[-1], "val_loss": val_loss,
            "optimizer_groups_initial_lr": [[g["kind"], len(g["params"]), g["initial_lr"]]
                                            for g in optimizer.param_groups],
        },
        "moved_from_init": {"min_rel_change_over_all_tensors": min(rel.values())},
        "model": model,
    }  # fmt: skip


def kv_decode(study: SimpleNamespace, model: Any, ids: torch.Tensor, kv_budget: int) -> torch.Tensor:
    """The study's cached decode, teacher-forced: prefill ids[:, :16], then one token at a time
    (the calls Engine.generate makes), with a KVCache sized by Engine._get_kv_config."""
    cache_num_recur, kv = study.engine.Engine(model, None)._get_kv_config(None, kv_budget)
    cache = study.engine.KVCache(batch_size=ids.shape[0], seq_len=ids.shape[1], device="cpu",
                                 dtype=torch.float32, num_recur=cache_num_recur, kv_budget=kv_budget, **kv)  # fmt: skip
    logits = [model(ids[:, :PREFILL], kv_cache=cache)]
    for t in range(PREFILL, ids.shape[1]):
        logits.append(model(ids[:, t : t + 1], kv_cache=cache))
    return torch.cat(logits, dim=1)


def reference_outputs(
    study: SimpleNamespace, model: Any, v: Variant
) -> tuple[dict[str, torch.Tensor], float]:
    """input_ids, logits at the trained r, the variant's extra logits, and the loss."""
    ids = torch.randint(0, v.vocab_size, REF_SHAPE, generator=torch.Generator().manual_seed(REF_SEED))
    model.eval()
    with torch.no_grad():
        out = {"input_ids": ids, "logits": model(ids)}
        for r in v.extra_num_recur:
            out[f"logits_num_recur_{r}"] = model(ids, num_recur=r)
        for k in v.extra_kv_budget:
            out[f"logits_kv_budget_{k}"] = kv_decode(study, model, ids, k)
        loss = float(model(ids[:, :-1].contiguous(), targets=ids[:, 1:].contiguous()))
    return out, loss


def reload_check(study: SimpleNamespace, folder: Path, v: Variant, ref: dict[str, torch.Tensor], loss: float):
    """checkpoint_manager.build_model on the written folder must reproduce every tensor bit for bit."""
    stub = SimpleNamespace(get_vocab_size=lambda: v.vocab_size)
    real = study.checkpoint_manager.get_tokenizer
    study.checkpoint_manager.get_tokenizer = lambda *a, **k: stub
    try:
        with contextlib.redirect_stdout(sys.stderr):
            model, _, _ = study.checkpoint_manager.build_model(
                str(folder), STEPS, torch.device("cpu"), "eval"
            )
    finally:
        study.checkpoint_manager.get_tokenizer = real
    again, loss_again = reference_outputs(study, model, v)
    diffs = {k: float((again[k].double() - ref[k].double()).abs().max()) for k in ref}
    if any(diffs.values()) or loss_again != loss:
        raise SystemExit(
            f"{folder}: build_model does not reproduce the reference: {diffs}, loss {loss_again} vs {loss}"
        )
    return {"path": "checkpoint_manager.build_model(dir, step, cpu, 'eval') (tokenizer stubbed)",
            "bitwise_equal": dict.fromkeys(ref, True), "loss_equal": True}  # fmt: skip


def describe(key: str, v: Variant) -> str:
    if key.startswith("logits_num_recur_"):
        return f"GPT.forward(input_ids, num_recur={key.rsplit('_', 1)[1]}) (trained with {v.num_recur})"
    k = int(key.rsplit("_", 1)[1])
    return (f"KVCache(batch {REF_SHAPE[0]}, seq_len {REF_SHAPE[1]}, fp32, kv_budget={k}, "
            f"num_layers={v.n_prelude}+{v.n_recur_block}*{k}+{v.n_coda}) built with Engine._get_kv_config; "
            f"GPT.forward(input_ids[:, :{PREFILL}], kv_cache=cache), then GPT.forward(input_ids[:, t:t+1], "
            f"kv_cache=cache) for t = {PREFILL}..{REF_SHAPE[1] - 1}, logits concatenated")  # fmt: skip


def make_variant(study: SimpleNamespace, v: Variant, out: Path) -> dict[str, Any]:
    """Write one fixture folder and return its reference.json."""
    from safetensors.torch import save_file

    folder = out / v.name
    folder.mkdir(parents=True, exist_ok=True)
    args = base_train_parser(study.src).parse_args(base_train_flags(v))
    trained = train_variant(study, v, folder, args)
    model = trained.pop("model")
    ref, loss = reference_outputs(study, model, v)
    with torch.no_grad():
        sensitivity = {r: float((model(ref["input_ids"], num_recur=r) - ref["logits"]).abs().max())
                       for r in range(1, (v.num_recur if v.input_injection == "hyperconnect" else 2 * v.num_recur) + 1)}  # fmt: skip
    save_file({k: t.contiguous() for k, t in ref.items()}, folder / "reference.safetensors")
    state = torch.load(folder / f"model_{STEPS:06d}.pt", weights_only=True)
    model_file = folder / f"model_{STEPS:06d}.pt"
    logits = ref["logits"]
    full_loss = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                        ref["input_ids"][:, 1:].reshape(-1)))  # fmt: skip
    doc = {
        "variant": v.name,
        "study": f"{STUDY} @ {STUDY_COMMIT} (MIT)",
        "generator": "scripts/make_study_fixtures.py of looped_hf",
        "model_config": json.loads((folder / f"meta_{STEPS:06d}.json").read_text())["model_config"],
        "num_recur": v.num_recur,
        "checkpoint": {
            "model": model_file.name, "meta": f"meta_{STEPS:06d}.json", "step": STEPS,
            "model_sha256": hashlib.sha256(model_file.read_bytes()).hexdigest(),
            "state_dict": {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in state.items()},
            "padded_vocab_rows": state["lm_head.weight"].shape[0], "vocab_size": v.vocab_size,
        },
        "reference_inputs": {"key": "input_ids", "generator_seed": REF_SEED, "shape": list(REF_SHAPE),
                             "dtype": "int64", "high_exclusive": v.vocab_size,
                             "recipe": f"torch.randint(0, {v.vocab_size}, {REF_SHAPE}, "
                                       f"generator=torch.Generator().manual_seed({REF_SEED}))"},
        "logits": {"key": "logits", "shape": list(logits.shape), "dtype": "float32",
                   "how": "model.eval(); torch.no_grad(); GPT.forward(input_ids) (soft-capped at 15, "
                          "cropped to vocab_size)"},
        "max_abs_logit": float(logits.abs().max()),
        "loss": loss,
        "loss_how": "GPT.forward(input_ids[:, :-1], targets=input_ids[:, 1:]) -> mean CE (ignore_index=-1)",
        "loss_from_full_logits": full_loss,
        **trained,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "recurrence_sensitivity": {
            "what": "max |GPT.forward(input_ids, num_recur=r) - logits| (how strongly these weights depend on r)",
            "values": sensitivity,
        },
        "extra_logits": {k: describe(k, v) for k in ref if k not in ("input_ids", "logits")},
        "extra_stats": {k: {"max_abs_diff_vs_logits": float((ref[k] - logits).abs().max())}
                        for k in ref if k not in ("input_ids", "logits")},
        "reload_check": reload_check(study, folder, v, ref, loss),
    }  # fmt: skip
    (folder / "reference.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def verify(study: SimpleNamespace, out: Path) -> int:
    """Reload every fixture under ``out`` with the study's build_model and compare bit for bit."""
    from safetensors.torch import load_file

    for v in VARIANTS:
        folder = out / v.name
        ref = load_file(folder / "reference.safetensors")
        loss = json.loads((folder / "reference.json").read_text())["loss"]
        reload_check(study, folder, v, ref, loss)
        print(f"{v.name}: build_model reproduces {sorted(ref)} and the loss bit for bit")
    return 0


# ---------------------------------------------------------------------------------------------
# The prepacked rows
# ---------------------------------------------------------------------------------------------
PREPACKED = REPO / "tests" / "fixtures" / "study_prepacked"
PACK = {"row_capacity": 65, "buffer_size": 1000, "rows_per_shard": 400, "tokenizer_batch_size": 128}


def _read_json_xz(path: Path) -> Any:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _write_json_xz(path: Path, value: Any) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        json.dump(value, f)


def repack(study_src: Path, out: Path, fixture: Path = PREPACKED) -> int:
    """Pack the fixture's documents with the study's scripts/prepack.py into ``out`` and compare."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not (study_src / "scripts" / "prepack.py").is_file():
        raise SystemExit(f"--study-src {study_src}: no scripts/prepack.py there (a checkout of {STUDY})")
    sys.path.insert(0, str(study_src))  # prepack.py imports nanochat.common and nanochat.tokenizer
    spec = importlib.util.spec_from_file_location("study_prepack", study_src / "scripts" / "prepack.py")
    packer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(packer)
    docs = _read_json_xz(fixture / "docs.json.xz")
    bos, vocab = docs["bos_token_id"], docs["vocab_size"]

    class StandIn:
        """The study's tokenizer interface answering with the stored ids (a text is a document's index)."""

        def __init__(self, split_docs: list[list[int]]) -> None:
            self.docs = split_docs

        def encode(self, texts: list[str], prepend: int) -> list[list[int]]:
            return [[prepend, *self.docs[int(t)]] for t in texts]

        def get_vocab_size(self) -> int:
            return vocab

    in_order: list[list[int]] = []
    real_write = packer._write_shard

    def recording_write(output_dir, shard_idx, rows, split):  # the rows as packed, before its shuffle
        in_order.extend(list(r) for r in rows)
        return real_write(output_dir, shard_idx, rows, split)

    packer._write_shard = recording_write
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for split in ("train", "val"):
            split_docs = docs["docs_without_bos"][split]
            source = Path(tmp) / f"{split}.parquet"
            pq.write_table(pa.table({"text": [str(i) for i in range(len(split_docs))]}), source)
            in_order.clear()
            random.seed(0)
            packer._pack_split(split, [str(source)], out, StandIn(split_docs), bos, PACK["row_capacity"],
                               PACK["buffer_size"], PACK["rows_per_shard"], PACK["tokenizer_batch_size"], 0)  # fmt: skip
            _write_json_xz(out / f"rows_{split}_in_order.json.xz", in_order)
    differ = []
    for path in sorted(fixture.glob("*.parquet")):
        if not (out / path.name).is_file() or not pq.read_table(out / path.name).equals(pq.read_table(path)):
            differ.append(path.name)
    for name in ("meta_train.json", "meta_val.json"):
        if json.loads((out / name).read_text()) != json.loads((fixture / name).read_text()):
            differ.append(name)
    for split in ("train", "val"):
        name = f"rows_{split}_in_order.json.xz"
        if _read_json_xz(out / name) != _read_json_xz(fixture / name):
            differ.append(name)
    differ += sorted({p.name for p in out.glob("*.parquet")} - {p.name for p in fixture.glob("*.parquet")})
    if differ:
        print(f"the repacked rows differ from {fixture}: {differ}", file=sys.stderr)
        return 1
    print(
        f"the study's _pack_split reproduces {fixture.name}: every shard's table, both metas, the rows in order"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study-src", type=Path, help=f"a checkout of {STUDY} @ {STUDY_COMMIT[:7]}")
    p.add_argument(
        "--out", type=Path, default=OUT, help=f"where the folders go (default: {OUT.relative_to(REPO)})"
    )
    p.add_argument(
        "--verify", action="store_true", help="reload the fixtures in --out and compare; write nothing"
    )
    p.add_argument("--prepacked", type=Path, metavar="OUT",
                   help="repack the prepacked fixture's documents with the study's packer into OUT and compare")  # fmt: skip
    args = p.parse_args(argv)
    if args.study_src is None:
        print(
            f"--study-src DIR is required: a checkout of {STUDY} at commit {STUDY_COMMIT[:7]}",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    if args.prepacked is not None:
        return repack(args.study_src.resolve(), args.prepacked)
    study = import_study(args.study_src.resolve())
    if args.verify:
        return verify(study, args.out)
    for v in VARIANTS:
        doc = make_variant(study, v, args.out)
        size = (args.out / v.name / f"model_{STEPS:06d}.pt").stat().st_size
        print(f"{v.name}: {size:,} B checkpoint, val_loss {doc['train']['val_loss']:.4f}, "
              f"kv/r extras {sorted(doc['extra_logits'])}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
