"""The training loop of one rank, in sight in `fit` in nanoGPT's order: forward, backward, clip
and step (which the non-finite watch may skip); then what follows the step, as one decision says
(`StepEnds.decide`). Optional behaviour is a callback; the components arrive built (run.py,
trainer.py), and the loop never asks which strategy it has: the strategy object does what differs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.callbacks import Callbacks, Run, StepEnd
from ringtrain.checkpoints import CheckpointManager
from ringtrain.data.batches import counted, samples_in, split_batch, summed_training_loss, training_loss
from ringtrain.distributed import DistInfo, all_reduce_sum
from ringtrain.loop import FitResult
from ringtrain.loop.evaluation import Evaluator
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.setup import TrainingParts, failures_reported_as_mistakes
from ringtrain.loop.stopping import SAVING, TRAINING, Agreement, StopSignals, Watchdog

log = logging.getLogger("ringtrain")
NONFINITE = "non-finite"
FIRST_STEP_FIX = ("the model, the task and the data do not fit each other (check model.*, task.* and data.*), "
                  "or one of them has a bug")


def fit(job: Any, dist: DistInfo, run_dir: Path, parts: TrainingParts, task: Any,
        callbacks: Callbacks, checkpoints: CheckpointManager, stop: StopSignals, watchdog: Watchdog) -> FitResult:
    """Train `parts` (set up by loop/setup.py, and restored there if the run resumes)."""
    cfg, progress = job.trainer, parts.progress
    run = Run(model=parts.model, module=parts.module, optimizer=parts.optimizer, scheduler=parts.scheduler,
              dist=dist, run_dir=run_dir, config=job.resolved, task=task, trainer=cfg,
              total_steps=parts.total_steps, train_loader=parts.train_loader, group=job.group)
    evaluator = Evaluator(cfg, parts, task, dist, watchdog)
    _follow(run, progress, evaluator)  # a resumed run starts where its checkpoint stands, epoch too
    nonfinite = NonFiniteWatch(cfg.on_nonfinite, dist, uses_scaler=parts.precision.scaler is not None,
                               weight_norm=lambda: parts.strategy.weight_norm(parts.params))
    if checkpoints.resumed is not None:  # every registered part restored (loop/setup.py)
        callbacks.call("on_load_checkpoint", run, checkpoints.resumed.state)
    with Agreement(job.strategy.timeout_minutes) as agreement, checkpoints:
        ends = StepEnds(run, callbacks, evaluator, checkpoints, nonfinite, agreement, stop, watchdog)
        try:
            _report_start(parts, dist, job)
            stop.lag_steps = agreement.lag_steps
            callbacks.call("on_fit_start", run)
            decision = ends.before_training()
            started, first_step = time.perf_counter(), progress.step
            steps = parts.batches(watchdog, cfg.accumulate_grad_batches) if decision.stop is None else ()
            # Where a model, task and data that do not fit each other fail: one line, exit 2.
            with failures_reported_as_mistakes("the first training step", FIRST_STEP_FIX, dist,
                                               armed=lambda: progress.step == first_step):
                for micro_batches, position, epoch_done in steps:
                    step = progress.step + 1
                    watchdog.feed(TRAINING, step)
                    callbacks.call("on_step_start", run, step)
                    # Forward and backward: each micro-batch's share of the step's loss, the
                    # gradients reduced across the ranks on the last one only.
                    losses = StepLoss(task, micro_batches, dist)
                    last = len(micro_batches) - 1
                    for i, batch in enumerate(micro_batches):
                        with parts.strategy.no_sync(parts.module, enabled=i == last), parts.precision.autocast():
                            share = losses.forward(i, parts.module, batch)
                        parts.precision.backward(share)
                    # Clip, step (unless the non-finite watch skips it), schedule.
                    logging_step = ends.logs(step)
                    parts.precision.unscale_(parts.optimizer)
                    if cfg.grad_clip_norm > 0:
                        grad_norm = parts.strategy.clip_gradients(parts.params, cfg.grad_clip_norm)
                    elif logging_step or nonfinite.needs_grad_norm:
                        grad_norm = parts.strategy.gradient_norm(parts.params)
                    else:
                        grad_norm = None  # a pass over every gradient that most steps skip
                    lr = parts.scheduler.get_last_lr()[0]
                    applied = nonfinite.allows_update(step, losses.detached, grad_norm) and parts.precision.step(parts.optimizer)
                    parts.scheduler.step()
                    for param in parts.params:  # zero_grad(set_to_none=True), without its per-step overhead
                        param.grad = None
                    if not applied and not progress.skipped_steps and dist.is_main:
                        _report_first_skip(nonfinite, step)
                    progress.finish_step(position, epoch_done, applied)
                    _follow(run, progress, evaluator)
                    # Decide what follows, then do it.
                    decision = ends.decide(StepEnd(step, run.epoch, losses.detached, losses.summed, losses.samples,
                                                   losses.tokens, lr, grad_norm, applied, logging_step),
                                           position, epoch_done)
                    if decision.save:
                        ends.save(progress.step, decision.best)
                    if decision.stop:
                        if decision.stop_kind != NONFINITE:  # whose line the decision logged
                            saved = "; last.pt saved" if cfg.checkpoint else " (trainer.checkpoint=false: nothing saved)"
                            log.info(f"stopped by {decision.stop} after step {progress.step}{saved}")
                        break
            checkpoints.flush()  # the final save, or a stop's, is on disk before fit returns
            ends.report()
            result = FitResult(
                metrics=run.metrics, monitor=task.monitor, mode=task.mode, best_metric=progress.best_metric,
                steps=progress.step, train_seconds=time.perf_counter() - started, stopped=decision.stop,
                stop_kind=decision.stop_kind, skipped_steps=progress.skipped_steps)
            callbacks.call("on_fit_end", run, result)
            return result
        except BaseException as err:
            callbacks.call("on_exception", run, err)
            raise


def _follow(run: Run, progress: Any, evaluator: Evaluator) -> None:
    """The callbacks' view of where training stands: step, skipped steps, fractional epoch."""
    run.step, run.skipped_steps = progress.step, progress.skipped_steps
    run.epoch = progress.epoch + progress.samples_into_epoch / max(evaluator.epoch_length, 1)


@dataclass(frozen=True)
class Decision:
    """What the loop does after a step: save (`best`: as best.pt too), then stop or go on."""

    save: bool = False
    best: bool = False
    stop: str | None = None  # why the run stops here, and which kind of stop that is, as FitResult says
    stop_kind: str | None = None


GO_ON = Decision()  # most steps: shared, not a new object each step
STOP_NONFINITE = Decision(stop=NONFINITE, stop_kind=NONFINITE)


@dataclass
class StepEnds:
    """What follows each step of one run, decided in one place (`decide`, from what each schedule
    says is due: docs/ARCHITECTURE.md lists them). Callbacks add their state to a save
    (on_save_checkpoint) and hear of it once it is on disk (a background save is, once written)."""

    run: Run
    callbacks: Callbacks
    evaluator: Evaluator
    checkpoints: CheckpointManager
    nonfinite: NonFiniteWatch
    agreement: Agreement
    stop: StopSignals
    watchdog: Watchdog

    def logs(self, step: int) -> bool:
        """Asked before the update too, which measures the gradient norm only where it is logged (or watched)."""
        return step % self.run.trainer.log_every_n_steps == 0 or step == self.run.total_steps

    def before_training(self) -> Decision:
        """Before the first step (after on_fit_start): a callback's stop (a run resumed from the
        checkpoint of early stopping's last step), a signal during set-up on any rank (agreed at
        once, so no rank trains), or a finished run started again, which validates only."""
        run, step = self.run, self.run.step
        if run.control.stop_reason:
            log.info(f"stopped by {run.control.stop_reason} before training step {step + 1}")
            return Decision(stop=run.control.stop_reason, stop_kind="requested")
        if self.agreement.agree_now(self.stop.poll(step)):
            stopped = self.stop.received or "a stop signal on another rank"
            log.info(f"stopped by {stopped} before training step {step + 1}; nothing new to save"
                     + (f": the checkpoint it resumed from (step {step}) is where the run stands" if step else ""))
            return Decision(stop=stopped, stop_kind="signal")
        if step >= run.total_steps:  # a requeue, the same command
            self.evaluator.validate(run, self.callbacks)
            log.info(f"nothing to train: the checkpoint is at step {step} of {run.total_steps} (raise "
                     f"trainer.max_steps or trainer.max_epochs to continue)")
        return Decision()

    def decide(self, end: StepEnd, position: int, epoch_done: bool) -> Decision:
        """After step `end.step` (which brought the epoch to `position`): on_step_end hears what the
        schedules made due; then the step's one cross-rank agreement (`Agreement.exchange`), its one
        non-finite check (`NonFiniteWatch.check`, before any value is logged, evaluated or saved),
        and validation when due (a callback may stop the run then: early stopping)."""
        run, step = self.run, end.step

        def stops_nonfinite(grad_norm: Any) -> bool:
            if not self.nonfinite.check(step, grad_norm):
                return False
            if run.dist.is_main:
                log.error(self.nonfinite.stop_message(step, self.checkpoints.last))
            run.metrics = {run.task.monitor: float("nan")}
            return True

        validate = self.evaluator.due(step, position, epoch_done)
        saving = self.checkpoints.due(step, validate, last=step == run.total_steps)
        if (end.logging or validate or saving) and stops_nonfinite(end.grad_norm):
            return STOP_NONFINITE
        end.due = {name for name, due in (("validate", validate), ("save", saving)) if due}
        self.callbacks.call("on_step_end", run, end)
        # What was asked: by callbacks now, and by any rank a step ago (a stop signal, a rank-0
        # callback, eval_every_minutes), which every rank now agrees on.
        local, run.control.local = run.control.local, {}
        agreed = self.agreement.exchange(
            stop_signal=self.stop.poll(step), stop_request=bool(local.get("stop_reason")),
            validate=bool(local.get("validate")) or self.evaluator.time_is_up(), save=bool(local.get("save")))
        if (run.control.validate or agreed["validate"]) and not validate:
            validate = True
            if stops_nonfinite(end.grad_norm):
                return STOP_NONFINITE
        best = self.evaluator.validate(run, self.callbacks) if validate else False
        stop = kind = None
        if run.control.stop_reason or agreed["stop_request"]:  # the run is done: a signal now changes nothing
            stop, kind = run.control.stop_reason or local.get("stop_reason") or "a callback on rank 0", "requested"
        elif agreed["stop_signal"]:
            stop, kind = self.stop.received or "a stop signal on another rank", "signal"
            self.callbacks.call("on_stop_signal", run, stop)
        save = bool(run.trainer.checkpoint and (saving or validate or stop or run.control.save or agreed["save"]))
        if save and not saving and not validate and stops_nonfinite(None):
            return STOP_NONFINITE
        run.control.validate = run.control.save = False
        return Decision(save=save, best=best, stop=stop, stop_kind=kind) if save or stop else GO_ON

    def save(self, step: int, best: bool) -> None:
        self.watchdog.feed(SAVING, step)
        self.checkpoints.save(step, best, lambda state: self.callbacks.call("on_save_checkpoint", self.run, state))
        self.report()

    def report(self) -> None:
        for step, path in self.checkpoints.written():
            self.callbacks.call("on_checkpoint_saved", self.run, step, path)


class StepLoss:
    """Each micro-batch's share of an optimizer step's loss, for backward, and the detached
    losses the callbacks and the non-finite watch read.

    The step's loss is the sum over every micro-batch and rank of what the task's loss averages
    over (samples, or a language model's tokens not labelled -100), divided by their number:
    K micro-batches of B on N ranks give exactly the gradient of one batch of K*N*B, also when
    the micro-batches count different numbers of tokens. DDP and FSDP average the ranks'
    gradients, so each rank's share is scaled by N. Sample counts are the same on every rank
    (the loaders deal each as many samples); token counts are summed across the ranks, one
    small all-reduce a step, without a host sync. One micro-batch on one process is the task's
    mean loss itself."""

    def __init__(self, task: Any, micro_batches: list, dist: DistInfo):
        self.task, self.world = task, dist.world_size
        self.detached: list[tuple[torch.Tensor, Any]] = []
        targets = [split_batch(task, batch)[1] for batch in micro_batches]
        sizes = [samples_in(target) for target in targets]
        self.samples = sum(sizes)
        self.tokens = sum(target.numel() for target in targets if target.dim() == 2 and not target.is_floating_point())
        plain = len(micro_batches) == 1 and not dist.is_distributed
        self.counts = sizes if plain else [counted(task, t) for t in targets]
        self.summed = not plain and any(isinstance(count, torch.Tensor) for count in self.counts)
        if self.summed:  # at least 1: a step with nothing to count trains on nothing, not on NaN
            self.total = all_reduce_sum(dist, sum(self.counts).float()).clamp(min=1)
        else:
            self.total = sum(self.counts) * self.world

    def forward(self, i: int, module: nn.Module, batch: Any) -> torch.Tensor:
        """Micro-batch `i` through the model and the task: its share of the step's loss."""
        count = self.counts[i]
        if self.summed:
            loss = summed_training_loss(self.task, module, batch, count)
            share = loss * (self.world / self.total)
        else:
            loss, _ = training_loss(self.task, module, batch)
            weight = count * self.world / self.total
            share = loss if weight == 1 else loss * weight
        self.detached.append((loss.detach(), count))  # the one device op the loop adds
        return share


def _report_start(parts: TrainingParts, dist: DistInfo, job: Any) -> None:
    """One line each for what the run would otherwise hide at its start."""
    if not dist.is_main:
        return
    progress, batch, ranks = parts.progress, job.trainer.batch_size, dist.world_size
    if change := parts.layout.changes_from(parts.saved_layout):
        log.info(f"{change}; continuing at sample {progress.samples_into_epoch} of epoch {progress.epoch}, "
                 f"step {progress.step} of {parts.total_steps}")
    share = batch if parts.streamed else len(parts.train_loader.order)
    if share < batch and ranks == 1:
        log.info(f"trainer.batch_size={batch} is more than the training set's {share} samples: each batch is the "
                 f"whole set, {share} samples")
    elif share < batch:
        log.info(f"trainer.batch_size={batch} is more than each process's share of the training set ({share} "
                 f"samples, {ranks} processes): each batch is the whole share, {share} samples per process, "
                 f"{share * ranks} in all")
    warmup = job.scheduler.get("warmup_steps", 0) if isinstance(job.scheduler, dict) else 0
    if warmup and warmup >= parts.total_steps:
        log.warning(f"scheduler.warmup_steps={warmup} is not below the run's {parts.total_steps} steps: the learning "
                    f"rate is still warming up when training ends; lower scheduler.warmup_steps")


def _report_first_skip(nonfinite: NonFiniteWatch, step: int) -> None:
    """The run's first skipped update (later ones are counted); most skips must not pass unseen."""
    counted_later = "later skips are counted in train/skipped_steps and on the final line"
    if nonfinite.first_skip:
        log.warning(f"step {step}: update skipped, non-finite {nonfinite.first_skip} (trainer.on_nonfinite=skip); "
                    f"{counted_later}")
    else:  # 16-mixed: GradScaler's own skip, which it makes now and then by design
        log.info(f"step {step}: update skipped by GradScaler (float16 gradients overflowed; it lowers its loss "
                 f"scale and goes on); {counted_later}")
