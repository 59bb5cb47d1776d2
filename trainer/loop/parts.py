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
from ringtrain.loop.loaders import BatchLoader, build_train_loader, build_val_loader, worker_options
from ringtrain.config.optim import build_optimizer, build_scheduler
from ringtrain.loop.precision import Precision, set_matmul_precision
from ringtrain.loop.progress import Layout, Progress
from ringtrain.loop.schedules import WarmupCosine
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
    total_steps: int  # the step the run ends at (steps_in_run)
    layout: Layout  # how the data is dealt out: ranks, per-rank batch, accumulation

    def state_dict(self) -> dict[str, Any]:
        """The schedule's, the precision's and the layout's part of a checkpoint (the weights
        come from the strategy, strategies/base.py checkpoint_weights)."""
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.precision.state_dict(),
                "layout": self.layout.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler") or {})

    def continue_from(self, progress: Progress, trainer: Any) -> None:
        """The run goes on from `progress`: where it ends, and the schedule's horizon with it.
        A schedule planned over the whole run (WarmupCosine) reaches its end at the continued
        run's last step, also when the global batch or max_steps/max_epochs changed (its saved
        state holds the old total). torch's own schedules keep what they were saved with."""
        self.total_steps = steps_in_run(trainer, self.train_loader, progress)
        if isinstance(self.scheduler, WarmupCosine):
            self.scheduler.total_steps = self.total_steps


def steps_in_run(trainer: Any, loader: BatchLoader, progress: Progress) -> int:
    """The step the run ends at. Steps stay steps: trainer.max_steps > 0 ends the run at that
    step whatever the global batch. Otherwise trainer.max_epochs epochs: the steps taken, the
    steps that finish the current epoch from its data position, and the later epochs' steps,
    at the current layout (steps_per_epoch * max_epochs for a run that never changed layout)."""
    if trainer.max_steps > 0:
        return trainer.max_steps
    if progress.epoch >= trainer.max_epochs:
        return progress.step
    k = trainer.accumulate_grad_batches
    rest_of_epoch = math.ceil(loader.batches_left(progress.samples_into_epoch) / k)
    return progress.step + rest_of_epoch + (trainer.max_epochs - progress.epoch - 1) * math.ceil(len(loader) / k)


def set_up_training(run: RunConfig, dist: DistInfo, model: nn.Module, data: DataBundle) -> TrainingParts:
    """Place the model and let the strategy wrap, shard or compile it; then the loaders, the
    optimizer (built from the set-up model's parameters), the lr schedule and the precision."""
    cfg, strategy = run.trainer, run.strategy
    model = model.to(dist.device)
    module = strategy.setup_module(model, dist, cfg)
    train_loader, val_loader = _loaders(cfg, dist, data)
    total_steps = steps_in_run(cfg, train_loader, Progress())
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
        layout=Layout(dist.world_size, cfg.batch_size, cfg.accumulate_grad_batches),
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
    return train_loader, val_loader


def _optimizer(run: RunConfig, model: nn.Module, dist: DistInfo, strategy: Strategy) -> torch.optim.Optimizer:
    if callable(run.optimizer):  # the Python API: optimizer(params)
        return run.optimizer([p for p in model.parameters() if p.requires_grad])
    return build_optimizer(run.optimizer, model, dist.device, strategy.lr_scale(dist.world_size))
