"""strategy=fsdp: fully sharded data parallel with PyTorch's FSDP2 (`fully_shard`; what each rank
keeps: conf/strategy/fsdp.yaml). What differs from ddp is all here, each in the method the run
calls for it.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ringtrain.checkpoints.sharded import save_sharded
from ringtrain.checkpoints.state_dicts import distributed
from ringtrain.distributed import DistInfo, under_torchrun
from ringtrain.errors import ConfigError
from ringtrain.strategies.compilation import CompiledModel
from ringtrain.strategies.process_group import ProcessGroupStrategy

log = logging.getLogger(__name__)

NO_PROCESS_GROUP_MESSAGE = (
    "strategy=fsdp needs a process group: run under torchrun or set strategy.nproc_per_node >= 2; "
    "for one process use strategy=single or ddp"
)


class FSDP(ProcessGroupStrategy):
    option = "fsdp"
    forwards_in_lockstep = True  # each sharded layer's forward all-gathers its parameters

    def __init__(self, *, backend: str, nproc_per_node: int, timeout_minutes: float, max_restarts: int,
                 scale_lr_by_world_size: bool, shard_classes: list[str], reshard_after_forward: bool,
                 cpu_offload: bool, state_dict_type: str) -> None:
        super().__init__(backend=backend, nproc_per_node=nproc_per_node, timeout_minutes=timeout_minutes,
                         max_restarts=max_restarts, scale_lr_by_world_size=scale_lr_by_world_size)
        if state_dict_type not in ("full", "sharded"):
            raise ConfigError(
                f"strategy.state_dict_type={state_dict_type!r} is unknown; use full (one plain file) or sharded "
                f"(each rank writes its own shards, for models too large to gather on one rank)"
            )
        self.shard_classes = list(shard_classes)  # []: the repeated layers (each Block)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type

    def check(self, trainer: Any) -> None:
        super().check(trainer)
        if self.nproc_per_node == 1 and not under_torchrun():
            raise ConfigError(NO_PROCESS_GROUP_MESSAGE)

    def autocast_precision(self, precision: str) -> str:
        # bf16-mixed is FSDP2's own mixed precision (bf16 parameters, float32 gradient
        # reduction, setup_module) instead of autocast.
        return "32" if precision == "bf16-mixed" else precision

    def setup_module(self, model: nn.Module, dist_info: DistInfo, trainer: Any) -> nn.Module:
        param_dtype = torch.bfloat16 if trainer.precision == "bf16-mixed" else None
        try:
            classes = resolve_shard_classes(model, self.shard_classes) if self.shard_classes else None
            sharded = shard_model(model, dist_info.device, shard_classes=classes,
                                  reshard_after_forward=self.reshard_after_forward,
                                  param_dtype=param_dtype, cpu_offload=self.cpu_offload)
        except ValueError as err:
            raise ConfigError(f"strategy=fsdp: {err}") from None
        return super().setup_module(sharded, dist_info, trainer)  # compiled after sharding

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        # A micro-batch that is not the last skips the reduce-scatter and accumulates unsharded
        # gradients locally; the last one reduces the sum.
        sharded = module.module if isinstance(module, CompiledModel) else module
        sharded.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)  # a later backward outside this context syncs

    @staticmethod
    def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
        # Plain tensors and DTensor shards norm apart (foreach refuses a mix); a DTensor's all-reduces.
        sharded = [t for t in tensors if isinstance(t, DTensor)]
        plain = [t for t in tensors if not isinstance(t, DTensor)]
        norms = [torch.nn.utils.get_total_norm(group) for group in (sharded, plain) if group]
        norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
        return norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms)  # none: 0

    def inference(self, module: nn.Module) -> contextlib.AbstractContextManager:
        # Under inference_mode FSDP2 allocates its all-gather buffers as inference tensors, and the
        # next training forward fails ("Inplace update to inference tensor") even after reshard()
        # (torch 2.13).
        return torch.no_grad()

    def checkpoint_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                           shards_path: Callable[[], Path]) -> dict[str, Any]:
        if self.state_dict_type == "full":
            return super().checkpoint_weights(model, optimizer, shards_path)
        # Each rank writes its own shards (nothing gathered); the step file names them and is
        # written after them. A failed write raises on every rank alike.
        shards = shards_path()
        save_sharded(shards, model, optimizer)
        return {"shards": shards.name}


def default_shard_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The FSDP units when the user names none: a Hugging Face model's `_no_split_modules` (its
    decoder layers), else the class of any nn.ModuleList whose members share one class (the
    blocks), as torchtitan shards each block. Without one the model is a single unit: sharded
    between steps, but forward gathers it all at once (name a layer in strategy.shard_classes)."""
    present = {type(module).__name__ for module in model.modules()}
    if declared := [name for name in getattr(model, "_no_split_modules", None) or () if name in present]:
        return resolve_shard_classes(model, declared)
    repeated = list(dict.fromkeys(type(m[0]) for m in model.modules()
                                  if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1))
    if not repeated:
        log.info(
            "fsdp: %s has no repeated layers in an nn.ModuleList; the whole model is one FSDP unit, "
            "gathered at once in forward (name its layer class in strategy.shard_classes)",
            type(model).__name__,
        )
    return tuple(repeated)


def resolve_shard_classes(model: nn.Module, names: Iterable[str]) -> tuple[type[nn.Module], ...]:
    """The classes of `model`'s submodules by name ("Block") or dotted path
    ("ringtrain.models.transformer.Block"); a short name shared by several selects all; one
    matching nothing is a ValueError."""
    present = {type(module) for module in model.modules()}
    chosen: list[type[nn.Module]] = []
    for name in names:
        matches = [cls for cls in present if name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")]
        if not matches:
            available = ", ".join(sorted({cls.__name__ for cls in present}))
            raise ValueError(f"shard class '{name}' matches no module of {type(model).__name__}; "
                             f"name one of its classes: {available}")
        chosen.extend(cls for cls in sorted(matches, key=lambda c: c.__qualname__) if cls not in chosen)
    return tuple(chosen)


def shard_model(model: nn.Module, device: torch.device, *, shard_classes: tuple[type[nn.Module], ...] | None = None,
                reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                cpu_offload: bool = False) -> nn.Module:
    """Shard `model` in place with FSDP2 over all ranks of the default process group; return it.

    Each submodule of a `shard_classes` class (None: `default_shard_classes`) becomes one unit,
    gathered just for its own forward and backward; the root is the last unit, holding the rest
    (embeddings, final norm, head). Parameters become DTensors sharded on dim 0: build the
    optimizer and any cached parameter list after this call. A parameter shared across modules
    (a tied embedding / lm_head) must live in one unit, so a module sharing one with the outside
    is not a unit of its own: the enclosing unit (the root) holds it.

    reshard_after_forward: free each unit's gathered parameters after its forward and gather
        them again in backward; the root keeps FSDP's default (not resharded): backward needs
        it first.
    param_dtype: the gathered parameters' dtype (forward, backward and all-gather run in it);
        gradients reduce in float32, the shards and optimizer state keep their own dtype.
    cpu_offload: shards, gradients and the optimizer step live on the CPU, each unit copied to
        `device` when gathered (so no fused=True CUDA AdamW).
    """
    if next(model.parameters(), None) is None:
        raise ValueError(f"{type(model).__name__} has no parameters, so FSDP has nothing to shard; "
                         f"give the model trainable parameters or use strategy=single")
    if isinstance(model, (FSDPModule, DistributedDataParallel, nn.DataParallel)):
        raise ValueError(
            f"the model is already wrapped ({type(model).__name__}); pass the bare model to shard_model once"
        )
    units = _unit_modules(model, default_shard_classes(model) if shard_classes is None else shard_classes)
    if not distributed():
        raise ValueError(NO_PROCESS_GROUP_MESSAGE)

    options: dict[str, Any] = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if cpu_offload:
        # Pinned memory makes host<->GPU copies asynchronous; without a GPU it cannot be allocated.
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    root_options = dict(options)
    if param_dtype is not None:
        # float32 reduction: summing N ranks' bf16 gradients loses bits the optimizer needs.
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        # The model's output in float32, as autocast would give the loss: cross-entropy over
        # bf16 logits loses precision in the log-sum-exp.
        root_options["mp_policy"] = replace(options["mp_policy"], output_dtype=torch.float32)
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
        raise ValueError(f"no submodule of {type(model).__name__} is a shard class ({names}); "
                         f"name one of: {', '.join(sorted({type(m).__name__ for m in model.modules()}))}")
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

