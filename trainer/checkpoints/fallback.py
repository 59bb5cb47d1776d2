"""Falling back from checkpoints that cannot be read, and never deleting them.

  * `find_resumable`: the newest checkpoint of a run's directory that loads with its checksums
    matching, and each newer one that does not (`Unreadable`: its names and why).
  * `set_aside`: an unreadable checkpoint moves into `<checkpoints>/unreadable/` (with its
    shards), where no resume, rotation or cleanup counts, replaces or deletes it, and where it
    stays for a look, a repair or a copy from elsewhere. Only the decision to resume past it
    (checkpoints/resume.py) and the cleanup after resuming an older checkpoint
    (checkpoints/store.py) set files aside; nothing is ever deleted for being unreadable.
  * `holds_checkpoints`: whether a directory has any checkpoint file, readable or not.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from ringtrain.checkpoints.atomic import fsync_directory
from ringtrain.checkpoints.files import BEST_NAME, LAST_NAME, shards_name, step_checkpoints, step_of_name, why_unusable

# Where checkpoints that cannot be read are moved, never deleted (set_aside).
UNREADABLE_DIR = "unreadable"


class Unreadable(NamedTuple):
    """A checkpoint file that cannot be used: its names (last.pt and its step file are one
    file) and why, in a few words."""

    paths: list[Path]
    why: str

    def describe(self) -> str:
        """`<dir>/last.pt (= step-00000800.pt) is corrupt: ...`"""
        first, *aliases = self.paths
        return f"{first} (= {', '.join(p.name for p in aliases)}) {self.why}" if aliases else f"{first} {self.why}"


class Resumable(NamedTuple):
    """What `find_resumable` found: the newest usable checkpoint (None: none), and each newer
    file that is not."""

    path: Path | None
    unreadable: list[Unreadable]

    @property
    def warnings(self) -> list[str]:
        """One line per unreadable file, naming what the run falls back to."""
        if self.path is not None:
            then = f"falling back to {self.path}"
        else:
            then = f"no readable checkpoint is left in {self.unreadable[0].paths[0].parent}" if self.unreadable else ""
        return [f"checkpoint {broken.describe()}; {then}" for broken in self.unreadable]


def find_resumable(directory: Path) -> Resumable:
    """The newest checkpoint in `directory` that loads with its checksums matching, and every
    newer one that does not (truncated, corrupt, not ringtrain's).

    Tried in order: last.pt, the `step-*.pt` files newest first, best.pt (older than every kept
    step file once its own was rotated away). A name that is the same file as one already tried
    (last.pt and its step file are hard links) is not read twice. Temporary files of a killed
    save are never candidates. Each is checked with `why_unusable` (tensors memory-mapped; the
    checksums read the file, and a sharded checkpoint's shards, once). The caller reports the
    warnings (rank 0; the others get the path from it).
    """
    directory = Path(directory)
    candidates = [directory / LAST_NAME]
    candidates += [path for _, path in reversed(step_checkpoints(directory))]
    candidates.append(directory / BEST_NAME)

    tried: list[Path] = []
    unreadable: list[Unreadable] = []
    for path in candidates:
        if not path.is_file():
            continue
        same = [earlier for earlier in tried if _same_file(earlier, path)]
        tried.append(path)
        if same:
            continue
        why = why_unusable(path)
        if why is None:
            return Resumable(path, unreadable)
        unreadable.append(Unreadable(_names_of(path, candidates), why))
    return Resumable(None, unreadable)


def holds_checkpoints(directory: Path) -> bool:
    """Whether `directory` has any checkpoint file, readable or not (read none of them)."""
    directory = Path(directory)
    return any((directory / name).is_file() for name in (LAST_NAME, BEST_NAME)) or bool(step_checkpoints(directory))


def set_aside(paths: list[Path]) -> list[Path]:
    """Move checkpoint files that cannot be read into `<directory>/unreadable/` (kept for a
    look or a repair, never deleted), and a step file's shards directory with it, so that no
    resume, rotation or cleanup counts, overwrites or deletes them. A name already taken there
    gets a numbered suffix. Returns where each went."""
    moved = []
    for path in paths:
        target_dir = path.parent / UNREADABLE_DIR
        target_dir.mkdir(exist_ok=True)
        step = step_of_name(path.name)
        if step is not None and (shards := path.parent / shards_name(step)).is_dir():
            os.replace(shards, _free_name(target_dir / shards.name))
        target = _free_name(target_dir / path.name)
        os.replace(path, target)
        moved.append(target)
        fsync_directory(target_dir)
        fsync_directory(path.parent)
    return moved


def _free_name(path: Path) -> Path:
    number = 0
    candidate = path
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _names_of(path: Path, candidates: list[Path]) -> list[Path]:
    """Every candidate name of this same file, `path` first (last.pt, step-00000800.pt)."""
    return [path] + [other for other in candidates if other != path and other.is_file() and _same_file(other, path)]
