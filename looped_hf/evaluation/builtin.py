"""The built-in bundle: reasoning primitives generated locally from a seed (no download).

Written in the study's bundle format (``builtin.yaml`` + ``eval_data/<group>/<label>.jsonl``), so it
reads like any other bundle (:func:`looped_hf.evaluation.bundle.load_bundle`). Tasks:

- ``induction_head``: the study's in-context key/value lookup (its "owned" bundle): 8 lines
  ``kkkk -> vvv`` of random lowercase keys (4 letters) and values (3 letters), then one key again;
  the continuation is its value. Language modelling, 0-shot, seed 1337, as the study generates it.
- ``var_assign_d0_math`` / ``_code`` and ``var_assign_d1_math`` / ``_code``: Saunshi et al.'s
  variable-assignment probes (arXiv:2409.19044 App. B, reused in arXiv:2502.17416) as the study
  builds them: 5 variables with values in 1..25 (depth 0: ask one of them; depth 1: 5 more
  variables each aliasing a distinct one, ask an alias), in a "math" and a "code" wording.
  Language modelling, 5-shot; the four tasks are drawn from one ``random.Random(42)`` in that
  order, as the study's script does, so the rows match its bundle.
- ``p_hop_2``, ``p_hop_3``: p-hop lookup (the Saunshi et al. kind of multi-step latent reasoning):
  a shuffled list of ``x -> y`` links forming disjoint chains; follow p links from a start
  letter. Multiple choice over the chains' p-th letters (one right, the others the ends of
  the other chains at the same depth), 3-shot.
- ``addition_2d``, ``addition_3d``: multi-digit addition ``a+b=`` with the sum as the continuation,
  3-shot (a carry chain is the classic case for more depth per token).

Every generator takes its own ``random.Random``; the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

PathLike = str | os.PathLike[str]

BUILTIN_NAME = "builtin"
BUILTIN_YAML = f"{BUILTIN_NAME}.yaml"
DEFAULT_EXAMPLES = 1000
INDUCTION_SEED = 1337  # the study's owned-bundle seed
VAR_ASSIGN_SEED = 42  # the study's Saunshi-bundle seed
SYNTHETIC_SEED = 2025  # looped_hf's own tasks (p-hop, addition)

Row = dict[str, Any]


# --------------------------------------------------------------------------------------------
# The study's induction-head lookup
# --------------------------------------------------------------------------------------------
def _letters(rng: random.Random, k: int) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=k))


def induction_head_row(rng: random.Random, n_pairs: int = 8) -> Row:
    """One key/value lookup row: ``n_pairs`` lines ``key -> value``, then a key again; the answer is
    its value. Keys are drawn first, then values, then the queried line, as in the study."""
    keys = [_letters(rng, 4) for _ in range(n_pairs)]
    values = [_letters(rng, 3) for _ in range(n_pairs)]
    asked = rng.randrange(n_pairs)
    context = "\n".join(f"{k} -> {v}" for k, v in zip(keys, values)) + f"\n{keys[asked]} ->"
    # The delimiter " " of the task joins context and value, so the value has no leading space.
    return {"context": context, "continuation": values[asked], "choices": values, "gold": asked}


# --------------------------------------------------------------------------------------------
# Saunshi et al.'s variable assignment (depth 0 and depth 1), math and code wordings
# --------------------------------------------------------------------------------------------
_N_VARS = 5
_VALUE_RANGE = (1, 25)
_MATH_HEADER = "The following is a set of simple mathematical equations."
_CODE_HEADER = (
    "The following is a very short Python program. Use the program to resolve the value of the variable "
    "in the question."
)


def _assignments_d0(rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    names = rng.sample(string.ascii_lowercase, _N_VARS)
    values = {v: str(rng.randint(*_VALUE_RANGE)) for v in names}
    asked = rng.choice(names)
    return [(v, values[v]) for v in names], asked, values[asked]


def _assignments_d1(rng: random.Random) -> tuple[list[tuple[str, str]], str, str]:
    names = rng.sample(string.ascii_lowercase, 2 * _N_VARS)
    bases, aliases = names[:_N_VARS], names[_N_VARS:]
    values = {v: str(rng.randint(*_VALUE_RANGE)) for v in bases}
    targets = list(bases)
    rng.shuffle(targets)
    alias_of = dict(zip(aliases, targets))  # each alias names a distinct base
    asked = rng.choice(aliases)
    lines = [(v, values[v]) for v in bases] + [(a, alias_of[a]) for a in aliases]  # no forward references
    return lines, asked, values[alias_of[asked]]


def _math_row(lines: list[tuple[str, str]], asked: str, answer: str) -> Row:
    body = "\n".join(f"{v}={x}" for v, x in lines)
    return {
        "context": f"{_MATH_HEADER}\n\n{body}\nWhat is the numerical value of {asked}?\nAnswer:",
        "continuation": answer,
    }


def _code_row(lines: list[tuple[str, str]], asked: str, answer: str) -> Row:
    body = "\n".join(f"{v} = {x}" for v, x in lines)
    return {
        "context": f"{_CODE_HEADER}\nProgram:\n{body}\n\nQuestion:\nWhat is the value of {asked}?\nAnswer:",
        "continuation": answer,
    }


# --------------------------------------------------------------------------------------------
# looped_hf's synthetic tasks: p-hop lookup (multiple choice), multi-digit addition
# --------------------------------------------------------------------------------------------
def p_hop_row(rng: random.Random, hops: int, n_chains: int = 4) -> Row:
    """Disjoint chains of ``hops`` links over distinct letters, their links shuffled; the query asks
    where ``hops`` links from one chain's start lead. The options are every chain's end, so only
    following the links (not the letters' frequencies) tells them apart."""
    letters = rng.sample(string.ascii_lowercase, n_chains * (hops + 1))
    chains = [letters[i * (hops + 1) : (i + 1) * (hops + 1)] for i in range(n_chains)]
    links = [(c[j], c[j + 1]) for c in chains for j in range(hops)]
    rng.shuffle(links)
    asked = rng.randrange(n_chains)
    body = "\n".join(f"{a} -> {b}" for a, b in links)
    query = f"{body}\nStart at {chains[asked][0]}, follow {hops} links. End:"
    return {"query": query, "choices": [c[-1] for c in chains], "gold": asked}


def addition_row(rng: random.Random, digits: int) -> Row:
    """``a+b=`` with two ``digits``-digit numbers; the continuation is the sum."""
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"context": f"{a}+{b}=", "continuation": str(a + b)}


# --------------------------------------------------------------------------------------------
# The bundle
# --------------------------------------------------------------------------------------------
def _task(
    label: str, group: str, task_type: str, num_fewshot: int, delimiter: str, baseline: float = 0.0
) -> Row:
    return {
        "label": label,
        "dataset_uri": f"{group}/{label}.jsonl",
        "task_type": task_type,
        "num_fewshot": num_fewshot,
        "continuation_delimiter": delimiter,
        "group": group,
        "random_baseline": baseline,
    }


def builtin_rows(n_examples: int = DEFAULT_EXAMPLES) -> list[tuple[Row, list[Row]]]:
    """(task entry, rows) of every built-in task, in the bundle's order; deterministic."""
    if not isinstance(n_examples, int) or n_examples < 6:
        raise ValueError(
            f"n_examples={n_examples!r}: need an integer >= 6 (5-shot tasks draw from the other rows)"
        )
    out: list[tuple[Row, list[Row]]] = []
    rng = random.Random(INDUCTION_SEED)
    out.append((
        _task("induction_head", "reasoning_primitives", "language_modeling", 0, " "),
        [induction_head_row(rng) for _ in range(n_examples)],
    ))  # fmt: skip
    rng = random.Random(VAR_ASSIGN_SEED)  # one stream for the four tasks, in this order
    variants: list[tuple[str, Callable, Callable]] = [
        ("var_assign_d0_math", _assignments_d0, _math_row),
        ("var_assign_d0_code", _assignments_d0, _code_row),
        ("var_assign_d1_math", _assignments_d1, _math_row),
        ("var_assign_d1_code", _assignments_d1, _code_row),
    ]
    for label, make, word in variants:
        rows = [word(*make(rng)) for _ in range(n_examples)]
        out.append((_task(label, "reasoning_primitives", "language_modeling", 5, " "), rows))
    for hops in (2, 3):
        rng = random.Random(SYNTHETIC_SEED + hops)
        # 4 options, one right: chance is 25%.
        out.append((
            _task(f"p_hop_{hops}", "multi_hop", "multiple_choice", 3, " ", baseline=25.0),
            [p_hop_row(rng, hops) for _ in range(n_examples)],
        ))  # fmt: skip
    for digits in (2, 3):
        rng = random.Random(SYNTHETIC_SEED + 10 * digits)
        out.append((
            _task(f"addition_{digits}d", "arithmetic", "language_modeling", 3, ""),
            [addition_row(rng, digits) for _ in range(n_examples)],
        ))  # fmt: skip
    return out


def write_builtin_bundle(out_dir: PathLike, n_examples: int = DEFAULT_EXAMPLES) -> Path:
    """Write the built-in bundle into ``out_dir`` (``builtin.yaml`` and ``eval_data/``); returns the
    YAML's path. Files are written whole (temp file + rename), so a reader never sees half a file."""
    from looped_hf.fileio import write_text_atomic

    root = Path(out_dir)
    tasks = []
    for entry, rows in builtin_rows(n_examples):
        text = "".join(json.dumps(row) + "\n" for row in rows)
        write_text_atomic(root / "eval_data" / entry["dataset_uri"], text)
        tasks.append(entry)
    groups = list(dict.fromkeys(t["group"] for t in tasks))
    header = (
        "# looped_hf built-in bundle: reasoning primitives generated from fixed seeds "
        f"({n_examples} rows per task).\n"
    )
    yaml_text = header + yaml.safe_dump({"groups": groups, "tasks": tasks}, sort_keys=False)
    write_text_atomic(root / BUILTIN_YAML, yaml_text)
    return root / BUILTIN_YAML


def training_text(n_rows: int, seed: int = 0) -> list[str]:
    """Documents of the built-in tasks' kind from a different seed than the bundle (for a tiny model
    that should learn the primitives, not the evaluation rows): each is a rendered row."""
    rng = random.Random(10_000 + seed)
    docs = []
    for i in range(n_rows):
        kind = i % 3
        if kind == 0:
            row = induction_head_row(rng, n_pairs=4)
            docs.append(f"{row['context']} {row['continuation']}")
        elif kind == 1:
            row = p_hop_row(rng, 2)
            docs.append(f"{row['query']} {row['choices'][row['gold']]}")
        else:
            row = addition_row(rng, 2)
            docs.append(f"{row['context']}{row['continuation']}")
    return docs


__all__ = [
    "BUILTIN_NAME",
    "BUILTIN_YAML",
    "addition_row",
    "builtin_rows",
    "induction_head_row",
    "p_hop_row",
    "training_text",
    "write_builtin_bundle",
]
