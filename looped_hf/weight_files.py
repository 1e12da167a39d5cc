"""Which tensors a safetensors checkpoint folder holds, in which file, with which dtype and shape,
read from the headers the way transformers' ``from_pretrained`` finds them. It is the one reader of a
folder's weight files: the converters and retrofit (`convert.loader.Checkpoint`) and eval, test-time
and publish (`model_types.check_weights`) all use it. It reads nothing past the headers and writes
nothing.

    files = WeightFiles("./run")
    files.entries["lm_head.weight"]      # (Path of its file, safetensors dtype name "BF16", shape)

Refused, with one `CheckpointError` line naming the file and the value:

* a folder with neither ``model.safetensors`` nor ``model.safetensors.index.json``, and one with only
  a pickled ``pytorch_model.bin`` (unpickling runs code stored in the file);
* ``model.safetensors`` wins over the index, as in transformers. In a sharded folder each key is
  read from the shard that the index's ``weight_map`` names. Refused: an index that is not a JSON
  object or has no ``weight_map`` object of name -> shard; a shard name that leaves the folder
  (absolute, ``..``, a symlink out; the Hub cache's ``snapshots/<rev>/`` -> ``blobs/`` links are
  the one exception); a missing shard; a key the index names that its shard lacks; a key stored in
  two shards, or in a shard the index does not name it for;
* a weight file that is empty, truncated, not safetensors or holds no tensor (its header: 8-byte
  length + JSON, checked against the file's size, then every offset).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .fileio import CheckpointError, check_safetensors, first_line, read_json_object

SINGLE_WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: A tensor's entry: its file, its safetensors dtype name ("F32", "BF16", ...) and its shape.
Entry = tuple[Path, str, tuple[int, ...]]
#: The dtypes a model's weights may be stored in: floating point. No quantized format is read (an
#: int8 file would be cast to the model's dtype by ``from_pretrained`` and scored as if trained so).
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")


def first_of(names: list[str]) -> str:
    """``'a'``, or ``'a' (and 2 more)``: the first of several tensor names, for a one-line refusal."""
    return f"{names[0]!r}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''}"


def _allowed_roots(folder: Path) -> tuple[Path, ...]:
    """Where the weight files of ``folder`` may really live: the folder, and for a Hub cache
    snapshot (``<repo>/snapshots/<rev>``, whose files link to ``<repo>/blobs``) that blobs folder."""
    real = folder.resolve()
    roots = (real,)
    if real.parent.name == "snapshots":
        roots += (real.parent.parent / "blobs",)
    return roots


def inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a file name taken from the checkpoint, refused where it leaves the folder."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(
            f"{folder / SHARD_INDEX}: {what} {name!r}: not a file name inside the checkpoint folder"
        )
    path = folder / name
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in _allowed_roots(folder)):
        raise CheckpointError(
            f"{path}: {what} {name!r} leads out of the checkpoint folder (to {real}); refused"
        )
    return path


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype name, shape) of every tensor in the file ``path``, from its header
    only; a file that is missing, empty, truncated, not safetensors or holds no tensor is refused."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint names it)")
    check_safetensors(path)  # the header length and JSON, against the file's size: cheap and precise
    try:
        entries: dict[str, tuple[str, tuple[int, ...]]] = {}
        with safe_open(path, framework="pt") as handle:  # validates every offset, reads no tensor
            for name in handle.keys():
                view = handle.get_slice(name)
                entries[name] = (view.get_dtype(), tuple(view.get_shape()))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(err)})") from None
    if not entries:
        raise CheckpointError(f"{path}: holds no tensor")
    return entries


class WeightFiles:
    """The weight files of a checkpoint folder, indexed and checked (see the module docstring).

    Attributes:
        entries: tensor name -> (file, dtype name, shape), in the order the files list them.
        files: the weight files, in the order first named.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.entries: dict[str, Entry] = {}
        single, index = self.folder / SINGLE_WEIGHTS, self.folder / SHARD_INDEX
        if single.is_file() or single.is_symlink():
            self._add_file(inside(self.folder, SINGLE_WEIGHTS, "weight file"), None)
        elif index.is_file():
            self._read_index(index)
        elif any((self.folder / name).exists() for name in PICKLE_WEIGHTS):
            raise CheckpointError(f"{self.folder}: only a pickled pytorch_model.bin checkpoint, refused (unpickling "
                                  "runs code stored in the file); convert it to model.safetensors first")  # fmt: skip
        else:
            raise CheckpointError(f"{self.folder}: no {SINGLE_WEIGHTS} (or {SHARD_INDEX})")
        self.files: tuple[Path, ...] = tuple(dict.fromkeys(entry[0] for entry in self.entries.values()))

    def _add_file(self, path: Path, wanted: set[str] | None) -> None:
        """Index the tensors of ``path``; in a sharded folder only ``wanted`` (the keys the index
        names for it) may be there, and each of them must be."""
        header = read_header(path)
        for name, (dtype, shape) in header.items():
            if name in self.entries:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is stored twice (also in {self.entries[name][0].name})"
                )
            if wanted is not None and name not in wanted:
                raise CheckpointError(f"{path}: holds tensor {name!r}, which the index's weight_map does not name "
                                      "for this shard (a key stored twice, or a stale shard)")  # fmt: skip
            self.entries[name] = (path, dtype, shape)
        missing = sorted((wanted or set()) - set(header))
        if missing:
            raise CheckpointError(
                f"{path}: lacks {first_of(missing)}, which the index's weight_map names in it"
            )

    def _read_index(self, index: Path) -> None:
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        by_shard: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str):
                raise CheckpointError(f"{index}: weight_map[{name!r}]={shard!r}: expected a shard file name")
            by_shard.setdefault(shard, set()).add(name)
        for shard, names in by_shard.items():
            self._add_file(inside(self.folder, shard, "shard"), names)


def check_model_weights(entries: dict[str, Entry], model: Any, where: str) -> None:
    """Refuse, in one `CheckpointError` line starting with ``where``, weight files (``entries``, a
    `WeightFiles`' index) that do not hold exactly the weights of ``model`` (built on the meta
    device: only names and shapes are read), each in its shape and in a ``WEIGHT_DTYPES`` dtype.
    A tied weight (the model's ``all_tied_weights_keys``) may be absent, as transformers saves it."""
    want = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [name for name in want if name not in entries and name not in tied]
    if missing:
        raise CheckpointError(f"{where}: {first_of(missing)} is in no weight file")
    extra = [name for name in entries if name not in want]
    if extra:
        raise CheckpointError(f"{where}: {first_of(extra)} is not a weight of that model")
    for name, shape in want.items():  # in the model's order: the first layer's weight is named first
        if name not in entries:
            continue
        path, dtype, stored = entries[name]
        if stored != shape:
            raise CheckpointError(f"{where}: {name!r} has shape {list(stored)} in {path.name}, the config "
                                  f"makes {list(shape)}")  # fmt: skip
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{where}: {name!r} has dtype {dtype} in {path.name}: weights must be floating "
                                  f"point ({', '.join(WEIGHT_DTYPES)}; no quantized format is read)")  # fmt: skip
