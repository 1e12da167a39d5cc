"""Packed blocks into batches: the collators the ``Trainer`` gets, and ``TokenBlocks``, zero-copy rows."""

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from .data_arguments import DataArguments

logger = logging.getLogger(__name__)


class PackedBlockCollator:
    """Stack fixed-length blocks into ``input_ids`` and ``labels`` (a copy; the model's loss shifts).

    Packed blocks have no padding, so nothing is masked: equivalent to
    ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` on this data (whose pad token is
    distinct from EOS), without its per-batch padding pass.
    """

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        ids = torch.stack([torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features])
        return {"input_ids": ids, "labels": ids.clone()}


class TokenBlocks(torch.utils.data.Dataset):
    """The equal-length ``input_ids`` rows of a map-style ``datasets.Dataset`` as zero-copy NumPy
    views of its Arrow buffers (memory-mapped from the cache, so nothing is loaded up front).

    Why: the ``Trainer``'s loader asks the dataset for each batch (``__getitems__``), and a
    ``datasets`` row goes through an Arrow take and the torch formatter, every step, on the
    training process's critical path; here a batch is one NumPy index. Measured on a CPU, batch
    read + collate of 2-4 rows of 32-256 tokens: 0.26-0.44 ms -> 0.08 ms back to back, 1.6 -> 1.0
    ms per batch of 4 x 256 between steps of compute (cold caches). Rows are what the formatted
    dataset gives (``{"input_ids": int64 tensor}``), so collators and batches are unchanged, and the
    same indices give the same rows. Pickles as the source dataset (by file, for
    ``dataloader_num_workers`` with spawn), not as the arrays.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._views, self._starts = self._arrays(dataset)

    @staticmethod
    def _arrays(dataset: Dataset) -> tuple[list[np.ndarray], np.ndarray]:
        import pyarrow as pa

        views = []
        for chunk in dataset.data.table.column("input_ids").chunks:
            if chunk.null_count:
                raise ValueError("input_ids has null rows")
            if pa.types.is_fixed_size_list(chunk.type):
                width = chunk.type.list_size
            else:
                offsets = chunk.offsets.to_numpy()
                width = int(offsets[1] - offsets[0]) if len(chunk) else 0
                if np.any(np.diff(offsets) != width):
                    raise ValueError("input_ids rows differ in length")
            values = chunk.flatten().to_numpy(zero_copy_only=True)
            views.append(values.reshape(len(chunk), width))
        if len({v.shape[1] for v in views if len(v)}) > 1:
            raise ValueError("input_ids rows differ in length between chunks")
        starts = np.cumsum([0, *(len(v) for v in views)])
        return views, starts

    @classmethod
    def wrap(cls, dataset: Any) -> Any:
        """``TokenBlocks(dataset)`` where its rows allow it (map-style, only ``input_ids``, equal
        lengths, no index mapping from ``select``/``shuffle``, no nulls); else ``dataset`` itself."""
        if (
            not isinstance(dataset, Dataset)
            or dataset.column_names != ["input_ids"]
            or dataset._indices is not None
        ):
            return dataset
        try:
            return cls(dataset)
        except (
            ValueError,
            TypeError,
            AttributeError,
            NotImplementedError,
        ) as err:  # pyarrow: no zero-copy view
            logger.info("TokenBlocks: %s; the dataset is read row by row", err)
            return dataset

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _rows(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + len(self), idx)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"TokenBlocks: index out of range for {len(self)} rows")
        if len(self._views) == 1:
            return self._views[0][idx]
        which = np.searchsorted(self._starts, idx, side="right") - 1
        return np.stack([self._views[c][i - self._starts[c]] for c, i in zip(which, idx)])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self._rows([index])[0].astype(np.int64))}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        rows = torch.from_numpy(self._rows(indices).astype(np.int64))
        return [{"input_ids": row} for row in rows]

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dataset"])


def collator(
    tokenizer: PreTrainedTokenizerBase | None = None, data_args: DataArguments | None = None
) -> Callable[[list[Mapping[str, Any]]], dict[str, torch.Tensor]]:
    """The data collator to give the ``Trainer`` for rows from ``build_datasets(data_args, ...)``.

    Blocks of text data: ``PackedBlockCollator``. Prepacked rows (``data_args.prepacked``) of
    ``seq_len + 1`` tokens: ``PrepackedRowCollator``, the study's inputs ``row[:-1]`` and targets
    ``row[1:]``. (Given whole to ``PackedBlockCollator``, such a row trains on the same targets, as
    the model's loss shifts, but counts one input token more per row.)
    """
    del tokenizer  # kept in the signature so the call site reads like transformers' collators
    if data_args is not None and data_args.prepacked:
        from looped_hf.prepacked import PrepackedRowCollator

        return PrepackedRowCollator(data_args.seq_len)
    return PackedBlockCollator()
