"""One training job from a composed config: validate, launch workers if needed, train, report.

    run(cfg)                       validate; ddp without torchrun and N > 1? spawn N workers
      train_worker(run, run_dir)   on every rank: process group, seed, data, model, Trainer.fit
    <- the final validation metric (what a sweeper optimises)
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from data import build_data
from models import build_model
from models.linear import LinearRegression
from trainer.checkpoint import RunDirError
from trainer.config import ConfigError, RunConfig, validate
from trainer.distributed import (
    DistInfo,
    broadcast_object,
    setup_distributed,
    spawn_workers,
    teardown_distributed,
    under_torchrun,
)
from trainer.errors import exit_on_user_error
from trainer.trainer import FitResult, Trainer

log = logging.getLogger("ringtrain")


def run(cfg: DictConfig, run_dir: str | Path) -> float:
    """Train as configured, writing outputs under `run_dir`; return the final monitored metric."""
    run_cfg = validate(cfg)
    strategy = run_cfg.strategy
    if strategy.name == "ddp" and not under_torchrun() and strategy.nproc_per_node > 1:
        result = spawn_workers(strategy.nproc_per_node, _spawned_worker, (run_cfg, str(run_dir)))
    else:
        result = train_worker(run_cfg, str(run_dir))
    return sweep_value(result)


def sweep_value(result: FitResult) -> float:
    """The monitored metric; a diverged (non-finite) run is the worst possible value, never NaN."""
    value = result.metrics.get(result.monitor, float("nan"))
    if not math.isfinite(value):
        return math.inf if result.mode == "min" else -math.inf
    return value


def _spawned_worker(run: RunConfig, run_dir: str) -> FitResult:
    with exit_on_user_error():  # one clear line from the failing rank, as under torchrun
        return train_worker(run, run_dir)


def train_worker(run: RunConfig, run_dir: str) -> FitResult:
    """Everything one rank does. The process group is torn down on every exit path."""
    dist = setup_distributed(
        run.strategy.name, run.strategy.backend, run.trainer.accelerator, run.strategy.timeout_minutes
    )
    clean_exit = False
    try:
        # Rank 0's directory for everyone: under torchrun each rank's Hydra picked its own.
        shared_dir = Path(broadcast_object(dist, os.path.abspath(run_dir)))
        _configure_rank_logging(dist, shared_dir)
        _refuse_to_overwrite(shared_dir, run)

        data = build_data(run.data_name, run.data)
        for split, dataset in (("training", data.train), ("validation", data.val)):
            if len(dataset) < dist.world_size:  # every rank trains and validates on its own share
                raise ConfigError(
                    f"the {split} set has {len(dataset)} samples but {dist.world_size} processes "
                    f"need at least one each; use fewer processes or more data"
                )
        # Same seed on every rank: identical initial weights. Then a per-rank seed, so dropout
        # masks differ between ranks (the data order is the sampler's business, not this RNG's).
        torch.manual_seed(run.trainer.seed)
        model = build_model(run.model_name, _with_data_sizes(run.model, data.model_dims))
        torch.manual_seed(run.trainer.seed + dist.rank)

        result = Trainer(run, dist, shared_dir).fit(model, data)
        if dist.is_main:
            _report(result, model)
        clean_exit = True
        return result
    finally:
        teardown_distributed(clean_exit)


def _with_data_sizes(model_config, model_dims: dict[str, int]):
    """The model config with the sizes the data set dictates (input features, vocabulary...)."""
    fields = {f.name for f in dataclasses.fields(model_config)}
    return dataclasses.replace(model_config, **{k: v for k, v in model_dims.items() if k in fields})


def _refuse_to_overwrite(run_dir: Path, run: RunConfig) -> None:
    last = run_dir / "checkpoints" / "last.pt"
    if not run.trainer.checkpoint or not last.exists():
        return
    resuming_here = run.trainer.resume and Path(run.trainer.resume).resolve().parent == last.parent.resolve()
    if not resuming_here:
        raise RunDirError(
            f"{run_dir} already holds checkpoints of another run; continue it with "
            f"trainer.resume={last}, or choose a new hydra.run.dir"
        )


def _configure_rank_logging(dist: DistInfo, run_dir: Path) -> None:
    """Rank 0 logs to the console and to train.log; other ranks only report warnings and errors.

    Under Hydra (a plain run, torchrun) its handlers are in place. A worker spawned for a
    self-launched DDP job starts with none, so it sets up what Hydra would have.
    """
    root = logging.getLogger()
    if not root.handlers:
        formatter = logging.Formatter(f"[%(asctime)s][%(name)s][rank {dist.rank}][%(levelname)s] - %(message)s")
        handlers = [logging.StreamHandler(sys.stdout)]
        if dist.is_main:
            handlers.append(logging.FileHandler(run_dir / "train.log"))  # appends to the launcher's
        for handler in handlers:
            handler.setFormatter(formatter)
            root.addHandler(handler)
    root.setLevel(logging.INFO if dist.is_main else logging.WARNING)


def _report(result: FitResult, model: torch.nn.Module) -> None:
    metrics = " ".join(f"{k}={v:.5g}" for k, v in result.metrics.items())
    log.info(f"done: {result.steps} steps in {result.train_seconds:.2f}s, {metrics}")
    if isinstance(model, LinearRegression) and model.linear.weight.numel() == 1:
        # The tutorial's question: did we learn y = 2x + 3?
        log.info(f"learned w={model.linear.weight.item():.4f} b={model.linear.bias.item():.4f}")
