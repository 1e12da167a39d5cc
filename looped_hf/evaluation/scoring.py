"""Scoring a bundle's tasks at a given r, as the study's ``nanochat/core_eval.py`` does, in batches.

Per item (the study's rules):

- the prompt is rendered with ``num_fewshot`` examples drawn by ``random.Random(1234 + idx)`` from
  the task's other items (``idx``: the item's place in the shuffled, subsampled task), each
  followed by a blank line; the item itself comes last;
- multiple choice (options differ in their continuation) and schema (options differ in their
  context, the continuation is shared): the option with the lowest mean loss over its
  continuation tokens wins (ties: the first); the item's loss is the gold option's;
- language modelling: correct when the greedy argmax reproduces every continuation token.

Every sequence starts with the tokenizer's BOS (its EOS when it has none: the document boundary
a model trained on packed documents sees). Continuation tokens are located in token space: the
options' common prefix (multiple choice), common suffix (schema), or the context-only prompt
(language modelling). A sequence longer than the model's ``max_position_embeddings`` keeps its
last tokens, as the study does for models with a maximum length.

Task numbers: ``accuracy``; ``centered`` = (accuracy - 0.01 b) / (1 - 0.01 b) with ``b`` the task's
random baseline in percent; ``loss`` = nats per continuation token, summed over items and divided
by their tokens (token-weighted, the study's); ``mean_recurrences`` = recurrences run per scored
position (r, unless adaptive exit stopped tokens earlier).

Speed: items are tokenized once (:func:`prepare_task`) and reused at every r; the sequences of a
task are sorted by length and run in right-padded batches of at most ``batch_tokens`` tokens
(:func:`score_sequences`; causal attention makes right padding exact without a mask). A KV
budget below r acts only through the cache, so with one the continuation is decoded token by
token after a prefill of the context, as ``generate()`` would see it (one sequence at a time).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .bundle import Task

FEWSHOT_SEED = 1234  # the study: random.Random(1234 + idx)
DEFAULT_BATCH_TOKENS = 8192


class EvalError(ValueError):
    """An item or setting that cannot be scored; the message names the task, item and field."""


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------
def fewshot_indices(n_items: int, idx: int, num_fewshot: int) -> list[int]:
    """The few-shot examples of item ``idx``: ``num_fewshot`` of the other items, drawn with
    ``random.Random(1234 + idx)`` (the study's draw: reproducible, never the item itself)."""
    if num_fewshot <= 0:
        return []
    available = [i for i in range(n_items) if i != idx]
    return random.Random(FEWSHOT_SEED + idx).sample(available, num_fewshot)


def render_prompts(
    item: Mapping[str, Any], task_type: str, delimiter: str, fewshot: Sequence[Mapping[str, Any]] = ()
) -> list[str]:
    """The full prompts of one item: one per option (multiple choice, schema), or the context-only
    prompt and the full one (language modelling). The same strings as the study's templates."""
    if task_type == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(
            f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot
        )
        return [f"{shots}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    if task_type == "language_modeling":
        # Contexts are trimmed (some datasets end them in whitespace), and so is the context-only
        # prompt, so that it is a clean token prefix of the full one.
        shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        head = f"{shots}{item['context'].strip()}{delimiter}"
        return [head.strip(), f"{head}{item['continuation']}"]
    raise EvalError(f"task_type={task_type!r}: unknown task type")


def _common_length(seqs: Sequence[Sequence[int]], from_end: bool) -> int:
    shortest = min(len(s) for s in seqs)
    for i in range(shortest):
        pos = -1 - i if from_end else i
        if any(s[pos] != seqs[0][pos] for s in seqs):
            return i
    return shortest


# --------------------------------------------------------------------------------------------
# Tokenized items
# --------------------------------------------------------------------------------------------
@dataclass
class ScoredSequence:
    """One sequence to run: token ids, and the continuation's span ``[start, end)`` in them."""

    ids: list[int]
    start: int
    end: int
    item: int
    option: int


@dataclass
class PreparedTask:
    """A task's items rendered and tokenized once, ready to score at any r."""

    task: Task
    items: list[dict[str, Any]] = field(repr=False)
    sequences: list[ScoredSequence] = field(repr=False)

    @property
    def num_items(self) -> int:
        return len(self.items)


def bos_id(tokenizer: Any) -> int:
    """The id every sequence starts with: BOS, or EOS (the document separator) when there is none."""
    token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if token is None:
        raise EvalError(
            f"{type(tokenizer).__name__} has neither bos_token_id nor eos_token_id to start sequences with"
        )
    return int(token)


def _encode(tokenizer: Any, texts: list[str], bos: int) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [[bos, *ids] for ids in encoded]


def prepare_task(
    task: Task, tokenizer: Any, max_per_task: int | None = None, max_length: int | None = None
) -> PreparedTask:
    """Render and tokenize every item of ``task`` (shuffled and subsampled as the study does).

    ``max_length``: keep only the last ``max_length`` tokens of a longer sequence (the model's
    context). Raises :class:`EvalError` when a continuation has no tokens of its own."""
    items = task.items(max_per_task)
    if task.num_fewshot >= len(items):
        raise EvalError(
            f"task {task.label!r}: num_fewshot={task.num_fewshot} needs more than {len(items)} items "
            "(raise --max-per-task)"
        )
    bos = bos_id(tokenizer)
    sequences: list[ScoredSequence] = []
    for idx, item in enumerate(items):
        shots = [items[i] for i in fewshot_indices(len(items), idx, task.num_fewshot)]
        prompts = render_prompts(item, task.task_type, task.continuation_delimiter, shots)
        tokens = _encode(tokenizer, prompts, bos)
        where = f"task {task.label!r} ({task.path}), item {idx}"
        if task.task_type == "multiple_choice":
            start = _common_length(tokens, from_end=False)
            spans = [(start, len(t)) for t in tokens]
        elif task.task_type == "schema":
            suffix = _common_length(tokens, from_end=True)
            spans = [(len(t) - suffix, len(t)) for t in tokens]
        else:
            without, with_ = tokens
            if len(without) >= len(with_) or with_[: len(without)] != without:
                raise EvalError(
                    f"{where}: field 'continuation' = {item['continuation']!r}: the context-only prompt does not "
                    "tokenize to a prefix of the full prompt (the continuation merges with the context)"
                )
            tokens, spans = [with_], [(len(without), len(with_))]
        for option, (ids, (start, end)) in enumerate(zip(tokens, spans)):
            if end <= start:
                raise EvalError(f"{where}, option {option}: the continuation has no tokens of its own")
            if start < 1:
                raise EvalError(f"{where}, option {option}: the options share no context to predict from")
            if max_length is not None and len(ids) > max_length:
                cut = len(ids) - max_length
                if start - cut < 1:
                    raise EvalError(
                        f"{where}: the continuation alone exceeds the model's {max_length} tokens"
                    )
                ids, start, end = ids[cut:], start - cut, end - cut
            sequences.append(ScoredSequence(ids, start, end, idx, option))
    return PreparedTask(task, items, sequences)


# --------------------------------------------------------------------------------------------
# Forward passes
# --------------------------------------------------------------------------------------------
@dataclass
class SequenceScores:
    """Per sequence: summed continuation loss (nats), token count, whether greedy decoding
    reproduces the continuation, and the recurrences run at the scored positions (summed)."""

    loss_sum: list[float]
    num_tokens: list[int]
    greedy_ok: list[bool]
    recurrences: list[float]


def _batches(sequences: Sequence[ScoredSequence], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, each at most ``batch_tokens`` padded tokens
    (a sequence longer than that runs alone)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].ids))
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * len(sequences[out[-1][0]].ids) <= batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _span_scores(logits: Any, ids: Any, start: int, end: int) -> tuple[float, bool]:
    """(summed cross-entropy, greedy reproduces) for positions ``start - 1 .. end - 2`` predicting
    ``ids[start:end]``; ``logits``: (T, V) for those positions only."""
    import torch

    targets = ids[start:end]
    losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    return float(losses.double().sum()), bool((logits.argmax(-1) == targets).all())


def score_sequences(
    model: Any,
    sequences: Sequence[ScoredSequence],
    num_recurrences: int,
    *,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    call_kwargs: Mapping[str, Any] | None = None,
    pad_id: int = 0,
) -> SequenceScores:
    """Run every sequence through ``model`` at r = ``num_recurrences`` and score its continuation.

    ``call_kwargs`` go to every forward (``exit_criterion``, ``exit_threshold``,
    ``min_recurrences``, ``kv_budget``). A ``kv_budget`` below r switches to decoding (a prefill
    of the context, then one continuation token at a time through the cache), where the budget
    acts; otherwise sequences run in right-padded batches, sorted by length."""
    import torch

    kwargs = dict(call_kwargs or {})
    budget = kwargs.get("kv_budget")
    decode = budget is not None and int(budget) < num_recurrences
    device = next(model.parameters()).device
    n = len(sequences)
    scores = SequenceScores([0.0] * n, [0] * n, [False] * n, [0.0] * n)
    with torch.inference_mode():
        if decode:
            for i, seq in enumerate(sequences):
                _score_decoding(model, seq, i, num_recurrences, kwargs, scores, device)
            return scores
        for batch in _batches(sequences, batch_tokens):
            width = max(len(sequences[i].ids) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(sequences[i].ids)] = torch.tensor(sequences[i].ids)
            # Right padding needs no attention mask: attention is causal, so a real position never
            # sees the pads after it, and its numbers equal the unpadded run's. Without a mask the
            # attention kernels take their causal fast path (an explicit padding mask measured
            # several times slower on CPU).
            hidden, head, used = _forward(model, ids.to(device), num_recurrences, kwargs)
            for row, i in enumerate(batch):
                seq = sequences[i]
                span = slice(seq.start - 1, seq.end - 1)
                loss, ok = _span_scores(head(hidden[row, span]), ids[row], seq.start, seq.end)
                scores.loss_sum[i], scores.greedy_ok[i] = loss, ok
                scores.num_tokens[i] = seq.end - seq.start
                scores.recurrences[i] = (
                    float(used[row, span].sum())
                    if used is not None
                    else float(num_recurrences * (seq.end - seq.start))
                )
    return scores


def _forward(model: Any, ids: Any, r: int, kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(states, head, recurrences_used) of one padded batch. A ``LoopedForCausalLM`` runs its decoder
    and the LM head is applied only at the scored positions later (a few tokens of each sequence:
    the head over every position would cost more than the model at small widths); another model
    runs whole and its logits pass through."""
    decoder, head = getattr(model, "model", None), getattr(model, "logits_from_hidden", None)
    if decoder is not None and head is not None:
        out = decoder(input_ids=ids, num_recurrences=r, exit_head=head, **kwargs)
        return out.last_hidden_state, head, getattr(out, "recurrences_used", None)
    out = model(input_ids=ids, num_recurrences=r, **kwargs)
    return out.logits, (lambda logits: logits), getattr(out, "recurrences_used", None)


def _score_decoding(
    model: Any,
    seq: ScoredSequence,
    i: int,
    r: int,
    kwargs: dict[str, Any],
    scores: SequenceScores,
    device: Any,
) -> None:
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([seq.ids], dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids[:, : seq.start], cache=cache, use_cache=True, num_recurrences=r, **kwargs)
    logits, used = [out.logits[0, -1]], []
    if out.recurrences_used is not None:
        used.append(float(out.recurrences_used[0, -1]))
    for t in range(seq.start, seq.end - 1):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True, num_recurrences=r, **kwargs)
        logits.append(out.logits[0, -1])
        if out.recurrences_used is not None:
            used.append(float(out.recurrences_used[0, -1]))
    loss, ok = _span_scores(torch.stack(logits), ids[0], seq.start, seq.end)
    scores.loss_sum[i], scores.greedy_ok[i], scores.num_tokens[i] = loss, ok, seq.end - seq.start
    scores.recurrences[i] = sum(used) if used else float(r * (seq.end - seq.start))


# --------------------------------------------------------------------------------------------
# Task numbers
# --------------------------------------------------------------------------------------------
def centered_score(accuracy: float, random_baseline: float) -> float:
    """(accuracy - 0.01 b) / (1 - 0.01 b): 0 at chance, 1 at perfect (``b`` in percent, as CORE)."""
    return (accuracy - 0.01 * random_baseline) / (1.0 - 0.01 * random_baseline)


def task_metrics(prepared: PreparedTask, scores: SequenceScores) -> dict[str, Any]:
    """Accuracy, centered score, token-weighted continuation loss and mean recurrences of one task,
    from the scores of its sequences (in ``prepared.sequences`` order)."""
    task = prepared.task
    by_item: dict[int, list[int]] = {}
    for k, seq in enumerate(prepared.sequences):
        by_item.setdefault(seq.item, []).append(k)
    correct, nats, tokens = 0, 0.0, 0
    for idx, ks in sorted(by_item.items()):
        if task.task_type == "language_modeling":
            (k,) = ks
            correct += scores.greedy_ok[k]
            gold = k
        else:
            means = [scores.loss_sum[k] / scores.num_tokens[k] for k in ks]
            pred = means.index(min(means))  # ties: the first option, as the study's list.index(min)
            gold_option = int(prepared.items[idx]["gold"])
            correct += pred == gold_option
            gold = ks[gold_option]
        nats += scores.loss_sum[gold]
        tokens += scores.num_tokens[gold]
    n = len(by_item)
    accuracy = correct / n
    loss = nats / tokens if tokens else math.nan
    scored = sum(scores.num_tokens)
    return {
        "accuracy": accuracy,
        "centered": centered_score(accuracy, task.random_baseline),
        "loss": loss,
        "num_items": n,
        "num_correct": int(correct),
        "mean_recurrences": sum(scores.recurrences) / scored if scored else math.nan,
    }


def aggregate(task_results: Mapping[str, Mapping[str, Any]], groups: Mapping[str, str]) -> dict[str, Any]:
    """The study's averages over tasks: ``mean_centered`` (CORE's metric: the mean of the tasks'
    centered scores), per-group means of centered score, accuracy and loss (macro: every task
    weighs the same), and ``group_mean`` (the Saunshi suite's metric: the mean of the groups)."""
    members: dict[str, list[str]] = {}
    for label in task_results:
        members.setdefault(groups[label], []).append(label)

    def mean(values: list[float]) -> float:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        return sum(finite) / len(finite) if finite else math.nan

    group_rows = {
        g: {
            "centered": mean([task_results[x]["centered"] for x in labels]),
            "accuracy": mean([task_results[x]["accuracy"] for x in labels]),
            "loss": mean([task_results[x].get("loss") for x in labels]),
            "tasks": labels,
        }
        for g, labels in members.items()
    }
    return {
        "mean_centered": mean([t["centered"] for t in task_results.values()]),
        "group_mean": mean([g["centered"] for g in group_rows.values()]),
        "groups": group_rows,
    }


__all__ = [
    "EvalError",
    "PreparedTask",
    "ScoredSequence",
    "SequenceScores",
    "aggregate",
    "bos_id",
    "centered_score",
    "fewshot_indices",
    "prepare_task",
    "render_prompts",
    "score_sequences",
    "task_metrics",
]
