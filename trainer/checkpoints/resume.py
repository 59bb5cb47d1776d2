"""Which checkpoint a run continues from (the continued run's config: config/continuation.py).

trainer.resume is
  auto (default)  continue from this run directory's own newest readable checkpoint, if it
                  has one, else start fresh. This is what torchrun's restarted workers, a
                  requeued SLURM job and "run the same command again" rely on: the same
                  command lands in the same run directory (checkpoints/rundir.py). A corrupt
                  newest file is reported in one line and an older one is used.
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


from ringtrain.checkpoints.files import RunDirError, load_checkpoint
from ringtrain.checkpoints.store import find_resumable, remove_stale_temp_files
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
        except (RunDirError, ConfigError) as err:
            decision = (type(err).__name__, str(err))
    kind, value = broadcast_object(dist, decision)
    if kind == "RunDirError":
        raise RunDirError(value)
    if kind == "ConfigError":
        raise ConfigError(value)
    return Path(value) if value else None


def _decide(checkpoints: Path, resume: Any, resolved: dict) -> str | None:
    for stale in remove_stale_temp_files(checkpoints):
        log.info(f"removed {stale.name}, left by a save that was killed mid-write")
    if resume == "auto":
        found, warnings = find_resumable(checkpoints)
        for warning in warnings:
            log.warning(warning)
        if found is None:
            return None
        state = load_checkpoint(found, mmap=True)  # one cheap read: the config and the step
        stored = state["config"]
        for section in KEPT_SECTIONS:
            if stored.get(section) != resolved.get(section):
                changed = first_difference(stored.get(section) or {}, resolved.get(section) or {}, section)
                raise RunDirError(
                    f"{checkpoints.parent} holds a run whose {changed} differs from this one's; continue it with the "
                    f"same model, or choose a new hydra.run.dir"
                )
        log.info(f"resuming from {found} (step {state['progress']['step']})")
        return str(found)
    if resume is None:
        if find_resumable(checkpoints)[0] is not None:
            raise RunDirError(
                f"{checkpoints.parent} already holds checkpoints and trainer.resume=null; continue it with "
                f"trainer.resume=auto, or choose a new hydra.run.dir"
            )
        return None
    given = Path(resume).resolve()
    if given.parent != checkpoints.resolve() and find_resumable(checkpoints)[0] is not None:
        raise RunDirError(
            f"{checkpoints.parent} already holds checkpoints of another run; continue it with "
            f"trainer.resume={checkpoints / 'last.pt'}, or choose a new hydra.run.dir"
        )
    log.info(f"resuming from {resume}")
    return str(resume)


def first_difference(old: Any, new: Any, prefix: str) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key) != new.get(key):
                return first_difference(old.get(key), new.get(key), f"{prefix}.{key}")
    return f"{prefix} ({old!r} -> {new!r})"
