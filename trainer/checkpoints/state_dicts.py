"""Checkpoint state in ringtrain's plain format, the same for every strategy, so a checkpoint
written under one resumes under another.

The optimizer state is keyed by parameter name (FQN), not position: that makes it portable.
With a process group (DDP, FSDP2) torch.distributed.checkpoint's state-dict functions do the
work; without one (single, dp, the tools) the model's and optimizer's own state_dict(), renamed
by parameter name, give the same format, since importing DCP costs about half a second (DTensor,
dynamo), more than the whole seed tutorial's training (benchmarks/bench_process.py);
tests/test_checkpoint_files.py holds the two ways to the same output.

Each function is called on every rank: with a process group, a full state is gathered to rank 0
only (the others get {}: N ranks never hold N copies in host memory), and what is loaded is rank
0's state, broadcast (the others may pass {}).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights as plain CPU tensors, keyed by the bare model's names (no
    `module.` / `_orig_mod.`), tied weights under each name as in state_dict(); for a plain
    module, DDP, torch.compile and FSDP2. On a CPU model without FSDP they share storage with
    the live parameters: save them before the next optimizer step."""
    if not distributed():
        return {name: tensor.cpu() for name, tensor in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full())


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full weights (from `full_model_state_dict` or a bare model's state_dict()) into a
    plain, DDP or FSDP2 model, strictly."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, _rank0_only(state), options=_full(loading=True))


def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter name: {"state": {fqn: {...}},
    "param_groups": [{..., "params": [fqn, ...]}]}, plain CPU tensors and Python values,
    loadable with torch.load(weights_only=True); a tied parameter once, under its first name.
    Before the first step the state holds DCP's zero-lr step (optimizer_state_dict): save after it."""
    if distributed():
        return optimizer_state_dict(model, optimizer, _full())
    # Without a process group: optimizer.state_dict() renamed (module docstring), with CPU tensors.
    names, indexed = _parameter_names(model, optimizer), optimizer.state_dict()
    state = {names[index]: {key: value.cpu() if torch.is_tensor(value) else value for key, value in values.items()}
             for index, values in indexed["state"].items()}
    groups = [{**group, "params": [names[index] for index in group["params"]]} for group in indexed["param_groups"]]
    return {"state": state, "param_groups": groups}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                          options: StateDictOptions | None = None) -> dict[str, Any]:
    """DCP's name-keyed optimizer state, leaving `optimizer` as it was. DCP creates missing
    state with a zero-lr step; for Adam(W) that sets step=1, which would change the bias
    correction of the real first step, so state made that way is forgotten again."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    fresh = not optimizer.state
    state = get_optimizer_state_dict(model, optimizer, options=options)
    if fresh:
        optimizer.state.clear()
    return state


def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a name-keyed optimizer state (any strategy's) into `optimizer`, re-sharding it for
    FSDP, after the model is set up and the optimizer built."""
    settings_only, groups = from_rank0((not state.get("state"), state.get("param_groups")))
    if settings_only:
        # Only hyperparameters (SGD without momentum): DCP's loader needs a tensor to learn the
        # device from, and each group's settings are all there is to load.
        for group, saved in zip(optimizer.param_groups, groups or []):
            group.update({key: value for key, value in saved.items() if key != "params"})
        return
    if not distributed():
        index = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
        optimizer.load_state_dict({
            "state": {index[name]: values for name, values in state["state"].items()},
            "param_groups": [{**saved, "params": [index[name] for name in saved["params"]]}
                             for saved in state["param_groups"]],
        })
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, _rank0_only(state), options=_full(loading=True))


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in its state_dict's index order; a
    tied parameter under its first name, as DCP names it."""
    names = {param: name for name, param in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return [names[param] for group in optimizer.param_groups for param in group["params"]]


def _full(loading: bool = False) -> StateDictOptions:
    # broadcast_from_rank0 needs a process group; one process simply loads its own state.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=not loading, broadcast_from_rank0=loading and distributed())


def _rank0_only(state: dict[str, Any]) -> dict[str, Any]:
    """`state` on rank 0 (a shallow copy: DCP renames keys in the dict it is given), {} elsewhere:
    with broadcast_from_rank0, a full state off rank 0 under DDP keeps its unprefixed keys next
    to the broadcast `module.` ones, which load_state_dict rejects (torch 2.13)."""
    return dict(state) if rank() == 0 else {}


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def from_rank0(value: Any) -> Any:
    if distributed():
        holder = [value]
        dist.broadcast_object_list(holder, src=0)
        value = holder[0]
    return value


# What torch.load(weights_only=True) reads back: a checkpoint holds these and nothing else.
_DATA = (str, bytes, int, float, complex, bool, type(None))


def refuse_state_that_is_not_data(value: Any, key: str = "checkpoint") -> None:
    """One line naming the first value in a checkpoint's state that is not plain data (a
    callback's state_dict holding an object of its own, say), which would make the file one
    that weights_only refuses: the first save refuses the run instead of writing it."""
    if isinstance(value, dict):
        for name, item in value.items():
            refuse_state_that_is_not_data(item, f"{key}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            refuse_state_that_is_not_data(item, f"{key}[{i}]")
    elif not isinstance(value, (*_DATA, torch.Tensor, torch.Size, torch.dtype, torch.device)):
        owner = key.removeprefix("checkpoint.").split(".")[:2]
        raise ConfigError(f"{key.removeprefix('checkpoint.')} is a {type(value).__module__}.{type(value).__qualname__}, "
                          f"which a checkpoint cannot keep as data (torch.load(weights_only=True) would refuse every "
                          f"file); make {'.'.join(owner)}'s state_dict() return tensors, numbers, strings, lists and "
                          f"dicts")
