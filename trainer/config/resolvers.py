"""ringtrain's own `${ringtrain.*:...}` interpolations in conf/, registered before Hydra composes.

  ${ringtrain.run_name:}          the default run directory's name (trainer/rundir.py)
  ${ringtrain.direction:${task.mode}}   "minimize" or "maximize", for Optuna's direction
"""
from __future__ import annotations

from omegaconf import OmegaConf

from ringtrain.checkpoints.rundir import run_name


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("ringtrain.direction"):
        OmegaConf.register_new_resolver("ringtrain.direction", optimization_direction)
    if not OmegaConf.has_resolver("ringtrain.run_name"):
        # use_cache: one name per process, however often the run directory is resolved.
        OmegaConf.register_new_resolver("ringtrain.run_name", run_name, use_cache=True)


def optimization_direction(mode: str) -> str:
    """The task monitors a loss (mode min) or an accuracy (mode max)."""
    if mode not in ("min", "max"):
        raise ValueError(f"task.mode={mode!r} must be min or max")
    return "maximize" if mode == "max" else "minimize"
