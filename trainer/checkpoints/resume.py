"""Which checkpoint a run continues from (the continued run's config: config/continuation.py).

trainer.resume is
  auto (default)  continue from this run directory's own newest readable checkpoint, if it
                  has one, else start fresh. This is what torchrun's restarted workers, a
                  requeued SLURM job and "run the same command again" rely on: the same
                  command lands in the same run directory (checkpoints/rundir.py). A corrupt
                  newest file (truncated, or bytes that do not match its checksums) is
                  reported in one line, moved into checkpoints/unreadable/, and an older one is
                  used. A directory whose checkpoints are all unreadable is refused in one
                  line, every file left as it is: starting over there would hide the loss.
  <path>          continue that run with the config stored in its checkpoint, in its own run
                  directory unless hydra.run.dir says otherwise (config/command_line.py). The
                  command line may change what is safe to change (trainer.max_steps, the
                  strategy, the data's path...); a different model is refused in one line.
  null            never resume; a run directory that already holds checkpoints is refused.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


from ringtrain.checkpoints.files import CheckpointError, RunDirError, load_checkpoint
from ringtrain.checkpoints.fallback import UNREADABLE_DIR, Unreadable, find_resumable, holds_checkpoints, set_aside
from ringtrain.checkpoints.store import remove_stale_temp_files
from ringtrain.distributed import DistInfo, broadcast_object
from ringtrain.errors import ConfigError

log = logging.getLogger("ringtrain")

# Sections a continued run must keep: what the weights and the optimizer state belong to.
KEPT_SECTIONS = ("model",)


def checkpoint_to_resume(run_dir: Path, resume: Any, resolved: dict, dist: DistInfo) -> Path | None:
    """The checkpoint this rank continues from (rank 0 decides, every rank gets its answer)."""
    decision: tuple[str, str | None] = ("ok", None)
    if dist.is_main:
        try:
            decision = ("ok", _decide(run_dir / "checkpoints", resume, resolved))
        except (RunDirError, CheckpointError, ConfigError) as err:
            decision = (type(err).__name__, str(err))
    kind, value = broadcast_object(dist, decision)
    refusals = {"RunDirError": RunDirError, "CheckpointError": CheckpointError, "ConfigError": ConfigError}
    if kind in refusals:
        raise refusals[kind](value)
    return Path(value) if value else None


def _decide(checkpoints: Path, resume: Any, resolved: dict) -> str | None:
    for stale in remove_stale_temp_files(checkpoints):
        log.info(f"removed {stale.name}, left by a save that was killed mid-write")
    if resume == "auto":
        return _newest_readable(checkpoints, resolved)
    if resume is None:
        if holds_checkpoints(checkpoints):
            raise RunDirError(
                f"{checkpoints.parent} already holds checkpoints and trainer.resume=null; continue it with "
                f"trainer.resume=auto, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)"
            )
        return None
    given = Path(resume).resolve()
    if given.parent != checkpoints.resolve() and holds_checkpoints(checkpoints):
        raise RunDirError(
            f"{checkpoints.parent} already holds checkpoints of another run; continue it with "
            f"trainer.resume={checkpoints / 'last.pt'}, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)"
        )
    load_checkpoint(given, mmap=True)  # its checksums, before any work: every rank loads it unchecked
    log.info(f"resuming from {resume}")
    return str(resume)


def _newest_readable(checkpoints: Path, resolved: dict) -> str | None:
    """trainer.resume=auto: the newest checkpoint that loads, after one warning for each newer
    one that does not, which is set aside; None for a directory without checkpoints."""
    found = find_resumable(checkpoints)
    if found.path is None:
        if found.unreadable:
            raise RunDirError(_nothing_readable(checkpoints, found.unreadable))
        return None
    state = load_checkpoint(found.path, mmap=True, verify=False)  # verified just now: the config and step
    stored = state["config"]
    for section in KEPT_SECTIONS:
        if stored.get(section) != resolved.get(section):
            changed = first_difference(stored.get(section) or {}, resolved.get(section) or {}, section)
            raise RunDirError(
                f"{checkpoints.parent} holds a run whose {changed} differs from this one's; continue it with the "
                f"same model, or choose a new hydra.run.dir (hydra.sweep.dir in a sweep)"
            )
    for broken, warning in zip(found.unreadable, found.warnings):
        set_aside(broken.paths)  # newer than the one resumed: rotation would count them, a save replace them
        log.warning(f"{warning}; it is kept in {checkpoints / UNREADABLE_DIR}")
    log.info(f"resuming from {found.path} (step {state['progress']['step']})")
    return str(found.path)


def _nothing_readable(checkpoints: Path, unreadable: list[Unreadable]) -> str:
    """One line: which files, why, that they stay, and the two ways on."""
    files = "; ".join(broken.describe().replace(f"{checkpoints}/", "") for broken in unreadable)
    return (
        f"no checkpoint in {checkpoints} can be read ({files}); they are left as they are. Start over with "
        f"trainer.resume=null and a new hydra.run.dir (hydra.sweep.dir in a sweep), or continue from a good copy with trainer.resume=<its path>"
    )


def first_difference(old: Any, new: Any, prefix: str) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                return first_difference(old.get(key), new.get(key), f"{prefix}.{key}")
    return f"{prefix} ({old!r} -> {new!r})"
