"""Whether a checkpoint's bytes are still the ones that were written: its checksums.

A full checkpoint file is the zip archive torch.save writes, and every record in it (the
pickle, each tensor's bytes `data/<N>`) carries the CRC-32 that torch.save computed while
writing it (torch.serialization's crc32 option, on by default). So the file carries its own
checksums, in the zip's standard fields, and `torch.load(path, weights_only=True)` reads it as
before. torch.load never compares them (its zip reader skips the check, and a memory-mapped
load reads tensors where they lie), so `file_damage` does: it reads every record through
Python's zipfile, which compares each record's CRC-32 when it reaches its end. That costs one
read of the file on load and nothing of ringtrain's on save (benchmarks/bench_checkpoint.py
measures torch's own CRC-32 during the write).

A sharded checkpoint's shards are torch.distributed.checkpoint's files, which carry no
checksums: CheckpointStore.save records `directory_checksums` (the CRC-32 of each file) in the
step file it writes after them, in the background writer under trainer.async_checkpoint, and
`shards_damage` compares them on load.

A file is verified once per process: `ringtrain evaluate` reads a checkpoint's config, then
its sizes, then its weights, and each read checked the whole file again (three full reads
of a multi-GB file for one evaluation). A file whose identity, size and modification time
are those of one verified before in this process is not read again: ringtrain only ever
replaces a checkpoint by a rename (a new inode), and a change in place moves its mtime
(unless it comes within the same tick of the file system's clock as the verification).

Unchecked, and loaded as before: a record whose CRC-32 field is 0 (written with
torch.serialization.set_crc32_options(False)), and shards whose step file records no
checksums (written before ringtrain recorded them).

Why CRC-32: it catches every error burst up to 32 bits and all other random corruption but one
in 2^32 (a disk, a copy or a network file system that changed bytes), and zlib.crc32 is the
fastest hash measured here (1.8 GB/s on the 2-core benchmark VM; blake2b 0.5, sha256 0.7). It
does not stop someone who alters a file on purpose; weights_only loading keeps code out.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path
from typing import NamedTuple

_CHUNK = 1 << 24  # bytes read at a time: large enough to keep the CRC at memory speed
_ZIP_MAGIC = b"PK\x03\x04"  # the first bytes of a zip archive (of every torch.save file)
# Files this process found intact, as `_identity` gives them (see the module docstring).
_verified: set[tuple[int, int, int, int]] = set()


class Damage(NamedTuple):
    """What is wrong with a file: `foreign` (not a checkpoint file at all, e.g. empty) or not
    (a checkpoint whose bytes changed or were cut short); `reason` in a few words, to follow
    the file's name ("is truncated (...)")."""

    foreign: bool
    reason: str


def file_damage(path: Path, verify: bool = True) -> Damage | None:
    """None when `path` is an intact zip archive (with `verify`: every record's bytes match
    their CRC-32, which reads the whole file the first time in this process); else what is
    wrong with it. A file that is not
    a zip archive at all (an old torch format, a plain pickle) is left to torch.load to judge,
    except an empty one."""
    stat = Path(path).stat()
    if stat.st_size == 0:
        return Damage(True, "is empty (0 bytes)")
    if not starts_as_zip(path):
        return None
    verify = verify and _identity(stat) not in _verified
    try:
        with zipfile.ZipFile(path) as archive:
            damage = _first_mismatch(archive) if verify else None
    except zipfile.BadZipFile as err:  # no end-of-archive directory: cut short
        detail = "its zip directory is missing" if "not a zip file" in str(err) else str(err)
        return Damage(False, f"is truncated or corrupt ({detail})")
    if verify and damage is None:
        _verified.add(_identity(stat))
    return damage


def starts_as_zip(path: Path) -> bool:
    """Whether `path` begins like a zip archive, as every file torch.save writes does (False
    when it cannot be read at all)."""
    try:
        with open(path, "rb") as file:
            return file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    except OSError:
        return False


def _first_mismatch(archive: zipfile.ZipFile) -> Damage | None:
    for info in archive.infolist():
        if info.CRC == 0 and info.file_size:
            continue  # saved with torch's CRC-32 turned off: nothing to compare with
        try:
            with archive.open(info) as record:
                while record.read(_CHUNK):
                    pass
        except (zipfile.BadZipFile, EOFError) as err:
            name = info.filename.split("/", 1)[-1]  # torch puts every record under one folder
            if "CRC" in str(err):
                return Damage(False, f"is corrupt: its record {name} does not match its checksum")
            return Damage(False, f"is truncated or corrupt (record {name}: {err})")
    return None


def directory_checksums(directory: Path) -> dict[str, int]:
    """The CRC-32 of every file in `directory` (a shards directory: flat), by name."""
    return {entry.name: _file_crc32(entry) for entry in sorted(Path(directory).iterdir()) if entry.is_file()}


def shards_damage(directory: Path, recorded: dict[str, int]) -> str | None:
    """None when every file `recorded` names is in `directory` with that CRC-32; else which
    one is not, in a few words (reads every recorded file)."""
    for name, checksum in sorted(recorded.items()):
        path = Path(directory) / name
        if not path.is_file():
            return f"its shard file {path} is missing"
        stat = path.stat()
        if _identity(stat) in _verified:
            continue
        if _file_crc32(path) != checksum:
            return f"is corrupt: its shard file {path} does not match its checksum"
        _verified.add(_identity(stat))
    return None


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    """Which file, and which version of it: device, inode, size, modification time (ns)."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _file_crc32(path: Path) -> int:
    checksum = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            checksum = zlib.crc32(chunk, checksum)
    return checksum
