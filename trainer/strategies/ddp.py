"""strategy=ddp: DistributedDataParallel, one process per device, a full copy of the model on each."""
from __future__ import annotations

import contextlib
import inspect
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringtrain.distributed import DistInfo
from ringtrain.errors import ConfigError
from ringtrain.strategies import NOTHING
from ringtrain.strategies.process_group import ProcessGroupStrategy


class DDP(ProcessGroupStrategy):
    """DistributedDataParallel (conf/strategy/ddp.yaml); its options are DDP's own."""

    option = "ddp"

    def __init__(self, *, backend: str, nproc_per_node: int, timeout_minutes: float, max_restarts: int,
                 scale_lr_by_world_size: bool, bucket_cap_mb: float, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool, static_graph: bool, forward_sync_buffers: bool) -> None:
        super().__init__(backend=backend, nproc_per_node=nproc_per_node, timeout_minutes=timeout_minutes,
                         max_restarts=max_restarts, scale_lr_by_world_size=scale_lr_by_world_size)
        if bucket_cap_mb <= 0:
            raise ConfigError(f"strategy.bucket_cap_mb={bucket_cap_mb} must be positive")
        self.options = {"bucket_cap_mb": bucket_cap_mb, "find_unused_parameters": find_unused_parameters,
                        "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": static_graph}  # DDP's own
        if not forward_sync_buffers:
            # Not only a rename: torch 2.13's name still copies rank 0's buffers once, at the wrap, the
            # older one (deprecated on 2.13) none (README, DDP options; tests/test_distributed.py).
            new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            self.options["forward_sync_buffers" if new_name else "broadcast_buffers"] = False

    def check(self, trainer: Any) -> None:
        super().check(trainer)
        if trainer.compile and (bucket_cap_mb := self.options["bucket_cap_mb"]) < 1:
            raise ConfigError(
                f"strategy.bucket_cap_mb={bucket_cap_mb} is below DDP's first bucket (1 MiB), which "
                f"torch.compile's DDP graph splitting refuses; use strategy.bucket_cap_mb >= 1 with trainer.compile=true"
            )

    def setup_module(self, model: nn.Module, dist: DistInfo, trainer: Any) -> nn.Module:
        # Compiled inside DDP, as torch.compile + DDP expects (strategies/compilation.py).
        module = super().setup_module(model, dist, trainer)
        return self.wrap(module, dist) if dist.is_distributed else module

    def wrap(self, module: nn.Module, dist: DistInfo) -> DistributedDataParallel:
        """`module` in DDP with this strategy's options (the bare model stays `.module`)."""
        return DistributedDataParallel(
            module,
            device_ids=[dist.device.index] if dist.device.type == "cuda" else None,  # also its output's
            **self.options,
        )

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # DDP decides in forward whether backward all-reduces: both go inside no_sync.
        if not enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return NOTHING
