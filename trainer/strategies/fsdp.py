"""strategy=fsdp building blocks: FSDP2 sharding, gradient accumulation, clipping, checkpoints.

Why: DDP keeps a full copy of the parameters, gradients and optimizer state on every rank
(16 bytes per parameter with AdamW in fp32), so a model stops fitting long before the batch
does. FSDP2 (`torch.distributed.fsdp.fully_shard`) keeps 1/N of each on each of N ranks and
all-gathers one unit's parameters (a transformer Block) just before that unit runs.

How the training loop uses this module (order matters):

    model = shard_model(model, device, shard_classes=None, reshard_after_forward=True,
                        param_dtype=None, cpu_offload=False)   # parameters become DTensors
    params = list(model.parameters())        # taken AFTER sharding, as is the optimizer
    optimizer = build_optimizer(model, ...)
    for i, (inputs, targets) in enumerate(micro_batches):
        with gradient_sync(model, enabled=i == last):     # FSDP2, DDP or a plain module
            (loss_fn(model(inputs), targets) * share).backward()
    norm = clip_grad_norm(params, max_norm)  # or grad_norm(params): a plain tensor, every rank
    optimizer.step()
    with inference_context(model):           # evaluation: no_grad under FSDP, see there
        ...

Checkpoints in ringtrain's plain format work for every strategy (single, ddp, fsdp), so a
checkpoint written under one resumes under another: `full_model_state_dict` /
`full_optimizer_state_dict` are called on every rank (under FSDP they all-gather) and return
the complete state on rank 0; `load_full_model_state_dict` / `load_full_optimizer_state_dict`
are called on every rank and take rank 0's state. The optimizer state is keyed by parameter
name (FQN), not by position, which is what makes it portable between strategies.
For models too large to gather on one rank (strategy.state_dict_type=sharded), `save_sharded` /
`load_sharded` write and read a torch.distributed.checkpoint directory where each rank writes
its own shards.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ringtrain.checkpoints.atomic import fsync_directory
from ringtrain.checkpoints.files import LAST_NAME, CheckpointError, write_failure_message


log = logging.getLogger(__name__)

NO_PROCESS_GROUP_MESSAGE = (
    "strategy=fsdp needs a process group: run under torchrun or set strategy.nproc_per_node >= 2; "
    "for one process use strategy=single or ddp"
)

# Full (unsharded) state dicts as plain CPU tensors. With a process group, only rank 0 gets
# them (the others get {}), so N ranks never hold N full copies in host memory at once.
_GATHER_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


# --- sharding --------------------------------------------------------------------------------


def default_shard_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The FSDP units when the user names none: the repeated layers, i.e. the class of the
    modules in any nn.ModuleList whose members all share one class (a Transformer's blocks,
    ringtrain's or a user's), as torchtitan shards each block. A model without such a list is
    one unit: memory is still sharded between steps, but forward gathers everything at once,
    so name its repeated layer with strategy.shard_classes to do better."""
    repeated = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and next(iter(kinds)) not in repeated:
                repeated.append(next(iter(kinds)))
    if not repeated:
        log.info(
            "fsdp: %s has no repeated layers in an nn.ModuleList; the whole model is one FSDP unit, "
            "gathered at once in forward (name its layer class in strategy.shard_classes)",
            type(model).__name__,
        )
    return tuple(repeated)


def resolve_shard_classes(model: nn.Module, names: Iterable[str]) -> tuple[type[nn.Module], ...]:
    """Map class names ("Block") or dotted paths ("ringtrain.models.transformer.Block") to the classes of
    `model`'s submodules. A name that matches nothing raises ValueError listing the classes
    present; a short name shared by several classes selects all of them."""
    present = {type(module) for module in model.modules()}
    chosen: list[type[nn.Module]] = []
    for name in names:
        matches = [cls for cls in present if name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")]
        if not matches:
            available = ", ".join(sorted({cls.__name__ for cls in present}))
            raise ValueError(
                f"shard class '{name}' matches no module of {type(model).__name__}; "
                f"name one of its classes: {available}"
            )
        chosen.extend(cls for cls in sorted(matches, key=lambda c: c.__qualname__) if cls not in chosen)
    return tuple(chosen)


def shard_model(
    model: nn.Module,
    device: torch.device,
    *,
    shard_classes: tuple[type[nn.Module], ...] | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over all ranks of the default process group; return it.

    Each submodule whose class is in `shard_classes` (None: `default_shard_classes`) becomes
    one FSDP unit, gathered just for its own forward and backward; the root module becomes
    the last unit and holds everything else (embeddings, final norm, head). Parameters are
    replaced by DTensors sharded on dim 0, so build the optimizer and any cached parameter
    list after this call.

    reshard_after_forward: free each unit's gathered parameters after its forward and gather
        them again in backward (less memory, one more all-gather per unit). The root keeps
        FSDP's own default (not resharded), since backward needs it first.
    param_dtype: e.g. torch.bfloat16, the dtype of the gathered parameters, so forward,
        backward and the all-gather run in it; gradients are reduced in float32 and the
        sharded parameters and optimizer state stay in their own dtype.
    cpu_offload: keep the sharded parameters, gradients and optimizer step on the CPU and copy
        each unit to `device` when it is gathered (so the optimizer must be a CPU one: no
        fused=True CUDA AdamW).

    A parameter shared between modules (the Transformer's tied embedding / lm_head) must live
    in one unit: a shard-class module holding a parameter also used outside it is not made a
    unit of its own, so the parameter falls to the enclosing unit (the root).
    """
    if next(model.parameters(), None) is None:
        raise ValueError(
            f"{type(model).__name__} has no parameters, so FSDP has nothing to shard; "
            f"give the model trainable parameters or use strategy=single"
        )
    if isinstance(model, (FSDPModule, DistributedDataParallel, nn.DataParallel)):
        raise ValueError(
            f"the model is already wrapped ({type(model).__name__}); pass the bare model to shard_model once"
        )
    if shard_classes is None:
        shard_classes = default_shard_classes(model)
    units = _unit_modules(model, shard_classes)
    if not _distributed():
        raise ValueError(NO_PROCESS_GROUP_MESSAGE)

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    root_options: dict[str, Any] = {"mesh": mesh}
    if param_dtype is not None:
        # float32 reduction: summing N ranks' bf16 gradients loses bits the optimizer needs.
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        # The model's output in float32, as autocast would give the loss: cross-entropy over
        # bf16 logits loses precision in the log-sum-exp.
        root_options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    if cpu_offload:
        # Pinned memory makes host<->GPU copies asynchronous; without a GPU it cannot be allocated.
        options["offload_policy"] = root_options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    # fully_shard groups the parameters not yet owned by a unit, so children go first.
    for module in units:
        fully_shard(module, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **root_options)
    return model


def _unit_modules(model: nn.Module, shard_classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The submodules to shard as units, children before parents."""
    if not shard_classes:
        return []
    candidates = [m for m in model.modules() if m is not model and isinstance(m, shard_classes)]
    if not candidates and not isinstance(model, shard_classes):
        names = ", ".join(cls.__name__ for cls in shard_classes)
        raise ValueError(
            f"no submodule of {type(model).__name__} is a shard class ({names}); "
            f"name one of: {', '.join(sorted({type(m).__name__ for m in model.modules()}))}"
        )
    owners: dict[nn.Parameter, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(param, []).append(module)
    units, skipped = [], []
    for module in candidates:
        inside = set(module.modules())
        if any(owner not in inside for param in module.parameters() for owner in owners[param]):
            skipped.append(module)
        else:
            units.append(module)
    if skipped:
        log.warning(
            "fsdp: %d %s module(s) share a parameter with modules outside them (tied weights); "
            "they are not sharded as units of their own, the enclosing unit holds them",
            len(skipped), ", ".join(sorted({type(m).__name__ for m in skipped})),
        )
    # modules() lists parents before children: reversed, every child comes before its parent.
    return units[::-1]


# --- the training step -------------------------------------------------------------------------


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Forward and backward inside this context reduce gradients only when `enabled`.

    Under FSDP2, a micro-batch that is not the last skips the reduce-scatter and accumulates
    unsharded gradients locally (set_requires_gradient_sync); the last one reduces the sum.
    Under DDP this is `no_sync`; for a plain module it does nothing, so the loop can always
    call it. Weight each micro-batch's loss by its share of the samples, as for DDP.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # a later backward outside this context syncs
    elif not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield


def inference_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """For evaluation: torch.no_grad() under FSDP2, torch.inference_mode() otherwise.

    A forward under inference_mode makes FSDP2 allocate its all-gather buffers as inference
    tensors; the next training forward then fails ("Inplace update to inference tensor
    outside InferenceMode"), even after reshard() (torch 2.13, checked here).
    """
    return torch.no_grad() if isinstance(model, FSDPModule) else torch.inference_mode()


def grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The global norm of all gradients as a plain tensor, for plain and sharded (DTensor)
    gradients alike; under FSDP every rank must call it (it all-reduces)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return _total_norm(grads, norm_type)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so that their global norm is at most `max_norm`; return the norm
    before clipping as a plain tensor. Under FSDP the norm is the full model's (not this
    rank's shard's), so every rank scales by the same factor; every rank must call it."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if all(isinstance(p.grad, DTensor) for p in params) or not any(isinstance(p.grad, DTensor) for p in params):
        # clip_grad_norm_ handles all-DTensor gradients itself (the norm's reduction is a
        # DTensor Partial -> all-reduce); it returns a DTensor norm then.
        return _plain(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
    # A mix (parameters FSDP does not manage next to sharded ones): torch's foreach kernels
    # refuse mixed Tensor/DTensor lists, so take the norm per kind and clip each kind with it.
    total = _total_norm([p.grad for p in params], norm_type)
    sharded = [p for p in params if isinstance(p.grad, DTensor)]
    plain = [p for p in params if not isinstance(p.grad, DTensor)]
    for group in (sharded, plain):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = [_plain(torch.nn.utils.get_total_norm(group, norm_type)) for group in (sharded, plain) if group]
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


def _plain(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


# --- checkpoints in ringtrain's plain format (every strategy) --------------------------------


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors, keyed by the bare model's names (no
    `module.` / `_orig_mod.`), tied weights under each of their names as in state_dict().

    Works for a plain module, DDP, torch.compile and FSDP2. Call it on every rank: under FSDP
    it all-gathers. With a process group only rank 0 gets the weights, the others get {}.
    On a CPU model without FSDP the tensors share storage with the live parameters, as
    state_dict()'s do: save them before the next optimizer step.
    """
    return get_model_state_dict(_without_data_parallel(model), options=_GATHER_TO_RANK0)


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full weights (from `full_model_state_dict` or a bare model's state_dict()) into a
    plain, DDP or FSDP2 model, strictly. Call it on every rank; with a process group rank 0's
    `state` is broadcast and the other ranks' is ignored (they may pass {})."""
    set_model_state_dict(_without_data_parallel(model), _rank0_only(state), options=_load_options())


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name: {"state": {fqn: {...}},
    "param_groups": [{..., "params": [fqn, ...]}]}, plain CPU tensors and Python values,
    loadable with torch.load(weights_only=True). A tied parameter appears once, under its
    first name. Call it on every rank; with a process group only rank 0 gets it, others {}.

    An optimizer that has not stepped has no state; DCP then makes some with a zero-lr step
    (Adam(W): step=1, zero moments). That is taken back from `optimizer`, so saving never
    changes training, but the returned state holds it: save after the first step.
    """
    return _optimizer_state_dict(_without_data_parallel(model), optimizer, _GATHER_TO_RANK0)


def _optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                          options: StateDictOptions | None = None) -> dict[str, Any]:
    """DCP's name-keyed optimizer state, leaving `optimizer` as it was. DCP creates missing
    state with a zero-lr step; for Adam(W) that sets step=1, which would change the bias
    correction of the real first step, so state made that way is forgotten again."""
    fresh = not optimizer.state
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if fresh:
        optimizer.state.clear()
    return state


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a name-keyed optimizer state (from `full_optimizer_state_dict` under any strategy)
    into `optimizer`, re-sharding it for FSDP. Call it on every rank after the model is set
    up (sharded) and the optimizer built; with a process group rank 0's `state` is broadcast
    and the other ranks' is ignored (they may pass {})."""
    settings_only = not state.get("state")
    if _distributed():  # rank 0's state decides: the other ranks may have passed {}
        holder = [(settings_only, state.get("param_groups"))]
        dist.broadcast_object_list(holder, src=0)
        settings_only, groups = holder[0]
    else:
        groups = state.get("param_groups")
    if settings_only:
        # Nothing but hyperparameters (SGD without momentum keeps no state): DCP's loader
        # cannot place what has no tensor (it looks for one to learn the device from), and a
        # plain copy of each group's settings is all there is to load.
        for group, saved in zip(optimizer.param_groups, groups or []):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    set_optimizer_state_dict(_without_data_parallel(model), optimizer, _rank0_only(state), options=_load_options())


def _load_options() -> StateDictOptions:
    # broadcast_from_rank0 needs a process group; one process simply loads its own state.
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=_distributed())


def _rank0_only(state: dict[str, Any]) -> dict[str, Any]:
    """`state` on rank 0 (a shallow copy: DCP renames keys in the dict it is given), {} elsewhere.

    With broadcast_from_rank0 DCP expects {} off rank 0: under DDP a full state there keeps
    its unprefixed keys next to the broadcast `module.` ones and load_state_dict rejects them
    as unexpected (torch 2.13).
    """
    return dict(state) if _rank() == 0 else {}


def _without_data_parallel(model: nn.Module) -> nn.Module:
    # DCP strips DDP's `module.` and torch.compile's `_orig_mod.` itself, but not the prefix
    # of the single-process nn.DataParallel (strategy=dp).
    return model.module if isinstance(model, nn.DataParallel) else model


# --- sharded checkpoints (torch.distributed.checkpoint) --------------------------------------
# strategy.state_dict_type=sharded: each rank writes its own shards, nothing is gathered, so a
# model too large for one rank's memory still saves. CheckpointStore (trainer/checkpoint.py)
# keeps the rest of the state (schedule, progress, rng, config) in a small step-<N>.pt beside
# the shards directory, written only after the directory is complete.


def save_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write the model and optimizer state as a torch.distributed.checkpoint directory, each
    rank its own shards. Call it on every rank.

    Atomic: the files go to `.<name>.partial`, which rank 0 renames to `directory` once every
    rank has written and fsynced its files, and the parent directory is fsynced; a crash never
    leaves a half-written directory under that name. An older directory of that name is
    replaced. A failure on any rank (a full disk) raises the same CheckpointError on every
    rank and leaves the earlier checkpoints as they were.
    """
    directory = Path(directory)
    partial = directory.with_name(f".{directory.name}.partial")
    failure = _on_rank0(lambda: _fresh_directory(partial), directory)
    if failure is None:
        model = _without_data_parallel(model)
        state = {"model": get_model_state_dict(model), "optimizer": _optimizer_state_dict(model, optimizer)}
        try:  # DCP gathers every rank's outcome: one rank's failure raises on all of them
            with _single_process_is_intended():
                dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, sync_files=True))
        except dcp.CheckpointException as err:
            failure = _shard_write_failure(directory, err)
    if failure is None:
        failure = _on_rank0(lambda: _replace_directory(partial, directory), directory)
    if failure is not None:
        _on_rank0(lambda: shutil.rmtree(partial, ignore_errors=True), directory)
        raise CheckpointError(failure)


def load_sharded(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a `save_sharded` directory into `model` (and `optimizer`), set up as for training:
    wrapped or sharded, the optimizer built. Each rank reads what its shards need, so the
    number of ranks and the strategy may differ from the saving run's (fsdp on 2 ranks ->
    ddp, fsdp on 4 ranks, or one process). Call it on every rank of the process group (or
    without one). The shards hold tensors and plain values; DCP unpickles the latter, so load
    only checkpoints you trust, as with any torch.distributed.checkpoint directory."""
    model = _without_data_parallel(model)
    # Templates with this run's shapes and placement, which DCP fills in place.
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    fresh = optimizer is not None and not optimizer.state
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
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


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process; here that is the point
    # (trainer.evaluate / sample, a single-process resume), not a mistake to report.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fresh_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a crash mid-save
    path.mkdir(parents=True)


def _replace_directory(partial: Path, directory: Path) -> None:
    # A directory cannot replace another in one rename: the old one moves aside first. A
    # crash between the two renames leaves `.previous` and no `directory`; the store then
    # falls back to an older checkpoint (trainer/checkpoint.py).
    previous = directory.with_name(f".{directory.name}.previous")
    if directory.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(directory, previous)
    os.replace(partial, directory)
    fsync_directory(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _on_rank0(action, directory: Path) -> str | None:
    """Run `action` on rank 0 only; every rank returns its failure message (None: it worked).
    Also the barrier: no rank goes on before rank 0 is done."""
    failure = None
    if _rank() == 0:
        try:
            action()
        except OSError as err:
            failure = write_failure_message(directory, err, intact=directory.parent / LAST_NAME)
    if _distributed():
        holder = [failure]
        dist.broadcast_object_list(holder, src=0)
        failure = holder[0]
    return failure


def _shard_write_failure(directory: Path, err: dcp.CheckpointException) -> str:
    os_errors = [exc for exc, _ in err.failures.values() if isinstance(exc, OSError)]
    if os_errors:
        return write_failure_message(directory, os_errors[0], intact=directory.parent / LAST_NAME)
    return f"cannot save sharded checkpoint {directory}: {_first_failure(err)}"


def _first_failure(err: dcp.CheckpointException) -> str:
    rank, (exc, _) = next(iter(sorted(err.failures.items(), key=lambda item: item[0])))
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"rank {rank}: {text[:200]}"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0
