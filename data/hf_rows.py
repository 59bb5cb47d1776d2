"""Rows of local files as dict batches: each column a batch key (Hugging Face's style).

    python train.py data=hf_rows data.path=reviews.jsonl data.tokenizer=my_tokens/tokenizer.json \
        model=... task=classification            # batches {input_ids, attention_mask, label}

conf/data/hf_rows.yaml builds `HFRows`, a data component (data/__init__.py), for data that is not
one token stream: a json/jsonl, parquet or csv file of records (or a .txt of lines) with a
text and a label, or already-tokenized `input_ids` / `labels`. Each row becomes a dict of
tensors, unpadded, and `RowBatches.collate_fn` (the DataLoader's collate, data/batches.py)
makes a batch of them one dict (the model is called as `model(**inputs)`, the target is
`label`/`labels` or `task.target_key`).

- `tokenizer` (a tokenizer.json, data/bpe.py): `text_column` is tokenized once (Dataset.map,
  cached in `cache_dir` like data/hf_text.py's) into `input_ids` and `attention_mask`,
  truncated to `max_length` and stored unpadded.
- `columns`: the columns that become batch keys, a list of names or a mapping
  {batch key: column}; null takes every column whose values are numbers or lists of numbers
  (strings cannot be tensors). List columns are truncated to `max_length`.
- `padding` (Hugging Face's names, DataCollatorWithPadding's): `longest` pads each batch's
  list columns to the batch's longest row, so a batch of short rows costs only their length;
  `max_length` pads every batch to `max_length`. `labels` pads with -100 (ignored by the loss,
  Hugging Face's convention), `attention_mask` and `token_type_ids` with 0, every other list
  column with `pad_id`; scalar columns are stacked.
- Validation: `val_path`'s rows, else `val_fraction` of the rows drawn with `seed` (the same
  rows on every rank and every run).

`dims`: `vocab_size` from the tokenizer; `num_classes` from an integer `label`/`labels` column
(the number of its ClassLabel names, else its largest value + 1), known after `setup()`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ringtrain.data import DataError, DataModule, check_positive_ints
from ringtrain.data.bpe import read_tokenizer
from ringtrain.data.hf_files import cache_key, check_columns, data_files, file_format, load_rows, mapped, peek_columns

LABEL_COLUMNS = ("labels", "label")
IGNORE_INDEX = -100  # data/tasks.py's: padded labels count neither in the loss nor in the metrics
PADDINGS = ("longest", "max_length")  # Hugging Face's names for the same two choices
MASK_COLUMNS = ("attention_mask", "token_type_ids")  # padded with 0 whatever pad_id is: a mask, not a token


class HFRows(DataModule):
    """Rows as dict batches: `data=hf_rows` (module docstring)."""

    def __init__(self, path: str | list[str], val_path: str | list[str] | None = None, val_fraction: float = 0.1,
                 columns: list[str] | dict[str, str] | None = None, tokenizer: str | None = None,
                 text_column: str = "text", max_length: int = 64, padding: str = "longest", pad_id: int = 0,
                 seed: int = 0, format: str | None = None, cache_dir: str = "~/.cache/ringtrain"):  # noqa: A002
        self.val_fraction, self.text_column, self.max_length, self.pad_id = val_fraction, text_column, max_length, pad_id
        self.padding, self.seed, self.cache_dir = padding, seed, cache_dir
        check_positive_ints(self, "max_length")
        if padding not in PADDINGS:
            raise DataError(f"data.padding={padding!r} is not one of {', '.join(PADDINGS)}; longest pads each batch to "
                            f"its longest row, max_length pads every row to data.max_length")
        if val_path is None and not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1 (or set data.val_path)")
        self.keys = _batch_keys(columns)
        self.tokenizer = read_tokenizer(tokenizer) if tokenizer else None
        wanted = {f"columns.{key}": column for key, column in (self.keys or {}).items()
                  if not (self.tokenizer and column in ("input_ids", "attention_mask"))}
        if self.tokenizer:
            wanted["text_column"] = text_column
        self.sources = {"train": self._source(path, format, "data.path", wanted)}
        if val_path is not None:
            self.sources["val"] = self._source(val_path, format, "data.val_path", wanted)
        self.dims = {"vocab_size": self.tokenizer.size} if self.tokenizer else {}
        files, builder = self.sources["train"]
        named = list(self.keys) if self.keys is not None else (peek_columns(files[0], builder) or [])
        if any(label in named for label in LABEL_COLUMNS):
            self.dims["num_classes"] = None  # given, but known only once setup() has read the labels
        self.vocab = self.tokenizer.to_state() if self.tokenizer else None

    @staticmethod
    def _source(path: Any, format: str | None, key: str, wanted: dict[str, str]) -> tuple[list[str], str]:  # noqa: A002
        files = data_files(path, key)
        builder = file_format(files, format, key)
        check_columns(files, builder, wanted)
        return files, builder

    def prepare_data(self) -> None:
        """Tokenize into the cache once per machine (ringtrain runs this on local rank 0 first)."""
        if self.cache_dir and self.tokenizer:
            for files, builder in self.sources.values():
                self._rows(files, builder)

    def setup(self) -> None:
        train = self._rows(*self.sources["train"])
        if "val" in self.sources:
            val = self._rows(*self.sources["val"])
        else:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            count = max(1, int(len(train) * self.val_fraction))
            train, val = train.select(sorted(order[count:])), train.select(sorted(order[:count]))
        keys = self.keys or {name: name for name in _numeric_columns(train)}
        for key, column in keys.items():
            if column not in train.column_names:
                raise DataError(f"data.columns.{key}={column!r}: the rows have no such column (they have "
                                f"{', '.join(train.column_names)}); name one of them")
        self.train, self.val = (RowBatches(split, keys, self.max_length, self.pad_id, self.padding)
                                for split in (train, val))
        label = next((keys[k] for k in LABEL_COLUMNS if k in keys), None)
        self.dims.pop("num_classes", None)
        if label is not None and _is_integer(train.features[label]):
            self.dims["num_classes"] = _class_count(train, val, label)

    def _rows(self, files: list[str], builder: str) -> Any:
        rows = load_rows(files, builder, self.cache_dir, "data.path")
        if self.tokenizer is None:
            return rows
        if self.text_column not in rows.column_names:
            raise DataError(f"data.text_column={self.text_column!r}: the data has no such column (it has "
                            f"{', '.join(rows.column_names)}); set data.text_column to one of them")
        return self._tokenized(rows, files, builder)

    def _tokenized(self, rows: Any, files: list[str], builder: str) -> Any:
        """`rows` with input_ids and attention_mask (at most max_length each, unpadded: the
        collate pads) in place of the text."""
        import datasets

        tokenizer, length = self.tokenizer, self.max_length

        def tokenize(texts: list[str]) -> dict[str, list[list[int]]]:
            ids = [row[:length] for row in tokenizer.encode_many([text or "" for text in texts])]
            return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}

        features = rows.features.copy()
        del features[self.text_column]
        features["input_ids"] = datasets.Sequence(datasets.Value("int64"))
        features["attention_mask"] = datasets.Sequence(datasets.Value("int8"))
        # "unpadded" in the key: the files of before, padded to max_length, are never read as these.
        name = "rows-" + cache_key(builder, self.text_column, length, "unpadded", tokenizer.tokenizer_json, files=files)
        return mapped(rows, tokenize, name, self.cache_dir, datasets.Features(features),
                      input_columns=[self.text_column], remove_columns=[self.text_column])


class RowBatches(torch.utils.data.Dataset):
    """Row i of a `datasets.Dataset` as {batch key: tensor}, list columns truncated to
    max_length and unpadded; `collate_fn` pads a batch of them (module docstring: `padding`)."""

    def __init__(self, rows: Any, keys: Mapping[str, str], max_length: int, pad_id: int, padding: str = "longest"):
        self.rows, self.keys, self.max_length, self.pad_id, self.padding = rows, dict(keys), max_length, pad_id, padding
        # An empty list has no values to tell torch its dtype: the column's says it.
        self.empty_dtypes = {key: _torch_dtype(rows.features[column]) for key, column in self.keys.items()
                             if column in rows.features}

    @property
    def max_sequence_length(self) -> int:
        """The longest a batch gets (data/batches.py): the pre-check holds the model's positions
        against it, since its first rows may be shorter than later batches."""
        return self.max_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[int(index)]
        return {key: self._tensor(key, row[column]) for key, column in self.keys.items()}

    def _tensor(self, key: str, value: Any) -> torch.Tensor:
        if not isinstance(value, list):
            return torch.tensor(value)
        value = value[: self.max_length]
        return torch.tensor(value) if value else torch.empty(0, dtype=self.empty_dtypes.get(key, torch.int64))

    def collate_fn(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch of `samples` (the DataLoader's collate, in its worker processes too):
        scalar columns stacked, list columns padded to the longest row or to max_length."""
        return {key: self._stacked(key, [sample[key] for sample in samples]) for key in samples[0]}

    def _stacked(self, key: str, values: list[torch.Tensor]) -> torch.Tensor:
        if values[0].dim() == 0:
            return torch.stack(values)
        width = self.max_length if self.padding == "max_length" else max(len(value) for value in values)
        fill = IGNORE_INDEX if key == "labels" else 0 if key in MASK_COLUMNS else self.pad_id
        longest = max(values, key=len)  # its item shape and dtype: an empty row's may not say
        batch = torch.full((len(values), width, *longest.shape[1:]), fill, dtype=longest.dtype)
        for row, value in zip(batch, values):
            row[: len(value)] = value
        return batch


def _batch_keys(columns: list[str] | dict[str, str] | None) -> dict[str, str] | None:
    if columns is None:
        return None
    if isinstance(columns, Mapping):
        return {str(k): str(v) for k, v in columns.items()}
    if isinstance(columns, (list, tuple)) and columns and all(isinstance(c, str) for c in columns):
        return {c: c for c in columns}
    raise DataError(f"data.columns={columns!r} must be a list of column names or a mapping {{batch key: column}}")


def _numeric_columns(rows: Any) -> list[str]:
    return [name for name, feature in rows.features.items() if _is_numeric(feature)]


def _is_numeric(feature: Any) -> bool:
    inner = getattr(feature, "feature", None)  # a list column's items
    if inner is not None:
        return _is_numeric(inner)
    dtype = getattr(feature, "dtype", "")
    return getattr(feature, "names", None) is not None or dtype.startswith(("int", "uint", "float", "bool"))


def _torch_dtype(feature: Any) -> torch.dtype:
    """The dtype torch.tensor gives the values of a (list) column: float32 for floats, bool, else int64."""
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return _torch_dtype(inner)
    dtype = getattr(feature, "dtype", "")
    return torch.float32 if dtype.startswith("float") else torch.bool if dtype == "bool" else torch.int64


def _is_integer(feature: Any) -> bool:
    return getattr(feature, "names", None) is not None or getattr(feature, "dtype", "").startswith(("int", "uint"))


def _class_count(train: Any, val: Any, column: str) -> int:
    names = getattr(train.features[column], "names", None)
    if names is not None:
        return len(names)
    highest = max(max(split[column]) for split in (train, val) if len(split))
    return int(highest) + 1
