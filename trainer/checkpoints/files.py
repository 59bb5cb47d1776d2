"""Checkpoint files: plain tensors and plain data, written durably, read back safely.

A checkpoint is a dict loadable with `torch.load(path, weights_only=True)`:
  model        the bare model's full state_dict (no `module.` / `_orig_mod.` prefixes; under
               fsdp gathered from every rank's shards)
  optimizer    its full state keyed by parameter name (torch.distributed.checkpoint's
               get_optimizer_state_dict), so it loads under single, ddp or fsdp alike
  scheduler, scaler   their state_dicts
  progress     {"step", "epoch", "batches_into_epoch", "best_metric", "skipped_steps"}
  rng          one torch RNG state per rank (CPU, and CUDA when used), in rank order
  config       the resolved run config as plain data
  data_dims, vocab   the sizes the data gave the model, and its vocabulary (sampling)
  format       CHECKPOINT_FORMAT (2: optimizer state by parameter name)

Under strategy=fsdp with strategy.state_dict_type=sharded, `model` and `optimizer` are not in
the file: `shards` names the torch.distributed.checkpoint directory beside it
(`step-<N>.shards/`, each rank's own shards, trainer/fsdp.py's save_sharded). The file is
written only once that directory is complete, so a step file that exists always has its
shards; `load_checkpoint` returns `shards` as the directory's path.

Why the care: a week-long run must not lose its progress to a preemption, a full disk, a
power cut or a file broken some other way. So:
  * Every file is written to a temporary name in the same directory (`.<name>.tmp-<pid>`),
    fsynced, renamed over the real name, and the directory is fsynced: after a crash the name
    holds the old file or the new one, complete, never a truncated mix, even after a power
    cut. A failed write (full disk, quota, I/O error) removes the temporary file, leaves the
    previous checkpoint untouched and raises CheckpointError with one line saying what to do.
  * `CheckpointStore` keeps the last `keep_last_k` checkpoints as `step-<step>.pt` files and
    points `last.pt` / `best.pt` at them with hard links (no second write), so one broken file
    still leaves an older one to resume from; `find_resumable` picks the newest that loads.
    A shards directory is deleted once no step file, last.pt or best.pt names it.
  * Files are read with `weights_only=True`: a checkpoint is data, and a pickle that would run
    code when loaded is refused.
Only rank 0 writes.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.errors import UserError

CHECKPOINT_FORMAT = 2
_REQUIRED_KEYS = ("model", "optimizer", "scheduler", "progress", "rng", "config", "format")
_REQUIRED_KEYS_SHARDED = ("shards", "scheduler", "progress", "rng", "config", "format")

LAST_NAME = "last.pt"
BEST_NAME = "best.pt"
_STEP_NAME = re.compile(r"^step-(\d+)\.pt$")
# What `_temp_path` makes of ringtrain's own names; nothing else is ever removed as stale.
_STALE_TEMP_NAME = re.compile(r"^\.(?:last|best|step-\d+)\.pt\.tmp-\d+$")
_SHARDS_NAME = re.compile(r"^step-\d+\.shards$")
# What trainer/fsdp.py's save_sharded leaves when killed mid-save.
_STALE_SHARDS_NAME = re.compile(r"^\.step-\d+\.shards\.(?:partial|previous)$")
# Directory fsync is not supported everywhere (some network and FUSE file systems): there the
# rename is as durable as the file system makes it, and that is no reason to stop a run.
_FSYNC_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}

log = logging.getLogger("ringtrain")


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


# --- writing ------------------------------------------------------------------------------


def step_checkpoint_name(step: int) -> str:
    """`step-00001200.pt`: zero-padded so that names sort like steps in a directory listing."""
    return f"step-{step:08d}.pt"


def shards_name(step: int) -> str:
    """`step-00001200.shards`: the directory of a sharded checkpoint's weights and optimizer state."""
    return f"step-{step:08d}.shards"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` durably: complete and in place after a crash or power cut, or
    not at all (CheckpointError, with the previous file at `path` untouched)."""
    _write_durably(Path(path), state, intact=Path(path))


def link_checkpoint(source: Path, target: Path) -> None:
    """Make `target` the same file as `source` (last.pt / best.pt = the step file just written),
    atomically and durably.

    A hard link costs no second serialisation or write. Checkpoints are only ever replaced by
    a rename, never rewritten in place, so `target` keeps this version when `source`'s name
    later points to a new file or is deleted. Where links are not supported (some network
    and FAT file systems, another device), the file is copied.
    """
    source, target = Path(source), Path(target)
    tmp = _temp_path(target)
    try:
        _remove_if_present(tmp)  # left by a killed process with our pid (containers reuse pids)
        try:
            os.link(source, tmp)
        except FileNotFoundError:
            raise
        except OSError:
            _copy_durably(source, tmp)
        os.replace(tmp, target)
    except OSError as err:
        _remove_if_present(tmp)
        raise CheckpointError(write_failure_message(target, err, intact=target)) from None
    fsync_directory(target.parent)


def _write_durably(path: Path, state: dict[str, Any], intact: Path) -> None:
    """Temp file, fsync, rename, fsync the directory. `intact` is the file a failure leaves
    untouched, named in the error."""
    tmp = _temp_path(path)
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_directory(path.parent.parent)  # the new directory itself survives a power cut
        with open(tmp, "wb") as file:
            writer = _ErrorRecordingWriter(file)
            try:
                torch.save(state, writer)
            except RuntimeError:
                # torch turns a failed write into "unexpected pos ..."; the cause is the OSError
                # the file raised (ENOSPC on a really full disk, measured on a 1 MiB tmpfs).
                if writer.error is not None:
                    raise writer.error from None
                raise
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except OSError as err:
        _remove_if_present(tmp)
        raise CheckpointError(write_failure_message(path, err, intact)) from None
    except BaseException:  # a state torch cannot save, Ctrl-C mid-write: no debris either
        _remove_if_present(tmp)
        raise
    fsync_directory(path.parent)  # the rename itself survives a power cut


class _ErrorRecordingWriter:
    """A file's `write` that remembers the OSError it raised, which torch.save hides."""

    def __init__(self, file):
        self.file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _copy_durably(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    with open(target, "rb+") as file:
        os.fsync(file.fileno())


def fsync_directory(directory: Path) -> None:
    """Make the renames and links in `directory` durable (a file's own fsync does not cover its
    directory entry)."""
    consequence = "a power cut may undo the last checkpoint rename"
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as err:  # e.g. Windows cannot open a directory
        if err.errno not in _FSYNC_UNSUPPORTED:
            log.warning(f"cannot open {directory} to fsync it ({err.strerror}); {consequence}")
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _FSYNC_UNSUPPORTED:
            log.warning(f"fsync of {directory} failed ({err.strerror}); {consequence}")
    finally:
        os.close(fd)


def write_failure_message(path: Path, err: OSError, intact: Path) -> str:
    reason = err.strerror or str(err) or type(err).__name__
    if err.errno in _DISK_FULL:
        fix = f"free space on {path.parent} or keep fewer checkpoints"
    else:
        fix = f"check that {path.parent} is writable and its file system healthy"
    kept = f"the previous {intact.name} is intact" if intact.exists() else "no checkpoint was written"
    return f"cannot save checkpoint {path}: {reason}; {fix}; {kept}"


def _temp_path(path: Path) -> Path:
    """Hidden, in the same directory (so the rename is atomic), unique per process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _remove_if_present(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        log.warning(f"cannot remove {path} ({err.strerror}); delete it by hand")


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
        _write_durably(step_path, state, intact=self.last)
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
                # older checkpoint, a line of training this run has left.
                log.warning(
                    f"removing {path}: newer than step {saved_step} just saved, left from before "
                    f"resuming an older checkpoint"
                )
                _remove_if_present(path)
            else:
                kept.append((step, path))
        for _, path in kept[: -self.keep_last_k]:
            _remove_if_present(path)


def step_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-*.pt` file in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _STEP_NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


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
            _remove_if_present(entry)
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


# --- reading ------------------------------------------------------------------------------


class _Unusable(Exception):
    """Why a checkpoint file cannot be used: `kind` picks the message, `detail` says more."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _load_verified(path: str | Path, map_location: torch.device | str, mmap: bool = False) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise _Unusable("missing") from None
    except Exception as err:  # truncated file, pickle with code in it, not a torch file at all
        raise _Unusable("unreadable", _first_sentence(err)) from None
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


def load_checkpoint(path: str | Path, map_location: torch.device | str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read and check a ringtrain checkpoint; raise CheckpointError with the fix otherwise.
    `mmap`: map the tensors instead of reading them (cheap when only the config is wanted)."""
    try:
        return _load_verified(path, map_location, mmap=mmap)
    except _Unusable as err:
        if err.kind == "missing":
            message = f"checkpoint '{path}' does not exist; check trainer.resume"
        elif err.kind == "unreadable":
            message = (
                f"checkpoint '{path}' cannot be read ({err.detail}); pass a last.pt/best.pt "
                f"written by ringtrain"
            )
        elif err.kind == "foreign":
            message = (
                f"checkpoint '{path}' is not a ringtrain checkpoint (missing {err.detail}); "
                f"pass a last.pt/best.pt written by ringtrain"
            )
        elif err.kind == "shards":
            message = (
                f"checkpoint '{path}' keeps its weights in {err.detail}, which is missing or incomplete; "
                f"resume from another checkpoint of that run (trainer.resume=auto picks the newest that loads)"
            )
        else:
            message = f"checkpoint '{path}' has format {err.detail}, this ringtrain reads {CHECKPOINT_FORMAT}"
        raise CheckpointError(message) from None


def find_resumable(directory: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint in `directory` that loads, and one warning line per newer one that
    does not (truncated, corrupt, not ringtrain's), naming the file it falls back to.

    Tried in order: last.pt, the `step-*.pt` files newest first, best.pt (older than every kept
    step file once its own was rotated away). A name that is the same file as one already tried
    (last.pt and its step file are hard links) is not read twice. Temporary files of a killed
    save are never candidates. Files are memory-mapped to check them, so checking costs little
    even for a large checkpoint; a file whose structure is intact but whose tensor bytes were
    altered is not detected (there are no checksums). Returns (None, warnings) when nothing in
    the directory loads. The caller logs the warnings (rank 0; the others get the path from it).
    """
    directory = Path(directory)
    candidates = [directory / LAST_NAME]
    candidates += [path for _, path in reversed(step_checkpoints(directory))]
    candidates.append(directory / BEST_NAME)

    tried: list[Path] = []
    broken: list[tuple[str, str]] = []  # (names of the file, why it cannot be used)
    for path in candidates:
        if not path.is_file():
            continue
        same = [earlier for earlier in tried if _same_file(earlier, path)]
        tried.append(path)
        if same:
            continue
        try:
            _load_verified(path, "cpu", mmap=True)
        except _Unusable as err:
            broken.append((_names_of(path, candidates), _short_reason(err)))
            continue
        return path, [f"checkpoint {names} {why}; falling back to {path}" for names, why in broken]
    return None, [f"checkpoint {names} {why}; no readable checkpoint is left in {directory}" for names, why in broken]


def _short_reason(err: _Unusable) -> str:
    if err.kind == "unreadable":
        return f"cannot be read, truncated or corrupt ({err.detail})"
    if err.kind == "foreign":
        return f"is not a ringtrain checkpoint (missing {err.detail})"
    if err.kind == "format":
        return f"has format {err.detail}, this ringtrain reads {CHECKPOINT_FORMAT}"
    if err.kind == "shards":
        return f"names shards {err.detail} that are missing or incomplete"
    return "disappeared while being read"


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _names_of(path: Path, candidates: list[Path]) -> str:
    """`<dir>/last.pt (= step-00000800.pt)`: every candidate name of this same file."""
    aliases = [other.name for other in candidates if other != path and other.is_file() and _same_file(other, path)]
    return f"{path} (= {', '.join(aliases)})" if aliases else str(path)


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
            f"was trained with, or start a new run (a new hydra.run.dir, or trainer.resume=null)"
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
