"""Pretraining-scale token corpora in many files: `data=token_shards data.path=<dir or glob>`.

    python dev/data/fineweb.py -v 10B                   # llm.c: writes dev/data/fineweb10B/
    python train.py model=transformer data=token_shards data.path=dev/data/fineweb10B

`data.path` is a directory or a glob; a directory stands for the llm.c shards in it, itself
if it holds meta.json, and each subdirectory that does. Two kinds of shard:

- llm.c's token shards (dev/data/data_common.py write_datafile, used by its fineweb.py; also
  modded-nanogpt's FineWeb files): a header of 256 little-endian int32 (the magic 20240520,
  version 1, the token count, zeros), then the uint16 ids; `*_train_*.bin` and `*_val_*.bin`.
- ringtrain's token directories (data/token_file.py: train.bin, val.bin, meta.json): several
  of them, one per source say, make one corpus; each gives one shard to each split.

Samples are data/__init__.py `windows_of`'s windows, each within one shard: window j of a
shard is its seq_len + 1 tokens from token j * seq_len. A split numbers its shards' windows
one shard after the other, in path order, and finds sample i's shard by a binary search in
the cumulative counts, so the trainer's order (a permutation of the split, loop/loaders.py
ShuffledShards) and its resume with other ranks or batch sizes work as for one file.

Reads are data/token_file.py's: one positioned read (os.pread) per window, no memory map
(its docstring says why): the resident set stays at the batches however large the corpus,
and a job's ranks share the files through the page cache. Files open on first use and at
most `max_open_files` stay open (the least recently used closes): thousands of shards need
no higher open-file limit. The constructor checks each shard's header and size (1 KiB read
per file), so a damaged shard is refused before any work; `setup()` checks every id against
vocab_size, reading each file once per version of it (data/token_ids.py keeps what it found).
"""
from __future__ import annotations

import glob
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError, DataModule, looked_in, token_ids
from ringtrain.data.bpe import read_tokenizer
from ringtrain.data.token_file import META_FILE, SPLITS, check_token_directory, read_meta, window_rows

log = logging.getLogger("ringtrain")
LLMC_MAGIC = 20240520  # llm.c's GPT-2 token shards (dev/data/data_common.py HEADERS_INFO["gpt-2"])
LLMC_VERSION = 1  # uint16 ids
HEADER_BYTES = 256 * 4
MAX_OPEN_FILES = 64
# Headers of neighbouring formats, named when a shard holds one of them.
OTHER_FORMATS = {
    20240801: "llm.c's llama-3 shard, uint32 ids",
    20240522: "llm.c's evaluation file (HellaSwag, MMLU), not a token stream",
    0x4D554E93: "a .npy file, as build-nanogpt's fineweb.py writes",  # b"\x93NUM"
}


@dataclass(frozen=True)
class Shard:
    """One file of token ids: `num_tokens` ids of `dtype`, from byte `offset` on."""

    path: str
    offset: int  # the header's size: HEADER_BYTES for an llm.c shard, 0 for a token file
    num_tokens: int
    dtype: str


class ShardWindows(Dataset):
    """Next-token windows over many shards: sample i is (inputs, targets), a window's first
    seq_len tokens and the same shifted by one, as int64 tensors (the module docstring says
    which window). Pickles as paths; reads are positioned, so forked workers share files."""

    def __init__(self, shards: list[Shard], seq_len: int, max_open_files: int = MAX_OPEN_FILES):
        self.shards, self.seq_len, self.max_open_files = list(shards), seq_len, max_open_files
        counts = np.array([(s.num_tokens - 1) // seq_len for s in self.shards], dtype=np.int64)
        self.ends = np.cumsum(counts)  # shard k's windows are samples ends[k-1] .. ends[k] - 1
        self.starts = self.ends - counts
        self.offsets = np.array([s.offset for s in self.shards], dtype=np.int64)
        self.dtype = np.dtype(self.shards[0].dtype) if self.shards else np.dtype("uint16")
        self._files: dict[int, BinaryIO] = {}  # open shards, least recently used first

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def locate(self, indices: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard numbers, window numbers within each shard) of samples `indices` (in range)."""
        rows = np.asarray(indices, dtype=np.int64)
        shard = np.searchsorted(self.ends, rows, side="right")
        return shard, rows - self.starts[shard]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.read_windows(window_rows([index], len(self)))[0])
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (len(indices), seq_len) int64, one positioned read per window."""
        windows = torch.from_numpy(self.read_windows(window_rows(indices, len(self))))
        return windows[:, :-1], windows[:, 1:]

    def read_windows(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), seq_len + 1) int64 ids of samples `rows` (in range)."""
        width, itemsize = self.seq_len + 1, self.dtype.itemsize
        nbytes, stride = width * itemsize, self.seq_len * itemsize
        shard, window = self.locate(rows)
        order = np.argsort(shard, kind="stable")  # each file looked up once per call
        shards, byte = shard[order].tolist(), (self.offsets[shard[order]] + window[order] * stride).tolist()
        chunks, current, descriptor = [], -1, -1
        for number, at in zip(shards, byte):
            if number != current:
                current, descriptor = number, self._descriptor(number)
            chunks.append(_read_at(descriptor, nbytes, at))
        data = b"".join(chunks)
        if len(data) != nbytes * len(rows):
            short = next(i for i, chunk in enumerate(chunks) if len(chunk) != nbytes)
            raise DataError(f"{self.shards[shards[short]].path} is shorter than when it was checked; it changed while in use")
        windows = np.empty((len(rows), width), dtype=np.int64)
        windows[order] = np.frombuffer(data, dtype=self.dtype).reshape(len(rows), width)
        return windows

    def _descriptor(self, shard: int) -> int:
        """Shard `shard`'s open file; past max_open_files the least recently used one closes."""
        file = self._files.pop(shard, None)
        if file is None:
            if len(self._files) >= self.max_open_files:
                self._files.pop(next(iter(self._files))).close()
            path = self.shards[shard].path
            try:
                file = open(path, "rb", buffering=0)
            except OSError as err:
                raise _unreadable(path, err) from None
        self._files[shard] = file  # now the most recently used
        return file.fileno()

    def close(self) -> None:
        """Close the open shards (they reopen on the next read)."""
        while self._files:
            self._files.popitem()[1].close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"] = {}  # reopened lazily wherever it is unpickled
        return state

    def __repr__(self) -> str:
        return f"ShardWindows({len(self.shards)} shards, seq_len={self.seq_len}, {len(self)} windows of {self.dtype})"


def _read_by_seek(descriptor: int, nbytes: int, offset: int) -> bytes:
    os.lseek(descriptor, offset, os.SEEK_SET)  # Windows, which has no pread: its workers do not fork
    return os.read(descriptor, nbytes)


_read_at = getattr(os, "pread", _read_by_seek)


def _unreadable(file: str | Path, err: OSError) -> DataError:
    return DataError(f"{file} cannot be read ({err.strerror}); make it readable or leave it out of data.path")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class TokenShards(DataModule):
    """A sharded token corpus as a data component: `data=token_shards data.path=<dir or glob>`.

    `vocab_size`: ids must lie below it, and the model's vocabulary is filled with it; None: the
    tokenizer's size, else the largest meta.json vocab_size, else the largest id plus one (the
    scan setup() does anyway, once per file version; logged). `tokenizer`: the tokenizer.json
    (or its folder) the ids were made with, kept in the checkpoint for `ringtrain sample`."""

    def __init__(self, path: str, seq_len: int = 1024, vocab_size: int | None = None, tokenizer: str | None = None,
                 cache_dir: str = "~/.cache/ringtrain") -> None:
        if not _positive_int(seq_len):
            raise DataError(f"data.seq_len={seq_len!r} must be a positive integer; set model.block_size")
        if vocab_size is not None and not _positive_int(vocab_size):
            raise DataError(f"data.vocab_size={vocab_size!r} must be a positive integer, or null to take meta.json's")
        self.path, self.seq_len, self.cache_dir = path, seq_len, cache_dir
        files = find_shard_files(path)
        self.shards = {split: [check_shard(file, meta, seq_len) for file, meta in files[split]] for split in SPLITS}
        first = self.shards["train"][0]
        for shard in self.shards["train"] + self.shards["val"]:  # a batch is decoded with one dtype
            if shard.dtype != first.dtype:
                raise DataError(f"{shard.path} holds {shard.dtype} ids but {first.path} holds {first.dtype}; the "
                                f"shards of one corpus need one id type (and one tokenizer): tokenize them alike")
        metas = [meta or {} for split in SPLITS for _, meta in files[split]]  # {} for an llm.c shard
        read = read_tokenizer(tokenizer) if tokenizer is not None else None
        self.scanned = vocab_size is None and read is None and not any(metas)
        if vocab_size is None:
            vocab_size = read.size if read else max((meta["vocab_size"] for meta in metas if meta), default=0)
        if self.scanned:
            vocab_size = 1 + max(largest_shard_id(shard, cache_dir) for split in SPLITS for shard in self.shards[split])
        self.dims = {"vocab_size": vocab_size}
        vocabs = [meta.get("vocab") for meta in metas]
        self.vocab = read.to_state() if read else vocabs[0] if all(v == vocabs[0] for v in vocabs) else None

    def setup(self) -> None:
        if self.scanned:
            log.info(f"data.vocab_size={self.dims['vocab_size']}: the largest id in the shards plus one (data.vocab_size "
                     f"or data.tokenizer sets it)")
        for split in SPLITS:  # every id, before any training: data/token_ids.py's check, cached
            for shard in self.shards[split]:
                check_shard_ids(shard, self.dims["vocab_size"], self.cache_dir)
        self.train = ShardWindows(self.shards["train"], self.seq_len)
        self.val = ShardWindows(self.shards["val"], self.seq_len)


def find_shard_files(path: str) -> dict[str, list[tuple[Path, dict | None]]]:
    """The shard files `path` names, by split, in path order: (file, its token directory's
    meta.json, or None for an llm.c shard). DataError when a split has none."""
    if not path:
        raise DataError("data.path is not set; pass a directory or a glob of token shards "
                        "(llm.c's fineweb_train_*.bin, or token directories)")
    pattern = os.path.expanduser(path)
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not matches or not os.path.lexists(matches[0]):
        where = "matches no file" if glob.has_magic(pattern) else f"does not exist{looked_in(pattern)}"
        raise DataError(f"data.path={path!r} {where}; pass a directory or a glob of token shards")
    found: dict[str, dict[Path, dict | None]] = {split: {} for split in SPLITS}
    for match in map(Path, matches):
        for file, meta in _shards_named_by(match):
            split = _split_of(file, meta)
            if split is not None:
                found[split][file] = meta
    for split in SPLITS:
        if not found[split]:
            raise DataError(f"data.path={path!r} holds no {split} shards; expected llm.c token shards named *_{split}_*.bin "
                            f"(as fineweb_{split}_000001.bin) or token directories holding train.bin, val.bin and "
                            f"meta.json (ringtrain prepare_tokens)")
    return {split: sorted(found[split].items(), key=lambda item: str(item[0])) for split in SPLITS}


def _shards_named_by(match: Path) -> list[tuple[Path, dict | None]]:
    """A file stands for itself; a directory for its llm.c shards and token directories (module doc)."""
    if not match.is_dir():  # a token directory's train.bin or val.bin comes with its meta.json
        beside = match.name in ("train.bin", "val.bin") and (match.parent / META_FILE).is_file()
        return [(match, read_meta(str(match.parent), match.parent) if beside else None)]
    shards = [(file, None) for file in sorted(match.glob("*.bin")) if not file.is_dir() and _split_of(file, None)]
    for directory in [match, *sorted(d for d in match.iterdir() if d.is_dir())]:
        if (directory / META_FILE).is_file():
            check_token_directory(str(directory))
            meta = read_meta(str(directory), directory)
            shards += [(directory / f"{split}.bin", meta) for split in SPLITS]
    return shards


def _split_of(file: Path, meta: dict | None) -> str | None:
    if meta is not None:
        return file.stem  # train.bin or val.bin of a token directory
    return next((split for split in SPLITS if f"_{split}_" in file.name and file.suffix == ".bin"), None)


def check_shard(file: Path, meta: dict | None, seq_len: int) -> Shard:
    """The shard in `file`, after checking its header (an llm.c shard) or its size (a token
    file, `meta` its meta.json) and that it holds one window of seq_len + 1 tokens."""
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header = handle.read(HEADER_BYTES) if meta is None else b""
    except OSError as err:
        raise _unreadable(file, err) from None
    if meta is None:
        shard = _llmc_shard(file, header, size)
    else:
        itemsize = np.dtype(meta["dtype"]).itemsize
        if size % itemsize:
            raise DataError(f"{file} is {size} bytes, not a whole number of {meta['dtype']} tokens ({itemsize} bytes "
                            f"each); the file is cut short or meta.json's dtype is wrong")
        shard = Shard(str(file), 0, size // itemsize, meta["dtype"])
    if shard.num_tokens < seq_len + 1:
        raise DataError(f"{file} holds {shard.num_tokens} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}; "
                        f"leave it out of data.path or use a smaller model.block_size")
    return shard


def _llmc_shard(file: Path, header: bytes, size: int) -> Shard:
    """An llm.c shard's header, checked: magic, version, token count, and the file's size."""
    ints = np.frombuffer(header[: len(header) // 4 * 4], dtype="<i4")
    if len(ints) and ints[0] != LLMC_MAGIC:
        known = f" ({OTHER_FORMATS[int(ints[0])]})" if int(ints[0]) in OTHER_FORMATS else ""
        raise DataError(f"{file} is not an llm.c token shard: its header starts with {int(ints[0])}{known}, not the magic "
                        f"number {LLMC_MAGIC}; write it with llm.c's dev/data/data_common.py or leave it out of data.path")
    if len(header) < HEADER_BYTES:
        raise DataError(f"{file} is {size} bytes, shorter than the {HEADER_BYTES}-byte header of an llm.c token shard; "
                        f"it is cut short: download or write it again")
    version, count = int(ints[1]), int(ints[2])
    if version != LLMC_VERSION:
        raise DataError(f"{file} is an llm.c token shard of version {version}; ringtrain reads version {LLMC_VERSION} "
                        f"(uint16 GPT-2 ids): write it again with llm.c's gpt-2 format")
    if count <= 0:
        raise DataError(f"{file} holds {count} tokens (its header's count); leave it out of data.path")
    expected = HEADER_BYTES + 2 * count
    if size != expected:
        cause = "it is cut short: download or write it again" if size < expected else \
            "it holds more than its header says: write it again"
        raise DataError(f"{file} is {size} bytes, but its header's {count} tokens make {expected} "
                        f"({HEADER_BYTES} + 2 x {count}); {cause}")
    return Shard(str(file), HEADER_BYTES, count, "uint16")


def check_shard_ids(shard: Shard, vocab_size: int, cache_dir: str = "") -> None:
    """Every id of the shard below vocab_size, or DataError naming the first one that is not."""
    largest = largest_shard_id(shard, cache_dir)
    if largest < vocab_size:
        return
    for start, chunk in _chunks(shard):
        past = np.flatnonzero(chunk >= vocab_size)
        if len(past):
            index = start + int(past[0])
            raise DataError(
                f"{shard.path}: token {index} (byte {shard.offset + index * chunk.itemsize}) is id {int(chunk[past[0]])}, "
                f"but the vocabulary has {vocab_size} ids (data.vocab_size); set data.vocab_size to at least "
                f"{largest + 1} or tokenize again"
            )


def largest_shard_id(shard: Shard, cache_dir: str = "") -> int:
    """data/token_ids.py's largest_token_id, for ids that may start after a header: kept in
    the same caches, under the path with the header's size (ids from byte 0 are another key)."""
    if shard.offset == 0:
        return token_ids.largest_token_id(shard.path, shard.dtype, None, cache_dir)
    path = Path(shard.path).expanduser().resolve()
    version = token_ids.file_version(path)
    key = (f"{path}@{shard.offset}", version["bytes"], version["mtime_ns"])
    if time.time_ns() - version["mtime_ns"] < token_ids._RACY_SECONDS * 1e9:
        return _scan_largest(shard)  # it may still change within one tick of its file time
    if key not in token_ids._seen:
        cache = token_ids._cache_path(key, cache_dir)
        found = token_ids._read_cache(cache) if cache is not None else None
        if found is None:
            found = _scan_largest(shard)
            if cache is not None:
                token_ids._write_cache(cache, found)
        token_ids._seen[key] = found
    return token_ids._seen[key]


def _scan_largest(shard: Shard) -> int:
    return max(int(chunk.max()) for _, chunk in _chunks(shard))  # a chunk at a time, as token_ids reads


def _chunks(shard: Shard) -> Iterator[tuple[int, np.memmap]]:
    """(first token, ids) of the shard a mapped chunk at a time, each unmapped once the next is taken."""
    itemsize = np.dtype(shard.dtype).itemsize
    for start in range(0, shard.num_tokens, token_ids.CHUNK_TOKENS):
        count = min(token_ids.CHUNK_TOKENS, shard.num_tokens - start)
        yield start, np.memmap(shard.path, shard.dtype, "r", shard.offset + start * itemsize, (count,))
