"""One checkpoint file: its format and names, writing it durably, reading and verifying it.

A checkpoint is a dict loadable with `torch.load(path, weights_only=True)`:
  model        the bare model's full state_dict (no `module.` / `_orig_mod.` prefixes; under
               fsdp gathered from every rank's shards)
  optimizer    its full state keyed by parameter name (torch.distributed.checkpoint's
               get_optimizer_state_dict), so it loads under single, ddp or fsdp alike
  scheduler, scaler   their state_dicts
  layout       {"world_size", "batch_size", "accumulate_grad_batches"} it was trained in
  progress     {"step", "epoch", "samples_into_epoch", "best_metric", "skipped_steps"}
  rng          one torch RNG state per rank (CPU, and CUDA when used), in rank order
  config       the resolved run config as plain data
  data_dims, vocab   the sizes the data gave the model, and its vocabulary (sampling)
  format       CHECKPOINT_FORMAT (2: optimizer state by parameter name)
  shard_checksums   sharded checkpoints only: {file name: CRC-32} of the shards directory

Under strategy=fsdp with strategy.state_dict_type=sharded, `model` and `optimizer` are not in
the file: `shards` names the torch.distributed.checkpoint directory beside it
(`step-<N>.shards/`, each rank's own shards, ringtrain.strategies.fsdp's save_sharded). The
file is written only once that directory is complete, so a step file that exists always has
its shards; `load_checkpoint` returns `shards` as the directory's path.

Why the care: a week-long run must not lose its progress to a preemption, a full disk, a
power cut or a file broken some other way. So:
  * A file is written atomically and durably (checkpoints/atomic.py): after a crash its name
    holds the old file or the new one, complete. A failed write (full disk, quota, I/O error)
    leaves the previous checkpoint untouched and raises CheckpointError with one line saying
    what to do.
  * Files are read with `weights_only=True`: a checkpoint is data, and a pickle that would run
    code when loaded is refused. `why_unusable` says in a few words what is wrong with one.
  * A file carries checksums of its contents (checkpoints/checksums.py: the CRC-32 torch.save
    writes for each record of its zip archive; for sharded checkpoints, `shard_checksums` of
    each shard file). Loading checks them unless told not to: bytes that changed on disk make
    the checkpoint unusable like a truncated one, instead of loading as silently wrong weights.
The run's set of checkpoint files (rotation, last.pt, best.pt, which to resume) is
checkpoints/store.py. Only rank 0 writes.
"""
from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoints.atomic import open_atomically
from ringtrain.checkpoints.checksums import file_damage, shards_damage, starts_as_zip
from ringtrain.errors import UserError

CHECKPOINT_FORMAT = 2
_REQUIRED_KEYS = ("model", "optimizer", "scheduler", "progress", "rng", "config", "format")
_REQUIRED_KEYS_SHARDED = ("shards", "scheduler", "progress", "rng", "config", "format")

_STEP_NAME = re.compile(r"^step-(\d+)\.pt$")
LAST_NAME = "last.pt"
BEST_NAME = "best.pt"
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used or written; the message names the file and what to do."""


class RunDirError(UserError, RuntimeError):
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


# --- names and writing --------------------------------------------------------------------


def step_checkpoint_name(step: int) -> str:
    """`step-00001200.pt`: zero-padded so that names sort like steps in a directory listing."""
    return f"step-{step:08d}.pt"


def shards_name(step: int) -> str:
    """`step-00001200.shards`: the directory of a sharded checkpoint's weights and optimizer state."""
    return f"step-{step:08d}.shards"


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-*.pt` file in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        step = step_of_name(entry.name)
        if step is not None and entry.is_file():
            found.append((step, entry))
    return sorted(found)


def step_of_name(name: str) -> int | None:
    """The step of a `step-<N>.pt` name, None for any other name."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def save_checkpoint(path: str | Path, state: dict[str, Any], intact: Path | None = None) -> None:
    """Write `state` to `path` durably: complete and in place after a crash or power cut, or
    not at all (CheckpointError). `intact` is the file a failure leaves untouched, named in the
    error (default: the previous file at `path`)."""
    path = Path(path)
    try:
        with open_atomically(path) as file:
            torch.save(state, file)
    except OSError as err:
        raise CheckpointError(write_failure_message(path, err, intact or path)) from None


def write_failure_message(path: Path, err: OSError, intact: Path) -> str:
    """One line: why `path` could not be written, what to do, and whether `intact` survives."""
    reason = err.strerror or str(err) or type(err).__name__
    if err.errno in _DISK_FULL:
        fix = f"free space on {path.parent} or keep fewer checkpoints"
    else:
        fix = f"check that {path.parent} is writable and its file system healthy"
    kept = f"the previous {intact.name} is intact" if intact.exists() else "no checkpoint was written"
    return f"cannot save checkpoint {path}: {reason}; {fix}; {kept}"


# --- reading ------------------------------------------------------------------------------


class _Unusable(Exception):
    """Why a checkpoint file cannot be used: `kind` picks the message, `detail` says more."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _load_verified(path: str | Path, map_location: torch.device | str, mmap: bool = False,
                   verify: bool = True) -> dict[str, Any]:
    """The checkpoint at `path`, checked; `verify`: its bytes against their checksums too."""
    try:
        damage = file_damage(Path(path), verify)
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap) if damage is None else None
    except FileNotFoundError:
        raise _Unusable("missing") from None
    except Exception as err:  # a pickle with code in it, a file torch cannot read
        detail = _first_sentence(err)
        if "would run" in detail or starts_as_zip(Path(path)):
            raise _Unusable("unreadable", detail) from None
        # Not what torch.save writes; torch's own words would advise _use_new_zipfile_serialization.
        raise _Unusable("foreign_file", "is not a torch checkpoint file (torch.save writes a zip archive)") from None
    if damage is not None:
        raise _Unusable("foreign_file" if damage.foreign else "damaged", damage.reason)
    required = _REQUIRED_KEYS_SHARDED if isinstance(state, dict) and "shards" in state else _REQUIRED_KEYS
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise _Unusable("foreign", ", ".join(missing))
    if state["format"] != CHECKPOINT_FORMAT:
        raise _Unusable("format", str(state["format"]))
    if "shards" in state:
        # DCP writes .metadata last, and save_sharded renames the directory only when complete.
        shards = Path(path).parent / str(state["shards"])
        if not (shards / ".metadata").is_file():
            raise _Unusable("shards", str(shards))
        state["shards"] = shards
        if verify and (damage := shards_damage(shards, state.get("shard_checksums") or {})):
            raise _Unusable("damaged", damage)
    return state


def _first_sentence(err: Exception) -> str:
    """What went wrong, from torch's multi-line errors, short enough for one line of ours.

    A refused weights_only load puts the cause after paragraphs of advice, among it to load
    with weights_only=False, the very thing a file of unknown origin must not get.
    """
    text = str(err).strip()
    if not text:
        return type(err).__name__
    # torch < 2.6 says "Unsupported global: GLOBAL x.y"; torch 2.13 says "Trying to load
    # unsupported GLOBAL x.y whose module x is blocked" (the first form only matched the old one,
    # so the refusal read "cannot be read (Weights only load failed)").
    if code := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text):
        return f"loading it would run {code.group(1)}, which ringtrain refuses"
    if cause := re.search(r"WeightsUnpickler error:\s*([^\n]+)", text):
        text = cause.group(1)
    elif text.startswith("Weights only load failed"):
        # The cause is the paragraph after torch's advice, before its pointer to the docs.
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        causes = [p for p in paragraphs[1:] if not p.startswith("Check the documentation")]
        text = causes[0] if causes else paragraphs[0]
    return text.splitlines()[0].split(". ")[0].rstrip(".")[:200]


def load_checkpoint(path: str | Path, map_location: torch.device | str = "cpu", mmap: bool = False,
                    verify: bool = True) -> dict[str, Any]:
    """Read and check a ringtrain checkpoint; raise CheckpointError with the fix otherwise.
    `mmap`: map the tensors instead of reading them (cheap when only the config is wanted).
    `verify`: compare its bytes (and its shards') with their checksums, which reads them all
    the first time this process loads them (checkpoints/checksums.py)."""
    try:
        return _load_verified(path, map_location, mmap=mmap, verify=verify)
    except _Unusable as err:
        raise CheckpointError(_refusal(path, err)) from None


def _refusal(path: str | Path, err: _Unusable) -> str:
    if err.kind == "missing":
        return f"checkpoint '{path}' does not exist; check trainer.resume"
    if err.kind == "unreadable":
        return f"checkpoint '{path}' cannot be read ({err.detail}); pass a last.pt/best.pt written by ringtrain"
    if err.kind == "foreign_file":
        return f"checkpoint '{path}' {err.detail}; pass a last.pt/best.pt written by ringtrain"
    if err.kind == "damaged":
        return (f"checkpoint '{path}' {err.detail}; use another checkpoint of that run (an older "
                f"step-*.pt, or best.pt) or a copy of this one from elsewhere")
    if err.kind == "foreign":
        return (f"checkpoint '{path}' is not a ringtrain checkpoint (missing {err.detail}); "
                f"pass a last.pt/best.pt written by ringtrain")
    if err.kind == "shards":
        return (f"checkpoint '{path}' keeps its weights in {err.detail}, which is missing or incomplete; "
                f"resume from another checkpoint of that run (trainer.resume=auto picks the newest that loads)")
    return f"checkpoint '{path}' has format {err.detail}, this ringtrain reads {CHECKPOINT_FORMAT}"


def why_unusable(path: Path) -> str | None:
    """None when `path` loads as a ringtrain checkpoint whose bytes (and shards) match their
    checksums, else why not, in a few words ("is truncated or corrupt (...)"). The tensors are
    memory-mapped, not loaded; the checksums read the whole file once (its shards too)."""
    try:
        _load_verified(path, "cpu", mmap=True)
    except _Unusable as err:
        return _short_reason(err)
    return None


def _short_reason(err: _Unusable) -> str:
    if err.kind in ("damaged", "foreign_file"):
        return err.detail
    if err.kind == "unreadable":
        return f"cannot be read ({err.detail})"
    if err.kind == "foreign":
        return f"is not a ringtrain checkpoint (missing {err.detail})"
    if err.kind == "format":
        return f"has format {err.detail}, this ringtrain reads {CHECKPOINT_FORMAT}"
    if err.kind == "shards":
        return f"names shards {err.detail} that are missing or incomplete"
    return "disappeared while being read"


def load_model_weights(model: nn.Module, state: dict[str, Any], path: str | Path) -> None:
    """Load the checkpoint's weights into the bare model, with a clear error on a mismatch."""
    try:
        unwrap_model(model).load_state_dict(state["model"])
    except RuntimeError as err:
        text = " ".join(str(err).split())
        # torch lists every mismatch; the first says enough ("size mismatch for x: copying a
        # param with shape [a] from checkpoint, the shape in current model is [b]").
        first = re.search(r"(size mismatch for [^:]+: .*?current model is torch\.Size\(\[[^\]]*\]\))", text)
        detail = first.group(1) if first else text[:200]
        raise CheckpointError(
            f"checkpoint '{path}' does not fit this model ({detail}); continue with the model and data it "
            f"was trained with, or start a new run (a new hydra.run.dir or hydra.sweep.dir, or trainer.resume=null)"
        ) from None


# --- random number generators -------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's torch RNG states (CPU, and CUDA when used), for the checkpoint's `rng`."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what `rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
