"""One training job: launch workers if needed, build the components on each rank, train, report.

    run(cfg, run_dir)                    the Hydra path: validate, then launch
    launch(run, run_dir, built)          the strategy runs train_worker here, or on N ranks
      train_worker(run, run_dir, built)  on every rank: process group, seed, data, model, task,
                                         loop.fit
    <- the final validation metric (what a sweeper optimises)

`built` is None on the config path (each rank builds the components from their nodes) and
holds the user's own objects on the Python path (trainer/trainer.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ringtrain.data.bundle import DataBundle
from ringtrain.config.builders import build_data, build_model, check_task
from ringtrain.checkpoints.files import RunDirError
from ringtrain.config.components import build
from ringtrain.config.data_lengths import check_data_lengths
from ringtrain.config.schema import RunConfig, gpu_preset_notice, validate
from ringtrain.distributed import (
    DistInfo,
    DistributedSetupError,
    broadcast_object,
    is_timeout,
    name_unresponsive_ranks,
    peer_lost,
    teardown_distributed,
)
from ringtrain.errors import (
    NONFINITE_EXIT,
    STOPPED_BY_SIGNAL_EXIT,
    USER_ERROR_EXIT,
    TrainingStopped,
    UserError,
    first_to_report,
)
from ringtrain.checkpoints.initial_weights import load_initial_weights
from ringtrain.checkpoints.state_dicts import full_model_state_dict
from ringtrain.loop.failures import component_name, failures_reported_as_mistakes
from ringtrain.loop.fit import fit
from ringtrain.loop.progress import FitResult
from ringtrain.checkpoints.resume import checkpoint_to_resume
from ringtrain.config.continuation import config_to_continue
from ringtrain.checkpoints.restart_notes import forget_restart_note, leave_restart_note
from ringtrain.checkpoints.rundir import RunDirectoryLock, RunRecord
from ringtrain.loop.signals import StopSignals
from ringtrain.loop.watchdog import watching

log = logging.getLogger("ringtrain")


@dataclass
class BuiltComponents:
    """What the Python API was handed: the model, the splits and the task, already built."""

    model: nn.Module
    data: DataBundle
    task: Any


def run(cfg: DictConfig, run_dir: str | Path, overrides: list[str] = (), in_sweep: bool = False,
        record: RunRecord | None = None) -> float:
    """Train as configured, writing outputs under `run_dir`; return the final monitored metric.

    `overrides` are the command line's; with trainer.resume=<path> they are applied to the
    checkpoint's stored config (trainer/resume.py). `record`: the job's .hydra/ files, which
    rank 0 writes once the job owns `run_dir`. A run stopped early raises TrainingStopped (its
    exit status), except in a sweep, where it scores the worst value and the sweep goes on.
    """
    if OmegaConf.select(cfg, "trainer.resume") not in (None, "auto"):
        cfg = config_to_continue(cfg, list(overrides))
    run = validate(cfg)
    result = launch(run, str(run_dir), record=record)
    if result.stopped and not in_sweep:
        raise stopped_error(result, run.trainer.checkpoint)
    return sweep_value(result)


def stopped_error(result: FitResult, checkpoint: bool) -> TrainingStopped:
    if result.stopped == "non-finite":
        return TrainingStopped("training stopped on a non-finite value (see the log)", NONFINITE_EXIT)
    # Only what is true: a stop before the first step of a new run saved nothing, and one
    # before the first step after a resume left the checkpoint it resumed from as it was.
    if result.steps == 0:
        where = "before the first step; nothing to save"
    elif not checkpoint:
        where = f"after step {result.steps} (trainer.checkpoint=false: nothing saved)"
    else:
        where = f"at step {result.steps}; its checkpoint holds that step"
    return TrainingStopped(f"stopped by {result.stopped} {where}", STOPPED_BY_SIGNAL_EXIT)


def launch(run: RunConfig, run_dir: str, built: BuiltComponents | None = None,
           record: RunRecord | None = None) -> FitResult:
    """Train on this process, or on the ranks the strategy starts (ddp/fsdp without torchrun);
    the trainer's stop signals reach those ranks through this process too (Ctrl-C, `kill`)."""
    entry = train_worker if built is None else _worker_returning_weights
    return run.strategy.launch(entry, run, run_dir, built, record, stop_signals=tuple(run.trainer.stop_signals),
                               accelerator=run.trainer.accelerator)


def sweep_value(result: FitResult) -> float:
    """The monitored metric; a diverged (non-finite) run is the worst possible value, never NaN."""
    value = result.metrics.get(result.monitor, float("nan"))
    if not math.isfinite(value):
        return math.inf if result.mode == "min" else -math.inf
    return value


def _worker_returning_weights(run: RunConfig, run_dir: str, built: BuiltComponents,
                              record: RunRecord | None = None) -> FitResult:
    # The Python caller's model may live in another process: rank 0 sends the trained weights back.
    return train_worker(run, run_dir, built, record, return_weights=True)


def train_worker(run: RunConfig, run_dir: str, built: BuiltComponents | None = None,
                 record: RunRecord | None = None, return_weights: bool = False) -> FitResult:
    """Everything one rank does, with stop signals watched from the start. The process group
    is torn down on every exit path. `return_weights`: rank 0's result carries the model's
    full weights (`model_state`), gathered from every rank while the process group lives
    (under fsdp each rank holds only its shards)."""
    with StopSignals(run.trainer.stop_signals) as stop:
        return _train_rank(run, run_dir, built, record, stop, return_weights)


def _train_rank(run: RunConfig, run_dir: str, built: BuiltComponents | None, record: RunRecord | None,
                stop: StopSignals, return_weights: bool) -> FitResult:
    dist = run.strategy.setup_process(run.trainer.accelerator)
    clean_exit = completed = False
    directory_lock = RunDirectoryLock(run_dir)  # taken by rank 0, whose run_dir everyone shares
    try:
        shared_dir = _claim_run_directory(dist, run_dir, directory_lock)
        resume_from = checkpoint_to_resume(shared_dir, run.trainer.resume, run.resolved, dist)
        if dist.is_main:  # the job owns the directory now: a refused job has written nothing
            log.info(f"run directory: {shared_dir}")
            if notice := gpu_preset_notice(run.trainer):
                log.warning(notice)
            leave_restart_note(shared_dir)
            if record is not None:
                record.write(shared_dir)

        with failures_reported_as_mistakes(f"building the data{component_name(run.data)}", "check the data.* settings", dist):
            data = built.data if built else build_data(run.data, dist)
        with failures_reported_as_mistakes(f"building the task{component_name(run.task)}", "check the task.* settings", dist):
            task = built.task if built else check_task(build(run.task, "task"))
        # Every rank trains and validates on its own share: said ahead where the pre-check could
        # set the data up, here for the rest (prepare_data first, the Python API's data sets).
        check_data_lengths(len(data.train), len(data.val), run.trainer, dist.world_size)
        # Same seed on every rank: identical initial weights. Then a per-rank seed, so dropout
        # masks differ between ranks (the data order is the sampler's business, not this RNG's).
        torch.manual_seed(run.trainer.seed)
        with failures_reported_as_mistakes(f"building the model{component_name(run.model)}", "check the model.* settings", dist):
            model = built.model if built else build_model(run.model, data.dims)
        _load_starting_weights(model, run.trainer.init_from, resume_from, dist)
        torch.manual_seed(run.trainer.seed + dist.rank)

        with watching(run.strategy.timeout_minutes, dist.rank, dist.world_size):  # a rank stuck anywhere ends
            result = fit(run, dist, shared_dir, stop, model, data, task, resume_from)
        if return_weights:
            weights = full_model_state_dict(model)  # every rank takes part; rank 0 gets them
            result = dataclasses.replace(result, model_state=weights if dist.is_main else None)
        if dist.is_main:
            _report(result, model, shared_dir)
        completed = not result.stopped
        clean_exit = True
        return result
    except Exception as err:
        if dist.is_distributed and is_timeout(err):
            raise DistributedSetupError(name_unresponsive_ranks(dist, run.strategy.timeout_minutes)) from None
        if dist.is_distributed and (lost := peer_lost(err, dist.rank)):
            raise lost from None
        if dist.is_distributed and isinstance(err, UserError):
            # Claimed before leaving the process group: a peer that then finds this rank gone
            # learns the job's mistake was said, and says nothing more.
            first_to_report(USER_ERROR_EXIT)
        raise
    finally:
        if dist.is_main:
            forget_restart_note(completed)
        directory_lock.release()
        teardown_distributed(clean_exit)


def _claim_run_directory(dist: DistInfo, run_dir: str, lock: RunDirectoryLock) -> Path:
    """Rank 0's run directory for every rank (under torchrun each rank's Hydra picked its
    own), claimed by rank 0 for the whole job before anything is written there; a second job
    there ends on every rank."""
    shared_dir = Path(broadcast_object(dist, os.path.abspath(run_dir)))
    refusal = broadcast_object(dist, lock.acquire() if dist.is_main else None)
    if refusal:
        raise RunDirError(refusal)
    _configure_rank_logging(dist, shared_dir)
    return shared_dir


def _load_starting_weights(model: nn.Module, init_from: str | None, resume_from: Path | None,
                           dist: DistInfo) -> None:
    """trainer.init_from's weights into the bare model, on every rank, before the strategy
    wraps it; a run that resumes takes its weights from the checkpoint instead."""
    if init_from is None:
        return
    if resume_from is not None:
        if dist.is_main:
            log.info(f"trainer.init_from={init_from} ignored: this run resumes from {resume_from}")
        return
    count = load_initial_weights(model, init_from)
    if dist.is_main:
        log.info(f"starting from the weights in {init_from} ({count} tensors)")


def _configure_rank_logging(dist: DistInfo, run_dir: Path) -> None:
    """Rank 0 logs to the console and to train.log; other ranks only report warnings and errors.

    Under Hydra (a plain run, torchrun) its handlers are in place. A worker spawned for a
    self-launched DDP job, and a run from the Python API, start with none, so they set up
    what Hydra would have.
    """
    root = logging.getLogger()
    if not root.handlers:
        formatter = logging.Formatter(f"[%(asctime)s][%(name)s][rank {dist.rank}][%(levelname)s] - %(message)s")
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
        if dist.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(run_dir / "train.log"))  # appends to the launcher's
        for handler in handlers:
            handler.setFormatter(formatter)
            root.addHandler(handler)
    root.setLevel(logging.INFO if dist.is_main else logging.WARNING)


def _report(result: FitResult, model: nn.Module, run_dir: Path) -> None:
    metrics = " ".join(f"{k}={v:.5g}" for k, v in result.metrics.items())
    ended = "stopped early" if result.stopped else "done"
    skipped = f", {result.skipped_steps} updates skipped (non-finite)" if result.skipped_steps else ""
    log.info(f"{ended}: {result.steps} steps in {result.train_seconds:.2f}s{skipped}" + (f", {metrics}" if metrics else ""))
    summary = getattr(model, "summary", None)
    if callable(summary):  # a model may say what it learned (the tutorial's w and b)
        log.info(summary())
    log.info(f"outputs in {run_dir}")
