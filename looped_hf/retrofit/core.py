"""The common core of ``looped-hf retrofit``: a dense parent checkpoint -> a Hub-ready looped folder.

    parent folder (config.json + safetensors) --family (by ``architectures``)--> LoopedConfig
                  --layer plan (plan.py)--> which parent tensor fills which looped one
                  --streamed, tensor by tensor--> LoopedForCausalLM --write_folder--> out/

The looped model is built once, empty, in the parent's dtype; each of its tensors is then read
from the parent's safetensors files and copied in (the parent is never held as a whole, so peak
memory is about the looped model plus one tensor). Kept layers are copied bit for bit.

Adapter (the linear injection, McLeish et al. 2025, LoopedLMs/retrofitting-recurrence):
``identity`` is their later ``[0 | I]`` on ``[state; embedding]``: the block reads the prelude's
output unchanged at every recurrence (the state is ignored until training moves the weights).
looped_hf's injection reads ``[e; h]`` (e the prelude output), so the same map is ``[I | 0]``
here. ``study`` is the adapter their published runs started from: ``torch.nn.Linear``'s default
(Kaiming-uniform, bound 1/sqrt(2d)) on ``[state; embedding]``, seeded, its column blocks swapped
into looped_hf's order. The initial state is their ``initialize_state``: a normal with std
sqrt(2 / (5 d)) truncated at +-3 std (their converters set the embedding scale to 1), or
``zeros`` (their ``init_scale=0``: deterministic, what vLLM serving needs) or ``prelude``
(their ``embed-init``: h_0 = e).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..convert.common import ConversionError, check_target, write_folder
from ..convert.loader import Checkpoint
from ..fileio import first_line
from ..publish import PathLike
from .family import Family
from .llama import LLAMA, MISTRAL
from .olmo2 import OLMO2
from .parent import open_parent, parent_name
from .plan import LayerPlan
from .qwen import QWEN2, QWEN3

#: ``architectures`` name -> the family that maps it (by name; nothing is guessed from the weights).
FAMILIES: dict[str, Family] = {
    arch: fam for fam in (LLAMA, MISTRAL, QWEN2, QWEN3, OLMO2) for arch in fam.architectures
}
ADAPTER_INITS = ("identity", "study")
STATE_INITS = ("truncated_normal", "zeros", "prelude")
DEFAULT_OUT_SUFFIX = "-retrofit"
RECORD_FILE = "retrofit.json"
PAPER_URL = "https://github.com/LoopedLMs/retrofitting-recurrence"
RRT_URL = "https://arxiv.org/abs/2410.20672"


def default_out(parent_dir: PathLike) -> Path:
    """``PARENT_DIR-retrofit`` beside the parent folder."""
    path = Path(parent_dir).resolve()
    return path.with_name(path.name + DEFAULT_OUT_SUFFIX)


def parent_family(config: dict[str, Any], where: Path) -> Family:
    """The family of the parent's ``architectures`` (by name), or a refusal naming the value."""
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"{where / 'config.json'} architectures={archs!r}: expected a list naming the model "
                              "class (save_pretrained writes it)")  # fmt: skip
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch]
    raise ConversionError(f"{where / 'config.json'} architectures={archs!r}: not a parent class retrofit maps "
                          f"(it maps {', '.join(sorted(FAMILIES))})")  # fmt: skip


def parent_config(parent: Checkpoint) -> Any:
    """The parent's transformers config (its own class: RoPE, GQA and defaults as transformers reads them)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from ..fileio import first_line

    try:
        return AutoConfig.from_pretrained(parent.folder)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as err:
        # A config class's validator (e.g. an odd head_dim) wraps the error that names the field.
        reason = first_line(err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err)
        raise ConversionError(
            f"{parent.folder / 'config.json'}: transformers cannot read it ({reason})"
        ) from None


def looped_config(cfg: Any, family: Family, plan: LayerPlan, *, adapter_init: str, state_init: str,
                  extra: dict[str, Any] | None = None, config_class: type | None = None) -> Any:  # fmt: skip
    """The ``LoopedConfig`` of the retrofit: the family's fields, the plan's layer counts and r, the
    injection (``linear`` for the paper's retrofits; ``none`` for a shared stack, whose loop t reads
    loop t - 1's output as the parent's layer t*K reads layer t*K - 1's) and the initial state."""
    from looped_hf import LoopedConfig

    config_class = config_class or LoopedConfig
    if adapter_init not in ADAPTER_INITS:
        raise ConversionError(f"--adapter-init={adapter_init!r}: must be one of {ADAPTER_INITS}")
    if state_init not in STATE_INITS:
        raise ConversionError(f"--state-init={state_init!r}: must be one of {STATE_INITS}")
    fields = family.looped_fields(cfg)
    shared = plan.share is not None
    loop = dict(
        num_prelude_layers=len(plan.prelude), num_recurrent_layers=len(plan.recurrent), num_coda_layers=len(plan.coda),
        num_recurrences=plan.num_recurrences,
        input_injection="none" if shared else "linear",
        state_init="prelude" if shared else state_init,
        state_init_std=math.sqrt(2 / (5 * fields["hidden_size"])),
    )  # fmt: skip
    try:
        return config_class(**fields, **loop, **(extra or {}))
    except ValueError as err:
        raise ConversionError(f"{plan.method}: {err}") from None


def adapter_weight(d: int, adapter_init: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The injection's d x 2d weight in looped_hf's [e; h] order (see the module docstring)."""
    if adapter_init == "identity":
        return torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(2 * d)  # nn.Linear's default: kaiming_uniform_(a=sqrt(5)) on fan_in = 2d
    paper = torch.empty(d, 2 * d).uniform_(-bound, bound, generator=generator)  # on [state; embedding]
    return torch.cat([paper[:, d:], paper[:, :d]], dim=1).to(dtype)


def source_map(
    model: torch.nn.Module, plan: LayerPlan, family: Family, own: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """Looped parameter name -> the parent tensors it is made of (one, or several to average; none
    for the adapter and the family's ``zero_init`` tensors). Names starting with a prefix in ``own``
    are left to the caller (the per-loop LoRA)."""
    stacks = {"prelude_layers": [(i,) for i in plan.prelude], "recurrent_layers": list(plan.recurrent),
              "coda_layers": [(i,) for i in plan.coda]}  # fmt: skip
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if own and name.startswith(own):
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[name] = [name]
        elif name == "model.injection.weight":
            out[name] = []
        elif len(parts) > 3 and parts[0] == "model" and parts[1] in stacks:
            suffix = ".".join(parts[3:])
            group = stacks[parts[1]][int(parts[2])]
            out[name] = [] if suffix in family.zero_init else [f"model.layers.{i}.{suffix}" for i in group]
        else:
            raise ConversionError(f"the looped model has a parameter {name!r} retrofit has no source for")
    return out


def check_parent_keys(parent: Checkpoint, sources: dict[str, list[str]], plan: LayerPlan) -> None:
    """Every parent tensor is used or sits in a dropped layer; every source exists. Refusals name keys."""
    used = {key for keys in sources.values() for key in keys}
    missing = sorted(used - set(parent.keys()))
    if missing:
        raise ConversionError(f"{parent.folder}: the weights lack {missing[:4]} (expected for this config)")
    suffixes = {key.split(".", 3)[3] for key in used if key.startswith("model.layers.")}
    dropped = {f"model.layers.{i}.{suffix}" for i in plan.dropped for suffix in suffixes}
    tied = "lm_head.weight" if "lm_head.weight" not in sources else None
    unknown = sorted(
        k for k in set(parent.keys()) - used - dropped - {tied} if not k.endswith("rotary_emb.inv_freq")
    )
    if unknown:
        raise ConversionError(f"{parent.folder}: weights retrofit does not know how to map: {unknown[:4]}"
                              f"{' ...' if len(unknown) > 4 else ''}")  # fmt: skip


def check_parent_shapes(parent: Checkpoint, shell: torch.nn.Module, sources: dict[str, list[str]]) -> None:
    """Every parent tensor has the shape of the looped parameter it fills (``shell``: the model on
    the meta device), from the headers: a config.json size the files do not hold is refused here."""
    params = dict(shell.named_parameters())
    for name, keys in sources.items():
        for key in keys:
            if parent.shape(key) != tuple(params[name].shape):
                raise ConversionError(f"{parent.folder}: {key} has shape {parent.shape(key)}, the config.json sizes "
                                      f"make {tuple(params[name].shape)} (vocab_size, hidden_size, "
                                      "intermediate_size, heads)")  # fmt: skip


@torch.no_grad()
def fill_from_parent(model: torch.nn.Module, parent: Checkpoint, sources: dict[str, list[str]],
                     adapter: Callable[[], torch.Tensor] | None) -> None:  # fmt: skip
    """Copy every looped parameter from its parent tensors, one tensor at a time (a group of several
    is averaged in float32). Shapes are checked; the parent's tensors are never all in memory."""
    params = dict(model.named_parameters())
    for name, keys in sources.items():
        param = params[name]
        if name == "model.injection.weight":
            param.copy_(adapter())
            continue
        if not keys:
            param.zero_()
            continue
        total = None
        for key in keys:
            tensor = parent.get_tensor(key)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ConversionError(f"{parent.folder}: {key} has shape {tuple(tensor.shape)}, the config says "
                                      f"{tuple(param.shape)}")  # fmt: skip
            if len(keys) == 1:
                param.copy_(tensor)
            else:
                total = tensor.float() if total is None else total.add_(tensor.float())  # our own copy
            del tensor
        if total is not None:
            param.copy_(total / len(keys))


def build_retrofit(parent: Checkpoint, plan: LayerPlan, *, adapter_init: str = "identity",
                   state_init: str = "truncated_normal", seed: int = 0, extra_config: dict[str, Any] | None = None,
                   model_class: type | None = None, own: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The looped model (eval mode, the parent's dtype) and its record (``retrofit.json``), from an
    opened parent and a layer plan. ``model_class`` (default ``LoopedForCausalLM``)
    and the parameters it names under the prefixes ``own`` (left to the caller) are for the
    per-loop LoRA."""
    from transformers.initialization import no_init_weights

    from looped_hf import LoopedForCausalLM, __version__

    family = parent_family(parent.config, parent.folder)
    cfg = parent_config(parent)
    if plan.num_parent_layers != cfg.num_hidden_layers:
        raise ConversionError(f"the layer plan is for {plan.num_parent_layers} layers, the parent has "
                              f"num_hidden_layers={cfg.num_hidden_layers}")  # fmt: skip
    model_class = model_class or LoopedForCausalLM
    config = looped_config(cfg, family, plan, adapter_init=adapter_init, state_init=state_init, extra=extra_config,
                           config_class=model_class.config_class)  # fmt: skip
    dtype = parent.floating_dtype()
    # Built on the meta device first and checked against the parent's headers: a config whose sizes
    # the files do not hold (vocab_size 10**10, intermediate_size 10**9) is refused naming the
    # tensor, before anything is allocated.
    try:
        with torch.device("meta"), no_init_weights():
            shell = model_class._from_config(config, dtype=dtype)
            if config.tie_word_embeddings:
                shell.tie_weights()  # as the model below: the head is the embedding, not a source of its own
    except (RuntimeError, ValueError, OverflowError) as err:
        raise ConversionError(f"{parent.folder / 'config.json'}: the looped model cannot be built "
                              f"({first_line(err)})") from None  # fmt: skip
    sources = source_map(shell, plan, family, own)
    check_parent_keys(parent, sources, plan)
    check_parent_shapes(parent, shell, sources)
    del shell
    with no_init_weights():  # every parameter is set below: no random init of a 1B model first
        model = model_class._from_config(config, dtype=dtype)
    if config.tie_word_embeddings:
        model.tie_weights()
    fill_from_parent(
        model, parent, sources, lambda: adapter_weight(config.hidden_size, adapter_init, seed, dtype)
    )
    record = {
        "method": plan.method,
        "paper": RRT_URL if plan.share is not None else PAPER_URL,
        "layer_map": plan.as_dict(),
        "adapter_init": None if plan.share is not None else adapter_init,
        "state_init": config.state_init,
        "seed": seed,
        # The folder's name, not its path (a published card would carry the user's home); the
        # digests pin the parent's weights.
        "parent": {"path": parent_name(parent), "family": family.name,
                   "architectures": parent.config.get("architectures"), "config": parent.config,
                   "weights_sha256": parent.sha256()},
        "looped_hf_version": __version__,
    }  # fmt: skip
    return model.eval(), record


_CARD_BODY = """
# {{ model_name }}

A looped (depth-recurrent) model retrofitted from the dense `{{ arch }}` checkpoint `{{ parent }}` with
`looped-hf retrofit` ({{ method }}; {{ paper }}). It loads with `AutoModelForCausalLM` (looped_hf
installed, or `trust_remote_code=True`). It is the parent's weights rearranged, not yet trained as a
looped model: train it on with a retrofit recipe before reading its quality.

| | value |
|---|---|
| method | `{{ method }}` |
| parent layers | {{ layer_map.num_parent_layers }} |
| prelude <- parent layers | {{ layer_map.prelude }} |
| recurrent block <- parent layers | {{ layer_map.recurrent }} |
| coda <- parent layers | {{ layer_map.coda }} |
| dropped parent layers | {{ layer_map.dropped }} |
| r (num_recurrences) | {{ config.num_recurrences }} |
| injection, adapter init | `{{ config.input_injection }}`, `{{ adapter_init }}` |
| initial state | `{{ config.state_init }}` |
| N_once / N_rec | {{ params.once }} / {{ params.recurrent }} |

Parent weights (sha256):

{% for name, digest in files.items() %}- `{{ name }}`: `{{ digest }}`
{% endfor %}
The parent's config and the full layer map are in `retrofit.json`.
"""


def retrofit_card(model: Any, record: dict[str, Any], repo_id: str, license: str | None) -> Any:
    """The folder's README card: the parent (class, path, weight hashes), the layer map, the method."""
    from huggingface_hub import ModelCard, ModelCardData

    from looped_hf.cards.common import _count

    data = ModelCardData(library_name="transformers", license=license,
                         tags=["looped_hf", "looped", "retrofit", record["method"], record["parent"]["family"]])  # fmt: skip
    data.retrofitted_from = {"architectures": record["parent"]["architectures"], "path": record["parent"]["path"],
                             "weights_sha256": record["parent"]["weights_sha256"], "method": record["method"]}  # fmt: skip
    params = {key: _count(value) for key, value in model.num_scaling_params().items()}
    return ModelCard.from_template(
        data, template_str="---\n{{ card_data }}\n---\n" + _CARD_BODY, model_name=repo_id.split("/")[-1],
        arch=record["parent"]["architectures"][0], parent=Path(record["parent"]["path"]).name, method=record["method"],
        paper=record["paper"], layer_map=record["layer_map"], config=model.config, adapter_init=record["adapter_init"],
        params=params, files=record["parent"]["weights_sha256"],
    )  # fmt: skip


def write_retrofit(model: Any, record: dict[str, Any], parent: Checkpoint, dest: Path, *, repo_id: str | None,
                   license: str | None, extra_files: Callable[[Path], list[str]] | None = None) -> Path:  # fmt: skip
    """The Hub-ready folder: weights, config, remote code, generation config, the parent's tokenizer,
    ``retrofit.json`` and the card; built beside ``dest`` and moved into place at the end."""
    from transformers import GenerationConfig

    from looped_hf.cards import CARD_NAME

    parent_dir = parent.folder
    if parent.check_generation_config():  # types and ranges: GenerationConfig would copy them unchecked
        try:
            model.generation_config = GenerationConfig.from_pretrained(parent_dir)
        except (OSError, ValueError) as err:
            raise ConversionError(f"{parent_dir / 'generation_config.json'}: {err}") from None
    parent.check_tokenizer()  # refused before anything is written

    def extras(tmp: Path) -> list[str]:
        tokenizer = parent.copy_tokenizer(tmp)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        retrofit_card(model, record, repo_id or f"path/to/{dest.name}", license).save(tmp / CARD_NAME)
        names = [*tokenizer, RECORD_FILE]
        return names + (extra_files(tmp) if extra_files is not None else [])

    return write_folder(model, dest, extras)


def retrofit(parent_dir: PathLike, out: PathLike | None, plan_for: Callable[[int], LayerPlan], *,
             adapter_init: str = "identity", state_init: str = "truncated_normal", seed: int = 0,
             repo_id: str | None = None, license: str | None = None, overwrite: bool = False) -> Path:  # fmt: skip
    """Write the retrofit of ``parent_dir`` to ``out`` (default ``PARENT_DIR-retrofit``) and return it.

    ``plan_for(num_parent_layers)`` gives the layer plan (``plan.py``). Everything is checked before
    anything is written: the parent class, the layer ranges, the weights; on refusal nothing is left
    behind. Raises ``ConversionError`` (or ``PublishError`` for ``out`` / ``repo_id``), one line naming
    the field and the value."""
    dest = check_target(parent_dir, default_out(parent_dir) if out is None else out, overwrite=overwrite,
                        repo_id=repo_id, written_by=RECORD_FILE)  # fmt: skip
    parent = open_parent(parent_dir)  # the layer count is checked against the weight files there
    parent_family(parent.config, parent.folder)  # an unmapped class is refused before any tensor is read
    plan = plan_for(parent.config["num_hidden_layers"])
    model, record = build_retrofit(parent, plan, adapter_init=adapter_init, state_init=state_init, seed=seed)
    return write_retrofit(model, record, parent, dest, repo_id=repo_id, license=license)


__all__ = ["ADAPTER_INITS", "DEFAULT_OUT_SUFFIX", "FAMILIES", "RECORD_FILE", "STATE_INITS", "adapter_weight",
           "build_retrofit", "default_out", "looped_config", "parent_family", "retrofit", "source_map",
           "write_retrofit"]  # fmt: skip
