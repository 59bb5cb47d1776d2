"""Wrapping the model for the chosen strategy, and gradient synchronisation control."""
from __future__ import annotations

import contextlib
import inspect
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import StrategyConfig
from trainer.distributed import DistInfo

log = logging.getLogger(__name__)


def wrap_model(model: nn.Module, strategy: StrategyConfig, dist: DistInfo) -> nn.Module:
    """DDP / DataParallel / the model itself. The bare model stays reachable as `.module`."""
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


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Under DDP, skip the gradient all-reduce on micro-steps that are not the last (no_sync)."""
    if not enabled and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()
