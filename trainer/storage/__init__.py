"""Files on disk that are not checkpoints, for any code that writes files: here, replacing a file
or folder atomically and durably, and JSON any parser reads; rundir.py, run directory names that
survive restarts and one job's claim on its directory. May import: ringtrain.errors,
ringtrain.distributed (this module imports nothing of ringtrain, so any layer may use it).

Replacing a file atomically and durably: after a crash, a kill or a power cut its name holds
the old file or the new one, complete, never a truncated mix. Every file ringtrain replaces
goes through here.

The new file is written to a hidden temporary name in the same directory (`temp_path`),
fsynced, renamed over the real name (atomic on POSIX), and the directory fsynced (the file's
fsync does not cover its directory entry: a power cut could undo the rename). A failure removes
the temporary file and raises the OSError, the previous file untouched.

What ringtrain writes for scripts (metrics.json, eval/*.json, sweep_summary.json) is `json_text`:
JSON that every parser reads. Python's json writes NaN / Infinity, which are not JSON
(JSON.parse refuses the file, jq makes them null). A diverged run has such metrics, so they are
written as null, and `allow_nan=False` makes any that slipped past an error, not a broken file.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("ringtrain")

# Directory fsync is not supported everywhere (some network and FUSE file systems): there the
# rename is as durable as the file system makes it, and that is no reason to stop a run.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR}


@contextlib.contextmanager
def open_atomically(path: str | os.PathLike) -> Iterator[_ErrorRecordingWriter]:
    """A binary file that replaces `path` when the `with` block ends without an error (missing
    parents are created durably). A write's OSError (ENOSPC) is raised as itself even where the
    serializer turned it into another error (torch.save makes it "unexpected pos ...")."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        fsync_directory(path.parent.parent)  # the new directory itself survives a power cut
    with _replacing(path) as temp, _ErrorRecordingWriter(io.FileIO(temp, "wb")) as file:
        try:
            yield file
        except Exception:
            if file.error is not None:
                raise file.error from None
            raise
        file.flush()
        os.fsync(file.fileno())  # the bytes are on disk before the name points at them


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    with open_atomically(path) as file:
        file.write(text.encode("utf-8"))


def replace_atomically(path: str | os.PathLike, make: Callable[[Path], None]) -> None:
    """Have `make` create the new file at the temporary path it is given (e.g. a hard link to
    a file already on disk), then rename it over `path`. `make` makes its contents durable."""
    with _replacing(Path(path)) as temp:
        make(temp)


def replace_directory(partial: Path, directory: Path) -> None:
    """Rename the complete directory `partial` to `directory`, replacing an older one of that
    name, and make the renames durable. A directory cannot replace another in one rename: the
    old one moves aside to `.<name>.previous` first, so a crash between the two renames leaves
    that and no `directory`, never a half-written one under the name."""
    previous = directory.with_name(f".{directory.name}.previous")
    if directory.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(directory, previous)
    os.replace(partial, directory)
    fsync_directory(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def temp_name_pattern(names: str) -> re.Pattern[str]:
    """The names `temp_path` gives the files whose names the regular expression `names` matches:
    how a caller recognises the temporary files of its own writes that a kill left behind."""
    return re.compile(rf"^\.(?:{names})\.tmp-\d+$")


def fsync_directory(directory: Path) -> None:
    """Make the renames and links in `directory` durable where the file system can (else a warning at most)."""
    fd = None
    try:
        fd = os.open(directory, os.O_RDONLY)  # e.g. Windows cannot open a directory
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            what = f"cannot open {directory} to fsync it" if fd is None else f"fsync of {directory} failed"
            log.warning(f"{what} ({err.strerror}); a power cut may undo the latest rename there")
    finally:
        if fd is not None:
            os.close(fd)


def remove_if_present(path: Path) -> None:
    try:
        Path(path).unlink(missing_ok=True)
    except OSError as err:
        log.warning(f"cannot remove {path} ({err.strerror}); delete it by hand")


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    temp = temp_path(path)
    # Left by a killed process with our pid (containers reuse pids). It may be a hard link to
    # a checkpoint (checkpoints/__init__.py links last.pt so), which writing through it would truncate.
    remove_if_present(temp)
    try:
        yield temp
        os.replace(temp, path)
    except BaseException:  # an OSError, a state torch cannot save, Ctrl-C mid-write: no debris
        remove_if_present(temp)
        raise
    fsync_directory(path.parent)


class _ErrorRecordingWriter(io.BufferedWriter):
    """What `open_atomically` hands out: a binary file whose `write` remembers the OSError it raised."""

    error: OSError | None = None

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as err:
            self.error = err
            raise


def finite_or_none(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def json_text(value: Any, **dumps_options: Any) -> str:
    return json.dumps(finite_or_none(value), allow_nan=False, **dumps_options)
