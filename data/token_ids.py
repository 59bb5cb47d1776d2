"""The largest token id in a token file (data/token_file.py), found once per file version.

An id at or above the vocabulary's size indexes past the model's embedding: without this
check it surfaced at some step as torch's `IndexError: index out of range in self`, naming
neither the file nor the id. So every id of every split is checked before training, which
means reading the whole file once. What that read found is kept, so it is not repeated:

  meta.json "max_ids"   ringtrain prepare_tokens records, per split, the largest id it wrote
                        with the file's size and modification time; used while both match
  cache_dir             otherwise a small JSON file per file version, keyed by the file's
                        path, size and modification time (as data/text.py keys its cache);
                        "" turns it off
  this process          a file version already read here is not read again (the pre-check,
                        the config's validation and the rank's set-up each open the data)

The read goes through a memory map a chunk at a time, each chunk unmapped before the next,
so the resident set stays at one chunk whatever the file's size. A file changed in the last
few seconds is read every time and its maximum kept nowhere: file times tick coarsely (a
jiffy), so a change right after a read could leave size and time as they were (git's
"racily clean" files).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from ringtrain.storage import write_text_atomically

log = logging.getLogger(__name__)

# Tokens per mapped chunk: 16 MiB of uint16 ids.
CHUNK_TOKENS = 8 << 20
# A file modified less than this long ago may still change within the same file time.
_RACY_SECONDS = 3.0
_CACHE_FORMAT = 1
_seen: dict[tuple[str, int, int], int] = {}  # (resolved path, size, mtime_ns) -> largest id


def file_version(file: str | os.PathLike) -> dict[str, int]:
    """What says a file is the one a recorded maximum was found in: its size and mtime."""
    stat = os.stat(file)
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def largest_token_id(file: str | os.PathLike, dtype: str, recorded: dict | None = None, cache_dir: str = "") -> int:
    """The largest id in `file` (-1 when it is empty). `recorded`: meta.json's entry for
    this split ({"max_id", "bytes", "mtime_ns"}), used when the file still matches it."""
    path = Path(file).expanduser().resolve()
    version = file_version(path)
    if isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in version.items()) \
            and isinstance(recorded.get("max_id"), int):
        return recorded["max_id"]
    key = (str(path), version["bytes"], version["mtime_ns"])
    if time.time_ns() - version["mtime_ns"] < _RACY_SECONDS * 1e9:
        return _scan(path, dtype, version["bytes"])
    if key not in _seen:
        cache = _cache_path(key, cache_dir)
        found = _read_cache(cache) if cache is not None else None
        if found is None:
            found = _scan(path, dtype, version["bytes"])
            if cache is not None:
                _write_cache(cache, found)
        _seen[key] = found
    return _seen[key]


def _scan(path: Path, dtype: str, size: int) -> int:
    itemsize = np.dtype(dtype).itemsize
    count, largest = size // itemsize, -1
    for start in range(0, count, CHUNK_TOKENS):
        chunk = np.memmap(path, dtype=dtype, mode="r", offset=start * itemsize, shape=(min(CHUNK_TOKENS, count - start),))
        largest = max(largest, int(chunk.max()))
        del chunk  # unmapped: its pages leave the resident set
    return largest


def _cache_path(key: tuple[str, int, int], cache_dir: str) -> Path | None:
    if not cache_dir:
        return None
    digest = hashlib.sha256("|".join(map(str, key)).encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / f"token-max-{Path(key[0]).stem}-{digest}.json"


def _read_cache(cache: Path) -> int | None:
    try:
        state = json.loads(cache.read_text())
        return state["max_id"] if state.get("format") == _CACHE_FORMAT and isinstance(state.get("max_id"), int) else None
    except (OSError, ValueError, KeyError, AttributeError):  # absent or damaged: read the file again
        return None


def _write_cache(cache: Path, largest: int) -> None:
    try:
        write_text_atomically(cache, json.dumps({"format": _CACHE_FORMAT, "max_id": largest}))
    except OSError as err:  # a read-only home directory must not stop training
        log.warning("could not write the token id cache %s (%s); continuing without it", cache, err)
