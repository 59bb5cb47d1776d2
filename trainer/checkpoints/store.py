"""The checkpoints of one run directory: `step-<step>.pt` files, `last.pt` and `best.pt`,
their rotation, the debris of killed saves, and recording the checksums of sharded ones.

  * `CheckpointStore` keeps the last `keep_last_k` checkpoints as `step-<step>.pt` files and
    points `last.pt` / `best.pt` at them with hard links (no second write), so one broken file
    still leaves an older one to resume from (checkpoints/fallback.py finds it).
  * A shards directory (a sharded fsdp checkpoint's weights) is deleted once no step file,
    last.pt or best.pt names it.
  * `remove_stale_temp_files` deletes what a save killed mid-write left behind, recognising
    only ringtrain's own names.
  * A checkpoint that cannot be read is never deleted: the cleanup sets it aside
    (checkpoints/fallback.py).
One checkpoint file (its format, writing and reading it) is checkpoints/files.py.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ringtrain.checkpoints.atomic import (
    open_atomically,
    remove_if_present,
    replace_atomically,
    temp_name_pattern,
)
from ringtrain.checkpoints.files import (
    BEST_NAME,
    LAST_NAME,
    CheckpointError,
    save_checkpoint,
    shards_name,
    step_checkpoint_name,
    step_checkpoints,
    why_unusable,
    write_failure_message,
)
from ringtrain.checkpoints.checksums import directory_checksums
from ringtrain.checkpoints.fallback import set_aside

# The temporary names of ringtrain's own checkpoint writes; nothing else is ever removed as stale.
_STALE_TEMP_NAME = temp_name_pattern(r"last\.pt|best\.pt|step-\d+\.pt")
_SHARDS_NAME = re.compile(r"^step-\d+\.shards$")
# What ringtrain.strategies.fsdp's save_sharded leaves when killed mid-save.
_STALE_SHARDS_NAME = re.compile(r"^\.step-\d+\.shards\.(?:partial|previous)$")

log = logging.getLogger("ringtrain")


class CheckpointStore:
    """The checkpoints of one run directory: `step-<step>.pt` files, `last.pt` and `best.pt`.

    keep_last_k: how many `step-*.pt` files to keep, newest by step (>= 1). With 1, only the
    newest step file is kept, the very file `last.pt` names: no older checkpoint to fall back
    to, and the disk holds one checkpoint (two when best.pt is older). Each further one is an
    older fallback for `find_resumable` and costs one checkpoint's size.
    Saving needs room for one more file than is kept (the new one is written in full before an
    old one is deleted, so a failed save never leaves less than there was).
    """

    def __init__(self, directory: Path, keep_last_k: int):
        if keep_last_k < 1:
            raise CheckpointError(
                f"keep_last_k={keep_last_k} for {directory} must be >= 1 (1 keeps only the newest "
                f"step file, the one last.pt names)"
            )
        self.directory = Path(directory)
        self.keep_last_k = keep_last_k

    @property
    def last(self) -> Path:
        return self.directory / LAST_NAME

    @property
    def best(self) -> Path:
        return self.directory / BEST_NAME

    def shards_path(self, step: int) -> Path:
        """Where a sharded checkpoint of `step` keeps its shards (written before `save`)."""
        return self.directory / shards_name(step)

    def save(self, state: dict[str, Any], step: int, best: bool) -> Path:
        """Write `step-<step>.pt` durably, point last.pt (and best.pt when `best`) at it, then
        delete the step files beyond the newest `keep_last_k` (and the shards directories no
        file names any more). Returns the step file."""
        step_path = self.directory / step_checkpoint_name(step)
        if "shards" in state and "shard_checksums" not in state:
            # DCP's files carry no checksums: the step file, written after them, records theirs.
            # This runs in the background writer under trainer.async_checkpoint, not in the stop.
            state = {**state, "shard_checksums": directory_checksums(self.directory / state["shards"])}
        save_checkpoint(step_path, state, intact=self.last)
        link_checkpoint(step_path, self.last)
        if best:
            link_checkpoint(step_path, self.best)
        self._remove_old_step_files(step)
        remove_unnamed_shards(self.directory)
        return step_path

    def step_files(self) -> list[tuple[int, Path]]:
        """(step, path) of every `step-*.pt` file, oldest first."""
        return step_checkpoints(self.directory)

    def _remove_old_step_files(self, saved_step: int) -> None:
        # Deleting a step name never loses last.pt or best.pt: they are hard links to the same
        # file (or copies where links are unsupported), so the data stays while either name
        # does. That is why rotation counts only step names and may delete the one best.pt
        # shares. The deletions need no fsync: one that a power cut undoes is only a file too many.
        kept: list[tuple[int, Path]] = []
        for step, path in self.step_files():
            if step > saved_step:
                # Steps only grow within a run: a newer file is from before a resume from an
                # older checkpoint (trainer.resume=<an older step file of this directory>), a
                # line of training this run has left. One that cannot be read is kept aside.
                if (why := why_unusable(path)) is not None:
                    log.warning(f"{path} {why}; moved to {set_aside([path])[0]}, not deleted")
                    continue
                log.warning(
                    f"removing {path}: step {step} of the line of training this run left when it resumed "
                    f"from an older checkpoint (step {saved_step} was just saved in its place)"
                )
                remove_if_present(path)
            else:
                kept.append((step, path))
        for _, path in kept[: -self.keep_last_k]:
            remove_if_present(path)


def link_checkpoint(source: Path, target: Path) -> None:
    """Make `target` the same file as `source` (last.pt / best.pt = the step file just written),
    atomically and durably.

    A hard link costs no second serialisation or write. Checkpoints are only ever replaced by
    a rename, never rewritten in place, so `target` keeps this version when `source`'s name
    later points to a new file or is deleted. Where links are not supported (some network
    and FAT file systems, another device), the file is copied.
    """
    source, target = Path(source), Path(target)
    try:
        try:
            replace_atomically(target, lambda temp: os.link(source, temp))
        except FileNotFoundError:
            raise
        except OSError:
            with open(source, "rb") as original, open_atomically(target) as copy:
                shutil.copyfileobj(original, copy)
    except OSError as err:
        raise CheckpointError(write_failure_message(target, err, intact=target)) from None


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Delete what saves killed mid-write left behind; returns it.

    Only ringtrain's own names are touched: temporary files (`.last.pt.tmp-<pid>`,
    `.best.pt.tmp-<pid>`, `.step-<step>.pt.tmp-<pid>`), partial shards directories
    (`.step-<step>.shards.partial`), and shards directories that no checkpoint file names (a
    save killed after its shards were complete, before its step file was written). Call it
    before the first save, while no other process writes checkpoints to this directory
    (run.py refuses a directory another run uses).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if _STALE_TEMP_NAME.match(entry.name) and entry.is_file():
            remove_if_present(entry)
            removed.append(entry)
        elif _STALE_SHARDS_NAME.match(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return sorted(removed + remove_unnamed_shards(directory))


def remove_unnamed_shards(directory: Path) -> list[Path]:
    """Delete the `step-<N>.shards` directories that no step file, last.pt or best.pt names;
    returns them. A shards directory lives exactly as long as some checkpoint file uses it
    (best.pt may keep one whose step file was rotated away). When last.pt or best.pt cannot
    be read, which directory it names is unknown, and nothing is deleted."""
    directory = Path(directory)
    shards = [entry for entry in directory.iterdir() if _SHARDS_NAME.match(entry.name) and entry.is_dir()]
    if not shards:
        return []
    named = {shards_name(step) for step, _ in step_checkpoints(directory)}
    for pointer in (directory / LAST_NAME, directory / BEST_NAME):
        if pointer.is_file():
            try:
                state = torch.load(pointer, map_location="cpu", weights_only=True, mmap=True)
            except Exception:
                return []
            if isinstance(state, dict) and "shards" in state:
                named.add(str(state["shards"]))
    removed = [entry for entry in shards if entry.name not in named]
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    return sorted(removed)
