"""Sharded checkpoints (strategy.state_dict_type=sharded): each rank writes its own shards
with torch.distributed.checkpoint, nothing gathered, so a model too large for one rank's memory
still saves. CheckpointManager (checkpoints/__init__.py) keeps the rest of the state in a small
step-<N>.pt beside the shards directory, written only once the directory is complete.

The shards are written synchronously even with trainer.async_checkpoint, not with DCP's
async_save: the directory becomes a checkpoint only once every rank's shards are complete and
rank 0 renamed it, which needs every rank's outcome at one collective point; in the background
that would wait for the next save, each rank holding a staged CPU copy meanwhile, with a failure
carried to the others later. Each rank writes only its 1/N slice anyway.

DCP keeps a directory's index (`.metadata`) as a pickle, and its own reader unpickles it whole,
which would run whatever a crafted file names. `_DataOnlyReader` unpickles only the classes that
index is made of (ALLOWED_GLOBALS) and refuses anything else in one line naming the flag for a
file the user trusts; the tensors themselves DCP reads with weights_only.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from ringtrain.checkpoints.files import LAST_NAME, CheckpointError, write_failure_message
from ringtrain.checkpoints.state_dicts import from_rank0, optimizer_state_dict, rank
from ringtrain.storage import replace_directory

# What DCP's index of a directory is made of (torch 2.4-2.13): its dataclasses, torch's sizes,
# dtypes and layouts, and the paths of its files. Nothing here runs code beyond building them.
_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = frozenset({
    *((_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                     "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                     "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})


class _DataOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"its index names {module}.{name}, which is not data of a DCP index")


class _DataOnlyReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        raw = (Path(self.path) / ".metadata").read_bytes()
        try:
            metadata = _DataOnlyUnpickler(io.BytesIO(raw)).load()
        except Exception as err:  # a crafted index, or one of classes this list lacks
            raise CheckpointError(f"sharded checkpoint {self.path} cannot be read as data ({str(err)[:200]}); if you "
                                  f"trust it, pass trust_checkpoint=true (trainer.trust_checkpoint=true when training)") from None
        files = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
        if any(Path(name).name != name or name in ("", ".", "..") for name in files):
            raise CheckpointError(f"sharded checkpoint {self.path} names files outside its directory; pass a "
                                  f"checkpoint ringtrain wrote")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _reader(directory: str | Path, trusted: bool) -> dcp.FileSystemReader:
    """DCP's reader, or the data-only one with the index checked now: a refusal is then one line
    here, not a failure DCP reports from inside its collectives."""
    if trusted:
        return dcp.FileSystemReader(directory)
    reader = _DataOnlyReader(directory)
    reader.read_metadata()
    return reader


def save_sharded(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model and optimizer state as a torch.distributed.checkpoint directory; call it on
    every rank. Atomic: the files go to `.<name>.partial`, which rank 0 renames to `directory`
    (replacing an older one) once every rank has fsynced its files. A failure on any rank (a
    full disk) raises the same CheckpointError on every rank, the earlier checkpoints intact."""
    partial = directory.with_name(f".{directory.name}.partial")
    # What a crash mid-save left, gone before any rank writes; DCP makes the directory (each rank, in its plan).
    _on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True), directory)
    state = {"model": get_model_state_dict(model), "optimizer": optimizer_state_dict(model, optimizer)}
    try:  # DCP gathers every rank's outcome: one rank's failure raises on all of them
        with _single_process_is_intended():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, sync_files=True))
    except dcp.CheckpointException as err:
        os_errors = [exc for exc, _ in err.failures.values() if isinstance(exc, OSError)]
        failure = (write_failure_message(directory, os_errors[0], intact=directory.parent / LAST_NAME) if os_errors
                   else f"cannot save sharded checkpoint {directory}: {_first_failure(err)}")
    else:
        failure = _on_rank0(lambda: replace_directory(partial, directory), directory)
    if failure is not None:
        _on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True), directory)
        raise CheckpointError(failure)


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 trusted: bool = False) -> None:
    """Load a `save_sharded` directory into `model` (and `optimizer`), set up as for training;
    call it on every rank (or without a process group). Each rank reads what its shards need, so
    the ranks and strategy may differ from the saving run's (fsdp on 2 -> ddp, 4 ranks, or one).
    `trusted`: unpickle the directory's index whole, as DCP's own reader does."""
    # Templates with this run's shapes and placement, which DCP fills in place.
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    fresh = optimizer is not None and not optimizer.state
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    reader = _reader(directory, trusted)
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=reader)
    except dcp.CheckpointException as err:
        raise CheckpointError(
            f"sharded checkpoint {directory} cannot be read ({_first_failure(err)}); resume from an older "
            f"checkpoint, or start a new run"
        ) from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        if fresh and not state["optimizer"]["state"]:
            optimizer.state.clear()  # nothing saved (SGD without momentum): forget the template's
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def sharded_model_shapes(directory: str | Path, trusted: bool = False) -> dict[str, list[int]]:
    """The full shape of each model tensor a `save_sharded` directory holds, from its
    metadata alone (no tensor is read): what a model must have to load it."""
    metadata = _reader(directory, trusted).read_metadata()
    return {
        key.removeprefix("model."): list(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process; here that is the point
    # (ringtrain evaluate / sample, a single-process resume), not a mistake to report.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _on_rank0(action, directory: Path) -> str | None:
    """Run `action` on rank 0 only; every rank returns its failure message (None: it worked).
    Also the barrier: no rank goes on before rank 0 is done."""
    failure = None
    if rank() == 0:
        try:
            action()
        except OSError as err:
            failure = write_failure_message(directory, err, intact=directory.parent / LAST_NAME)
    return from_rank0(failure)


def _first_failure(err: dcp.CheckpointException) -> str:
    rank, (exc, _) = min(err.failures.items())  # the lowest rank that failed
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"rank {rank}: {text[:200]}"
