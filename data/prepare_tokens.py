"""Write a token directory (train.bin, val.bin, meta.json; see data/token_file.py).

The command is `ringtrain prepare_tokens` (ringtrain/tools/prepare_tokens.py):

    ringtrain prepare_tokens input=INPUT.txt output=OUT_DIR [vocab=char|byte] [val_fraction=0.1]
    ringtrain prepare_tokens random_tokens=N vocab_size=V output=OUT_DIR [seed=0]

From a UTF-8 text (`prepare_text`): the first (1 - val_fraction) of the tokens train, the rest
validate, the split data/text.py makes. The `char` vocabulary gives one id per distinct
character (sorted by code point); `byte` one per UTF-8 byte (256 ids, any text); `bpe` a
`tokenizers` tokenizer's ids (data/bpe.py: trained on the input, or read from a
tokenizer.json), whose tokenizer.json is written into the directory as well. The
vocabulary goes into meta.json, so the directory alone decodes samples. The text is streamed
in chunks, never read whole: the byte vocabulary needs one pass, the character vocabulary
two (the first finds the alphabet, the second encodes), and so does BPE (the first counts the
tokens). BPE chunks end at a single newline between two non-space characters, where GPT-2's
byte-level pre-tokenizer splits anyway, so the ids are those of the whole text encoded at once.

`prepare_random` writes N uniform random ids (and a small val.bin) in chunks: a corpus of any
size in seconds, for measuring memory and loader speed, not for learning anything.

The files are written under temporary names and renamed at the end, so an interrupted or
failed run never leaves a directory that looks complete.
"""
from __future__ import annotations

import codecs
import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from ringtrain.data.bpe import TOKENIZER_FILE, train_bpe
from ringtrain.data.token_file import SPLITS, token_dtype_for, write_meta
from ringtrain.data.token_ids import file_version
from ringtrain.data.vocab import BPEVocab, ByteVocab, CharVocab, Vocab
from ringtrain.errors import UserError
from ringtrain.storage import open_atomically, write_text_atomically

# Text read per step: big enough that per-chunk overhead vanishes, small enough that the
# encoded chunk (int64 ids, 8 bytes per character) stays well under a gigabyte.
CHUNK_BYTES = 4 << 20
RANDOM_CHUNK_TOKENS = 16 << 20
UNICODE_SIZE = 0x110000
# Where a BPE chunk may end: after a newline with a non-space character on either side (a
# longer run of white space is one pre-token when it ends a text, several inside one).
_LINE_START = re.compile(r"(?<=\S)\n(?=\S)")


class PrepareError(UserError):
    """An input that cannot be tokenized; the message is the one line the command prints."""


def prepare_text(
    input_path: str | os.PathLike, out_dir: str | os.PathLike, vocab_kind: str = "char",
    val_fraction: float = 0.1, chunk_bytes: int = CHUNK_BYTES, tokenizer: BPEVocab | None = None,
) -> dict:
    """Tokenize a UTF-8 text file into `out_dir`; returns what meta.json records. `tokenizer`:
    the BPE vocabulary of vocab_kind "bpe" (data/bpe.py's train_bpe or read_tokenizer)."""
    if vocab_kind not in ("char", "byte", "bpe"):
        raise ValueError(f"vocab_kind={vocab_kind!r} must be 'char', 'byte' or 'bpe'")
    if (vocab_kind == "bpe") != (tokenizer is not None):
        raise ValueError("vocab_kind='bpe' takes its tokenizer (a BPEVocab), and only it does")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1, e.g. 0.1")
    source = Path(input_path)
    if not source.is_file():
        raise PrepareError(f"{input_path} does not exist or is not a file; pass a UTF-8 text file")
    if source.stat().st_size == 0:
        raise PrepareError(f"{input_path} is empty; pass a UTF-8 text file with some text in it")

    if vocab_kind == "char":
        seen = np.zeros(UNICODE_SIZE, dtype=bool)
        num_tokens = 0
        for text in _decoded_chunks(source, chunk_bytes):
            codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            seen |= np.bincount(codepoints, minlength=UNICODE_SIZE).astype(bool)
            num_tokens += len(codepoints)
        vocab = CharVocab("".join(map(chr, np.flatnonzero(seen).tolist())))
    elif vocab_kind == "byte":
        vocab = ByteVocab()
        num_tokens = source.stat().st_size  # one token per byte; the pass below checks UTF-8
    else:
        vocab = tokenizer
        num_tokens = sum(len(vocab.encode(text)) for text in _encoded_chunks(source, chunk_bytes, vocab))

    split = int(num_tokens * (1 - val_fraction))
    counts = {"train": split, "val": num_tokens - split}
    for name, count in counts.items():
        if count < 2:
            raise PrepareError(
                f"{input_path} gives {count} {name} tokens, too few for any window; use a longer text "
                f"or another val_fraction"
            )
    dtype = np.dtype(token_dtype_for(vocab.size))
    with _TokenDirectoryWriter(out_dir) as writer:
        written = 0
        for text in _encoded_chunks(source, chunk_bytes, vocab):
            ids = vocab.encode_array(text).astype(dtype)
            cut = min(max(split - written, 0), len(ids))
            writer.write("train", ids[:cut])
            writer.write("val", ids[cut:])
            written += len(ids)
        meta = {"dtype": str(dtype), "vocab_size": vocab.size, "vocab": vocab.to_state(),
                "train_tokens": counts["train"], "val_tokens": counts["val"], "source": source.name}
        writer.meta = meta
    if isinstance(vocab, BPEVocab):  # the tokenizer itself, for data.tokenizer and other tools
        write_text_atomically(Path(out_dir) / TOKENIZER_FILE, vocab.tokenizer_json)
    return meta


def prepare_random(out_dir: str | os.PathLike, num_tokens: int, vocab_size: int, seed: int = 0) -> dict:
    """`num_tokens` uniform random ids below `vocab_size` in train.bin, a small val.bin."""
    if num_tokens < 2 or vocab_size < 1:
        raise ValueError("num_tokens must be at least 2 and vocab_size at least 1")
    dtype = np.dtype(token_dtype_for(vocab_size))
    num_val = max(2, min(num_tokens // 10, 1 << 20))
    generator = np.random.default_rng(seed)
    with _TokenDirectoryWriter(out_dir) as writer:
        for name, count in (("train", num_tokens), ("val", num_val)):
            for start in range(0, count, RANDOM_CHUNK_TOKENS):
                size = min(RANDOM_CHUNK_TOKENS, count - start)
                writer.write(name, generator.integers(0, vocab_size, size, dtype=dtype))
        writer.meta = {"dtype": str(dtype), "vocab_size": vocab_size, "train_tokens": num_tokens,
                       "val_tokens": num_val, "source": f"uniform random ids, seed {seed}"}
    return writer.meta


class _TokenDirectoryWriter:
    """train.bin and val.bin, each replaced atomically (storage/__init__.py) when the block
    ends without an error, then meta.json, with each split's largest id (`max_ids`, so that
    training need not read the files to check them: data/token_ids.py); on an error nothing
    is replaced, and a directory this made is removed again."""

    def __init__(self, out_dir: str | os.PathLike):
        self.directory = Path(out_dir)
        self.meta: dict | None = None
        self.files: dict[str, BinaryIO] = {}
        self.max_ids = {split: -1 for split in SPLITS}

    def write(self, split: str, ids: np.ndarray) -> None:
        self.files[split].write(ids.tobytes())
        if ids.size:
            self.max_ids[split] = max(self.max_ids[split], int(ids.max()))

    def __enter__(self) -> _TokenDirectoryWriter:
        self.created = not self.directory.exists()
        self._files = contextlib.ExitStack()
        self.files = {split: self._files.enter_context(open_atomically(self.directory / f"{split}.bin"))
                      for split in SPLITS}
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self._files.__exit__(error_type, error, traceback)
        if error_type is None:
            meta = dict(self.meta)
            meta["max_ids"] = {split: {"max_id": largest, **file_version(self.directory / f"{split}.bin")}
                               for split, largest in self.max_ids.items()}
            write_meta(self.directory, meta.pop("dtype"), meta.pop("vocab_size"), meta.pop("vocab", None), **meta)
        elif self.created:
            shutil.rmtree(self.directory, ignore_errors=True)


def train_tokenizer(input_path: str | os.PathLike, vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> BPEVocab:
    """A byte-level BPE tokenizer of `vocab_size` ids (data/bpe.py) trained on a UTF-8 text
    file, streamed as prepare_text streams it."""
    source = Path(input_path)
    if not source.is_file() or source.stat().st_size == 0:
        raise PrepareError(f"{input_path} does not exist, is not a file or is empty; pass a UTF-8 text file")
    return train_bpe(_line_start_chunks(source, chunk_bytes), vocab_size)


def _encoded_chunks(source: Path, chunk_bytes: int, vocab: Vocab) -> Iterator[str]:
    """The pieces of text to encode one at a time: for BPE, cut at line starts (module docstring)."""
    return _line_start_chunks(source, chunk_bytes) if isinstance(vocab, BPEVocab) else _decoded_chunks(source, chunk_bytes)


def _line_start_chunks(source: Path, chunk_bytes: int) -> Iterator[str]:
    """The decoded chunks, each cut back to its last line start, the rest carried into the next."""
    carried = ""
    for text in _decoded_chunks(source, chunk_bytes):
        text = carried + text
        cut = 0
        for match in _LINE_START.finditer(text):
            cut = match.end()
        if cut:
            yield text[:cut]
        carried = text[cut:]
    if carried:
        yield carried


def _decoded_chunks(source: Path, chunk_bytes: int) -> Iterator[str]:
    """The file's text in pieces of about chunk_bytes; a character cut by a chunk boundary is
    completed by the next chunk (incremental decoder). PrepareError names the first bad byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file handed to the decoder so far
    with source.open("rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            pending = len(decoder.getstate()[0])  # bytes of a cut character held from the last chunk
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                raise PrepareError(
                    f"{source} is not UTF-8 text (byte {offset - pending + err.start}); convert it to UTF-8 first"
                ) from None
            offset += len(chunk)
            if text:
                yield text
            if not chunk:
                return
