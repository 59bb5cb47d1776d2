"""Language modelling over binary token files, the format nanoGPT and llm.c write.

    ringtrain prepare_tokens input=input.txt output=~/datasets/mytext vocab=char
    python train.py model=transformer data=token_file data.path=~/datasets/mytext

conf/data/token_file.yaml builds `TokenFile`, a data component (data/__init__.py): its
constructor checks the directory and reads meta.json (vocab_size, vocabulary), `setup()`
opens the splits.

A token directory holds three files:

- train.bin, val.bin: flat token ids, uint16 or uint32 in the machine's byte order, no
  header (numpy's `ids.astype(np.uint16).tofile(path)`).
- meta.json: {"dtype": "uint16" or "uint32", "vocab_size": N} and, when the ids came from a
  vocabulary in data/vocab.py, "vocab": its state, so samples decode without the tokenizer;
  ringtrain prepare_tokens adds "max_ids", each split's largest id (data/token_ids.py).

Every id is checked against vocab_size before training (data/token_ids.py: each file read
once, a chunk at a time, and what it found kept). Beyond that, neither file is ever read whole: a batch reads only its own windows, so a corpus of many
gigabytes trains with a resident set of a few hundred megabytes, and the ranks of a DDP job
share one copy of the file in the page cache. Samples are the windows
`data.windows_of` makes: window i is the block_size + 1 tokens starting at token
i * block_size, so consecutive windows share one token and every token is a target exactly
once.

Why windows are read with os.pread rather than gathered from a memory map: every page a map
has touched counts in the process's resident set until the map is closed (or the kernel
reclaims it), and the kernel maps whole folios around each touched page (up to 2 MB for a
freshly written file). Gathering 200 shuffled batches of 32 x 256 tokens from a persistent
2.2 GB numpy.memmap left the resident set at 2.4 GB (the whole file; 0.64 GB when the file
was not in the page cache); one positioned read per window kept it at 0.27 GB either way, at
a similar cost (a few microseconds per window). The memory map is still there, as
`TokenWindows.tokens`, for looking at the data and on systems without os.pread.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError, DataModule, looked_in
from ringtrain.data.token_ids import largest_token_id
from ringtrain.data.vocab import vocab_from_state
from ringtrain.storage import write_text_atomically

TOKEN_DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")
META_FILE = "meta.json"

_HOW_TO_MAKE = "ringtrain prepare_tokens input=INPUT.txt output=OUT_DIR makes one from a text file"


def window_rows(indices: Any, count: int) -> np.ndarray:
    """`indices` of `count` windows as int64 rows, negative ones from the end (as torch indexes)."""
    rows = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices, dtype=np.int64)
    if rows.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {tuple(rows.shape)}")
    rows = np.where(rows < 0, rows + count, rows)
    if rows.size and (rows.min() < 0 or rows.max() >= count):
        raise IndexError(f"window indices must lie in [-{count}, {count}) for {count} windows")
    return rows


class TokenWindows(Dataset):
    """Next-token windows over one token file: sample i is (inputs, targets), the block_size
    tokens from i * block_size and the same shifted by one, as int64 tensors.

    The file opens on first use and is left out when the dataset is pickled, so DataLoader
    workers and spawned DDP ranks receive a path, not the file. Reads are positioned
    (os.pread), so forked workers can share one open file safely.
    """

    def __init__(self, path: str | os.PathLike, block_size: int, dtype: str):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        if str(dtype) not in TOKEN_DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
        self.path = str(path)
        self.block_size = block_size
        self.dtype = np.dtype(str(dtype))
        size = os.path.getsize(self.path)
        if size % self.dtype.itemsize:
            raise DataError(
                f"{self.path} is {size} bytes, not a whole number of {self.dtype} tokens "
                f"({self.dtype.itemsize} bytes each); the file is cut short or meta.json's dtype is wrong"
            )
        self.num_tokens = size // self.dtype.itemsize
        self._file: BinaryIO | None = None
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.block_size)

    @property
    def tokens(self) -> np.memmap:
        """All the file's token ids, memory-mapped read-only (opened on first use). Pages it
        touches stay resident while it is open; batches do not go through it (module doc)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        position = int(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"window {index} is out of range for {len(self)} windows")
        window = torch.from_numpy(self._read_windows(np.array([position]))[0])
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), block_size) int64: only the chosen windows
        are read, with one positioned read each."""
        windows = torch.from_numpy(self._read_windows(window_rows(indices, len(self))))
        return windows[:, :-1], windows[:, 1:]

    def _read_windows(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), block_size + 1) int64 token ids of windows `rows` (all in range)."""
        width = self.block_size + 1
        if not len(rows):
            return np.empty((0, width), dtype=np.int64)
        if not hasattr(os, "pread"):  # Windows: one fancy index on the map instead
            step = self.block_size * self.dtype.itemsize
            windows = np.lib.stride_tricks.as_strided(
                self.tokens, shape=(len(self), width), strides=(step, self.dtype.itemsize), writeable=False
            )
            return windows[rows].astype(np.int64)
        if self._file is None:
            self._file = open(self.path, "rb", buffering=0)
        descriptor, stride = self._file.fileno(), self.block_size * self.dtype.itemsize
        nbytes = width * self.dtype.itemsize
        data = b"".join([os.pread(descriptor, nbytes, row * stride) for row in rows.tolist()])
        if len(data) != nbytes * len(rows):
            raise DataError(f"{self.path} is shorter than when it was opened; it changed while in use")
        return np.frombuffer(data, dtype=self.dtype).reshape(len(rows), width).astype(np.int64)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"] = state["_tokens"] = None  # reopened lazily wherever it is unpickled
        return state

    def __repr__(self) -> str:
        return f"TokenWindows({self.path!r}, block_size={self.block_size}, {len(self)} windows of {self.dtype})"


@dataclass
class TokenFileData:
    """What `token_file` builds: the two splits, the model size they dictate, the vocabulary."""

    train: TokenWindows
    val: TokenWindows
    dims: dict[str, int]  # {"vocab_size": N}
    vocab: dict | None  # a data.vocab state, or None when meta.json has none


def token_file(path: str, block_size: int, cache_dir: str = "") -> TokenFileData:
    """The token directory at `path` as next-token windows of `block_size` tokens; every id
    is checked against vocab_size (data/token_ids.py; `cache_dir` keeps what that found)."""
    directory = check_token_directory(path)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise DataError(f"block_size={block_size!r} must be a positive integer; set model.block_size")
    meta = read_meta(path, directory)
    dtype, vocab_size = meta["dtype"], meta["vocab_size"]
    splits = {}
    for split in SPLITS:
        file = directory / f"{split}.bin"
        size = file.stat().st_size
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise DataError(
                f"data.path={path!r}: {split}.bin is {size} bytes, not a whole number of {dtype} tokens "
                f"({itemsize} bytes each); the file is cut short or meta.json's dtype is wrong"
            )
        if size // itemsize < block_size + 1:
            raise DataError(
                f"data.path={path!r}: {split}.bin holds {size // itemsize} tokens, fewer than one window "
                f"of block_size + 1 = {block_size + 1}; use more data or a smaller model.block_size"
            )
        check_token_ids(path, file, meta, cache_dir)
        splits[split] = TokenWindows(file, block_size, dtype)
    return TokenFileData(
        train=splits["train"], val=splits["val"], dims={"vocab_size": vocab_size}, vocab=meta.get("vocab")
    )


class TokenFile(DataModule):
    """A token directory as a data component: `data=token_file data.path=<dir>`."""

    def __init__(self, path: str, seq_len: int = 64, cache_dir: str = "~/.cache/ringtrain") -> None:
        self.path, self.seq_len, self.cache_dir = path, seq_len, cache_dir
        directory = check_token_directory(path)
        meta = read_meta(path, directory)
        for split in SPLITS:  # here, so that an id past the vocabulary is refused before any work
            check_token_ids(path, directory / f"{split}.bin", meta, cache_dir)
        self.dims = {"vocab_size": meta["vocab_size"]}
        self.vocab = meta.get("vocab")

    def setup(self) -> None:
        data = token_file(self.path, self.seq_len, self.cache_dir)
        self.train, self.val = data.train, data.val


def check_token_directory(path: str) -> Path:
    """The directory, after checking it holds the three files; DataError names what is missing."""
    if not path:
        raise DataError(f"data.path is not set; pass a directory with train.bin, val.bin and meta.json ({_HOW_TO_MAKE})")
    directory = Path(path).expanduser()
    if not directory.exists():
        raise DataError(f"data.path={path!r} does not exist{looked_in(path)}; {_HOW_TO_MAKE}")
    if not directory.is_dir():
        raise DataError(f"data.path={path!r} is not a directory; pass the directory holding train.bin, val.bin and meta.json")
    for name in (*(f"{split}.bin" for split in SPLITS), META_FILE):
        if not (directory / name).is_file():
            raise DataError(
                f"data.path={path!r} has no {name}; a token directory holds train.bin, val.bin and meta.json ({_HOW_TO_MAKE})"
            )
    return directory


def read_meta(path: str, directory: Path) -> dict:
    """meta.json, checked: a known dtype, a positive vocab_size, a usable vocab if any."""
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"data.path={path!r}: meta.json is not valid JSON ({err}); rewrite it or run ringtrain prepare_tokens again") from None
    if not isinstance(meta, dict):
        raise DataError(f"data.path={path!r}: meta.json must be an object such as {{\"dtype\": \"uint16\", \"vocab_size\": 50257}}")
    dtype = meta.get("dtype")
    if dtype not in TOKEN_DTYPES:
        raise DataError(
            f"data.path={path!r}: meta.json has dtype={dtype!r}; set it to \"uint16\" or \"uint32\", the type the .bin files hold"
        )
    vocab_size = meta.get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise DataError(
            f"data.path={path!r}: meta.json has vocab_size={vocab_size!r}; set it to the number of token ids, a positive integer"
        )
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(f"data.path={path!r}: meta.json's vocab_size={vocab_size} does not fit {dtype}; use \"uint32\"")
    if meta.get("vocab") is not None:
        try:
            vocab = vocab_from_state(meta["vocab"])
        except ValueError as err:
            raise DataError(f"data.path={path!r}: meta.json's vocab is unusable ({err}); fix it or remove the \"vocab\" entry") from None
        if vocab.size > vocab_size:
            raise DataError(
                f"data.path={path!r}: meta.json's vocab has {vocab.size} ids but vocab_size={vocab_size}; "
                f"set vocab_size to at least {vocab.size}"
            )
    return meta


def check_token_ids(path: str, file: Path, meta: dict, cache_dir: str = "") -> None:
    """Ids >= vocab_size would index past the model's embedding: every id of the file is
    checked, once per version of it (data/token_ids.py)."""
    recorded = (meta.get("max_ids") or {}).get(file.stem) if isinstance(meta.get("max_ids"), dict) else None
    largest = largest_token_id(file, meta["dtype"], recorded, cache_dir)
    if largest >= meta["vocab_size"]:
        raise DataError(
            f"data.path={path!r}: {file.name} holds token id {largest}, but the vocabulary has "
            f"{meta['vocab_size']} ids (meta.json's vocab_size); fix vocab_size or the dtype in meta.json, or tokenize again"
        )


def write_meta(directory: str | os.PathLike, dtype: str, vocab_size: int, vocab: dict | None = None, **extra) -> None:
    """meta.json for a token directory; `extra` keys (e.g. token counts) are informational."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(TOKEN_DTYPES)}")
    meta = {"dtype": dtype, "vocab_size": int(vocab_size), **({"vocab": vocab} if vocab is not None else {}), **extra}
    write_text_atomically(Path(directory) / META_FILE, json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def token_dtype_for(vocab_size: int) -> str:
    """The smallest file dtype that holds ids below vocab_size."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
