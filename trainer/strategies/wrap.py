"""Wrapping the model for the chosen strategy: DDP, DataParallel, FSDP2 sharding, or nothing.

Gradient synchronisation during accumulation, clipping and checkpoint state for every
strategy live in trainer/fsdp.py, whose helpers handle plain, DDP and FSDP models alike.
"""
from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringtrain.config.schema import StrategyConfig
from ringtrain.strategies.distributed import DistInfo

log = logging.getLogger(__name__)


def wrap_model(
    model: nn.Module, strategy: StrategyConfig, dist: DistInfo, param_dtype: torch.dtype | None = None
) -> nn.Module:
    """DDP / DataParallel (the bare model stays reachable as `.module`), FSDP2 (the model
    itself, sharded in place: `param_dtype` is then its mixed-precision dtype), or the model."""
    if strategy.name == "fsdp":
        from ringtrain.errors import ConfigError
        from ringtrain.strategies.fsdp import resolve_shard_classes, shard_model

        try:
            classes = resolve_shard_classes(model, strategy.shard_classes) if strategy.shard_classes else None
            return shard_model(
                model, dist.device, shard_classes=classes, reshard_after_forward=strategy.reshard_after_forward,
                param_dtype=param_dtype, cpu_offload=strategy.cpu_offload,
            )
        except ValueError as err:
            raise ConfigError(f"strategy=fsdp: {err}") from None
    if strategy.name == "ddp" and dist.is_distributed:
        on_cuda = dist.device.type == "cuda"
        # Syncing buffers from rank 0 in every forward is DDP's default. torch 2.13 renamed the
        # flag (broadcast_buffers -> forward_sync_buffers) and warns on the old name; older
        # torch only knows the old one. Either way it is passed only to turn syncing off.
        buffers = {}
        if not strategy.forward_sync_buffers:
            new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            buffers = {"forward_sync_buffers" if new_name else "broadcast_buffers": False}
        return DistributedDataParallel(
            model,
            device_ids=[dist.device.index] if on_cuda else None,
            output_device=dist.device.index if on_cuda else None,
            bucket_cap_mb=strategy.bucket_cap_mb,
            find_unused_parameters=strategy.find_unused_parameters,
            gradient_as_bucket_view=strategy.gradient_as_bucket_view,
            static_graph=strategy.static_graph,
            **buffers,
        )
    if strategy.name == "dp":
        gpus = torch.cuda.device_count() if dist.device.type == "cuda" else 0
        if gpus < 2:
            log.warning(
                "strategy=dp needs 2 or more CUDA GPUs; %s visible, running on %s without DataParallel",
                gpus, dist.device,
            )
            return model
        return nn.DataParallel(model)
    return model


