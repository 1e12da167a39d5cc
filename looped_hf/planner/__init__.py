"""Plan a training run from a fitted looped scaling law: phi as a decision.

A fit (:class:`looped_hf.scaling.ScalingLawFit`) says what loss a model of ``N_once``, ``N_rec``
trained with ``r`` recurrences on ``D`` tokens reaches. This module answers the question a user
trains for: *with C training FLOPs (and T tokens to serve), which width, r and token count, and
what loss?*

    looped-hf plan FIT.json --budget 1e20 1e21 [--recurrences 1 2 4 8] [--inference-tokens T]
                            [--inference-recurrences 4=2.7] [--kv-budget K] [--target-loss L]
                            [--recipe SWEEP.yaml] [--resamples N] [--json]

>>> from looped_hf.planner import plan                           # doctest: +SKIP
>>> p = plan(fit, [1e20], recipe="recipes/iso_depth_paper.yaml")  # doctest: +SKIP
>>> print(p.to_markdown()); p.to_dict()                           # doctest: +SKIP

The architecture family (prelude / block / coda split per r, head dim, vocabulary, seq_len,
injection) is the sweep recipe's: the one saved beside the fitted ``results.jsonl``
(``sweep.yaml``) or the one passed as ``recipe``. Its N_once, N_rec and FLOPs per token come from
the model's own accounting (``num_scaling_params``, ``training_flops_per_token``,
``inference_flops_per_token`` of ``LoopedForCausalLM`` built on the meta device through the sweep
plan, :func:`looped_hf.sweep.make_plan`). Every count is a polynomial of degree <= 2 in the width
at fixed head dim (layers are ``~12 d^2``, the head ``V d``, attention ``12 d T`` per layer
application, norms ``d``), so the family measures the model at three widths per r, takes the
exact quadratic through them and checks it against the model at a fourth: the numbers at any
width are the model's, without building a model per width.

Widths are multiples of the head dim (the only widths the family has). For a budget C and an r,
the plan spends the whole budget (the law's loss falls with tokens): ``D = C / flops_per_token(d)``,
and the width is the grid point with the lowest predicted loss. Every bootstrap resample of the
fit plans its own optimum, so the 95% band of the loss is the spread of *optimal* losses, not of
the loss at one fixed width.

Decisions:

- best r for a training budget (lowest predicted loss; with the share of resamples where it wins);
- with ``inference_tokens=T``: at the loss the best r reaches with C (or at ``target_loss``), the
  r whose cheapest model has the lowest training + T x inference FLOPs. A checkpoint measured with
  adaptive exit may pass its mean recurrences (``inference_recurrences={4: 2.7}``): inference FLOPs
  are linear in r, so the model's count at r and r + 1 gives any mean;
- with ``target_loss=L``: per r, the cheapest (width, tokens) that reaches L, or a plain
  statement that the law does not (L at or below its floor E, or beyond every width).

KV cache: bytes per token of context = layer applications that write KV x 2 (K and V) x kv_heads
x head_dim x bytes per element; with a KV budget k the block keeps min(k, r) applications instead
of r (``LoopedConfig.kv_budget``); prelude and coda keep theirs.

Where the code is: ``family`` (the architecture family and its accounting), ``results`` (the
result objects), ``search`` (the law over a width grid; ``plan``, ``model_at``, ``frontier``),
``cli`` (``looped-hf plan``).
"""

from .cli import main
from .family import ArchitectureFamily, FamilyMember, Quadratic, family_for_fit
from .results import PLAN_FORMAT, BudgetDecision, CostDecision, CostEntry, Extrapolation, Plan, PlanEntry
from .search import frontier, model_at, plan

__all__ = [
    "PLAN_FORMAT", "ArchitectureFamily", "BudgetDecision", "CostDecision", "CostEntry", "Extrapolation",
    "FamilyMember", "Plan", "PlanEntry", "Quadratic", "family_for_fit", "frontier", "main", "model_at", "plan",
]  # fmt: skip
