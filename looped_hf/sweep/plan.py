"""The plan of a sweep: the `sweep:` section of a recipe (`SweepArguments`) and the runs it makes
(`make_plan`: budget x width x r x seed, each an iso-depth model trained for its FLOP budget)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from looped_hf.arguments import RecipeError, load_yaml, steps_for_tokens, yaml_key_lines
from looped_hf.field_checks import AT_LEAST_0, AT_LEAST_1, POSITIVE, SEED, check_value, declared_fields

VARIANTS = ("base", "truncated", "hyperconnection")
EXECUTORS = ("local", "subprocess", "accelerate", "submitit")
# ---------------------------------------------------------------------------------------------
# The sweep section of a recipe
# ---------------------------------------------------------------------------------------------
@dataclass
class SweepArguments:
    """The `sweep:` section of a sweep recipe (the rest of the file is the per-run recipe)."""

    budgets: Annotated[list[float], POSITIVE] = field(default_factory=list)
    """Training-FLOP budgets C (the model's `training_flops_per_token` x tokens)."""
    widths: Annotated[list[list[int]] | list[int], AT_LEAST_1] = field(default_factory=list)
    """Hidden sizes d: one list per budget (index-aligned with `budgets`), or one list for all."""
    recurrences: Annotated[list[int], AT_LEAST_1] = field(default_factory=lambda: [1, 2, 4, 8])
    """The r values; each must divide `effective_depth - prelude - coda` (r = 1 always fits)."""
    effective_depth: Annotated[int, AT_LEAST_1] = field(default=20)
    """Layer applications per token, the same for every r (the study: 20)."""
    prelude: Annotated[int, AT_LEAST_0] = field(default=2)
    """Prelude layers of the looped models (r > 1); r = 1 has none."""
    coda: Annotated[int, AT_LEAST_0] = field(default=2)
    """Coda layers of the looped models (r > 1); r = 1 has none."""
    head_dim: Annotated[int, AT_LEAST_1] = field(default=128)
    """Per-head width; heads = d / head_dim (the study: 128, d = 64 s)."""
    injection: str = "linear"
    """Input injection of the looped models (the study: linear)."""
    variant: str = "base"
    """"base"; "truncated" (backprop through the last ceil(r/2) recurrences); "hyperconnection"."""
    hyperconnection_lanes: Annotated[int, AT_LEAST_1] = field(default=2)
    """Lanes for the hyperconnection variant (the study: 2)."""
    learning_rate_by_r: Annotated[dict[int, float] | None, POSITIVE] = field(default=None)
    """AdamW / Muon recipes: the `learning_rate` of each r (every r of `recurrences` listed), so
    every architecture trains at its own tuned lr, as the study's HyperP gives looped and plain
    models their own reference (D_REF). None: the recipe's `learning_rate` for all. Not with
    muonh, whose lrs HyperP computes per run."""
    seeds: Annotated[list[int], SEED] = field(default_factory=lambda: [0])
    """One run per seed per cell (the study: one seed); run ids get `-s<seed>` if several."""
    vocab_size: Annotated[int | None, AT_LEAST_1] = field(default=None)
    """Plan with this vocabulary size instead of loading the tokenizer (offline dry runs of Hub
    tokenizers); the runs themselves always use the tokenizer's size."""
    executor: str = "local"
    """local: in this process (fast; exceptions are caught). subprocess: one `python -m
    looped_hf.train` per run (a crash cannot take the sweep down). accelerate: one `accelerate
    launch --num_processes N` per run. submitit: one SLURM (or local) job per run."""
    num_processes: Annotated[int, AT_LEAST_1] = field(default=1)
    """Processes per run (accelerate / submitit); part of tokens_per_step."""
    checkpoints_per_run: Annotated[int, AT_LEAST_0] = field(default=4)
    """Trainer checkpoints per run (the last one is kept), so a killed run resumes mid-way."""
    submitit: dict[str, Any] = field(default_factory=dict)
    """Passed to `submitit.AutoExecutor.update_parameters` (e.g. slurm_partition, timeout_min,
    gpus_per_node); `cluster` picks the executor ("local" for tests, default auto-detect)."""
    output_dir: str | None = None
    """The sweep directory (default: runs/<recipe file stem>); `--output` overrides."""

    def validate(self) -> None:
        def bad(name: str, why: str) -> RecipeError:
            return RecipeError(f"sweep.{name}={getattr(self, name)!r}: {why}")

        if not self.budgets or any(not isinstance(b, (int, float)) or b <= 0 for b in self.budgets):
            raise bad("budgets", "must be a non-empty list of positive FLOP counts")
        if not self.widths:
            raise bad("widths", "must list hidden sizes (one list per budget, or one for all)")
        if isinstance(self.widths[0], list) and len(self.widths) != len(self.budgets):
            raise bad("widths", f"has {len(self.widths)} lists for {len(self.budgets)} budgets")
        for w in self.widths_for_all():
            for d in w:
                if not isinstance(d, int) or d < 1 or d % self.head_dim:
                    raise bad("widths", f"width {d!r} is not a positive multiple of head_dim={self.head_dim}")
        if not self.recurrences or any(not isinstance(r, int) or r < 1 for r in self.recurrences):
            raise bad("recurrences", "must be a non-empty list of integers >= 1")
        depth = self.effective_depth - self.prelude - self.coda
        if self.prelude < 0 or self.coda < 0 or (depth < 1 and any(r > 1 for r in self.recurrences)):
            raise bad(
                "effective_depth",
                f"leaves {depth} recurrent layers after prelude {self.prelude} + coda {self.coda}",
            )
        for r in self.recurrences:
            if r > 1 and depth % r:
                raise bad(
                    "recurrences",
                    f"r={r} does not divide the recurrent depth effective_depth - prelude - coda = {depth}",
                )
        if self.variant not in VARIANTS:
            raise bad("variant", f"must be one of {VARIANTS}")
        if self.executor not in EXECUTORS:
            raise bad("executor", f"must be one of {EXECUTORS}")
        if self.num_processes < 1:
            raise bad("num_processes", "must be >= 1")
        if self.executor == "local" and self.num_processes != 1:
            raise bad("num_processes", "the local executor runs one process; use executor: accelerate")
        if self.checkpoints_per_run < 0:
            raise bad("checkpoints_per_run", "must be >= 0")
        if not self.seeds:
            raise bad("seeds", "must list at least one seed")
        # A repeated value would plan the same run twice (one run id for both): name the list.
        for name in ("recurrences", "seeds"):
            values = getattr(self, name)
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise bad(name, f"repeats {repeated}; each value must appear once")
        for w in self.widths_for_all():
            repeated = sorted({d for d in w if w.count(d) > 1})
            if repeated:
                raise bad("widths", f"repeats {repeated} within one budget; each width must appear once")
        if self.learning_rate_by_r is not None:
            lrs = self.learning_rate_by_r
            if not isinstance(lrs, dict) or any(
                not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 for v in lrs.values()
            ):
                raise bad("learning_rate_by_r", "must map each r to a positive learning rate")
            try:
                lrs = {int(k): float(v) for k, v in lrs.items()}
            except (TypeError, ValueError) as err:
                raise bad("learning_rate_by_r", f"keys must be values of r ({err})") from err
            missing = [r for r in self.recurrences if r not in lrs]
            if missing:
                raise bad("learning_rate_by_r", f"has no learning rate for r = {missing}")
            self.learning_rate_by_r = lrs

    def widths_for_all(self) -> list[list[int]]:
        if self.widths and isinstance(self.widths[0], list):
            return [list(w) for w in self.widths]
        return [list(self.widths) for _ in self.budgets]


def parse_sweep_section(data: Any, where: str) -> SweepArguments:
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: 'sweep' must be a mapping of sweep fields")
    known = {f.name for f in dataclasses.fields(SweepArguments)}
    for key in data:
        if key not in known:
            raise RecipeError(f"{where}: unknown field 'sweep.{key}' (known: {', '.join(sorted(known))})")
    data = dict(data)
    if "budgets" in data:
        try:
            data["budgets"] = [float(b) for b in data["budgets"]]  # YAML reads 1e12 (no dot) as a string
        except (TypeError, ValueError) as err:
            raise RecipeError(f"{where}: sweep.budgets={data['budgets']!r}: must be numbers ({err})") from err
    # Each field's type and rule are declared on it (for a list or mapping: each of its numbers).
    declared = declared_fields(SweepArguments)
    for key in data:
        data[key] = check_value(f"sweep.{key}", data[key], *declared[key], where)
    args = SweepArguments(**data)
    try:
        args.validate()
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None
    return args


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass
class PlannedRun:
    """One run of the plan (all FLOPs from the model's own `training_flops_per_token`)."""

    run_id: str
    arch: str
    variant: str
    budget_index: int
    budget: float
    hidden_size: int
    num_recurrences: int
    num_prelude_layers: int
    num_recurrent_layers: int
    num_coda_layers: int
    input_injection: str
    backprop_recurrences: int | None
    seed: int
    effective_num_layers: int
    n_once: int
    n_rec: int
    flops_per_token: float
    target_tokens: float
    steps: int
    tokens: int
    flops: float
    recipe: dict[str, Any]
    learning_rates: dict[str, Any] | None = None
    """optimizer muonh: the run's peak lr per group and the HyperP factors (`looped_hf.optim.
    LearningRates.to_dict`); the run's recipe carries the lrs themselves (lr_scaling none).
    With `sweep.learning_rate_by_r`: {"learning_rate": lr, "scaling": "by_r"}."""


@dataclass
class SweepPlan:
    sweep: SweepArguments
    base_recipe: dict[str, Any]
    runs: list[PlannedRun]
    tokens_per_step: int
    vocab_size: int
    seq_len: int
    eval_blocks: int | None = None
    """Held-out blocks of seq_len tokens every run is evaluated on (DataArguments.eval_blocks)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep": dataclasses.asdict(self.sweep),
            "tokens_per_step": self.tokens_per_step,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "eval_blocks": self.eval_blocks,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }

    def summary(self) -> list[str]:
        """The plan's totals (runs per arch, FLOPs, batch, held-out size, lr rule), one per line."""
        lines: list[str] = []
        by_arch: dict[str, int] = {}
        for r in self.runs:
            by_arch[r.arch] = by_arch.get(r.arch, 0) + 1
        total = sum(r.flops for r in self.runs)
        arch_counts = ", ".join(f"{a} {n}" for a, n in by_arch.items())
        lines.append(
            f"{len(self.runs)} runs ({arch_counts}); {total:.3g} training FLOPs in all; "
            f"{self.tokens_per_step:,} tokens per step; seq_len {self.seq_len}; vocab {self.vocab_size}"
            + self._padding_note()
        )
        rounding = self.base_recipe.get("train_steps_rounding", "up")
        lines.append(
            "steps: budget / (FLOPs per token x tokens per step), "
            + ("rounded to the nearest (as the study)" if rounding == "nearest" else "rounded up (never under budget)")
            + " (train_steps_rounding)"
        )
        if self.eval_blocks is not None:
            lines.append(
                f"held-out set: {self.eval_blocks:,} blocks x {self.seq_len:,} = "
                f"{self.eval_blocks * self.seq_len:,} tokens per run (data field eval_blocks)"
            )
        scaled = [r.learning_rates for r in self.runs if r.learning_rates and r.learning_rates["scaling"] == "hyperp"]
        if scaled:
            lines.append(
                f"lrs: HyperP per run (looped_hf.optim.hyperp_learning_rates): every lr x (B / 262,144)^0.558 = "
                f"x{scaled[0]['batch_scale']:.4g}; matrix lr x (T / D_REF)^-0.32 with D_REF (the reference's "
                "params at the run's r) "
                + ", ".join(f"{d:,} at r = {r}" for r, d in sorted(self._reference_tokens_by_r().items()))
                + "; AdamW lrs x (d / 640)^-0.5"
            )
        if self.sweep.learning_rate_by_r:
            lines.append(
                "lrs: learning_rate by r (sweep.learning_rate_by_r): "
                + ", ".join(f"r = {r}: {lr:g}" for r, lr in sorted(self.sweep.learning_rate_by_r.items()))
            )
        return lines

    def _padding_note(self) -> str:
        multiple = self.base_recipe.get("pad_vocab_size_to_multiple_of", 1)
        if not isinstance(multiple, int) or multiple <= 1 or self.vocab_size % multiple == 0:
            return ""
        return f" (embedding and head padded to {-(-self.vocab_size // multiple) * multiple:,} rows, counted in FLOPs)"

    def _reference_tokens_by_r(self) -> dict[int, int]:
        """HyperP's D_REF of each r (the study counts its reference at the run's r)."""
        return {
            r.num_recurrences: r.learning_rates["reference_tokens"]
            for r in self.runs
            if r.learning_rates and r.learning_rates["scaling"] == "hyperp"
        }

    def table(self) -> str:
        """The plan as a fixed-width table plus totals; with muonh, each run's peak lrs (matrix,
        embedding, lm_head, norm scales, and hyperconnection gains where a run has them)."""
        lr_cols = [("matrix", "lr_mat"), ("embedding", "lr_emb"), ("lm_head", "lr_head"), ("norm", "lr_norm")]
        if any(r.input_injection == "hyperconnection" for r in self.runs):
            lr_cols.append(("hyperconnection", "lr_hc"))
        if any(r.learning_rates and r.learning_rates["scaling"] == "by_r" for r in self.runs):
            lr_cols = [("learning_rate", "lr")]
        if not any(r.learning_rates for r in self.runs):
            lr_cols = []
        head = f"{'run_id':<30} {'budget':>9} {'width':>5} {'r':>2} {'P/K/C':>7} {'n_once':>11} {'n_rec':>11} " \
               f"{'tokens':>13} {'FLOPs':>9} {'steps':>7}" + "".join(f" {title:>8}" for _, title in lr_cols)  # fmt: skip
        lines = [head, "-" * len(head)]
        for r in self.runs:
            pkc = f"{r.num_prelude_layers}/{r.num_recurrent_layers}/{r.num_coda_layers}"
            lrs = "".join(
                f" {r.learning_rates[key]:>8.3g}" if r.learning_rates and (key != "hyperconnection" or
                r.input_injection == "hyperconnection") else f" {'-':>8}" for key, _ in lr_cols
            )  # fmt: skip
            lines.append(
                f"{r.run_id:<30} {r.budget:>9.3g} {r.hidden_size:>5} {r.num_recurrences:>2} {pkc:>7} "
                f"{r.n_once:>11,} {r.n_rec:>11,} {r.tokens:>13,} {r.flops:>9.3g} {r.steps:>7,}{lrs}"
            )
        lines.append("-" * len(head))
        lines += self.summary()
        return "\n".join(lines)


def _shape(sweep: SweepArguments, r: int) -> tuple[int, int, int, str, int | None]:
    """(prelude, block, coda, injection, backprop_recurrences) of the iso-depth model with r."""
    if r == 1:
        return 0, sweep.effective_depth, 0, "none", None
    block = (sweep.effective_depth - sweep.prelude - sweep.coda) // r
    injection, k = sweep.injection, None
    if sweep.variant == "truncated":
        k = math.ceil(r / 2)
    elif sweep.variant == "hyperconnection":
        injection = "hyperconnection"
    return sweep.prelude, block, sweep.coda, injection, k


@dataclass(frozen=True)
class _Accounting:
    """What the plan reads from one model shape's own accounting (see `_model_accounting`)."""

    n_once: int
    n_rec: int
    flops_per_token: float
    muonh_error: str | None
    """Why `muonh_parameter_groups` refuses the model (a tied head, an ungrouped parameter), or None."""


_ACCOUNTING: dict[tuple[Any, ...], _Accounting] = {}


def _model_accounting(model_args: Any, config: Any, seq_len: int) -> _Accounting:
    """N_once, N_rec and training FLOPs per token of `config` (built from `model_args`) from the
    model's own `num_scaling_params` and `training_flops_per_token`, on the meta device, once per
    shape: a paper grid repeats each width x r at several budgets. Keyed by the model fields, the
    vocabulary and seq_len, which determine the config (cheaper than serialising it)."""
    import torch
    from transformers.initialization import no_init_weights

    from looped_hf import LoopedForCausalLM
    from looped_hf.optim import muonh_parameter_groups

    key = (repr(sorted(model_args.settings.items())), config.vocab_size, int(seq_len))
    if key not in _ACCOUNTING:
        # Shapes are all the accounting reads: no init (on meta it only costs time; ~2x faster).
        with torch.device("meta"), no_init_weights():
            model = LoopedForCausalLM(config)
        params = model.num_scaling_params()
        try:
            muonh_parameter_groups(model)
            error = None
        except ValueError as err:
            error = str(err)
        _ACCOUNTING[key] = _Accounting(
            int(params["once"]), int(params["recurrent"]), model.training_flops_per_token(seq_len), error
        )
    return _ACCOUNTING[key]


def make_plan(
    recipe: str | os.PathLike | dict[str, Any], sweep_dir: str | os.PathLike | None = None, text: str | None = None
) -> SweepPlan:
    """Turn a sweep recipe into its runs; every error names the recipe field. `text`: the recipe
    file's text, when already read (`run_sweep`): parsed instead of reading the file again.

    Each run's N_once, N_rec and FLOPs per token are its model's own accounting; its steps are
    `steps_for_tokens(budget / flops_per_token)` with the recipe's `train_steps_rounding` (the paper
    recipes: nearest, as the study); with muonh, its lrs are `hyperp_learning_rates` at T =
    int(budget / flops_per_token), as the study's base_train.py."""
    from looped_hf.arguments import LENGTH_FIELDS, parse_recipe, tokens_per_step
    from looped_hf.optim import hyperp_learning_rates
    from looped_hf.train import arch_name

    if isinstance(recipe, dict):
        data, where = dict(recipe), "sweep recipe"
    else:
        data, where = load_yaml(recipe, "sweep recipe", text), f"sweep recipe {str(recipe)!r}"
    if "sweep" not in data:
        raise RecipeError(f"{where}: no 'sweep' section (a single run is `looped-hf train`)")
    sweep = parse_sweep_section(data.pop("sweep"), where)
    for name in (*LENGTH_FIELDS, "output_dir", "run_id", "arch", "variant", "results_file"):
        if name in data:
            raise RecipeError(f"{where}: field {name!r} is set by the sweep for each run; remove it")
    model_fields = ("hidden_size", "num_attention_heads", "head_dim", "num_prelude_layers", "num_recurrent_layers",
                    "num_coda_layers", "num_recurrences", "input_injection", "backprop_recurrences")  # fmt: skip
    for name in model_fields:
        if name in data:
            raise RecipeError(
                f"{where}: field {name!r} is set by the sweep (see the sweep: section); remove it"
            )
    # Parsing the shared part checks every field name and value once, before any run starts, in
    # the shape every run shares (the sweep's prelude, coda and injection: a design option may
    # depend on them, e.g. Ouro's gate loss needs no coda). Precision flags do not change the
    # plan, and TrainingArguments rejects bf16 on a machine without a GPU: drop them so a GPU
    # recipe can be planned (--dry-run) anywhere.
    shared_shape = {"num_prelude_layers": sweep.prelude, "num_coda_layers": sweep.coda, "input_injection": sweep.injection}
    model_args, data_args, training_args = parse_recipe(
        {
            **{
                k: v
                for k, v in data.items()
                if k not in ("bf16", "fp16", "tf32", "bf16_full_eval", "fp16_full_eval")
            },
            **shared_shape,
        },
        where=where,
        lines=None if isinstance(recipe, dict) else yaml_key_lines(recipe, text),
    )
    seq_len = data_args.seq_len
    step_tokens = tokens_per_step(training_args, seq_len, world_size=sweep.num_processes)
    if sweep.vocab_size is not None:
        vocab = sweep.vocab_size
    else:
        from looped_hf.data import load_tokenizer

        vocab = len(load_tokenizer(data_args.tokenizer))
    sweep_dir = Path(sweep_dir) if sweep_dir is not None else None

    runs: list[PlannedRun] = []
    for b, (budget, widths) in enumerate(zip(sweep.budgets, sweep.widths_for_all())):
        for width in widths:
            for r in sweep.recurrences:
                for seed in sweep.seeds:
                    prelude, block, coda, injection, k = _shape(sweep, r)
                    run_model = model_args.replace(
                        hidden_size=width, head_dim=sweep.head_dim, num_attention_heads=None,
                        num_prelude_layers=prelude, num_recurrent_layers=block, num_coda_layers=coda,
                        num_recurrences=r, input_injection=injection, backprop_recurrences=k,
                        num_hyperconnection_lanes=sweep.hyperconnection_lanes,
                    )  # fmt: skip
                    config = run_model.to_config(vocab, seq_len)
                    accounting = _model_accounting(run_model, config, seq_len)
                    fpt = accounting.flops_per_token
                    target = budget / fpt
                    steps = steps_for_tokens(target, step_tokens, f"sweep.budgets[{b}]", f"{budget:.4g}",
                                             rounding=training_args.train_steps_rounding)  # fmt: skip
                    arch = arch_name(config)
                    run_id = f"{arch}-w{width}-b{b}"
                    if sweep.variant != "base":
                        run_id = f"{sweep.variant}-{run_id}"
                    if len(sweep.seeds) > 1:
                        run_id += f"-s{seed}"
                    run_recipe = dict(data)
                    run_recipe.update(
                        {f: run_model.settings[f] for f in (*model_fields, "num_hyperconnection_lanes")}
                    )
                    run_recipe.update(
                        train_flops_budget=float(budget),
                        run_id=run_id,
                        arch=arch,
                        variant=sweep.variant,
                        seed=seed,
                    )
                    lrs = None
                    if sweep.learning_rate_by_r is not None:
                        if training_args.optimizer == "muonh":
                            raise RecipeError(
                                f"{where}: sweep.learning_rate_by_r is for adamw / muon; muonh's lrs are "
                                "HyperP's per run (remove it, or set lr_scaling: none and give the lrs)"
                            )
                        lr = sweep.learning_rate_by_r[r]
                        run_recipe["learning_rate"] = lr
                        lrs = {"learning_rate": lr, "scaling": "by_r"}
                    if training_args.optimizer == "muonh":
                        # The study's per-run lrs (HyperP: this run's batch, target tokens T =
                        # int(budget / flops_per_token) as base_train.py, width), written into
                        # the run's recipe so it trains at exactly these (lr_scaling none).
                        if accounting.muonh_error is not None:  # a tied head or a parameter no group takes
                            raise RecipeError(f"{where}: run {run_id}: {accounting.muonh_error}")
                        try:
                            rates = hyperp_learning_rates(
                                training_args, config, tokens_per_step=step_tokens, train_tokens=int(target)
                            )
                        except ValueError as err:
                            raise RecipeError(f"{where}: run {run_id}: {err}") from err
                        run_recipe.update(rates.recipe_fields())
                        lrs = rates.to_dict()
                    if sweep_dir is not None:
                        run_recipe["output_dir"] = str(sweep_dir / run_id)
                    if sweep.checkpoints_per_run > 0:
                        run_recipe.update(
                            save_strategy="steps",
                            save_steps=max(1, math.ceil(steps / sweep.checkpoints_per_run)),
                            save_total_limit=1,
                        )
                    runs.append(
                        PlannedRun(
                            run_id=run_id, arch=arch, variant=sweep.variant, budget_index=b, budget=float(budget),
                            hidden_size=width, num_recurrences=r, num_prelude_layers=prelude,
                            num_recurrent_layers=block, num_coda_layers=coda, input_injection=injection,
                            backprop_recurrences=k, seed=seed, effective_num_layers=config.effective_num_layers,
                            n_once=accounting.n_once, n_rec=accounting.n_rec, flops_per_token=fpt,
                            target_tokens=target, steps=steps, tokens=steps * step_tokens,
                            flops=steps * step_tokens * fpt, recipe=run_recipe, learning_rates=lrs,
                        )
                    )  # fmt: skip
    ids = [r.run_id for r in runs]
    if len(set(ids)) != len(ids):
        raise RecipeError(f"{where}: sweep.widths: repeated widths give duplicate run ids")
    return SweepPlan(sweep, data, runs, step_tokens, vocab, seq_len, eval_blocks=data_args.eval_blocks)
