"""ringtrain's own `${ringtrain.*:...}` interpolations in conf/, registered before Hydra composes.

  ${ringtrain.run_name:}          the default run directory's name (trainer/rundir.py)
  ${ringtrain.direction:${task.mode}}   "minimize" or "maximize", for Optuna's direction
  ${ringtrain.scratch_dir:}       a directory of this process's own, removed when it exits
"""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

from omegaconf import OmegaConf

from ringtrain.checkpoints.rundir import run_name


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("ringtrain.direction"):
        OmegaConf.register_new_resolver("ringtrain.direction", optimization_direction)
    if not OmegaConf.has_resolver("ringtrain.run_name"):
        # use_cache: one name per process, however often the run directory is resolved.
        OmegaConf.register_new_resolver("ringtrain.run_name", run_name, use_cache=True)
    if not OmegaConf.has_resolver("ringtrain.scratch_dir"):
        OmegaConf.register_new_resolver("ringtrain.scratch_dir", scratch_directory)


def optimization_direction(mode: str) -> str:
    """The task monitors a loss (mode min) or an accuracy (mode max)."""
    if mode not in ("min", "max"):
        raise ValueError(f"task.mode={mode!r} must be min or max")
    return "maximize" if mode == "max" else "minimize"


@functools.cache
def scratch_directory() -> str:
    """Where a tool's multirun keeps the multirun.yaml Hydra's sweeper writes (conf/hydra/tool.yaml):
    the tools write their results where they say, so nothing of Hydra's belongs in the current
    directory. Made only when a multirun resolves it; one per process, removed at exit."""
    path = tempfile.mkdtemp(prefix="ringtrain-multirun-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
