"""One reader of transformers-style checkpoint folders, for every converter and for retrofit.

    ckpt = Checkpoint("./Ouro-1.4B", model_types=("ouro",))
    ckpt.config["hidden_size"]              # config.json, a checked JSON object
    for name in ckpt.keys():                # every tensor name, from the safetensors headers
        tensor = ckpt.get_tensor(name)      # read on demand, a copy of its own (no file stays open)
    ckpt.dtypes, ckpt.shape(name)           # from the headers, no tensor read
    ckpt.generation_token_ids()             # generation_config.json's bos / eos / pad, checked
    ckpt.check_tokenizer()                  # the tokenizer files load, and fit the vocabulary
    ckpt.copy_tokenizer(dst)                # ... copied byte for byte
    ckpt.sha256()                           # {weight file: digest}, for cards and run records
    ckpt.check_foreign()                    # a transformers folder looped_hf did not write, before it is built:
    ckpt.check_layer_count(key, prefix)     #   the layer count against the layers the files hold,
    ckpt.check_tied_head(tied, emb, head)   #   a tied flag against a saved head that differs,
    ckpt.check_generation_config()          #   generation_config.json's ids, lengths, temperature, ...
    config_rope_parameters(ckpt.config)     # transformers-5 rope_parameters, from either generation

(the vocabulary the token ids and the tokenizer are checked against is config.json's
``vocab_size`` unless given).

It reads a folder the way transformers' ``from_pretrained`` does, and refuses, with one
``ConversionError`` line naming the file and the value, what transformers would misread or what
would make the conversion silently wrong:

* the weight files, as `looped_hf.weight_files.WeightFiles` reads them (shared with eval, test-time
  and publish): in a sharded folder each key from the shard that the index's ``weight_map`` names;
  a shard name that leaves the folder, a missing shard, a key stored twice or missing from its
  shard, a file that is empty, truncated or not safetensors, and a folder with only a pickled
  ``pytorch_model.bin`` are refused there, before any tensor is read (the old readers merged
  shards in file order, so a duplicate silently won). A dtype outside ``_SAFETENSORS_DTYPES`` is
  refused here.
* ``config.json`` and ``generation_config.json`` must be JSON objects; token ids must be integers
  inside the vocabulary (or lists of them); tie flags must be booleans; ``rope_scaling`` (or a transformers-5
  ``rope_parameters``) must name a RoPE type transformers knows and carry that type's keys
  (:func:`rope_parameters`).
* Tokenizer files (``TOKENIZER_FILES``) that hold JSON must be JSON objects, and the tokenizer must
  load with transformers and have no more tokens than the model's vocabulary.

**Unknown config keys: refused.** Every converter lists the keys of its source config that it maps
or knows to have no effect on the forward; any other key is refused by name
(:func:`check_known_keys`), in every format. A key the converter has never seen may change the
forward (a newer release's option), and converting without it would give a model that loads and
runs and is silently wrong; the line names the key so a user can look it up. The keys every
transformers ``config.json`` may carry without changing the forward (``architectures``,
``transformers_version``, ``torch_dtype``, ...) are accepted everywhere (``HF_BOOKKEEPING_KEYS``).

**One set of checks for every foreign folder.** A retrofit parent (`retrofit.parent.open_parent`) and a
distillation teacher (`teacher.check_teacher`) go through :meth:`Checkpoint.check_foreign` (the layer count,
RoPE, the tie flag, generation_config.json), and are then built on the meta device and checked against the
headers (keys, shapes, floating dtypes: `weight_files.check_model_weights`) before anything is allocated; a
converter whose source names its fields otherwise calls the parts with its own names. eval, test-time,
publish, serve and ``init_from`` read looped folders through `model_types.check_weights`, the same check.

Nothing here writes, except :meth:`Checkpoint.copy_tokenizer` into the folder it is given.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from .. import fileio
from ..configuration_looped import MAX_NUM_RECURRENCES
from ..fileio import TOKENIZER_FILES, CheckpointError, first_line, sha256_file
from ..weight_files import WeightFiles
from .common import ConversionError

PathLike = str | os.PathLike
# Files a tokenizer may consist of (``fileio.TOKENIZER_FILES``): checked, and copied when the source has them.
#: The tokenizer files that hold a JSON object.
_JSON_TOKENIZER_FILES = frozenset(name for name in TOKENIZER_FILES if name.endswith(".json"))
#: Keys any transformers config.json may carry that change nothing in the forward: accepted by
#: every converter beside the keys it maps (the unknown-key policy in the module docstring).
HF_BOOKKEEPING_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
    "initializer_range", "_from_model_config", "_attn_implementation_autoset",
})  # fmt: skip
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
#: Keys each RoPE type needs (transformers' ``validate_rope`` raises for a missing one only when a
#: config is built, and warns for a bad value; here both are refused before conversion).
ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
#: safetensors' dtype names (a header's "dtype") -> torch.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _non_negative_int(value: Any) -> bool:
    return _is_int(value) and value >= 0


#: ``generation_config.json`` fields checked (:meth:`Checkpoint.check_generation_config`): a check
#: and what it expects. Token ids are checked against the vocabulary (:func:`token_ids`).
GENERATION_FIELDS: dict[str, tuple[Any, str]] = {
    "max_length": (_positive_int, "an integer >= 1"),
    "max_new_tokens": (_positive_int, "an integer >= 1"),
    "min_length": (_non_negative_int, "an integer >= 0"),
    "min_new_tokens": (_non_negative_int, "an integer >= 0"),
    "num_beams": (_positive_int, "an integer >= 1"),
    "top_k": (_non_negative_int, "an integer >= 0"),
    "temperature": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
}


# --------------------------------------------------------------------------------------------
# Checked values of a source config
# --------------------------------------------------------------------------------------------
def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (``fileio.read_json_object``); anything else is a
    ``ConversionError`` naming the file."""
    try:
        return fileio.read_json_object(path)
    except CheckpointError as err:
        raise ConversionError(str(err)) from None


def _named(where: str, key: str) -> str:
    """How a field is named in a one-line error: ``config.json rope_theta``, ``model_config.n_embd``."""
    return f"{where} {key}" if where.endswith(".json") else f"{where}.{key}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _config_value(cfg: Mapping[str, Any], key: str, ok: bool, expected: str, where: str, default: Any) -> Any:
    """``cfg[key]`` when ``ok`` says it is valid (``default`` when absent, if given), else one line."""
    if key not in cfg:
        if default is ...:
            raise ConversionError(f"{where} has no {key!r}")
        return default
    if not ok:
        raise ConversionError(f"{_named(where, key)}={cfg[key]!r}: expected {expected}")
    return cfg[key]


def config_int(cfg: Mapping[str, Any], key: str, minimum: int, where: str = "config.json",
               default: Any = ...) -> int:  # fmt: skip
    """``cfg[key]`` as an integer >= ``minimum`` (``default`` when absent, if given); else a
    ``ConversionError`` naming ``where``, the key and the value."""
    value = cfg.get(key)
    return _config_value(
        cfg, key, _is_int(value) and value >= minimum, f"an integer >= {minimum}", where, default
    )


def config_number(cfg: Mapping[str, Any], key: str, minimum: float, where: str = "config.json",
                  default: Any = ...) -> float:  # fmt: skip
    """``cfg[key]`` as a finite number >= ``minimum`` (``default`` when absent, if given)."""
    value = cfg.get(key)
    ok = _is_number(value) and value >= minimum
    return float(_config_value(cfg, key, ok, f"a finite number >= {minimum}", where, default))


def config_bool(cfg: Mapping[str, Any], key: str, default: bool, where: str = "config.json") -> bool:
    """``cfg[key]`` (``default`` when absent or null) as a boolean; a tie flag of ``"yes"`` or 1 is
    refused, since transformers would read any truthy value as tied."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConversionError(f"{_named(where, key)}={value!r}: expected true or false")
    return value


def check_recurrences(r: int, key: str, where: str = "config.json") -> int:
    """A trained r within ``LoopedConfig``'s own ceiling (``MAX_NUM_RECURRENCES``), refused here naming
    its file rather than by the config after the mapping: the forward of a larger one never ends
    (each recurrence is K layer applications per token)."""
    ceiling = MAX_NUM_RECURRENCES
    if r > ceiling:
        raise ConversionError(f"{_named(where, key)}={r}: above the ceiling of {ceiling} recurrences (each is a pass "
                              "through the recurrent block for every token; is the config corrupt?)")  # fmt: skip
    return r


def check_known_keys(cfg: Mapping[str, Any], known: Collection[str], what: str,
                     where: str = "config.json") -> None:  # fmt: skip
    """The unknown-key policy (module docstring): a key neither in ``known`` nor in
    ``HF_BOOKKEEPING_KEYS`` is refused by name. ``what`` names the source format."""
    unknown = sorted(set(cfg) - set(known) - HF_BOOKKEEPING_KEYS)
    if unknown:
        raise ConversionError(f"{_named(where, unknown[0])}={cfg[unknown[0]]!r}: unknown {what} config key (keys "
                              f"{unknown} are unknown to this converter; not converted, as they might change the "
                              "forward)")  # fmt: skip


def token_ids(source: Mapping[str, Any], vocab_size: int, where: str) -> dict[str, int | list[int]]:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of ``source`` that are set: each an
    integer in [0, vocab_size) or a non-empty list of them (Llama 3's several EOS ids). A token id
    outside the vocabulary would index past the embedding: refused, naming ``where``."""
    ids: dict[str, int | list[int]] = {}
    for key in TOKEN_ID_KEYS:
        value = source.get(key)
        if value is None:
            continue
        items = value if isinstance(value, list) else [value]
        if not items or not all(_is_int(item) and 0 <= item < vocab_size for item in items):
            raise ConversionError(f"{_named(where, key)}={value!r}: expected a token id in [0, {vocab_size}) "
                                  f"(vocab_size={vocab_size}), or a list of them")  # fmt: skip
        ids[key] = value
    return ids


def rope_parameters(
    scaling: Any, theta: float, where: str = "config.json", field: str = "rope_scaling"
) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` from a transformers-4 ``rope_scaling`` (None, {} or an
    object with ``rope_type`` or the legacy ``type``) and ``rope_theta``. The type must be one
    ``ROPE_REQUIRED_KEYS`` lists, with its keys, each a positive number (the factor lists of
    ``longrope`` lists of them, ``original_max_position_embeddings`` an integer)."""
    if scaling is None or scaling == {}:
        return {"rope_type": "default", "rope_theta": theta}
    if not isinstance(scaling, dict):
        raise ConversionError(f"{where} {field}={scaling!r}: expected an object or null")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_REQUIRED_KEYS:
        raise ConversionError(f"{where} {field}.rope_type={rope_type!r}: unknown or not converted "
                              f"(one of {sorted(ROPE_REQUIRED_KEYS)})")  # fmt: skip
    for key in ROPE_REQUIRED_KEYS[rope_type]:
        if key not in scaling:
            raise ConversionError(f"{where} {field} has no {key!r}: rope_type {rope_type!r} needs "
                                  f"{list(ROPE_REQUIRED_KEYS[rope_type])}")  # fmt: skip
        value = scaling[key]
        if key in ("short_factor", "long_factor"):
            ok, expected = (
                isinstance(value, list) and value and all(_is_number(v) and v > 0 for v in value),
                "a list of numbers > 0",
            )
        elif key == "original_max_position_embeddings":
            ok, expected = _is_int(value) and value >= 1, "an integer >= 1"
        else:
            ok, expected = _is_number(value) and value > 0, "a number > 0"
        if not ok:
            raise ConversionError(f"{where} {field}.{key}={value!r}: expected {expected}")
    if rope_type in ("linear", "dynamic", "yarn", "llama3") and scaling["factor"] < 1:
        raise ConversionError(f"{where} {field}.factor={scaling['factor']!r}: expected a number >= 1")
    params = {key: value for key, value in scaling.items() if key != "type"}
    return {**params, "rope_type": rope_type, "rope_theta": theta}


def config_rope_parameters(cfg: Mapping[str, Any], where: str = "config.json", theta_key: str = "rope_theta",
                           default_theta: float = 10000.0) -> dict[str, Any]:  # fmt: skip
    """``rope_parameters`` of a config.json of either transformers generation: a transformers-5
    ``rope_parameters`` object (its ``rope_theta`` inside), or transformers-4's ``rope_scaling``
    and ``theta_key`` (``default_theta`` when absent); checked as :func:`rope_parameters` checks."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConversionError(f"{where} rope_parameters={params!r}: expected an object")
        theta = config_number(params, "rope_theta", 0, f"{where} rope_parameters")
        scaling = {key: value for key, value in params.items() if key != "rope_theta"}
        return rope_parameters(scaling, theta, where, field="rope_parameters")
    theta = config_number(cfg, theta_key, 0, where, default=default_theta)
    return rope_parameters(cfg.get("rope_scaling"), theta, where)


# --------------------------------------------------------------------------------------------
# The checkpoint folder
# --------------------------------------------------------------------------------------------
class Checkpoint:
    """A transformers-style checkpoint folder (config.json + safetensors, single or sharded), opened
    and checked; tensors are read on demand (see the module docstring for what is refused).

    Args:
        folder: the checkpoint folder.
        model_types: the ``config.json`` ``model_type`` values accepted (default: any).
    """

    def __init__(self, folder: PathLike, model_types: Collection[str] | None = None) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise ConversionError(f"checkpoint directory {self.folder} does not exist")
        config_path = self.folder / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{config_path}: missing (not a saved model folder)")
        #: config.json, a JSON object.
        self.config: dict[str, Any] = read_json_object(config_path)
        if model_types is not None and self.config.get("model_type") not in model_types:
            raise ConversionError(f"{config_path}: model_type={self.config.get('model_type')!r}: this converter "
                                  f"reads {' or '.join(map(repr, model_types))}")  # fmt: skip
        try:
            files = WeightFiles(self.folder)
        except CheckpointError as err:
            raise ConversionError(str(err)) from None
        #: tensor name -> the file it is read from.
        self._file_of: dict[str, Path] = {}
        #: tensor name -> (dtype, shape), from the headers.
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, (path, dtype_name, shape) in files.entries.items():
            dtype = _SAFETENSORS_DTYPES.get(dtype_name)
            if dtype is None:
                raise ConversionError(f"{path}: tensor {name!r} has dtype {dtype_name}, which is not converted")
            self._file_of[name], self._entries[name] = path, (dtype, shape)
        #: The weight files read, in the order first named.
        self.files: tuple[Path, ...] = files.files

    # ---- the tensors --------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every tensor name, in the order the files list them."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[self._known(name)][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[self._known(name)][1]

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        """name -> dtype of every tensor (from the headers)."""
        return {name: entry[0] for name, entry in self._entries.items()}

    def floating_dtype(self, exclude: Collection[str] = ()) -> torch.dtype:
        """The one floating dtype of the tensors (``exclude`` aside), as a converted model is built in
        it; several dtypes, or an integer one, are refused."""
        dtypes = {dtype for name, (dtype, _) in self._entries.items() if name not in exclude}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ConversionError(f"{self.folder}: weights of dtypes {sorted(map(str, dtypes))}: expected one "
                                  "floating dtype")  # fmt: skip
        return next(iter(dtypes))

    def num_elements(self) -> int:
        """Elements in all tensors together (what the checkpoint holds, from the headers)."""
        return sum(math.prod(shape) for _, shape in self._entries.values())

    def _known(self, name: str) -> str:
        if name not in self._entries:
            raise ConversionError(f"{self.folder}: no tensor {name!r} in the checkpoint")
        return name

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor as memory of its own, read from the file that holds it (nothing else is loaded).

        The file is opened for this read only. safetensors hands out views of a private memory map
        of the file: kept open, every page read stays resident (a whole parent read tensor by tensor
        would count twice in the process's memory), and a write into a view changes what the next
        read of the same name returns. So the view is copied and the map released before return:
        the caller may write into the tensor, and the peak is one tensor above what it keeps."""
        from safetensors import SafetensorError, safe_open

        path = self._file_of[self._known(name)]
        try:
            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(name).clone()
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ConversionError(f"{path}: tensor {name!r} cannot be read ({first_line(err)})") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor, read one at a time (as a dict's ``items()``, lazily)."""
        for name in self._entries:
            yield name, self.get_tensor(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (all in memory; a converter for a small or mid-size model reads so)."""
        return dict(self.items())

    def sha256(self) -> dict[str, str]:
        """{file name: sha256} of the weight files (what a card or a run record ties itself to)."""
        return dict(self._digests)

    @cached_property
    def _digests(self) -> dict[str, str]:
        return {str(path.relative_to(self.folder)): sha256_file(path) for path in self.files}

    # ---- the checks of a foreign folder (a retrofit parent, a distillation teacher) -----------
    def check_layer_count(self, key: str = "num_hidden_layers", prefix: str = "model.layers.") -> int:
        """``config.json``'s layer count as an integer >= 1 that equals the layers the weight files
        hold (``prefix`` + index), checked from the headers before anything is built: a count of
        10**12 would otherwise be a loop of module builds that never ends."""
        layers = config_int(self.config, key, 1)
        held = {name[len(prefix) :].split(".", 1)[0] for name in self._entries if name.startswith(prefix)}
        if held and layers != len(held):
            raise ConversionError(f"{self.folder / 'config.json'} {key}={layers}: the weight files hold {len(held)} "
                                  f"layers ({prefix}N)")  # fmt: skip
        return layers

    def check_tied_head(self, tied: bool, embedding: str = "model.embed_tokens.weight",
                        head: str = "lm_head.weight", key: str = "tie_word_embeddings") -> None:  # fmt: skip
        """A config that says tied (``tied``, its flag ``key``) whose files hold a head of their own:
        the head must equal the embedding. transformers would untie and use that head; a retrofit
        or a teacher built tied would drop it in silence, so one that differs is refused."""
        if not tied or head not in self._entries or embedding not in self._entries:
            return
        same = self.shape(head) == self.shape(embedding) and torch.equal(
            self.get_tensor(head), self.get_tensor(embedding)
        )
        if not same:
            raise ConversionError(f"{self.folder / 'config.json'} {key}=True, but {head} differs from {embedding} in "
                                  "the weight files: a tied model has one tensor for both (set the flag false to "
                                  "keep the saved head, or fix the checkpoint)")  # fmt: skip

    def check_generation_config(self, vocab_size: int | None = None) -> dict[str, Any]:
        """``generation_config.json`` ({} without it), checked before it is copied anywhere: a JSON
        object whose token ids are in the vocabulary (:meth:`generation_token_ids`) and whose
        lengths, temperature, top-k / top-p and flags have their types and ranges
        (``GENERATION_FIELDS``); transformers' ``GenerationConfig`` accepts ``max_length: -5`` and
        ``temperature: "hot"`` with a warning at most."""
        path = self.folder / "generation_config.json"
        if not path.is_file():
            return {}
        value = read_json_object(path)
        self.generation_token_ids(vocab_size)
        for key, (check, expected) in GENERATION_FIELDS.items():
            if value.get(key) is not None and not check(value[key]):
                raise ConversionError(f"{path} {key}={value[key]!r}: expected {expected}")
        return value

    def check_foreign(self, tie_default: bool = False) -> None:
        """The checks every folder that looped_hf did not write goes through before a model is built
        from it (a retrofit parent, a distillation teacher; the converters make the same ones with
        their own key names): config.json's layer count against the weight files, its RoPE
        settings (:func:`config_rope_parameters`), its tie flag against the files
        (:meth:`check_tied_head`, ``tie_default`` when absent) and ``generation_config.json``."""
        self.check_layer_count()
        config_rope_parameters(self.config)
        self.check_tied_head(config_bool(self.config, "tie_word_embeddings", tie_default))
        self.check_generation_config()

    # ---- generation config and tokenizer ---------------------------------------------------------
    def _vocab_size(self, vocab_size: int | None) -> int:
        return config_int(self.config, "vocab_size", 1) if vocab_size is None else vocab_size

    def generation_token_ids(self, vocab_size: int | None = None) -> dict[str, int | list[int]]:
        """The bos / eos / pad ids that ``generation_config.json`` sets (none without the file),
        each checked against ``vocab_size`` (default: config.json's) (:func:`token_ids`)."""
        path = self.folder / "generation_config.json"
        if not path.is_file():
            return {}
        return token_ids(read_json_object(path), self._vocab_size(vocab_size), str(path))

    @cached_property
    def tokenizer_files(self) -> tuple[Path, ...]:
        """The ``TOKENIZER_FILES`` the folder has (checked only by :meth:`check_tokenizer`)."""
        return tuple(self.folder / name for name in TOKENIZER_FILES if (self.folder / name).is_file())

    def check_tokenizer(self, vocab_size: int | None = None) -> int | None:
        """Check the folder's tokenizer, when it has one: its JSON files are JSON objects, it loads
        with transformers (from a copy of the tokenizer files alone, so the source's own config.json
        cannot steer it) and has at most ``vocab_size`` (default: config.json's) tokens. Returns its
        size (None: no tokenizer)."""
        if not self.tokenizer_files:
            return None
        return _tokenizer_size(self.tokenizer_files, self._vocab_size(vocab_size))

    def copy_tokenizer(self, dst: PathLike, vocab_size: int | None = None) -> list[str]:
        """:meth:`check_tokenizer`, then the tokenizer files copied into ``dst`` byte for byte;
        returns their names."""
        self.check_tokenizer(vocab_size)
        for file in self.tokenizer_files:
            shutil.copyfile(file, Path(dst) / file.name)
        return [file.name for file in self.tokenizer_files]


_TOKENIZER_SIZES: dict[tuple[tuple[Path, int, int], ...], int] = {}


def _tokenizer_size(files: tuple[Path, ...], vocab_size: int) -> int:
    """``len(tokenizer)`` of the tokenizer made of ``files``, checked (see ``check_tokenizer``);
    remembered per (file, size, mtime), since a converter checks before it copies."""
    from transformers import AutoTokenizer

    stamp = tuple((file, file.stat().st_size, file.stat().st_mtime_ns) for file in files)
    if stamp not in _TOKENIZER_SIZES:
        for file in files:
            if file.name in _JSON_TOKENIZER_FILES:
                read_json_object(file)
        with tempfile.TemporaryDirectory(prefix="looped-tokenizer-") as tmp:
            for file in files:
                shutil.copyfile(file, Path(tmp) / file.name)
            try:
                tokenizer = AutoTokenizer.from_pretrained(tmp)
            except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exceptions (and KeyError) for bad files
                names = ", ".join(file.name for file in files)
                raise ConversionError(f"{files[0].parent}: the tokenizer ({names}) does not load "
                                      f"({type(err).__name__}: {first_line(err)})") from None  # fmt: skip
        _TOKENIZER_SIZES[stamp] = len(tokenizer)
    size = _TOKENIZER_SIZES[stamp]
    if size > vocab_size:
        raise ConversionError(f"{files[0].parent}: the tokenizer has {size} tokens, more than the model's "
                              f"vocab_size={vocab_size}: its last ids would index past the embedding")  # fmt: skip
    return size


__all__ = [
    "GENERATION_FIELDS",
    "HF_BOOKKEEPING_KEYS",
    "ROPE_REQUIRED_KEYS",
    "TOKENIZER_FILES",
    "Checkpoint",
    "check_known_keys",
    "check_recurrences",
    "config_bool",
    "config_rope_parameters",
    "config_int",
    "config_number",
    "read_json_object",
    "rope_parameters",
    "token_ids",
]
