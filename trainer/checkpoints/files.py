"""One checkpoint file: its format and names, writing it durably, reading it and checking it.

A checkpoint is a dict loadable with `torch.load(path, weights_only=True)`:
  model        the bare model's full state_dict (no `module.` / `_orig_mod.` prefixes; under
               fsdp gathered from every rank's shards)
  optimizer    its full state keyed by parameter name, so it loads under any strategy
  scheduler, scaler   their state_dicts
  layout       {"world_size", "batch_size", "accumulate_grad_batches"} it was trained in
  progress     {"step", "epoch", "samples_into_epoch", "best_metric", "skipped_steps"}
  rng          one torch RNG state per rank (CPU, and CUDA when used), in rank order
  callbacks    each callback's state_dict, by its name (callbacks/__init__.py)
  job          what rebuilds the run: the option chosen in each config group and the overrides
               given (config/recipe.py), never a node that is built; None from the Python API
  config       the resolved run config as plain data, for the record only: nothing builds from it
  data_dims, vocab   the sizes the data gave the model, and its vocabulary (sampling)
  format       CHECKPOINT_FORMAT
Under fsdp's state_dict_type=sharded, `shards` names the torch.distributed.checkpoint directory
beside the file (`step-<N>.shards/`, that name and no other) instead of `model` and `optimizer`,
and `shard_checksums` holds the CRC-32 of each of its files.

A file is written atomically and durably (storage/__init__.py), read with weights_only, and
checked against the CRC-32 torch.save writes for every zip record, which torch.load never
compares (README.md "Checksums"): CRC-32 catches every burst up to 32 bits and all but one in
2^32 other corruptions, at 1.8 GB/s.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.errors import UserError
from ringtrain.storage import fsync_directory, open_atomically, replace_atomically

CHECKPOINT_FORMAT = 3  # 2 kept the config as nodes that were built again (before config/recipe.py)
_REQUIRED_KEYS = ("scheduler", "progress", "rng", "job", "config", "format")  # after the weights' keys

_STEP_NAME = re.compile(r"^step-(\d+)\.pt$")
_SHARDS_NAME = re.compile(r"^step-\d+\.shards$")
UNREADABLE_DIR = "unreadable"  # where checkpoints that cannot be read are moved, never deleted
LAST_NAME = "last.pt"
BEST_NAME = "best.pt"
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_CHUNK = 1 << 24  # bytes read at a time: large enough to keep the CRC at memory speed
_ZIP_MAGIC = b"PK\x03\x04"  # the first bytes of a zip archive (of every torch.save file)


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used or written; the message names the file and what to do."""


class RunDirError(UserError, RuntimeError):
    """The run directory holds another run's checkpoints; refusing to overwrite them."""


class Unusable(Exception):
    """Why a file is not a usable checkpoint, in a few words that follow its name; `fix` says
    what to do instead; `damaged`: its bytes are not the ones written (truncated, corrupt);
    `refused`: it reads, but holds what ringtrain never loads (code to run, shards outside its
    directory, another format): a resume refuses it rather than pass over it to an older file."""

    def __init__(self, reason: str, fix: str = "pass a last.pt/best.pt written by ringtrain", damaged: bool = False,
                 refused: bool = False):
        super().__init__(reason)
        self.fix, self.damaged, self.refused = fix, damaged, refused


def step_checkpoint_name(step: int) -> str:
    """`step-00001200.pt`: zero-padded so that names sort like steps in a directory listing."""
    return f"step-{step:08d}.pt"


def shards_name(step: int) -> str:
    return f"step-{step:08d}.shards"


def step_of_name(name: str) -> int | None:
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-*.pt` file in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((step, entry) for entry in directory.iterdir()
                  if (step := step_of_name(entry.name)) is not None and entry.is_file())


def save_checkpoint(path: Path, state: dict[str, Any], intact: Path | None = None) -> None:
    """Write `state` to `path` durably, or not at all (CheckpointError naming `intact`, untouched)."""
    try:
        with open_atomically(path) as file:
            torch.save(state, file)
    except OSError as err:
        raise CheckpointError(write_failure_message(path, err, intact or path)) from None


def write_failure_message(path: Path, err: OSError, intact: Path) -> str:
    reason = err.strerror or str(err) or type(err).__name__
    fix = (f"free space on {path.parent} or keep fewer checkpoints" if err.errno in _DISK_FULL
           else f"check that {path.parent} is writable and its file system healthy")
    kept = f"the previous {intact.name} is intact" if intact.exists() else "no checkpoint was written"
    return f"cannot save checkpoint {path}: {reason}; {fix}; {kept}"


def read_checkpoint(path: str | Path, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """The checkpoint at `path`, on the CPU, its bytes (and its shards') checked against their
    checksums (`verify=False`: rank 0, which chose the file for every rank, did); Unusable otherwise."""
    path = Path(path)
    if not path.is_file():
        raise Unusable("does not exist", "check the path")
    if verify:
        check_file_bytes(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # a pickle with code in it, a file torch cannot read
        detail = _first_sentence(err)
        if "would run" in detail or _starts_as_zip(path):
            raise Unusable(f"cannot be read ({detail})", refused="would run" in detail) from None
        raise Unusable("is not a torch checkpoint file (torch.save writes a zip archive)") from None
    if isinstance(state, dict) and state.get("format") == 2:
        raise Unusable("was written by an older ringtrain, whose checkpoints kept their config as nodes to build "
                       "(code a file could choose)", f"if you trust the file, rewrite it as data with `ringtrain "
                       f"upgrade checkpoint={path} trust_checkpoint=true`", refused=True)
    weights = ("shards",) if isinstance(state, dict) and "shards" in state else ("model", "optimizer")
    missing = [k for k in (*weights, *_REQUIRED_KEYS) if not isinstance(state, dict) or k not in state]
    if missing:
        raise Unusable(f"is not a ringtrain checkpoint (missing {', '.join(missing)})")
    if state["format"] != CHECKPOINT_FORMAT:
        raise Unusable(f"has format {state['format']}, this ringtrain reads {CHECKPOINT_FORMAT}",
                       "read it with the ringtrain version that wrote it", refused=True)
    if "shards" in state:
        if not isinstance(state["shards"], str) or not _SHARDS_NAME.match(state["shards"]):
            raise Unusable(f"names its shards {state['shards']!r}, not a step-<N>.shards directory beside it",
                           "pass a checkpoint ringtrain wrote", refused=True)
        # DCP writes .metadata last, and save_sharded renames the directory only when complete.
        shards = path.parent / state["shards"]
        if not (shards / ".metadata").is_file():
            raise Unusable(f"keeps its weights in {shards}, which is missing or incomplete", _OLDER)
        if verify:
            check_shards(shards, state.get("shard_checksums") or {})
        state["shards"] = shards
    return state


_OLDER = "use another checkpoint of that run (an older step-*.pt, or best.pt) or a copy of this one from elsewhere"


def load_checkpoint(path: str | Path, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """`read_checkpoint`, with what is wrong as one CheckpointError line naming the fix."""
    try:
        return read_checkpoint(path, mmap, verify)
    except Unusable as err:
        raise CheckpointError(f"checkpoint '{path}' {err}; {err.fix}") from None


def check_file_bytes(path: Path) -> None:
    """Every record of the zip archive against the CRC-32 torch.save stored for it (zipfile
    compares them as it reads each record to its end); a file that is not a zip archive at all
    is left to torch.load to judge, except an empty one."""
    if path.stat().st_size == 0:
        raise Unusable("is empty (0 bytes)")
    if not _starts_as_zip(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
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
                        raise Unusable(f"is corrupt: its record {name} does not match its checksum", _OLDER, True) from None
                    raise Unusable(f"is truncated or corrupt (record {name}: {err})", _OLDER, True) from None
    except zipfile.BadZipFile as err:  # no end-of-archive directory: cut short
        detail = "its zip directory is missing" if "not a zip file" in str(err) else str(err)
        raise Unusable(f"is truncated or corrupt ({detail})", _OLDER, True) from None


def _starts_as_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    except OSError:
        return False


def directory_checksums(directory: Path) -> dict[str, int]:
    return {entry.name: _file_crc32(entry) for entry in sorted(Path(directory).iterdir()) if entry.is_file()}


def check_shards(directory: Path, recorded: dict[str, int]) -> None:
    for name, checksum in sorted(recorded.items()):
        path = directory / name
        if not path.is_file():
            raise Unusable(f"is missing its shard file {path}", _OLDER)
        if _file_crc32(path) != checksum:
            raise Unusable(f"is corrupt: its shard file {path} does not match its checksum", _OLDER)


def _file_crc32(path: Path) -> int:
    checksum = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


def _first_sentence(err: Exception) -> str:
    """What went wrong, from torch's multi-line errors, short enough for one line of ours: a
    refused weights_only load puts the cause after paragraphs of advice, among it to load with
    weights_only=False, the very thing a file of unknown origin must not get."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    # torch says "Unsupported global: GLOBAL x.y" for a class it does not allow, and "Trying to
    # load unsupported GLOBAL x.y whose module x is blocked" for one of os, subprocess, ...
    if code := re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", text):
        return f"loading it would run {code.group(1)}, which ringtrain refuses"
    if cause := re.search(r"WeightsUnpickler error:\s*([^\n]+)", text):
        text = cause.group(1)
    return text.splitlines()[0].split(". ")[0].rstrip(".")[:200]


def load_model_weights(model: nn.Module, state: dict[str, Any], path: str | Path) -> None:
    try:
        model.load_state_dict(state["model"])
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


def link_checkpoint(source: Path, target: Path) -> None:
    """Make `target` the same file as `source` (last.pt = the step file just written) with a
    hard link, atomically and durably; a copy where links are not supported. Checkpoints are
    only ever replaced by a rename, so `target` keeps this version when `source` goes."""
    try:
        try:
            replace_atomically(target, lambda temp: os.link(source, temp))
        except OSError:
            with open(source, "rb") as original, open_atomically(target) as copy:
                shutil.copyfileobj(original, copy)
    except OSError as err:
        raise CheckpointError(write_failure_message(target, err, intact=target)) from None


def set_aside(paths: list[Path]) -> list[Path]:
    """Move checkpoint files that cannot be read (and a step file's shards) into
    `<directory>/unreadable/`, where no resume, rotation or cleanup touches them; a name taken
    there gets a numbered suffix. Returns where each went."""
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
    numbered = (path.with_name(f"{path.name}.{number}") for number in itertools.count(1))
    return next(candidate for candidate in itertools.chain([path], numbered) if not candidate.exists())


def remove_unnamed_shards(directory: Path) -> list[Path]:
    """Delete the `step-<N>.shards` directories no checkpoint file names (best.pt may keep one
    whose step file was rotated away); nothing when a pointer file cannot be read."""
    shards = [entry for entry in directory.iterdir() if _SHARDS_NAME.match(entry.name) and entry.is_dir()]
    if not shards:
        return []
    named = {shards_name(step) for step, _ in step_checkpoints(directory)}
    for pointer in directory.glob("*.pt"):
        if step_of_name(pointer.name) is None and pointer.is_file():
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
