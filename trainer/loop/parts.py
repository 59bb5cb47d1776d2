"""What one rank trains with, set up once: the model as the strategy runs it, the loaders,
the optimizer, the lr schedule and the precision (one small object, `TrainingParts`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ringtrain.config.schema import RunConfig
from ringtrain.data.bundle import DataBundle
from ringtrain.distributed import DistInfo
from ringtrain.errors import ConfigError
from ringtrain.loop.loaders import BatchLoader, build_train_loader, build_val_loader, worker_options
from ringtrain.config.optim import build_optimizer, build_scheduler
from ringtrain.loop.precision import Precision, set_matmul_precision
from ringtrain.strategies.base import Strategy


@dataclass
class TrainingParts:
    strategy: Strategy
    model: nn.Module  # the bare model (sharded in place under fsdp)
    module: nn.Module  # what the loop calls: wrapped, sharded and/or compiled by the strategy
    params: list[nn.Parameter]  # taken after sharding (FSDP2 makes them DTensors)
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    train_loader: BatchLoader
    val_loader: BatchLoader
    total_steps: int

    def state_dict(self) -> dict[str, Any]:
        """The schedule's and the precision's part of a checkpoint (the weights come from the
        strategy, strategies/base.py checkpoint_weights)."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler") or {})


def set_up_training(run: RunConfig, dist: DistInfo, model: nn.Module, data: DataBundle) -> TrainingParts:
    """Place the model and let the strategy wrap, shard or compile it; then the loaders, the
    optimizer (built from the set-up model's parameters), the lr schedule and the precision."""
    cfg, strategy = run.trainer, run.strategy
    model = model.to(dist.device)
    module = strategy.setup_module(model, dist, cfg)
    train_loader, val_loader = _loaders(cfg, dist, data)
    steps_per_epoch = math.ceil(len(train_loader) / cfg.accumulate_grad_batches)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.max_epochs
    optimizer = _optimizer(run, model, dist, strategy)
    if callable(run.scheduler):  # the Python API: scheduler(optimizer)
        scheduler = run.scheduler(optimizer)
    else:
        scheduler = build_scheduler(run.scheduler, optimizer, total_steps)
    set_matmul_precision(dist.device, cfg.tf32)
    return TrainingParts(
        strategy=strategy, model=model, module=module, params=list(model.parameters()),
        optimizer=optimizer, scheduler=scheduler,
        precision=Precision(strategy.autocast_precision(cfg.precision), dist.device),
        train_loader=train_loader, val_loader=val_loader, total_steps=total_steps,
    )


def _loaders(cfg: Any, dist: DistInfo, data: DataBundle) -> tuple[BatchLoader, BatchLoader]:
    overfit = cfg.overfit_batches  # > 0: train and validate on the same first batches
    workers = worker_options(cfg, dist.device)
    train_loader = build_train_loader(
        data.train, cfg.batch_size, dist.rank, dist.world_size, cfg.seed, cfg.drop_last, dist.device,
        shuffle=not overfit, limit_batches=overfit, workers=workers,
    )
    val_loader = build_val_loader(
        data.train if overfit else data.val, cfg.val_batch_size or cfg.batch_size, dist.rank, dist.world_size,
        dist.device,
        # overfit: the samples the ranks train on, the first overfit * batch * world_size
        limit_samples=overfit * cfg.batch_size * dist.world_size, limit_batches=cfg.limit_val_batches,
        workers=workers,
    )
    if len(train_loader) == 0:
        raise ConfigError(
            f"the training set has {len(data.train)} samples, too few for one batch of "
            f"{cfg.batch_size} on each of {dist.world_size} processes; lower trainer.batch_size "
            f"or the number of processes"
        )
    return train_loader, val_loader


def _optimizer(run: RunConfig, model: nn.Module, dist: DistInfo, strategy: Strategy) -> torch.optim.Optimizer:
    if callable(run.optimizer):  # the Python API: optimizer(params)
        return run.optimizer([p for p in model.parameters() if p.requires_grad])
    return build_optimizer(run.optimizer, model, dist.device, strategy.lr_scale(dist.world_size))
