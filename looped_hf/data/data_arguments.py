"""``DataArguments``: where the training text comes from and how it becomes blocks (recipe fields)."""

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated

# One way only: this module reads the corpus module, which never imports it back.
from looped_hf.configuration_looped import Interval
from looped_hf.field_checks import AT_LEAST_0, AT_LEAST_1, SEED, check_declared_fields, non_empty, open_unit

from .corpus import EMBEDDED, default_cache_dir

AT_LEAST_2 = Interval(2, None, integer=True)  # a block predicts its next token: two at least

# DataArguments fields that only shape text -> blocks; prepacked data rejects non-default values.
_TEXT_ONLY_FIELDS = ("dataset_config", "text_column", "text_sample_by", "streaming_eval_fraction",
                     "stratify_column", "pack_batch_docs", "num_proc")  # fmt: skip


@dataclass
class DataArguments:
    """Where the training text comes from and how it becomes blocks (parsed by ``HfArgumentParser``)."""

    dataset: Annotated[str | None, non_empty] = field(
        default=None,
        metadata={"help": "None or 'embedded': the shipped public-domain classics. Otherwise a Hub dataset "
                  "name, or a local text/JSON/JSONL/CSV/parquet file or a directory of them."},
    )  # fmt: skip
    dataset_config: Annotated[str | None, non_empty] = field(
        default=None, metadata={"help": "Hub dataset configuration name (load_dataset's `name`)."}
    )
    dataset_split: Annotated[str, non_empty] = field(
        default="train",
        metadata={
            "help": "Hub split to read (local files form one 'train' split); held-out is carved out of it."
        },
    )
    dataset_revision: Annotated[str | None, non_empty] = field(
        default=None, metadata={"help": "Hub dataset revision (commit/tag) to pin; part of the cache key."}
    )
    text_column: Annotated[str, non_empty] = field(default="text", metadata={"help": "Column holding the document text."})
    text_sample_by: Annotated[str, non_empty] = field(
        default="paragraph",
        metadata={"choices": ("line", "paragraph", "document"),
                  "help": "For .txt inputs, what one document is: a line, a paragraph or the whole file."},
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "Stream the dataset (for large Hub datasets): the train set is an IterableDataset "
                  "tokenized on the fly; only the held-out set is cached. Needs Trainer max_steps."},
    )  # fmt: skip
    streaming_eval_fraction: Annotated[float, open_unit] = field(
        default=0.01,
        metadata={"help": "Streaming only: fraction of documents (by hash) reserved for the held-out split."},
    )
    shuffle_buffer: Annotated[int, AT_LEAST_0] = field(
        default=1000,
        metadata={"help": "Streaming only: shuffle buffer (in blocks) for the train stream; 0 = off."},
    )
    tokenizer: Annotated[str | None, non_empty] = field(
        default=None,
        metadata={"help": "None or 'embedded': the shipped 4096-token BPE; 'bytes': byte-level (258 tokens); "
                  "a Hub tokenizer name; a local tokenizer directory or tokenizer.json file."},
    )  # fmt: skip
    seq_len: Annotated[int, AT_LEAST_2] = field(default=256, metadata={"help": "Tokens per packed block (>= 2)."})
    eval_blocks: Annotated[int, AT_LEAST_1] = field(
        default=64,
        metadata={"help": "Held-out blocks of seq_len tokens (fixed size, disjoint from training)."},
    )
    split_seed: Annotated[int, SEED] = field(
        default=0, metadata={"help": "Seed of the document hash that decides the train / held-out split."}
    )
    stratify_column: str | None = field(
        default="source",
        metadata={"help": "If the dataset has this column, the held-out documents alternate between its "
                  "values (e.g. the embedded corpus's 'source'). None or '' to disable."},
    )  # fmt: skip
    pack_batch_docs: Annotated[int, AT_LEAST_1] = field(
        default=10_000,
        metadata={"help": "Documents concatenated per packing batch; the remainder (< seq_len tokens) of each "
                  "batch is dropped."},
    )  # fmt: skip
    data_cache_dir: Annotated[str | None, non_empty] = field(
        default=None,
        metadata={
            "help": "Cache for tokenized data; default $LOOPED_HF_CACHE/data or ~/.cache/looped_hf/data."
        },
    )
    num_proc: Annotated[int | None, AT_LEAST_1] = field(default=None, metadata={"help": "Processes for tokenization (None = 1)."})
    prepacked: bool = field(
        default=False,
        metadata={"help": "dataset is already tokenized and packed in the study's format (a local directory or "
                  "Hub dataset repo of {split}-*.parquet shards with a `tokens` column of seq_len + 1 tokens per "
                  "row and meta_{split}.json; `looped-hf prepare-data` makes it): rows are read in file order, "
                  "dataset_split is the train split, the held-out set is the first eval_blocks rows of "
                  "eval_split. Text settings (text_column, stratify_column, ...) do not apply."},
    )  # fmt: skip
    eval_split: Annotated[str, non_empty] = field(
        default="val",
        metadata={"help": "prepacked only: the split whose first eval_blocks rows are the held-out set."},
    )

    def __post_init__(self) -> None:
        self.validate()

    def cache_root(self) -> Path:
        """Where this recipe's data is cached: ``data_cache_dir``, else ``default_cache_dir()``."""
        return Path(self.data_cache_dir).expanduser() if self.data_cache_dir else default_cache_dir()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and value for settings that cannot work."""
        # Types, ranges and choices: the fields' declarations, which recipes are checked against
        # too; below, how the fields go together.
        check_declared_fields(self)
        self._check_prepacked_fields()

    def _check_prepacked_fields(self) -> None:
        """No setting is silently unused: text-only fields with prepacked data, eval_split without."""
        defaults = {f.name: f.default for f in fields(self) if f.init}
        if not self.prepacked:
            if self.eval_split != defaults["eval_split"]:
                raise ValueError(
                    f"DataArguments.eval_split={self.eval_split!r}: used only with prepacked: true (text data "
                    "carves its held-out split out of dataset_split by document hash)"
                )
            return
        if self.dataset is None or self.dataset == EMBEDDED:
            raise ValueError(
                f"DataArguments.prepacked=True needs dataset to name prepacked shards (a directory or Hub "
                f"repo), got {self.dataset!r}"
            )
        for name in _TEXT_ONLY_FIELDS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"DataArguments.{name}={getattr(self, name)!r}: a text setting, not used with prepacked: "
                    "true (the rows are already tokenized and packed); remove it"
                )
        if self.eval_split == self.dataset_split:
            raise ValueError(
                f"DataArguments.eval_split={self.eval_split!r}: the same split as dataset_split; held-out rows "
                "would be trained on"
            )
