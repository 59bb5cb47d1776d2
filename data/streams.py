"""Text streamed from local JSON Lines, Parquet or text files, tokenized on the fly: `data=stream`.

    python train.py model=transformer data=stream data.path='corpus/*.jsonl' \
        data.tokenizer=my_tokens/tokenizer.json trainer.max_steps=10000

conf/data/stream.yaml builds `StreamText` (data/__init__.py's contract). Its constructor finds the
files, checks their format and text column (each Parquet footer, the first other file's head) and
reads the tokenizer; beyond setup()'s validation slice no text is read before training: the first
batch waits for its own documents only, however large the corpus. A document is a record's or row's `text_column`, or a
.txt line; null or "" is none. The documents' ids, each then the end-of-text id (`eot_token`, added
to the tokenizer when it lacks it), are one token stream cut as data/__init__.py `windows_of` cuts
one: seq_len + 1 tokens, each window's last the next one's first; a sample is (w[:-1], w[1:]).

`train` (`TextStream`) is an infinite IterableDataset that cycles over the files, counting epochs.
The files are cut into pieces (a Parquet row group; `piece_bytes` of another file, a line being in
the piece its first byte is in); reader r * W + w (rank r of R, DataLoader worker w of W) reads
pieces r * W + w, + R * W, ...: together the readers read each document once per epoch. Each reader
counts its own epochs; one with more text falls behind. A reader's state (`state_dict()`, one per
worker in StatefulDataLoader's) is its position: epoch, file, piece and offset (a Parquet row, else
a line's first byte) of the document being cut, the ids carried into it (at most seq_len) and how
many of its ids are in windows already. A resume seeks there and tokenizes that one document again:
its cost does not grow with how far the run got.

Exactness: the shares change with R x W, so a state continues exactly only on as many ranks and
workers per rank, with the same files, text column, seq_len, piece_bytes, tokenizer and validation.
Else `check_resume(loader_state, rank, world_size, num_workers)` returns the one line saying why
(None: exact), to refuse before loader.load_state_dict; a reader's load_state_dict raises it too.

`val` (map-style) is the first `val_documents` documents of `val_path`'s files, or else of the
training files, which the training stream then starts after; read in `setup()`.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ringtrain.data import DataError, DataModule, SequenceDataset, check_positive_ints, windows_of
from ringtrain.data.bpe import read_tokenizer
from ringtrain.data.hf_files import check_columns, data_files, file_format
from ringtrain.data.stream_positions import check_loader_state, reader_layout, reader_states, settings_change
from ringtrain.data.vocab import BPEVocab

EOT_TOKEN = "<|endoftext|>"
PIECE_BYTES = 8 << 20
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time, so the first batch does not wait for a whole row group
START = {"epoch": 0, "file": 0, "piece": 0, "offset": None, "carry": [], "consumed": 0}


@dataclass(frozen=True)
class StreamFile:
    """A file's documents from offset `start` to `stop`: bytes, or rows for Parquet (row groups ending at `group_ends`)."""

    path: str
    format: str
    start: int
    stop: int
    group_ends: tuple[int, ...] = ()
    section: str = "data"  # the config section that named it, for messages (data.sources.<name> in a mixture)

    def pieces(self, piece_bytes: int) -> list[tuple[int, int]]:
        if self.format == "parquet":
            bounds = (0, *self.group_ends)
            return [(max(b, self.start), e) for b, e in zip(bounds, bounds[1:]) if e > self.start]
        return [(b, min(b + piece_bytes, self.stop)) for b in range(self.start, self.stop, piece_bytes)]


def read_documents(file: StreamFile, column: str, piece: tuple[int, int], at: int | None,
                   reads: Counter) -> Iterator[tuple[int, int, str | None]]:
    """(offset, next offset, text) of each document of a piece, from offset `at` (a document's), or
    from the piece's first document when `at` is None; `reads` counts the "bytes" and "rows" read."""
    begin, end = piece
    position = begin if at is None else at
    if file.format == "parquet":
        yield from _parquet_rows(file, column, position, reads)
        return
    with open(file.path, "rb") as handle:
        if at is None and begin > 0:  # the line holding byte begin - 1 is the previous piece's
            handle.seek(begin - 1)
            position = begin - 1 + len(handle.readline())
            reads["bytes"] += position - begin + 1
        handle.seek(position)
        while position < end and (line := handle.readline()):
            reads["bytes"] += len(line)
            yield position, position + len(line), _line_text(file, column, position, line)
            position += len(line)


def _line_text(file: StreamFile, column: str, offset: int, line: bytes) -> str | None:
    """A text file's line, or a JSON Lines record's `column` (None for a blank line)."""
    try:
        text = line.decode("utf-8").rstrip("\r\n")
        record = json.loads(text) if file.format == "json" and text.strip() else None
    except ValueError as err:  # a UnicodeDecodeError is one too
        problem = f"UTF-8 ({err.reason})" if isinstance(err, UnicodeDecodeError) else f"JSON ({err}); a stream reads JSON Lines, one object per line"
        raise DataError(f"{file.section}.path: {_where(file, offset)} is not {problem}: fix or remove that line") from None
    if file.format == "text" or record is None:
        return text if file.format == "text" else None
    value = record.get(column) if isinstance(record, dict) else None
    if not isinstance(record, dict) or column not in record or not isinstance(value, (str, type(None))):
        found = (f"its {column!r} is a {type(value).__name__}" if value is not None else
                 f"it has {', '.join(record) or 'no field'}" if isinstance(record, dict) else f"it is a {type(record).__name__}")
        raise DataError(f"{file.section}.path: {_where(file, offset)} has no {column!r} text ({found}); fix the line or set "
                        f"{file.section}.text_column")
    return value


def _where(file: StreamFile, offset: int) -> str:
    """`path line N (byte B)`: lines are counted only here, when there is an error."""
    with open(file.path, "rb") as handle:
        newlines = sum(handle.read(min(1 << 20, offset - at)).count(b"\n") for at in range(0, offset, 1 << 20))
    return f"{file.path} line {newlines + 1} (byte {offset})"


def _parquet_rows(file: StreamFile, column: str, first: int, reads: Counter) -> Iterator[tuple[int, int, str | None]]:
    import pyarrow.parquet

    group = bisect.bisect_right(file.group_ends, first)  # a piece is one row group
    row = file.group_ends[group - 1] if group else 0
    try:
        with pyarrow.parquet.ParquetFile(file.path) as parquet:
            for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group], columns=[column]):
                reads["rows"], skip = reads["rows"] + batch.num_rows, max(0, first - row)
                for index, text in enumerate(batch.column(0).to_pylist()[skip:], start=row + skip):
                    yield index, index + 1, text
                row += batch.num_rows
    except (OSError, pyarrow.ArrowException) as err:
        raise DataError(f"{file.section}.path: {file.path} row group {group} cannot be read ({' '.join(str(err).split())[:200]}); "
                        f"rewrite the file or leave it out of {file.section}.path") from None


def stream_files(path: str | list[str], format: str | None, column: str, key: str) -> list[StreamFile]:  # noqa: A002
    """The files `path` names, checked: a streamable format, the text column, readable footers."""
    files = data_files(path, key)
    kind = file_format(files, format, key)
    if kind not in ("text", "json", "parquet"):
        raise DataError(f"{key}: {kind} files cannot be streamed; use JSON Lines, Parquet or text files (data.format)")
    section = key.rpartition(".")[0]  # data, or data.sources.<name>
    if kind != "parquet":
        check_columns(files, kind, {"text_column": column}, section)
    found = [_parquet_file(f, column, key) if kind == "parquet"
             else StreamFile(f, kind, 0, Path(f).stat().st_size, section=section) for f in files]
    if not any(file.stop for file in found):
        raise DataError(f"{key}={path!r}: every file is empty ({', '.join(Path(f).name for f in files[:3])}); "
                        f"point {key} at files with text")
    return found


def _parquet_file(path: str, column: str, key: str) -> StreamFile:
    import pyarrow.parquet

    try:
        meta = pyarrow.parquet.read_metadata(path)
        schema = meta.schema.to_arrow_schema()
    except (OSError, pyarrow.ArrowException) as err:
        raise DataError(f"{key}: {path} is not a readable Parquet file ({' '.join(str(err).split())[:200]}); "
                        f"rewrite it or leave it out of {key}") from None
    section = key.rpartition(".")[0]
    check_columns([path], "parquet", {"text_column": column}, section)
    kind = schema.field(column).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise DataError(f"{section}.text_column={column!r}: {Path(path).name}'s column holds {kind}; set it to a text column")
    ends = tuple(itertools.accumulate(meta.row_group(g).num_rows for g in range(meta.num_row_groups)))
    return StreamFile(path, "parquet", 0, meta.num_rows, ends, section)


class TextStream(IterableDataset):
    """The training windows of `StreamText`: infinite, sharded, resumable (module docstring)."""

    def __init__(self, files: list[StreamFile], text_column: str, tokenizer: BPEVocab, eot_id: int, seq_len: int,
                 piece_bytes: int, identity: dict[str, Any]):
        self.files, self.text_column, self.tokenizer, self.eot_id = files, text_column, tokenizer, eot_id
        self.seq_len, self.identity = seq_len, identity  # identity: what a position is only valid for
        self.pieces = [(f, j, piece) for f, file in enumerate(files) for j, piece in enumerate(file.pieces(piece_bytes))]
        self.rank = self.world_size = None  # set_rank's; None: the process group's
        self.position = dict(START)
        self.reads: Counter = Counter()  # "bytes" and "rows" this process read (for tests and benchmarks)

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read rank's share of world_size; called on every rank before iterating."""
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> dict[str, Any]:
        settings = {**reader_layout(self.rank, self.world_size), **self.identity}
        return {"settings": settings, **self.position, "carry": list(self.position["carry"])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if reason := self.check_state(state, reader_layout(self.rank, self.world_size)):
            raise DataError(reason)
        self.position = {key: state[key] for key in START}

    def check_state(self, state: dict[str, Any], layout: dict[str, int]) -> str | None:
        """Why this reader's saved `state` cannot continue at `layout` (None: it can)."""
        return settings_change(state.get("settings"), {**layout, **self.identity}, self.files[0].section)

    def check_resume(self, loader_state: dict[str, Any], rank: int, world_size: int, num_workers: int) -> str | None:
        """Why a saved StatefulDataLoader state cannot resume exactly here, in one line; None when it can."""
        return check_loader_state(self, loader_state, rank, world_size, num_workers)

    def completed_epochs(self, loader_state: dict[str, Any]) -> int:
        """How many whole passes over its share every reader of a saved loader state has made."""
        return min(state["epoch"] for state in reader_states(loader_state))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        layout = reader_layout(self.rank, self.world_size)
        workers = max(1, layout["num_workers"])
        reader, readers = layout["rank"] * workers + layout["worker"], layout["world_size"] * workers
        mine = self.pieces[reader::readers]
        if not mine:
            raise DataError(f"data.path: the files make {len(self.pieces)} pieces, fewer than the {readers} readers ({layout['world_size']} "
                            f"ranks x {workers} workers); lower data.piece_bytes, add files (Parquet: smaller row groups) or use fewer workers")
        return self._windows(mine, dict(self.position))

    def _windows(self, mine: list, position: dict[str, Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        width, epoch, carry, skip = self.seq_len + 1, position["epoch"], list(position["carry"]), position["consumed"]
        resume = (position["file"], position["piece"], position["offset"])  # where the first piece starts
        first = bisect.bisect_left([(f, j) for f, j, _ in mine], resume[:2])
        whole_epoch = first == 0 and resume[2] is None
        while True:
            tokens_read = 0
            for f, j, piece in mine[first:]:
                at, resume = (resume[2] if resume and (f, j) == resume[:2] else None), None
                for offset, _, text in read_documents(self.files[f], self.text_column, piece, at, self.reads):
                    if not text:
                        continue
                    tokens = carry + self.tokenizer.encode(text) + [self.eot_id]
                    tokens_read += len(tokens) - len(carry)
                    start, skip = skip, 0
                    while len(tokens) - start >= width:
                        # The position after this window, set before it is handed out.
                        self.position = {"epoch": epoch, "file": f, "piece": j, "offset": offset, "carry": carry,
                                         "consumed": start + self.seq_len}
                        window = torch.tensor(tokens[start:start + width], dtype=torch.long)
                        yield window[:-1], window[1:]
                        start += self.seq_len
                    carry = tokens[start:]
            if whole_epoch and not tokens_read:  # else this reader would loop forever
                raise DataError("data.path: a reader's share of the files holds no text (its pieces start no line); "
                                "lower data.piece_bytes or use fewer workers")
            epoch, first, whole_epoch = epoch + 1, 0, True


def with_end_of_text(vocab: BPEVocab, token: str) -> tuple[BPEVocab, int]:
    """The tokenizer with `token` (added as a special token, the next id, when it lacks it) and its id."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(vocab.tokenizer_json)
    if tokenizer.token_to_id(token) is None:
        tokenizer.add_special_tokens([token])
        vocab = BPEVocab(tokenizer.to_str())
    return vocab, tokenizer.token_to_id(token)


class StreamText(DataModule):
    """A text column of local files, streamed and tokenized on the fly: `data=stream` (module docstring).
    `key` is the config key errors name (a mixture's sources are data.sources.NAME)."""

    def __init__(self, path: str | list[str], tokenizer: str, text_column: str = "text", seq_len: int = 64,
                 val_path: str | list[str] | None = None, val_documents: int = 1000, format: str | None = None,  # noqa: A002
                 piece_bytes: int = PIECE_BYTES, eot_token: str = EOT_TOKEN, key: str = "data"):
        self.text_column, self.seq_len, self.val_documents, self.piece_bytes = text_column, seq_len, val_documents, piece_bytes
        check_positive_ints(self, "seq_len", "val_documents", "piece_bytes")
        self.key, self.tokenizer_path = key, tokenizer
        self.files = stream_files(path, format, text_column, f"{key}.path")
        self.val_files = None if val_path is None else stream_files(val_path, format, text_column, f"{key}.val_path")
        self.tokenizer, self.eot_id = with_end_of_text(read_tokenizer(tokenizer, f"{key}.tokenizer"), eot_token)
        self.dims = {"vocab_size": self.tokenizer.size}
        self.vocab = self.tokenizer.to_state()

    def setup(self) -> None:
        texts, (last_file, end) = self._first_documents(self.val_files or self.files)
        train_files = self.files
        if self.val_files is None:  # the training stream starts after the held-out documents
            train_files = [replace(file, start=end) if f == last_file else file
                           for f, file in enumerate(self.files) if f >= last_file]
            if not any(file.start < file.stop for file in train_files):
                raise DataError(f"{self.key}.val_documents={self.val_documents} holds out every document of {self.key}.path "
                                f"({len(texts)}); lower {self.key}.val_documents or set {self.key}.val_path")
        ids = [i for text in texts for i in self.tokenizer.encode(text) + [self.eot_id]]
        if len(ids) < self.seq_len + 1:
            raise DataError(f"{self.key}.val_documents: the first {len(texts)} validation documents give {len(ids)} tokens, "
                            f"fewer than one window of seq_len + 1 = {self.seq_len + 1}; raise {self.key}.val_documents")
        self.val = SequenceDataset(windows_of(torch.tensor(ids, dtype=torch.long), self.seq_len))
        identity = {"files": _digest([(Path(f.path).name, Path(f.path).stat().st_size, f.start, f.stop) for f in train_files]),
                    "text_column": self.text_column, "seq_len": self.seq_len, "piece_bytes": self.piece_bytes,
                    "tokenizer": _digest(self.tokenizer.tokenizer_json)}
        self.train = TextStream(train_files, self.text_column, self.tokenizer, self.eot_id, self.seq_len,
                                self.piece_bytes, identity)

    def _first_documents(self, files: list[StreamFile]) -> tuple[list[str], tuple[int, int]]:
        """The first val_documents texts, and (file, offset) just after the last of them."""
        texts, after = [], (len(files) - 1, files[-1].stop)
        for f, file in enumerate(files):
            for piece in file.pieces(max(1, file.stop)):
                for _, end, text in read_documents(file, self.text_column, piece, None, Counter()):
                    texts += [text] if text else []
                    if len(texts) == self.val_documents:
                        return texts, (f, end)
        return texts, after


def _digest(value: Any) -> str:
    """A short name for what a saved position depends on (files by name and size: a moved corpus still resumes)."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]
