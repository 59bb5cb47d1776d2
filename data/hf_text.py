"""Causal language modelling on a text column of local files, read with Hugging Face `datasets`.

    ringtrain prepare_tokens input=corpus.txt output=my_tokens vocab=bpe vocab_size=2048
    python train.py model=transformer data=hf_text data.path=corpus.jsonl \
        data.tokenizer=my_tokens/tokenizer.json [data.text_column=text] [data.val_path=val.jsonl]

conf/data/hf_text.yaml builds `HFText`, a data component (data/__init__.py). Its constructor
checks the files, the text column (from the head of the first file) and the tokenizer, and
knows `vocab_size` from the tokenizer; `setup()` does the work, once per cache:

1. the files become Arrow, memory-mapped (datasets' `load_dataset`, data/hf_files.py);
2. each row's text is tokenized (`Dataset.map`, without special tokens), and the ids are
   written to an Arrow file in `cache_dir`, named by the files (path, size, modification
   time), the column and the tokenizer: later runs and the other ranks read it back;
3. the rows' ids, end to end in file order, are one token stream, read in place from the
   memory-mapped file (`TokenStream`); the first (1 - val_fraction) of the tokens train and
   the rest validate, or `val_path`'s files validate.

Samples are the windows `data.windows_of` cuts from a stream: window i is the
seq_len + 1 tokens from token i * seq_len, (inputs, targets) = (window[:-1], window[1:]),
what the built-in language_model task reads. The windows are a plain map-style Dataset
without `get_batch`, so they go through torch's DataLoader with `trainer.num_workers`
processes, in DistributedSampler's order, and resume mid-epoch exactly (trainer/loop/loaders.py).

Text rows are the lines of a .txt file, each with its newline; json, parquet and csv rows are
records, whose texts are joined as they are (end each with a separator in the data if the
model should see where a document ends).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError, DataModule, check_positive_ints
from ringtrain.data.bpe import read_tokenizer
from ringtrain.data.hf_files import cache_key, check_columns, data_files, file_format, load_rows, mapped
from ringtrain.data.vocab import BPEVocab

IDS = "input_ids"


class TokenStream:
    """The ids of a tokenized `datasets.Dataset`'s `input_ids` column, end to end.

    Each Arrow record batch's ids are one numpy view of the memory-mapped cache file (no copy);
    `read(start, stop)` joins the views a range spans. The views are made on first use and left
    out when the stream is pickled: a DataLoader worker or spawned rank receives the Dataset,
    which datasets pickles as its file's path, and maps the file itself.
    """

    def __init__(self, tokens: Any):
        self.tokens = tokens
        self._parts: list[np.ndarray] | None = None
        self._starts: np.ndarray | None = None
        self.num_tokens = int(self.starts[-1])

    @property
    def parts(self) -> list[np.ndarray]:
        if self._parts is None:
            chunks = self.tokens.data.column(IDS).chunks
            self._parts = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in chunks]
        return self._parts

    @property
    def starts(self) -> np.ndarray:
        """Where each part begins in the stream, and the stream's length last."""
        if self._starts is None:
            self._starts = np.cumsum([0] + [len(part) for part in self.parts])
        return self._starts

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids start..stop-1 of the stream as int64."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces, position = [], start
        for index in range(first, len(self.parts)):
            if position >= stop:
                break
            offset = position - int(self.starts[index])
            piece = self.parts[index][offset : offset + stop - position]
            pieces.append(piece)
            position += len(piece)
        return np.concatenate(pieces).astype(np.int64) if pieces else np.empty(0, dtype=np.int64)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_parts": None}


class StreamWindows(Dataset):
    """Next-token windows over tokens start..stop-1 of a TokenStream, as `windows_of` cuts them."""

    def __init__(self, stream: TokenStream, start: int, stop: int, seq_len: int):
        self.stream, self.start, self.stop, self.seq_len = stream, start, stop, seq_len

    def __len__(self) -> int:
        return max(0, (self.stop - self.start - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} is out of range for {len(self)} windows")
        begin = self.start + index * self.seq_len
        window = torch.from_numpy(self.stream.read(begin, begin + self.seq_len + 1))
        return window[:-1], window[1:]


class HFText(DataModule):
    """A text column of local files as next-token windows: `data=hf_text` (module docstring)."""

    def __init__(self, path: str | list[str], tokenizer: str, text_column: str = "text", seq_len: int = 64,
                 val_path: str | list[str] | None = None, val_fraction: float = 0.1,
                 format: str | None = None, cache_dir: str = "~/.cache/ringtrain"):  # noqa: A002
        self.seq_len, self.text_column, self.val_fraction, self.cache_dir = seq_len, text_column, val_fraction, cache_dir
        check_positive_ints(self, "seq_len")
        if val_path is None and not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1 (or set data.val_path)")
        # (files, format) of the training data, and of the validation data when it has its own.
        self.sources = {"train": self._source(path, format, "data.path")}
        if val_path is not None:
            self.sources["val"] = self._source(val_path, format, "data.val_path")
        self.tokenizer: BPEVocab = read_tokenizer(tokenizer)
        self.dims = {"vocab_size": self.tokenizer.size}
        self.vocab = self.tokenizer.to_state()

    def _source(self, path: str | list[str], format: str | None, key: str) -> tuple[list[str], str]:  # noqa: A002
        files = data_files(path, key)
        builder = file_format(files, format, key)
        check_columns(files, builder, {"text_column": self.text_column})
        return files, builder

    def prepare_data(self) -> None:
        """Tokenize into the cache once per machine (ringtrain runs this on local rank 0 first)."""
        if self.cache_dir:
            for files, builder in self.sources.values():
                self._tokens(files, builder)

    def setup(self) -> None:
        train = TokenStream(self._tokens(*self.sources["train"]))
        if "val" not in self.sources:
            split = int(train.num_tokens * (1 - self.val_fraction))
            self.train = StreamWindows(train, 0, split, self.seq_len)
            self.val = StreamWindows(train, split, train.num_tokens, self.seq_len)
        else:
            val = TokenStream(self._tokens(*self.sources["val"]))
            self.train = StreamWindows(train, 0, train.num_tokens, self.seq_len)
            self.val = StreamWindows(val, 0, val.num_tokens, self.seq_len)
        val_key = "data.val_path" if "val" in self.sources else "data.path"
        for key, name, windows in (("data.path", "training", self.train), (val_key, "validation", self.val)):
            if len(windows) == 0:
                raise DataError(
                    f"{key} gives {windows.stop - windows.start} {name} tokens, fewer than one window of "
                    f"data.seq_len + 1 = {self.seq_len + 1}; use more data, a smaller seq_len (model.block_size) "
                    f"or another data.val_fraction"
                )

    def _tokens(self, files: list[str], builder: str) -> Any:
        """The files' rows tokenized: a Dataset with one `input_ids` list per row."""
        import datasets

        rows = load_rows(files, builder, self.cache_dir, "data.path")
        if self.text_column not in rows.column_names:
            raise DataError(f"data.text_column={self.text_column!r}: the data has no such column (it has "
                            f"{', '.join(rows.column_names)}); set data.text_column to one of them")
        tokenizer, dtype = self.tokenizer, "uint16" if self.tokenizer.size <= 1 << 16 else "uint32"

        def tokenize(texts: list[str]) -> dict[str, list[list[int]]]:
            return {IDS: tokenizer.encode_many([text or "" for text in texts])}

        name = "tokens-" + cache_key(builder, self.text_column, tokenizer.tokenizer_json, files=files)
        listed = getattr(datasets, "List", None) or datasets.Sequence  # List since datasets 4
        features = datasets.Features({IDS: listed(datasets.Value(dtype))})
        return mapped(rows, tokenize, name, self.cache_dir, features, input_columns=[self.text_column],
                      remove_columns=rows.column_names)
