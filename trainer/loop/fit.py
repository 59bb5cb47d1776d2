"""The training loop of one rank, top to bottom.

    fit(run, dist, run_dir, stop, model, data, task, resume_from)
      set up (parts.py): the strategy wraps/shards/compiles the model; loaders, optimizer,
        lr schedule, precision -> maybe restore a checkpoint (checkpointing.py)
      for each optimizer step (step.py): K micro-batches, gradients reduced on the last
        -> unscale, clip, step, schedule -> log -> evaluate -> checkpoint -> stop signal?
The components arrive built (ringtrain/run.py builds them from config, ringtrain/trainer.py
takes them from Python). The loop never asks which strategy it has: the strategy object does
what differs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from torch import nn

from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.checkpoints.json_text import nonfinite_names
from ringtrain.config.schema import RunConfig
from ringtrain.data.bundle import DataBundle
from ringtrain.distributed import DistInfo
from ringtrain.errors import ConfigError
from ringtrain.loop.checkpointing import Checkpointer, load_training_state, load_weights_before_set_up
from ringtrain.loop.evaluation import evaluate_model
from ringtrain.loop.failures import failures_reported_as_mistakes
from ringtrain.loop.loaders import Batch
from ringtrain.loop.logger import RunLogger
from ringtrain.loop.meter import TrainMeter
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.parts import TrainingParts, set_up_training
from ringtrain.loop.profiling import step_profiler
from ringtrain.loop.progress import FitResult, Layout, Progress
from ringtrain.loop.signals import StopAgreement, StopSignals
from ringtrain.loop.step import optimizer_step
from ringtrain.loop import watchdog
from ringtrain.loop.throughput import ThroughputReporter


FIRST_STEP_FIX = ("the model, the task and the data do not fit each other (check model.*, task.* and data.*), "
                  "or one of them has a bug")


@dataclass
class FitState:
    """What every step of one fit() reads: set up once, before the first step."""

    config: RunConfig
    dist: DistInfo
    parts: TrainingParts
    task: Any
    checkpointer: Checkpointer
    logger: RunLogger
    stop: StopSignals | None
    agreement: StopAgreement
    nonfinite: NonFiniteWatch
    meter: TrainMeter = field(default_factory=TrainMeter)
    metrics: dict[str, float] = field(default_factory=dict)  # the last validation metrics
    stopped: str | None = None  # why training ended early (FitResult.stopped)


def fit(run: RunConfig, dist: DistInfo, run_dir: Path, stop: StopSignals | None, model: nn.Module,
        data: DataBundle, task: Any, resume_from: Path | None = None) -> FitResult:
    cfg = run.trainer
    # Its checksums were verified by rank 0 when it chose the checkpoint (checkpoints/resume.py).
    resumed = load_checkpoint(resume_from, dist.device, verify=False) if resume_from else None
    model = model.to(dist.device)
    if resumed:
        load_weights_before_set_up(model, resumed, resume_from)
    parts = set_up_training(run, dist, model, data)
    progress, saved_layout = load_training_state(parts, resumed, dist) if resumed else (Progress(), parts.layout)
    parts.continue_from(progress, cfg)
    watchdog.feed(watchdog.SETTING_UP, progress.step)
    agreement = StopAgreement(timeout_minutes=run.strategy.timeout_minutes)
    nonfinite = NonFiniteWatch(cfg.on_nonfinite, dist, uses_scaler=parts.precision.scaler is not None)
    logger = RunLogger(Path(run_dir), dist.is_main, parts.total_steps, cfg.progress_bar)
    state = FitState(run, dist, parts, task, Checkpointer(run, dist, run_dir, data, task), logger, stop, agreement, nonfinite)

    # The checkpointer last: on an exception it waits for a background write before the rest closes.
    with logger, step_profiler(cfg.profile_steps, dist, Path(run_dir)) as profiler, agreement, state.checkpointer:
        logger.config(run.resolved)
        logger.advance(progress.step)
        _report_layout_change(state, progress, saved_layout)
        _report_batch_of_the_whole_share(state)
        _report_warmup_past_the_end(state)
        _stop_if_signalled_before_training(state, progress)
        if progress.step >= parts.total_steps and state.stopped is None:
            # A finished run started again (a requeue, the same command): report its metrics.
            state.metrics = evaluate(state)
            logger.info(
                f"nothing to train: the checkpoint is at step {progress.step} of {parts.total_steps} (raise "
                f"trainer.max_steps or trainer.max_epochs to continue); " + _format(state.metrics)
            )
        speed = ThroughputReporter.for_run(
            parts.module, dist.device, cfg.precision, cfg.tf32, cfg.peak_tflops, dist.world_size,
            start_step=progress.step, info=logger.info,
        )
        started = time.perf_counter()  # the loop's time: set-up and imports are not in it
        first_step = progress.step
        # Where a model, task and data that do not fit each other fail: one line, exit 2.
        with failures_reported_as_mistakes("the first training step", FIRST_STEP_FIX, dist,
                                           armed=lambda: progress.step == first_step):
            while progress.step < parts.total_steps and state.stopped is None:
                _train_rest_of_epoch(state, progress, speed, profiler)
        state.checkpointer.flush()  # the final save, or a stop signal's, is on disk before fit returns
        train_seconds = time.perf_counter() - started
        logger.hparams(run.resolved, state.metrics, progress.step)
        logger.summary({
            "final": state.metrics, "monitor": task.monitor, "mode": task.mode,
            "best": progress.best_metric, "steps": progress.step, "train_seconds": train_seconds,
            "stopped": state.stopped, "skipped_steps": progress.skipped_steps,
            "nonfinite": nonfinite_names(state.metrics),  # written as null in "final"
        })
    return FitResult(
        metrics=state.metrics, monitor=task.monitor, mode=task.mode, best_metric=progress.best_metric,
        steps=progress.step, train_seconds=train_seconds, stopped=state.stopped,
        skipped_steps=progress.skipped_steps,
    )


def _train_rest_of_epoch(state: FitState, progress: Progress, speed: ThroughputReporter, profiler) -> None:
    """Steps over the rest of the current epoch, from its data position, until the epoch, the
    run or a stop ends them. Every pass takes a step or finishes its epoch: the loop cannot spin."""
    cfg, loader = state.config.trainer, state.parts.train_loader
    start = progress.samples_into_epoch
    epoch = loader.epoch(progress.epoch, start=start)
    if epoch.num_batches == 0:
        if start == 0:  # the run refuses this (config/data_lengths.py); a data set that changed size since would spin here
            raise ConfigError(f"epoch {progress.epoch} has no batch of {cfg.batch_size}; lower trainer.batch_size")
        # A run continued with more ranks or a bigger batch: the few samples left make no full
        # batch (drop_last), or lie past the epoch's overfit_batches; an uninterrupted epoch
        # of this layout would not train them either.
        state.logger.info(f"the rest of epoch {progress.epoch} after sample {start} makes no batch of "
                          f"{cfg.batch_size} per rank; continuing with epoch {progress.epoch + 1}")
        progress.finish_epoch()
        return
    taken = 0
    for micro_batches in _groups(epoch.batches, cfg.accumulate_grad_batches, progress):
        taken += len(micro_batches)
        position, epoch_done = epoch.position(taken), taken >= epoch.num_batches
        if _train_one_step(state, progress, micro_batches, speed, position, epoch_done) or state.stopped:
            return
        if profiler:
            profiler.step()
    if taken < epoch.num_batches:
        raise ConfigError(
            f"epoch {progress.epoch} ended after {taken} of its {epoch.num_batches} batches: the training "
            f"Dataset yields fewer samples than its __len__ says; make __len__ and __getitem__ agree"
        )


def _report_layout_change(state: FitState, progress: Progress, saved: Layout) -> None:
    """One line when the run continues in another layout: what changed and where it goes on."""
    change = state.parts.layout.changes_from(saved)
    if change:
        state.logger.info(
            f"{change}; continuing at sample {progress.samples_into_epoch} of epoch {progress.epoch}, "
            f"step {progress.step} of {state.parts.total_steps}"
        )


def _report_batch_of_the_whole_share(state: FitState) -> None:
    """One line when trainer.batch_size is more than a rank's share of the training set: each
    batch is then the whole share (drop_last=true is refused before work), not batch_size."""
    batch, share, ranks = state.config.trainer.batch_size, len(state.parts.train_loader.order), state.dist.world_size
    if share < batch and ranks == 1:
        state.logger.info(f"trainer.batch_size={batch} is more than the training set's {share} samples: each "
                          f"batch is the whole set, {share} samples")
    elif share < batch:
        state.logger.info(f"trainer.batch_size={batch} is more than each process's share of the training set "
                          f"({share} samples, {ranks} processes): each batch is the whole share, {share} samples "
                          f"per process, {share * ranks} in all")


def _report_first_skip(state: FitState, step: int) -> None:
    """One line at the run's first skipped update (later ones are counted: train/skipped_steps,
    metrics.json, the done line); a run skipping most updates must not look like a good one."""
    counted = "later skips are counted in train/skipped_steps and on the final line"
    if state.nonfinite.first_skip:
        state.logger.warning(f"step {step}: update skipped, non-finite {state.nonfinite.first_skip} "
                             f"(trainer.on_nonfinite=skip); {counted}")
    else:  # 16-mixed: GradScaler's own skip, which it makes now and then by design
        state.logger.info(f"step {step}: update skipped by GradScaler (float16 gradients overflowed; it lowers "
                          f"its loss scale and goes on); {counted}")


def _report_warmup_past_the_end(state: FitState) -> None:
    """One line when the warmup outlasts the run: the lr never reaches optimizer.lr (not an
    error: a short trial run of a long config is common)."""
    schedule = state.config.scheduler
    warmup = schedule.get("warmup_steps", 0) if isinstance(schedule, dict) else 0
    total = state.parts.total_steps
    if warmup and warmup >= total:
        state.logger.warning(f"scheduler.warmup_steps={warmup} is not below the run's {total} steps: the learning "
                             f"rate is still warming up when training ends; lower scheduler.warmup_steps")


def _stop_if_signalled_before_training(state: FitState, progress: Progress) -> None:
    """A stop signal that came while the run set up (loaded its checkpoint, built its data)
    stops it before its first step, agreed by every rank: nothing new to save."""
    if state.stop is None:
        return
    state.stop.lag_steps = state.agreement.lag_steps
    if not state.agreement.agree_now(state.stop.poll(progress.step)):
        return
    state.stopped = state.stop.received or "a stop signal on another rank"
    state.logger.info(f"stopped by {state.stopped} before training step {progress.step + 1}; nothing new to save"
                      + (f": the checkpoint it resumed from (step {progress.step}) is where the run stands"
                         if progress.step else ""))


def _train_one_step(state: FitState, progress: Progress, micro_batches: list[Batch], speed: ThroughputReporter,
                    position: int, epoch_done: bool) -> bool:
    """One optimizer step, which brings the epoch to sample `position`, and what is due after
    it; True when it was the last step."""
    cfg, parts = state.config.trainer, state.parts
    step, total_steps = progress.step + 1, parts.total_steps
    watchdog.feed(watchdog.TRAINING, step)
    log_now = step % cfg.log_every_n_steps == 0 or step == total_steps
    lr_used = parts.scheduler.get_last_lr()[0] if log_now else None
    skipped_before = progress.skipped_steps
    grad_norm = optimizer_step(parts, state.task, micro_batches, state.meter, state.nonfinite, progress, step,
                               cfg.grad_clip_norm, measure_grad_norm=log_now or state.nonfinite.needs_grad_norm,
                               dist=state.dist)
    if progress.skipped_steps and not skipped_before:
        _report_first_skip(state, step)
    progress.finish_step(position, epoch_done)
    every = cfg.eval_every_n_steps  # by default at each epoch's end; always at the last step
    evaluate_now = step == total_steps or (step % every == 0 if every else epoch_done)
    checkpoint_now = not evaluate_now and cfg.checkpoint and cfg.checkpoint_every_n_steps > 0 \
        and step % cfg.checkpoint_every_n_steps == 0

    # on_nonfinite=stop: the losses since the last check, and this step's update, are read
    # (one sync) only where it matters: before values are logged or weights evaluated or saved.
    if (log_now or evaluate_now or checkpoint_now) and _found_nonfinite(state, progress, grad_norm):
        return True
    if log_now:
        values = {**state.meter.read(state.dist), "lr": lr_used, "grad_norm": float(grad_norm)}
        if progress.skipped_steps:
            values["train/skipped_steps"] = progress.skipped_steps
        state.logger.scalars({**values, **speed.read(step, values)}, step)
    state.logger.advance(1)
    if evaluate_now:
        state.metrics = _evaluate_and_checkpoint(state, progress)
    elif checkpoint_now:
        state.checkpointer.save(parts, progress, best=False)
    if step == total_steps:
        return True
    _stop_if_signalled(state, progress, saved=evaluate_now or checkpoint_now)
    return False


def _stop_if_signalled(state: FitState, progress: Progress, saved: bool) -> None:
    """A stop signal on any rank (agreed on by all): save last.pt unless just saved, and end."""
    if state.stop is None or not state.agreement.should_stop(state.stop.poll(progress.step)):
        return
    checkpoint = state.config.trainer.checkpoint
    if checkpoint and not saved:
        if _found_nonfinite(state, progress, grad_norm=None):  # this step's update is not checked yet
            return
        state.checkpointer.save(state.parts, progress, best=False)
    state.stopped = state.stop.received or "a stop signal on another rank"
    state.logger.info(
        f"stopped by {state.stopped} after step {progress.step}"
        + ("; last.pt saved" if checkpoint else
           " (trainer.checkpoint=false: nothing saved)")
    )


def _found_nonfinite(state: FitState, progress: Progress, grad_norm) -> bool:
    """on_nonfinite=stop: whether a non-finite value showed up by this step (then the run
    stops here, naming the first one, before anything logs, evaluates or saves it)."""
    parts = state.parts
    if not state.nonfinite.check(progress.step, grad_norm, lambda: parts.strategy.weight_norm(parts.params)):
        return False
    state.stopped = "non-finite"
    state.logger.error(state.nonfinite.stop_message(progress.step, state.checkpointer.last))
    state.metrics = {state.task.monitor: float("nan")}
    return True


def evaluate(state: FitState) -> dict[str, float]:
    """Validation metrics over the whole validation set, identical for any number of ranks."""
    parts = state.parts
    metrics = evaluate_model(parts.model, parts.val_loader, state.task, parts.precision, state.dist, parts.strategy)
    parts.model.train()
    return {f"val/{k}": v for k, v in metrics.items()}


def _evaluate_and_checkpoint(state: FitState, progress: Progress) -> dict[str, float]:
    metrics = evaluate(state)
    state.logger.scalars(metrics, progress.step)
    epochs = progress.epoch + progress.samples_into_epoch / len(state.parts.train_loader.dataset)
    state.logger.info(f"step {progress.step} epoch {epochs:.2f}: " + _format(metrics))
    improved = progress.improves(metrics.get(state.task.monitor), state.task.mode)
    if state.config.trainer.checkpoint:
        state.checkpointer.save(state.parts, progress, best=improved)
    return metrics


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.5g}" for k, v in metrics.items())


def _groups(batches: Iterator[Batch], size: int, progress: Progress) -> Iterator[list[Batch]]:
    """Micro-batches in groups of `size` (the last group of an epoch may be shorter); the
    watchdog knows while each group is loaded."""
    while True:
        watchdog.feed(watchdog.LOADING_TRAINING_BATCHES, progress.step)
        group = list(islice(batches, size))
        if not group:
            return
        yield group
