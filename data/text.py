"""Language modelling over any UTF-8 text file, by characters or with a BPE tokenizer.

    python train.py model=transformer data=text data.path=tinyshakespeare.txt  # README: Tiny Shakespeare
    python train.py model=transformer data=text data.path=input.txt data.tokenizer=tokenizer.json

The vocabulary is the set of characters in the file (sorted by code point), or, with
`tokenizer` (a tokenizers tokenizer.json, data/bpe.py), that tokenizer's ids. The first
(1 - val_fraction) of the tokens train, the rest validate. Samples are windows of seq_len + 1
tokens: non-overlapping by default; `stride` starts a training window every `stride` tokens
instead. Many epochs over a small file memorise its few fixed windows (Tiny Shakespeare's
3,900 at 256 characters: the baby-GPT preset's val loss turned up after 1,500 of its 5,000
steps on an H200, benchmarks/RESULTS.md); stride 1 trains on every offset, as nanoGPT's
random windows do. Validation windows never overlap, so each token is scored once.

The encoded file is cached under `cache_dir` (keyed by the file's path, size and
modification time, and the tokenizer), so later runs and the other ranks of a DDP job skip
the encoding; set `cache_dir` to "" to turn the cache off.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from ringtrain.data import DataError, DataModule, SequenceDataset, check_positive_ints, looked_in, windows_of
from ringtrain.data.bpe import read_tokenizer
from ringtrain.data.vocab import BPEVocab
from ringtrain.storage import open_atomically

log = logging.getLogger(__name__)

_CACHE_FORMAT = 1


def check_text_file(path: str) -> None:
    """Cheap checks before any work starts: the file is there and starts as UTF-8 text."""
    if not path:
        raise DataError(
            "data.path is not set; pass a UTF-8 text file, e.g. data.path=tinyshakespeare.txt (README: Tiny Shakespeare)"
        )
    file = Path(path).expanduser()
    if not file.exists():
        raise DataError(f"data.path={path!r} does not exist{looked_in(path)}; pass a UTF-8 text file")
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


def encode_with_tokenizer(text: str, tokenizer: BPEVocab) -> torch.Tensor:
    """The tokenizer's ids of `text`, in the narrowest dtype that holds them."""
    dtype = torch.uint8 if tokenizer.size <= 256 else torch.int16 if tokenizer.size <= 1 << 15 else torch.int32
    return torch.from_numpy(tokenizer.encode_array(text)).to(dtype)


def load_encoded(path: str, cache_dir: str, tokenizer: BPEVocab | None = None) -> tuple[str, torch.Tensor]:
    """The file's vocabulary (its characters; "" with a tokenizer) and ids, from the cache when
    neither the file nor the tokenizer has changed."""
    file = Path(path).expanduser().resolve()
    cache = _cache_path(file, cache_dir, tokenizer)
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
    vocab, ids = encode_text(text) if tokenizer is None else ("", encode_with_tokenizer(text, tokenizer))
    if cache is not None:
        _write_cache(cache, {"format": _CACHE_FORMAT, "vocab": vocab, "ids": ids})
    return vocab, ids


class CharText(DataModule):
    """Windows of a UTF-8 file's characters (or its `tokenizer`'s ids); `vocab_size` and the
    vocabulary come from the file (or the tokenizer)."""

    def __init__(self, path: str, seq_len: int = 64, val_fraction: float = 0.1, cache_dir: str = "~/.cache/ringtrain",
                 tokenizer: str | None = None, stride: int | None = None):
        self.path, self.seq_len, self.val_fraction, self.cache_dir = path, seq_len, val_fraction, cache_dir
        self.stride = stride  # None: seq_len
        check_positive_ints(self, "seq_len")
        if stride is not None:
            check_positive_ints(self, "stride")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1")
        check_text_file(path)
        self.tokenizer = read_tokenizer(tokenizer) if tokenizer else None  # null or "": characters
        # Characters: given, but known only once setup() has read the file.
        self.dims = {"vocab_size": self.tokenizer.size if self.tokenizer else None}

    def setup(self) -> None:
        vocab, ids = load_encoded(self.path, self.cache_dir, self.tokenizer)
        unit = "tokens" if self.tokenizer else "characters"
        split = int(len(ids) * (1 - self.val_fraction))
        train_ids, val_ids = ids[:split], ids[split:]
        for name, part in (("training", train_ids), ("validation", val_ids)):
            if len(part) < self.seq_len + 1:
                raise DataError(
                    f"data.path={self.path!r} gives {len(part)} {name} {unit}, fewer than one "
                    f"window of data.seq_len + 1 = {self.seq_len + 1}; use a longer file, a smaller "
                    f"seq_len (model.block_size) or another data.val_fraction"
                )
        self.train = SequenceDataset(windows_of(train_ids, self.seq_len, self.stride))
        self.val = SequenceDataset(windows_of(val_ids, self.seq_len))
        if self.tokenizer is not None:
            self.vocab = self.tokenizer.to_state()
        else:
            self.dims = {"vocab_size": len(vocab)}
            self.vocab = {"kind": "char", "chars": vocab}


def _cache_path(file: Path, cache_dir: str, tokenizer: BPEVocab | None) -> Path | None:
    if not cache_dir:
        return None
    stat = file.stat()
    encoding = "chars" if tokenizer is None else hashlib.sha256(tokenizer.tokenizer_json.encode()).hexdigest()
    key = hashlib.sha256(f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{encoding}".encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / f"text-{file.stem}-{key}.pt"


def _write_cache(cache: Path, state: dict) -> None:
    """Atomic (ringtrain.storage), so ranks writing at once never see half a file."""
    try:
        with open_atomically(cache) as file:
            torch.save(state, file)
    except OSError as err:  # a read-only home directory must not stop training
        log.warning("could not write the text cache %s (%s); continuing without it", cache, err)
