"""Checkpoints, and here the component that owns a run's: which one the run continues from,
reading it (once), its stateful parts saved and restored in one place, writing new ones and
keeping the newest few (torchtitan's CheckpointManager is the model). What it uses is a module a
concern, each named in its own docstring (run directories and atomic file writing are
ringtrain.storage). May import: ringtrain.errors, ringtrain.distributed, ringtrain.storage.
Never the strategies, config, loop or tools.

    checkpoints = CheckpointManager(run_dir / "checkpoints", trainer, dist)
    resumed = checkpoints.resume(trainer.resume, kept)   # rank 0 decides; each rank reads it once
    checkpoints.register(progress=progress, ...)          # Stateful parts, by their key in the file
    checkpoints.restore()                                 # each part's load_state_dict, in that order
    if checkpoints.due(step, evaluated, last): checkpoints.save(step, best, hook)
    checkpoints.flush()                                   # the last save is on disk

trainer.resume is `auto` (the newest readable checkpoint here, else a fresh start: what a
restarted job relies on), a path (continue that run; its recipe is replayed, config/recipe.py)
or null (never; a directory holding checkpoints is refused). An unreadable newest file
(truncated, checksum mismatch) is named in one line and moved into checkpoints/unreadable/,
never deleted, and an older one used; one that holds what ringtrain never loads is refused.
A save (checkpoints/files.py) writes `step-<N>.pt` atomically, hard-links `last.pt` (and
`best.pt`) to it and keeps `keep_last_k` step files: rank 0 writes, every rank takes part; with
trainer.async_checkpoint in a thread (checkpoints/background.py), whose failure stops the run at
the next save or `flush` on every rank, the previous checkpoint intact.
"""
from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ringtrain.checkpoints.background import BackgroundWriter, detached_copy
from ringtrain.storage import remove_if_present, temp_name_pattern
from ringtrain.checkpoints.files import (
    BEST_NAME, CHECKPOINT_FORMAT, LAST_NAME, UNREADABLE_DIR, CheckpointError, RunDirError, Unusable, directory_checksums, link_checkpoint,
    load_checkpoint, read_checkpoint, remove_unnamed_shards, save_checkpoint, set_aside, step_checkpoint_name,
    step_checkpoints,
)
from ringtrain.checkpoints.state_dicts import refuse_state_that_is_not_data
from ringtrain.distributed import DistInfo, broadcast_object
from ringtrain.errors import ConfigError

log = logging.getLogger("ringtrain")

# The temporary names of ringtrain's own writes; nothing else is ever removed as stale.
_STALE_TEMP_NAME = temp_name_pattern(r"[\w.-]+\.pt")
_STALE_SHARDS_NAME = re.compile(r"^\.step-\d+\.shards\.(?:partial|previous)$")  # a killed sharded save's


class Resumed:
    """The checkpoint a run continues from, read once: its path and its state (tensors on the
    CPU). Sent to a spawned rank it travels as its path: that process reads it itself."""

    def __init__(self, path: Path, state: dict[str, Any] | None):
        self.path, self.state = Path(path), state

    def __getstate__(self) -> dict:
        return {"path": self.path, "state": None}


class Part(NamedTuple):
    """A Stateful (torch.distributed.checkpoint's protocol) made of two functions; `spread`: its state is
    several of the file's keys, not one under its name (as torchtitan flattens its model's)."""

    state_dict: Callable[[], Any]
    load_state_dict: Callable[[Any], None] = lambda state: None  # saved only (what rebuilds the job)
    spread: bool = False


class CheckpointManager:
    def __init__(self, directory: Path, trainer: Any, dist: DistInfo):
        self.directory = Path(directory)
        self.keep_last_k, self.enabled, self.every = trainer.keep_last_k, trainer.checkpoint, trainer.checkpoint_every_n_steps
        self.dist = dist
        self.writer = BackgroundWriter() if trainer.async_checkpoint else None
        self.parts: dict[str, Any] = {}  # Stateful parts (or `Part`s) by their key in a file, restored in this order
        self.resumed: Resumed | None = None  # the checkpoint `resume` chose
        self._snapshot: dict[str, Any] | None = None  # the last copy written in the background
        self._written: list[tuple[int, Path]] = []  # (step, step file) on disk, not yet reported by `written`

    def register(self, **parts: Any) -> None:
        self.parts.update(parts)

    def state_dict(self) -> dict[str, Any]:
        """Every rank: each part's state (what is gathered, full weights too, whole on rank 0 only)."""
        state: dict[str, Any] = {"format": CHECKPOINT_FORMAT}
        for name, part in self.parts.items():
            saved = part.state_dict()
            state.update(saved if getattr(part, "spread", False) else {name: saved})
        return state

    def restore(self) -> None:
        """Every rank: each part's state from the checkpoint `resume` chose (None: not in the file)."""
        state = self.resumed.state
        for name, part in self.parts.items():
            part.load_state_dict(state if getattr(part, "spread", False) else state.get(name))

    @property
    def last(self) -> Path:
        return self.directory / LAST_NAME

    def resume(self, resume: Any, kept: dict, given: Resumed | None = None) -> Resumed | None:
        """The checkpoint this run continues from, read on every rank (rank 0 decides which),
        or None. `kept`: the model section it must have been trained with. `given`: the one
        trainer.resume=<path> names, already read by this process (tools/train.py)."""
        chosen, failure = None, None
        if self.dist.is_main:
            try:
                chosen = self._choose(resume, kept, given)
            except (RunDirError, CheckpointError, ConfigError) as err:
                failure = err
        failure, value = broadcast_object(self.dist, (failure, str(chosen.path) if chosen else None))
        if failure is not None:
            raise failure
        if chosen is None and value is not None:  # another rank: its own read of the file rank 0 chose and verified
            chosen = Resumed(Path(value), _state_of(Path(value), given, verify=False))
        self.resumed = chosen
        return chosen

    def _choose(self, resume: Any, kept: dict, given: Resumed | None) -> Resumed | None:
        for stale in self.remove_stale_files():
            log.info(f"removed {stale.name}, left by a save that was killed mid-write")
        if resume == "auto":
            return self._newest_readable(kept)
        if resume is None:
            if self._holds_checkpoints():
                raise RunDirError(f"{self.directory.parent} already holds checkpoints and trainer.resume=null; continue it "
                                  f"with trainer.resume=auto, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)")
            return None
        path = Path(resume).resolve()
        if path.parent != self.directory.resolve() and self._holds_checkpoints():
            raise RunDirError(f"{self.directory.parent} already holds checkpoints of another run; continue it with "
                              f"trainer.resume={self.last}, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)")
        state = _state_of(path, given)
        _refuse_another_model(state, kept, lambda changed: ConfigError(
            f"{changed} differs from the checkpoint's; a continued run keeps its model (its weights and optimizer state "
            f"belong to it): drop that override, or start a new run with trainer.resume=null (trainer.init_from="
            f"{resume} starts from its weights)"))
        log.info(f"resuming from {resume} (step {state['progress']['step']})")
        return Resumed(path, state)

    def _newest_readable(self, kept: dict) -> Resumed | None:
        found = find_resumable(self.directory)
        if found.path is None:
            if found.unreadable:
                files = "; ".join(_describe(names, why).replace(f"{self.directory}/", "") for names, why in found.unreadable)
                raise RunDirError(
                    f"no checkpoint in {self.directory} can be read ({files}); they are left as they are. Start over with "
                    f"trainer.resume=null and a new hydra.run.dir (hydra.sweep.dir in a sweep), or continue from a good "
                    f"copy with trainer.resume=<its path>")
            return None
        _refuse_another_model(found.state, kept, lambda changed: RunDirError(
            f"{self.directory.parent} holds a run whose {changed} differs from this one's; continue it with the same "
            f"model, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)"))
        for warning, (names, _) in zip(found.warnings, found.unreadable):
            log.warning(f"{warning}; it is kept in {self.directory / UNREADABLE_DIR}")
            set_aside(names)  # newer than the one resumed: rotation would count them, a save replace them
        log.info(f"resuming from {found.path} (step {found.state['progress']['step']})")
        return Resumed(found.path, found.state)

    def _holds_checkpoints(self) -> bool:
        return self.last.is_file() or (self.directory / BEST_NAME).is_file() or bool(step_checkpoints(self.directory))

    def due(self, step: int, evaluated: bool, last: bool) -> bool:
        return self.enabled and (evaluated or last or (self.every > 0 and step % self.every == 0))

    def save(self, step: int, best: bool, hook: Callable[[dict[str, Any]], None] = lambda state: None) -> None:
        """Every rank: the parts' state, then `hook(state)` (the callbacks' on_save_checkpoint,
        which may add entries), written as the module docstring says."""
        # The previous write ends first: its failure stops the run before more is gathered, one
        # copy of the state waits in memory, and its rotation cannot delete this save's shards.
        self.flush()
        state = self.state_dict()
        hook(state)
        failure = None
        if self.dist.is_main:
            refuse_state_that_is_not_data(state)  # before a file weights_only could not read exists
            if self.writer is not None:
                # A deep copy (background.py says why) into the previous copy's memory: flush waited for its write.
                snapshot = self._snapshot = detached_copy(state, reuse=self._snapshot)
                self.writer.submit(lambda: self._store(snapshot, step, best))
            else:
                try:
                    self._store(state, step, best)
                except CheckpointError as err:
                    failure = str(err)
        # Also the barrier: nobody resumes from a file before it is complete (or copied).
        if failure := broadcast_object(self.dist, failure):
            raise CheckpointError(failure)

    def flush(self) -> None:
        failure = self._wait() if self.dist.is_main else None
        if self.writer is not None and (failure := broadcast_object(self.dist, failure)):
            raise CheckpointError(failure)

    def written(self) -> list[tuple[int, Path]]:
        done, self._written = self._written, []
        return done

    def _wait(self) -> str | None:
        err = self.writer.wait() if self.writer is not None else None
        if err is None or isinstance(err, CheckpointError):
            return None if err is None else str(err)
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"cannot save checkpoint in {self.directory}: {type(err).__name__}{': ' + text if text else ''}"

    def _store(self, state: dict[str, Any], step: int, best: bool) -> None:
        step_path = self.directory / step_checkpoint_name(step)
        if "shards" in state and "shard_checksums" not in state:  # DCP's files carry none: record theirs
            state = {**state, "shard_checksums": directory_checksums(self.directory / state["shards"])}
        save_checkpoint(step_path, state, intact=self.last)
        link_checkpoint(step_path, self.last)
        if best:
            link_checkpoint(step_path, self.directory / BEST_NAME)
        self._rotate(step)
        remove_unnamed_shards(self.directory)
        self._written.append((step, step_path))

    def _rotate(self, saved: int) -> None:
        # Deleting a step name never loses last.pt or best.pt: they are hard links to the file.
        kept = []
        for step, path in step_checkpoints(self.directory):
            if step <= saved:
                kept.append(path)
                continue
            try:
                read_checkpoint(path, mmap=True)
            except Unusable as why:
                log.warning(f"{path} {why}; moved to {set_aside([path])[0]}, not deleted")
                continue
            log.warning(f"removing {path}: step {step} of the line of training this run left when it resumed "
                        f"from an older checkpoint (step {saved} was just saved in its place)")
            remove_if_present(path)
        for path in kept[: -self.keep_last_k]:
            remove_if_present(path)

    def remove_stale_files(self) -> list[Path]:
        """What saves killed mid-write left behind (ringtrain's own names only)."""
        if not self.directory.is_dir():
            return []
        removed = [entry for entry in self.directory.iterdir() if _STALE_TEMP_NAME.match(entry.name) and entry.is_file()
                   or _STALE_SHARDS_NAME.match(entry.name) and entry.is_dir()]
        for entry in removed:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                remove_if_present(entry)
        return sorted(removed + remove_unnamed_shards(self.directory))

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception no collective is safe (another rank may be gone): rank 0 only waits,
        # so the write in flight ends complete before the process does.
        if exc_type is not None and self.dist.is_main and (failure := self._wait()):
            log.warning(failure)


class Found(NamedTuple):
    """What `find_resumable` found; `unreadable`: each newer file that does not read, as (its names, why)."""

    path: Path | None
    state: dict[str, Any] | None
    unreadable: list[tuple[list[Path], str]]

    @property
    def warnings(self) -> list[str]:
        then = f"falling back to {self.path}" if self.path is not None else "no readable checkpoint is left"
        return [f"checkpoint {_describe(names, why)}; {then}" for names, why in self.unreadable]


def find_resumable(directory: Path) -> Found:
    """The newest checkpoint in `directory` that reads, checksums matching (last.pt, the step
    files newest first, best.pt), read once; and each newer one that does not. A name that is
    the same file as one tried (last.pt and its step file are hard links) is not read again."""
    candidates = [directory / LAST_NAME, *(path for _, path in reversed(step_checkpoints(directory))), directory / BEST_NAME]
    unreadable: list[tuple[list[Path], str]] = []
    for path in candidates:
        if not path.is_file() or any(path in names for names, _ in unreadable):
            continue
        try:
            return Found(path, read_checkpoint(path, mmap=True), unreadable)
        except Unusable as err:
            if err.refused:  # not damage a crash could leave: passing over it would hide what it holds
                raise CheckpointError(f"checkpoint '{path}' {err}; {err.fix}") from None
            names = [path] + [p for p in candidates if p != path and p.is_file() and p.samefile(path)]
            unreadable.append((names, str(err)))
    return Found(None, None, unreadable)


def _state_of(path: Path, given: Resumed | None, verify: bool = True) -> dict[str, Any]:
    if given is not None and given.state is not None and given.path.resolve() == path.resolve():
        return given.state
    return load_checkpoint(path, mmap=True, verify=verify)


def _refuse_another_model(state: dict, kept: dict, error: Callable[[str], Exception]) -> None:
    if (stored := (state["config"] or {}).get("model")) != kept:
        raise error(first_difference(stored or {}, kept or {}, "model"))


def first_difference(old: Any, new: Any, prefix: str) -> str:
    """`model.n_layers (2 -> 3)`: the first key where two configs differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                return first_difference(old.get(key), new.get(key), f"{prefix}.{key}")
    return f"{prefix} ({old!r} -> {new!r})"


def _describe(names: list[Path], why: str) -> str:
    """`<dir>/last.pt (= step-00000800.pt) is corrupt: ...`"""
    first, *aliases = names
    return f"{first} (= {', '.join(p.name for p in aliases)}) {why}" if aliases else f"{first} {why}"
