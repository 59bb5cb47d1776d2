"""Checkpoint files: plain tensors and plain data, written atomically, read back safely.

A checkpoint is a dict loadable with `torch.load(path, weights_only=True)`:
  model        the bare model's state_dict (no `module.` / `_orig_mod.` prefixes)
  optimizer, scheduler, scaler   their state_dicts
  progress     {"step", "epoch", "batches_into_epoch", "best_metric"}
  rng          one torch RNG state per rank (CPU, and CUDA when used), in rank order
  config       the resolved run config as plain data
  format       CHECKPOINT_FORMAT
Only rank 0 writes; files are written to a temporary name and renamed, so a crash mid-write
never leaves a truncated `last.pt` behind and never destroys the previous one.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

CHECKPOINT_FORMAT = 1
_REQUIRED_KEYS = ("model", "optimizer", "scheduler", "progress", "rng", "config", "format")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


class RunDirError(RuntimeError):
    """The run directory holds another run's checkpoints; refusing to overwrite them."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model inside DDP / DataParallel (`.module`) and torch.compile (`._orig_mod`)."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one


def link_checkpoint(source: Path, target: Path) -> None:
    """Make `target` the same file as `source` (best.pt = the last.pt just written), atomically.

    A hard link costs no second serialisation or write. The next save of `source` replaces
    its name with a new file, so `target` keeps this version. Where links are not supported,
    the file is copied.
    """
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def load_checkpoint(path: str | Path, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """Read and check a ringtrain checkpoint; raise CheckpointError with the fix otherwise."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint '{path}' does not exist; check trainer.resume") from None
    except Exception as err:  # truncated file, pickle with code in it, not a torch file at all
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read ({first_line[:200]}); pass a last.pt/best.pt "
            f"written by ringtrain"
        ) from None
    missing = [k for k in _REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint '{path}' is not a ringtrain checkpoint (missing {', '.join(missing)}); "
            f"pass a last.pt/best.pt written by ringtrain"
        )
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint '{path}' has format {state['format']}, this ringtrain reads {CHECKPOINT_FORMAT}"
        )
    return state


def load_model_weights(model: nn.Module, state: dict[str, Any], path: str | Path) -> None:
    """Load the checkpoint's weights into the bare model, with a clear error on a mismatch."""
    try:
        unwrap_model(model).load_state_dict(state["model"])
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(
            f"checkpoint '{path}' does not fit this model ({detail}); resume with the model "
            f"config it was trained with"
        ) from None


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
