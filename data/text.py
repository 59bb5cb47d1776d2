"""Character-level language modelling over any UTF-8 text file.

    python train.py model=transformer data=text data.path=../shared/data/tinyshakespeare.txt

The vocabulary is the set of characters in the file (sorted by code point). The first
(1 - val_fraction) of the characters train, the rest validate. Samples are non-overlapping
windows of seq_len + 1 characters. The encoded file is cached under `cache_dir` (keyed by
the file's path, size and modification time), so later runs and the other ranks of a DDP
job skip the encoding; set `cache_dir` to "" to turn the cache off.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from ringtrain.checkpoints.atomic import open_atomically
from ringtrain.data.bundle import DataError, DataModule, check_positive_ints
from ringtrain.data.tensors import SequenceDataset, windows_of

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1


def check_text_file(path: str) -> None:
    """Cheap checks before any work starts: the file is there and starts as UTF-8 text."""
    if not path:
        raise DataError(
            "data.path is not set; pass a UTF-8 text file, e.g. data.path=../shared/data/tinyshakespeare.txt"
        )
    file = Path(path).expanduser()
    if not file.exists():
        raise DataError(f"data.path={path!r} does not exist (looked in {Path.cwd()}); pass a UTF-8 text file")
    if not file.is_file():
        raise DataError(f"data.path={path!r} is not a file; pass a UTF-8 text file")
    with file.open("rb") as handle:
        head = handle.read(1 << 16)
    if not head:
        raise DataError(f"data.path={path!r} is empty; pass a UTF-8 text file with some text in it")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not just a character cut in half at the end of the chunk
            raise DataError(
                f"data.path={path!r} is not UTF-8 text (byte {err.start}); convert it to UTF-8 first"
            ) from None


def encode_text(text: str) -> tuple[str, torch.Tensor]:
    """(vocabulary, token ids): one id per character, ids in code-point order. Vectorised:
    UTF-32 gives every character as one int32, and unique() maps them to 0..V-1."""
    codepoints = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
    alphabet, ids = torch.unique(codepoints, sorted=True, return_inverse=True)
    vocab = "".join(map(chr, alphabet.tolist()))
    dtype = torch.uint8 if len(vocab) <= 256 else torch.int32
    return vocab, ids.to(dtype)


def load_encoded(path: str, cache_dir: str) -> tuple[str, torch.Tensor]:
    """The file's vocabulary and ids, from the cache when the file has not changed."""
    file = Path(path).expanduser().resolve()
    cache = _cache_path(file, cache_dir)
    if cache is not None and cache.exists():
        try:
            state = torch.load(cache, weights_only=True)
            if state.get("format") == _CACHE_FORMAT:
                return state["vocab"], state["ids"]
        except Exception as err:  # a damaged cache is rebuilt, never fatal
            log.warning("ignoring unreadable text cache %s (%s)", cache, err)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"data.path={path!r} is not UTF-8 text (byte {err.start}); convert it to UTF-8 first"
        ) from None
    vocab, ids = encode_text(text)
    if cache is not None:
        _write_cache(cache, {"format": _CACHE_FORMAT, "vocab": vocab, "ids": ids})
    return vocab, ids


class CharText(DataModule):
    """Character-level windows of a UTF-8 file; `vocab_size` and the vocabulary come from it."""

    def __init__(self, path: str, seq_len: int = 64, val_fraction: float = 0.1, cache_dir: str = "~/.cache/ringtrain"):
        self.path, self.seq_len, self.val_fraction, self.cache_dir = path, seq_len, val_fraction, cache_dir
        check_positive_ints(self, "seq_len")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1")
        check_text_file(path)
        self.dims = {"vocab_size": None}  # given, but known only once setup() has read the file

    def setup(self) -> None:
        vocab, ids = load_encoded(self.path, self.cache_dir)
        split = int(len(ids) * (1 - self.val_fraction))
        train_ids, val_ids = ids[:split], ids[split:]
        for name, part in (("training", train_ids), ("validation", val_ids)):
            if len(part) < self.seq_len + 1:
                raise DataError(
                    f"data.path={self.path!r} gives {len(part)} {name} characters, fewer than one "
                    f"window of data.seq_len + 1 = {self.seq_len + 1}; use a longer file, a smaller "
                    f"seq_len (model.block_size) or another data.val_fraction"
                )
        self.train = SequenceDataset(windows_of(train_ids, self.seq_len))
        self.val = SequenceDataset(windows_of(val_ids, self.seq_len))
        self.dims = {"vocab_size": len(vocab)}
        self.vocab = {"kind": "char", "chars": vocab}


def _cache_path(file: Path, cache_dir: str) -> Path | None:
    if not cache_dir:
        return None
    stat = file.stat()
    key = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / f"text-{file.stem}-{key}.pt"


def _write_cache(cache: Path, state: dict) -> None:
    """Atomic (ringtrain.checkpoints.atomic), so ranks writing at once never see half a file."""
    try:
        with open_atomically(cache) as file:
            torch.save(state, file)
    except OSError as err:  # a read-only home directory must not stop training
        log.warning("could not write the text cache %s (%s); continuing without it", cache, err)
