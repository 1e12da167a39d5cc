"""Optimizers, per-run learning rates and the study's schedule, in the form `Trainer(optimizers=...)` takes.

- `"adamw"` (default): `torch.optim.AdamW` over every parameter (hyperconnection gains at their
  own lr, the study's 0.01).
- `"muon"`: `torch.optim.Muon` for the 2-D weight matrices inside the layers (attention, MLP, the
  linear injection adapter), AdamW at `learning_rate` for the rest. Plain Muon: not the study's.
- `"muonh"`: the study's recipe, HyperP (arXiv 2603.28743) as its `nanochat/optim.py` and
  `nanochat/gpt.py setup_optimizer` build it. `MuonH` for every 2-D matrix inside the layers and
  the injection adapter; AdamW (betas 0.8, 0.95; eps 1e-10; no weight decay) for lm_head 0.004,
  embedding 0.3, norm scales 0.005 and hyperconnection gains 0.01, each times (d / 640)^-0.5.
  `hyperp_learning_rates` scales them per run as the study's `scripts/base_train.py` does.
- Schedule "study": `warmup_steps` (the study: 0) then linear decay to `final_lr_ratio` (0.1) of
  the peak at `max_steps` (base_train.py get_lr_multiplier with warmdown_ratio 1).

`CombinedOptimizer` lets one `Trainer` drive two optimizers: it shares their param-group dicts
(so one LR scheduler scales every group) and checkpoints both states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from looped_hf.arguments import LoopedTrainingArguments

# --- HyperP constants, all from the study's scripts/base_train.py --------------------------------
#: Reference batch in tokens per optimizer step (B_REF = 2**18); every lr scales by (B / B_REF)^0.558
#: (the study's script leaves the norm and hyperconnection lrs out; see hyperp_learning_rates).
HYPERP_BATCH_REF = 2**18
HYPERP_BATCH_EXPONENT = 0.558  # HyperP section 5.4
#: The matrix lr scales by (T / D_REF)^-0.32 (HyperP section 3.4): wider models under iso-FLOP
#: sampling train on fewer tokens and get a higher lr.
HYPERP_DATA_EXPONENT = -0.32
#: The reference model: size 10 x aspect ratio 64 = width 640 (REF_SIZE, D_REF_DIM), trained on
#: 10 tokens per scaling parameter (REF_DATA_RATIO).
HYPERP_REF_WIDTH = 640
HYPERP_REF_DATA_RATIO = 10
#: The reference shapes (build_reference_model): looped runs (r > 1) -> prelude 2, block 4 x 4,
#: coda 2 with linear injection; non-looped runs -> 20 layers, r = 1, no injection. The reference
#: is built with r = 4, but its scaling params are counted at the RUN's r (see hyperp_reference_tokens).
HYPERP_REF_LOOPED = {"num_prelude_layers": 2, "num_recurrent_layers": 4, "num_coda_layers": 2,
                     "num_recurrences": 4, "input_injection": "linear"}  # fmt: skip
HYPERP_REF_PLAIN = {"num_prelude_layers": 0, "num_recurrent_layers": 20, "num_coda_layers": 0,
                    "num_recurrences": 1, "input_injection": "none"}  # fmt: skip

# --- MuonH constants (nanochat/optim.py, gpt.py setup_optimizer) ---------------------------------
MUONH_MOMENTUM = 0.95
MUONH_NS_STEPS = 5
#: Polar Express (Amsel et al. 2025, arXiv 2505.16932) coefficients for 5 iterations, safety factor
#: 2e-2, cushion 2: the values in the study's nanochat/optim.py.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers stepped as one (for Trainer / accelerate, which take a single one).

    `param_groups` are the inner optimizers' own group dicts, so schedulers and gradient
    clipping act on all of them; `state_dict` nests the inner states by position.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        groups = [group for opt in self.optimizers for group in opt.param_groups]
        super().__init__(groups, {})
        # Optimizer.__init__ re-adds the same dicts; keep the exact objects shared with the inners.
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict["optimizers"]
        if len(inner) != len(self.optimizers):
            raise ValueError(
                f"checkpoint has {len(inner)} optimizer states, this run has {len(self.optimizers)}"
            )
        for opt, sd in zip(self.optimizers, inner):
            opt.load_state_dict(sd)


# ---------------------------------------------------------------------------------------------
# MuonH
# ---------------------------------------------------------------------------------------------
def polar_express(g: Tensor, steps: int = MUONH_NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """An approximately orthogonal U V^T of each matrix in `g` (shape (..., m, n)), in `dtype`.

    The study's Polar-Express iteration (nanochat/optim.py muon_step_fused): normalise by
    1.02 x the Frobenius norm, then `steps` odd-polynomial iterations X <- a X + (b A + c A^2) X
    with A = X X^T (or X^T X for tall matrices, so A is the smaller Gram matrix). Batched over the
    leading dimensions, so one call handles a stack of same-shape matrices. bf16, as the study:
    the iteration is built to tolerate it, and it is the faster matmul on GPUs and recent CPUs.
    """
    if not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"polar_express steps={steps}: must be in [1, {len(POLAR_EXPRESS_COEFFS)}]")
    x = g.to(dtype)
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) * 1.02 + 1e-6)
    if x.size(-2) > x.size(-1):
        for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
            gram = x.mT @ x
            x = a * x + x @ (b * gram + c * (gram @ gram))
    else:
        for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


class MuonH(torch.optim.Optimizer):
    """MuonH (Muon on the hyperball; HyperP, arXiv 2603.28743), as the study's nanochat/optim.py.

    For every 2-D parameter W with gradient G, per step:

        buf <- 0.95 buf + 0.05 G                     momentum (buf.lerp_(G, 1 - momentum))
        g   <- G + 0.95 (buf - G)                    Nesterov (G.lerp_(buf, momentum))
        U   <- polar_express(g)                      ~ orthogonal, 5 iterations in bf16
        U   <- U * ||W_0||_F / ||U||_F               the update has the weight's initial norm
        W   <- W - lr U
        W   <- W * ||W_0||_F / ||W||_F               back onto the sphere: ||W||_F never changes

    No weight decay (a first-order no-op on the sphere). ||W_0||_F is the norm at the first step
    (the initial weights), kept per parameter in the optimizer state as `initial_norm` with the
    momentum buffer, so a checkpoint resumes it exactly. Parameters of one shape are stacked and
    orthogonalised in one batched call (the study groups by shape for the same reason); the
    scaling and projection run in the parameter's dtype (the study: in bf16), the rest as the study.
    A zero initial norm is refused: such a matrix could never move.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.014,
        momentum: float = MUONH_MOMENTUM,
        ns_steps: int = MUONH_NS_STEPS,
        ortho_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"MuonH lr={lr}: must be > 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"MuonH momentum={momentum}: must be in [0, 1)")
        if not 1 <= ns_steps <= len(POLAR_EXPRESS_COEFFS):
            raise ValueError(f"MuonH ns_steps={ns_steps}: must be in [1, {len(POLAR_EXPRESS_COEFFS)}]")
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"MuonH: parameters must be 2-D matrices, got shape {tuple(p.shape)}")
        self.ortho_dtype = ortho_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape: dict[tuple[int, ...], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(tuple(p.shape), []).append(p)
            for params in by_shape.values():
                self._step_stack(params, group)
        return loss

    def _step_stack(self, params: list[Tensor], group: dict[str, Any]) -> None:
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                norm = torch.linalg.matrix_norm(p.detach()).to(p.dtype)
                if not norm > 0:
                    raise ValueError(
                        f"MuonH: a {tuple(p.shape)} matrix has Frobenius norm 0 at its first step; MuonH keeps "
                        "||W||_F at its initial value, so it could never move (initialise it non-zero)"
                    )
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["initial_norm"] = norm
        momentum = group["momentum"]
        grads = [p.grad for p in params]
        buffers = [state["momentum_buffer"] for state in states]
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        g = torch.stack(grads).lerp_(torch.stack(buffers), momentum)  # Nesterov, on a copy of the grads
        update = polar_express(g, group["ns_steps"], self.ortho_dtype).to(g.dtype)
        target = torch.stack([state["initial_norm"] for state in states]).view(-1, 1, 1)
        update.mul_(target / torch.linalg.matrix_norm(update, keepdim=True).clamp_min(1e-10))
        weights = torch.stack(params)
        weights.sub_(update, alpha=group["lr"])
        weights.mul_(target / torch.linalg.matrix_norm(weights, keepdim=True).clamp_min(1e-10))
        if any(hasattr(p, "full_tensor") for p in params):
            # FSDP2 shards parameters as DTensors, which have no sharding rule for _foreach_copy_.
            for p, w in zip(params, weights.unbind(0)):
                p.copy_(w)
        else:
            torch._foreach_copy_(params, list(weights.unbind(0)))


# ---------------------------------------------------------------------------------------------
# Parameter groups
# ---------------------------------------------------------------------------------------------
def peft_base(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a peft wrapper (LoRA), or ``model`` itself: the wrapper's parameters are
    the base's, and the groups are chosen by the base's modules."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _split_parameters(model: torch.nn.Module) -> tuple[list, list, list]:
    """(matrices inside layers, hyperconnection gains, everything else), each param once."""
    base = model.model
    layer_modules = [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers]
    if getattr(base, "injection", None) is not None:
        layer_modules.append(base.injection)
    matrices, seen = [], set()
    for module in layer_modules:
        for p in module.parameters():
            if p.requires_grad and p.ndim == 2 and id(p) not in seen:
                matrices.append(p)
                seen.add(id(p))
    hyper = []
    if getattr(base, "hyperconnection", None) is not None:
        for p in base.hyperconnection.parameters():
            if p.requires_grad and id(p) not in seen:
                hyper.append(p)
                seen.add(id(p))
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    return matrices, hyper, rest


#: The AdamW groups of muonh, in the study's order (setup_optimizer: lm_head, embedding, norms,
#: hyperconnection gains), then the MuonH matrices.
MUONH_ADAMW_GROUPS = ("lm_head", "embedding", "norm", "hyperconnection")


def muonh_parameter_groups(model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """The study's split of a `LoopedForCausalLM` for muonh, chosen by module (not by name).

    "matrix": every 2-D weight of the prelude / recurrent / coda layers and the injection
    adapter; "norm": every RMSNorm scale (incl. a learnable QK-norm's); "lm_head", "embedding";
    "hyperconnection": the lane gains. Every trainable parameter lands in exactly one group; one
    that fits none (a bias, say: the study's model has none) is an error naming it, as is a tied
    head (the study's embedding and head train at lrs 75x apart).
    """
    from looped_hf.modeling_looped import LoopedRMSNorm

    base = model.model
    if model.lm_head.weight is base.embed_tokens.weight:
        raise ValueError(
            "optimizer 'muonh' needs an untied lm_head (tie_word_embeddings=True): the study trains the "
            "embedding at lr 0.3 and the head at 0.004"
        )
    groups: dict[str, list[torch.nn.Parameter]] = {name: [] for name in (*MUONH_ADAMW_GROUPS, "matrix")}
    seen: set[int] = set()

    def add(group: str, params: Iterable[torch.nn.Parameter]) -> None:
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups[group].append(p)

    add("lm_head", model.lm_head.parameters())
    add("embedding", base.embed_tokens.parameters())
    add("norm", (m.weight for m in model.modules() if isinstance(m, LoopedRMSNorm)))
    if base.hyperconnection is not None:
        add("hyperconnection", base.hyperconnection.parameters())
    for module in [*base.prelude_layers, *base.recurrent_layers, *base.coda_layers, base.injection]:
        if module is not None:
            add("matrix", (p for p in module.parameters() if p.ndim == 2))
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if left:
        raise ValueError(
            f"optimizer 'muonh' has no group for {left} (the study's groups: 2-D layer and injection matrices, "
            "RMSNorm scales, embedding, lm_head, hyperconnection gains)"
        )
    return groups


# ---------------------------------------------------------------------------------------------
# Per-run learning rates (HyperP)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LearningRates:
    """The peak lr of every muonh group of one run, and how it was obtained.

    `scaling` is "hyperp" (the reference lrs times the factors below) or "none" (as given).
    """

    matrix: float
    embedding: float
    lm_head: float
    norm: float
    hyperconnection: float
    scaling: str
    batch_scale: float = 1.0
    data_scale: float = 1.0
    width_scale: float = 1.0
    tokens_per_step: int | None = None
    train_tokens: float | None = None
    reference_tokens: int | None = None

    def groups(self) -> dict[str, float]:
        """`{group name: lr}` in the names of `muonh_parameter_groups`."""
        return {name: getattr(self, name) for name in ("matrix", *MUONH_ADAMW_GROUPS)}

    def recipe_fields(self) -> dict[str, Any]:
        """The recipe keys that make a run train at exactly these lrs."""
        return {
            "muon_learning_rate": self.matrix,
            "embedding_learning_rate": self.embedding,
            "lm_head_learning_rate": self.lm_head,
            "norm_learning_rate": self.norm,
            "hyperconnection_learning_rate": self.hyperconnection,
            "lr_scaling": "none",
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _reference_fields(config: Any) -> tuple[tuple[str, Any], ...]:
    """The `LoopedConfig` fields of `config`'s reference model (see `hyperp_reference_config`)."""
    head_dim = config.head_dim
    width = math.ceil(HYPERP_REF_WIDTH / head_dim) * head_dim
    shape = HYPERP_REF_LOOPED if config.num_recurrences > 1 else HYPERP_REF_PLAIN
    fields = {
        "vocab_size": config.vocab_size,
        "hidden_size": width,
        "num_attention_heads": width // head_dim,
        "head_dim": head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "qk_norm": config.qk_norm,
        "embedding_norm": config.embedding_norm,
        "recurrence_norm": config.recurrence_norm,
        "tie_word_embeddings": config.tie_word_embeddings,
        "logit_softcap": config.logit_softcap,
        **shape,
    }
    return tuple(fields.items())


def hyperp_reference_config(config: Any) -> Any:
    """The study's size-10 reference model for `config` (scripts/base_train.py build_reference_model).

    Width 640 rounded up to a multiple of the run's head_dim, heads = width / head_dim, the
    study's block (MLP 4d for relu2) with the run's activation and norm switches; shape 2-4x4-2
    with linear injection if the run loops (r > 1), else 20 layers at r = 1: the reference is
    "of the same kind", whatever the run's own truncation or hyperconnections. Its `num_recurrences`
    is the study's 4; `hyperp_reference_tokens` counts its scaling params at the run's r.
    """
    from looped_hf.configuration_looped import LoopedConfig

    return LoopedConfig(**dict(_reference_fields(config)))


@functools.lru_cache(maxsize=64)
def _reference_params(fields: tuple[tuple[str, Any], ...]) -> tuple[int, int]:
    # Cached: a sweep plans a hundred runs against two reference models.
    from transformers.initialization import no_init_weights

    from looped_hf.configuration_looped import LoopedConfig
    from looped_hf.modeling_looped import LoopedForCausalLM

    with torch.device("meta"), no_init_weights():  # shapes only: no init needed
        params = LoopedForCausalLM(LoopedConfig(**dict(fields))).num_scaling_params()
    return int(params["once"]), int(params["recurrent"])


def hyperp_reference_tokens(config: Any) -> int:
    """D_REF = 10 x the scaling params of the reference model of `config`'s kind, at `config`'s r.

    Scaling params are the study's `effective_params(exclude_embedding=True)`: N_once + r N_rec,
    from the model's own accounting (`num_scaling_params`, built on the meta device). r is the
    RUN's `num_recurrences`, not the reference's 4: the study's get_scaling_params reads
    `model_config.num_recur` of the training model for the reference too (scripts/base_train.py),
    so D_REF is 606M / 1016M / 1836M for r = 2 / 4 / 8 at width 640, head 128, vocab 32,001, and
    looped runs of the same size and budget get different matrix lrs (-15% at r = 2, +21% at
    r = 8 against r = 4). We follow it: these are the lrs the study's phi was measured with.
    """
    once, recurrent = _reference_params(_reference_fields(config))
    return HYPERP_REF_DATA_RATIO * (once + int(config.num_recurrences) * recurrent)


def hyperp_learning_rates(
    args: LoopedTrainingArguments,
    config: Any,
    *,
    tokens_per_step: int | None = None,
    train_tokens: float | None = None,
) -> LearningRates:
    """The peak lrs of a muonh run: `args`' lrs scaled per run (lr_scaling "hyperp") or as given.

    HyperP as the study's scripts/base_train.py and gpt.py setup_optimizer apply it:

        every lr         x (B / 262,144)^0.558          B = tokens_per_step (tokens per optimizer step)
        matrix lr        x (T / D_REF)^-0.32            T = train_tokens, D_REF: `hyperp_reference_tokens`
        AdamW group lrs  x (d / 640)^-0.5               d = config.hidden_size

    One deliberate difference: the study's base_train.py batch-scales only the matrix, embedding
    and lm_head lrs; setup_optimizer sets the norm (0.005) and hyperconnection (0.01) lrs itself,
    unscaled. looped_hf scales every lr, as HyperP scales every AdamW group. At the study's
    262,144-token batch (the paper recipes) the two agree to the digit; at 2^19 tokens per step the
    study's norm lr would be 32% below ours. The sweep planner and `looped-hf train` both call this,
    so a planned run and a single run with the same batch, tokens and width get the same lrs.
    """
    base = LearningRates(
        matrix=args.muon_learning_rate,
        embedding=args.embedding_learning_rate,
        lm_head=args.lm_head_learning_rate,
        norm=args.norm_learning_rate,
        hyperconnection=args.hyperconnection_learning_rate,
        scaling="none",
    )
    if args.lr_scaling == "none":
        return base
    if args.lr_scaling != "hyperp":
        raise ValueError(
            f"LoopedTrainingArguments.lr_scaling={args.lr_scaling!r}: must be 'hyperp' or 'none'"
        )
    if tokens_per_step is None or train_tokens is None:
        raise ValueError(
            f"lr_scaling='hyperp' scales the lrs by the run's batch and length: give tokens_per_step "
            f"(got {tokens_per_step}) and train_tokens (got {train_tokens}), or set lr_scaling='none'"
        )
    if tokens_per_step < 1 or not train_tokens > 0:
        raise ValueError(f"tokens_per_step={tokens_per_step}, train_tokens={train_tokens}: must be positive")
    reference = hyperp_reference_tokens(config)
    batch = (tokens_per_step / HYPERP_BATCH_REF) ** HYPERP_BATCH_EXPONENT
    data = (train_tokens / reference) ** HYPERP_DATA_EXPONENT
    width = (config.hidden_size / HYPERP_REF_WIDTH) ** -0.5
    return LearningRates(
        matrix=base.matrix * batch * data,
        embedding=base.embedding * batch * width,
        lm_head=base.lm_head * batch * width,
        norm=base.norm * batch * width,
        hyperconnection=base.hyperconnection * batch * width,
        scaling="hyperp",
        batch_scale=batch,
        data_scale=data,
        width_scale=width,
        tokens_per_step=int(tokens_per_step),
        train_tokens=float(train_tokens),
        reference_tokens=int(reference),
    )


def lr_train_tokens(
    args: LoopedTrainingArguments, flops_per_token: float, max_steps: int, tokens_per_step: int
) -> float:
    """T of the data scaling: the run's target tokens, as the study's base_train.py takes them.

    `train_flops_budget / flops_per_token` (the study: int(target_flops / flops_per_token)),
    `train_tokens`, or `max_steps x tokens_per_step` (the study's --num-iterations case).
    """
    if args.train_flops_budget is not None:
        return float(int(args.train_flops_budget / flops_per_token))
    if args.train_tokens is not None:
        return float(args.train_tokens)
    return float(max_steps * tokens_per_step)


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------
def build_optimizer(
    model: torch.nn.Module,
    args: LoopedTrainingArguments,
    *,
    tokens_per_step: int | None = None,
    train_tokens: float | None = None,
) -> torch.optim.Optimizer:
    """The optimizer `args.optimizer` names, with the study's parameter split.

    Every param group carries a "name" (`learning_rates` reads them). muonh with lr_scaling
    "hyperp" needs the run's `tokens_per_step` and `train_tokens` (see `hyperp_learning_rates`).
    Only parameters that require gradients are taken (a frozen backbone, LoRA: `peft_base` finds
    the looped model inside a peft wrapper). "muon" is also the split of McLeish et al. 2025's
    retrofit (their `train.py`: Muon for the body, adapter included, AdamW for embeddings, head
    and norms, at separate lrs: `muon_learning_rate` 1e-3 and `learning_rate` 5e-5 in
    recipes/retrofit_*.yaml).
    """
    model = peft_base(model)
    if args.optimizer == "muonh":
        lrs = hyperp_learning_rates(
            args, model.config, tokens_per_step=tokens_per_step, train_tokens=train_tokens
        )
        return _build_muonh(model, args, lrs)
    matrices, hyper, rest = _split_parameters(model)
    adam_kwargs = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    hyper_group = (
        [
            {
                "params": hyper,
                "lr": args.hyperconnection_learning_rate,
                "weight_decay": 0.0,
                "name": "hyperconnection",
            }
        ]
        if hyper
        else []
    )
    if args.optimizer == "adamw":
        # Weight decay on matrices (and the embedding / head) only, not on norm scales: the usual split.
        decay = [p for p in matrices + rest if p.ndim >= 2]
        no_decay = [p for p in matrices + rest if p.ndim < 2]
        groups = [
            {"params": decay, "lr": args.learning_rate, "weight_decay": args.weight_decay, "name": "decay"},
            {"params": no_decay, "lr": args.learning_rate, "weight_decay": 0.0, "name": "no_decay"},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]] + hyper_group, **adam_kwargs)
    if args.optimizer == "muon":
        optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            optimizers.append(torch.optim.Muon(
                [{"params": matrices, "name": "muon"}], lr=args.muon_learning_rate, weight_decay=args.weight_decay
            ))  # fmt: skip
        adam = {"params": rest, "lr": args.learning_rate, "weight_decay": 0.0, "name": "adamw"}
        adam_groups = [adam, *hyper_group]
        if any(g["params"] for g in adam_groups):  # a frozen backbone may leave only adapter matrices
            optimizers.append(torch.optim.AdamW([g for g in adam_groups if g["params"]], **adam_kwargs))
        return CombinedOptimizer(optimizers)
    raise ValueError(
        f"LoopedTrainingArguments.optimizer={args.optimizer!r}: must be 'adamw', 'muon' or 'muonh'"
    )


def _build_muonh(
    model: torch.nn.Module, args: LoopedTrainingArguments, lrs: LearningRates
) -> CombinedOptimizer:
    groups = muonh_parameter_groups(model)
    rates = lrs.groups()
    adam = torch.optim.AdamW(
        [
            {"params": groups[name], "lr": rates[name], "name": name}
            for name in MUONH_ADAMW_GROUPS
            if groups[name]
        ],
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=0.0,
    )
    # One MuonH group per shape, sorted, as the study's setup_optimizer: each is one batched
    # orthogonalisation (a stack of same-shape matrices).
    shapes = sorted({tuple(p.shape) for p in groups["matrix"]})
    muon = MuonH(
        [{"params": [p for p in groups["matrix"] if tuple(p.shape) == s], "name": "matrix"} for s in shapes],
        lr=rates["matrix"],
    )
    return CombinedOptimizer([adam, muon])


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """`{group name: peak lr}` of an optimizer built here (groups sharing a name share an lr)."""
    out: dict[str, float] = {}
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name", f"group{i}")
        lr = float(group.get("initial_lr", group["lr"]))
        if name in out and out[name] != lr:
            name = f"{name}{i}"
        out[name] = lr
    return out


def study_schedule(
    optimizer: torch.optim.Optimizer, max_steps: int, warmup_steps: int = 0, final_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup over `warmup_steps` (the study: none), then linear decay from the peak to
    `final_lr_ratio` x peak at `max_steps`."""
    max_steps = max(1, int(max_steps))
    warmup_steps = int(warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, max_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 1.0 - (1.0 - final_lr_ratio) * progress

    return LambdaLR(optimizer, factor)


def build_optimizer_and_scheduler(
    model: torch.nn.Module,
    args: LoopedTrainingArguments,
    max_steps: int,
    *,
    tokens_per_step: int | None = None,
    train_tokens: float | None = None,
) -> tuple[torch.optim.Optimizer | None, Any]:
    """`(optimizer, scheduler)` for `Trainer(optimizers=...)`; `(None, None)` leaves both to the
    Trainer (AdamW with `lr_schedule="trainer"`). `tokens_per_step` / `train_tokens`: see
    `build_optimizer`."""
    if args.optimizer == "adamw" and args.lr_schedule == "trainer":
        return None, None
    optimizer = build_optimizer(model, args, tokens_per_step=tokens_per_step, train_tokens=train_tokens)
    if args.lr_schedule == "trainer":
        from transformers.optimization import get_scheduler

        scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=args.get_warmup_steps(max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
    else:
        scheduler = study_schedule(
            optimizer, max_steps, args.get_warmup_steps(max_steps), args.final_lr_ratio
        )
    return optimizer, scheduler


__all__ = [
    "CombinedOptimizer",
    "HYPERP_BATCH_REF",
    "HYPERP_REF_WIDTH",
    "LearningRates",
    "MuonH",
    "build_optimizer",
    "build_optimizer_and_scheduler",
    "hyperp_learning_rates",
    "hyperp_reference_config",
    "hyperp_reference_tokens",
    "learning_rates",
    "lr_train_tokens",
    "muonh_parameter_groups",
    "peft_base",
    "polar_express",
    "study_schedule",
]
