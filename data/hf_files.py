"""Local data files read with Hugging Face `datasets`: text, json (lines), parquet, csv.

What the data components in data/hf_text.py (and data/hf_rows.py) share:

- `data_files(path, key)`: the files a `path` names (a file, a glob, or a list of them),
  checked to exist before any work;
- `file_format(files, format, key)`: the `datasets` builder, from `format` or the extension;
- `peek_columns(file, format)`: the column names, read from the head of the file only (so a
  missing column is refused in the constructor, before the run starts);
- `load_rows(files, format, cache_dir)`: the rows as a `datasets.Dataset`, converted once to
  Arrow in `cache_dir` and memory-mapped from there (datasets' own cache);
- `mapped(rows, function, key, cache_dir, ...)`: `Dataset.map` whose result is written once to
  an Arrow file named by `key` in `cache_dir`, and read back from it by every later run and
  every rank of a DDP job.

`cache_dir` "" keeps everything in memory: nothing is written where the user can see it.
The `datasets` library is imported only when one of these runs (`pip install 'ringtrain[hf]'`).
"""
from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import json
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ringtrain.data import DataError, looked_in

# File extension -> the datasets builder that reads it.
FORMATS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
BUILDERS = ("text", "json", "parquet", "csv")
# Bump when what a cache file holds changes, so old files are not read as new ones.
CACHE_FORMAT = 1
# A json file whose first line is not a whole record is parsed whole for its columns only
# when it is smaller than this; a larger one is checked when the run loads it.
JSON_PEEK_BYTES = 32 << 20


def data_files(path: str | Sequence[str] | None, key: str) -> list[str]:
    """The files `path` names (a path or a glob, or a list of them), sorted within each glob."""
    if not path:
        raise DataError(f"{key} is not set; pass a data file, a glob such as data/*.jsonl, or a list of them")
    files: list[str] = []
    for entry in [path] if isinstance(path, str) else list(path):
        pattern = str(Path(str(entry)).expanduser())
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found:
            raise DataError(f"{key}={entry!r} matches no file{looked_in(pattern)}; check the pattern")
        for file in found:
            if not Path(file).is_file():
                raise DataError(f"{key}={entry!r}: {file} does not exist or is not a file{looked_in(file)}")
        files.extend(found)
    return files


def file_format(files: list[str], format: str | None, key: str) -> str:  # noqa: A002 - the option's name
    """The datasets builder for `files`: `format` when given, else their extension's."""
    if format is not None:
        if format not in BUILDERS:
            raise DataError(f"data.format={format!r} is not one of {', '.join(BUILDERS)}; pick one or leave it null")
        return format
    formats = {FORMATS.get(Path(file).suffix.lower()) for file in files}
    if None in formats or len(formats) != 1:
        raise DataError(
            f"{key}: cannot tell the format of {', '.join(Path(f).name for f in files[:3])} from the extension "
            f"(known: {', '.join(FORMATS)}); set data.format to one of {', '.join(BUILDERS)}"
        )
    return formats.pop()


def peek_columns(file: str, format: str) -> list[str] | None:  # noqa: A002
    """The columns of `file`, from its head; None when that cannot tell (checked at load)."""
    if format == "text":
        return ["text"]
    if format == "csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as handle:
            return next(csv.reader(handle), [])
    if format == "parquet":
        import pyarrow.parquet

        return list(pyarrow.parquet.read_schema(file).names)
    with open(file, encoding="utf-8", errors="replace") as handle:
        first = handle.readline().strip()
    with contextlib.suppress(ValueError):
        record = json.loads(first)
        if isinstance(record, dict):
            return list(record)
    if Path(file).stat().st_size <= JSON_PEEK_BYTES:
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            records = json.loads(Path(file).read_text(encoding="utf-8"))
            if isinstance(records, list) and records and isinstance(records[0], dict):
                return list(records[0])
    return None


def check_columns(files: list[str], format: str, wanted: dict[str, str | None], section: str = "data") -> None:  # noqa: A002
    """Each wanted column (option name -> column) is in the first file; DataError names the fix
    (the key `section`.option: a mixture's source is data.sources.<name>)."""
    columns = peek_columns(files[0], format)
    if columns is None:
        return
    for option, column in wanted.items():
        if column is not None and column not in columns:
            raise DataError(
                f"{section}.{option}={column!r}: {Path(files[0]).name} has no such column (it has "
                f"{', '.join(map(str, columns)) or 'none'}); set {section}.{option} to one of them"
            )


def cache_key(*parts: Any, files: Sequence[str] = ()) -> str:
    """A name for what `parts` and the files' paths, sizes and modification times determine."""
    stats = [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]
    text = json.dumps([CACHE_FORMAT, *map(str, parts), stats])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextlib.contextmanager
def quiet_datasets() -> Iterator[Any]:
    """The datasets module, its progress bars off while the block runs (they would be printed
    by every rank into the run's log), restored after."""
    try:
        import datasets
    except ImportError:
        raise DataError("data from local files with Hugging Face datasets needs the datasets library; "
                        "pip install 'ringtrain[hf]'") from None
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def load_rows(files: list[str], format: str, cache_dir: str, key: str) -> Any:  # noqa: A002
    """The rows of `files` as one `datasets.Dataset`, memory-mapped from datasets' Arrow cache
    under `cache_dir` (in memory when cache_dir is "")."""
    # Text lines keep their newline, so the rows' tokens end to end are the file's.
    options = {"keep_linebreaks": True} if format == "text" else {}
    with quiet_datasets() as datasets, _cache_root(cache_dir) as root:
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own log line of the error said below
        try:
            return datasets.load_dataset(
                format, data_files={"train": files}, split="train", cache_dir=str(root / "datasets"),
                keep_in_memory=not cache_dir, **options,
            )
        except (ValueError, TypeError, OSError, datasets.exceptions.DatasetGenerationError) as err:
            if format == "json" and (line := first_line_not_json(files)):
                raise DataError(f"{key}: {line}: fix or remove that line") from None
            cause = err.__cause__ or err
            detail = " ".join(str(cause).split())[:300] or type(cause).__name__
            raise DataError(f"{key}: datasets could not read the {format} files ({detail}); check the files and data.format") from None
        finally:
            datasets.logging.set_verbosity(verbosity)


def first_line_not_json(files: list[str]) -> str | None:
    """`<file> line N is not JSON (why)` for the first line of a JSON Lines file that does not
    parse (Arrow names a 0-based row of its block); None when every line does, or a file is one
    JSON document (a .json array) rather than lines."""
    for file in files:
        with open(file, "rb") as handle:
            try:
                json.load(handle)
                continue  # one JSON document
            except ValueError:
                handle.seek(0)
            for number, raw in enumerate(handle, start=1):
                try:
                    if raw.strip():
                        json.loads(raw.decode("utf-8"))
                except ValueError as err:  # a UnicodeDecodeError is one too
                    why = f"UTF-8 ({err.reason})" if isinstance(err, UnicodeDecodeError) else f"JSON ({err.msg} column {err.colno})"
                    return f"{file} line {number} is not {why}"
    return None


def mapped(rows: Any, function: Callable, name: str, cache_dir: str, features: Any, **options: Any) -> Any:
    """`rows.map(function, batched=True, **options)` with `features`, written once to the Arrow
    file `name` under `cache_dir` and memory-mapped from there on (kept in memory when
    cache_dir is ""). `name` must change whenever the result would."""
    with quiet_datasets():
        if not cache_dir:
            return rows.map(function, batched=True, features=features, keep_in_memory=True, **options)
        folder = Path(cache_dir).expanduser() / "hf-mapped"
        folder.mkdir(parents=True, exist_ok=True)
        return rows.map(
            function, batched=True, features=features, cache_file_name=str(folder / f"{name}.arrow"),
            load_from_cache_file=True, new_fingerprint=name, **options,
        )


@contextlib.contextmanager
def _cache_root(cache_dir: str) -> Iterator[Path]:
    if cache_dir:
        yield Path(cache_dir).expanduser()
        return
    with tempfile.TemporaryDirectory(prefix="ringtrain-datasets-") as scratch:
        yield Path(scratch)
