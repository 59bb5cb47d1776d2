"""Checkpoint state in ringtrain's plain format, the same for every strategy, so a checkpoint
written under one resumes under another.

`full_model_state_dict` / `full_optimizer_state_dict` are called on every rank (under FSDP
they all-gather) and return the complete state on rank 0; `load_full_model_state_dict` /
`load_full_optimizer_state_dict` are called on every rank and take rank 0's state. The
optimizer state is keyed by parameter name (FQN), not by position, which is what makes it
portable between strategies. torch.distributed.checkpoint's state-dict functions do the work
for plain, DDP, compiled and FSDP2 models alike.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# Full (unsharded) state dicts as plain CPU tensors. With a process group, only rank 0 gets
# them (the others get {}), so N ranks never hold N full copies in host memory at once.
_GATHER_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)



def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors, keyed by the bare model's names (no
    `module.` / `_orig_mod.`), tied weights under each of their names as in state_dict().

    Works for a plain module, DDP, torch.compile and FSDP2. Call it on every rank: under FSDP
    it all-gathers. With a process group only rank 0 gets the weights, the others get {}.
    On a CPU model without FSDP the tensors share storage with the live parameters, as
    state_dict()'s do: save them before the next optimizer step.
    """
    return get_model_state_dict(without_data_parallel(model), options=_GATHER_TO_RANK0)


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full weights (from `full_model_state_dict` or a bare model's state_dict()) into a
    plain, DDP or FSDP2 model, strictly. Call it on every rank; with a process group rank 0's
    `state` is broadcast and the other ranks' is ignored (they may pass {})."""
    set_model_state_dict(without_data_parallel(model), _rank0_only(state), options=_load_options())


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name: {"state": {fqn: {...}},
    "param_groups": [{..., "params": [fqn, ...]}]}, plain CPU tensors and Python values,
    loadable with torch.load(weights_only=True). A tied parameter appears once, under its
    first name. Call it on every rank; with a process group only rank 0 gets it, others {}.

    An optimizer that has not stepped has no state; DCP then makes some with a zero-lr step
    (Adam(W): step=1, zero moments). That is taken back from `optimizer`, so saving never
    changes training, but the returned state holds it: save after the first step.
    """
    return optimizer_state_dict(without_data_parallel(model), optimizer, _GATHER_TO_RANK0)


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
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
    if distributed():  # rank 0's state decides: the other ranks may have passed {}
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
    set_optimizer_state_dict(without_data_parallel(model), optimizer, _rank0_only(state), options=_load_options())


def _load_options() -> StateDictOptions:
    # broadcast_from_rank0 needs a process group; one process simply loads its own state.
    return StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed())


def _rank0_only(state: dict[str, Any]) -> dict[str, Any]:
    """`state` on rank 0 (a shallow copy: DCP renames keys in the dict it is given), {} elsewhere.

    With broadcast_from_rank0 DCP expects {} off rank 0: under DDP a full state there keeps
    its unprefixed keys next to the broadcast `module.` ones and load_state_dict rejects them
    as unexpected (torch 2.13).
    """
    return dict(state) if rank() == 0 else {}


def without_data_parallel(model: nn.Module) -> nn.Module:
    # DCP strips DDP's `module.` and torch.compile's `_orig_mod.` itself, but not the prefix
    # of the single-process nn.DataParallel (strategy=dp).
    return model.module if isinstance(model, nn.DataParallel) else model


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0
