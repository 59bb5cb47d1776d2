"""The training loop of one rank.

`TrainingLoop(run, dist, run_dir).fit(model, data, task)` reads top to bottom:
  place and wrap the model -> loaders, optimizer, lr schedule, precision -> maybe resume ->
  for each optimizer step: K micro-batches (autocast forward, scaled backward, gradient
  all-reduce only on the last) -> unscale, clip, step, schedule -> log -> evaluate -> checkpoint.
The components arrive built (trainer/run.py builds them from config, trainer/trainer.py
takes them from Python); the optimizer and schedule are built here, from the model.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ringtrain.data.bundle import DataBundle
from ringtrain.data.tasks import metrics_from_sums
from ringtrain.checkpoints.files import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    CheckpointStore,
    load_checkpoint,
    load_model_weights,
    rng_state,
    set_rng_state,
)
from ringtrain.loop.compilation import compile_for_training
from ringtrain.config.schema import RunConfig
from ringtrain.strategies.distributed import DistInfo, all_reduce_sum, broadcast_object, gather_objects
from ringtrain.errors import ConfigError
from ringtrain.strategies.fsdp import (
    clip_grad_norm,
    full_model_state_dict,
    full_optimizer_state_dict,
    grad_norm,
    gradient_sync,
    inference_context,
    load_full_optimizer_state_dict,
    load_sharded,
    save_sharded,
)
from ringtrain.loop.loaders import Batch, BatchLoader, build_train_loader, build_val_loader, worker_options
from ringtrain.loop.logger import RunLogger
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.optim import build_optimizer, build_scheduler
from ringtrain.loop.precision import Precision, set_matmul_precision
from ringtrain.loop.signals import StopAgreement, StopSignals
from ringtrain.strategies.wrap import wrap_model
from ringtrain.loop.throughput import ThroughputReporter


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    batches_into_epoch: int = 0  # micro-batches of the current epoch already trained on
    best_metric: float | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values

    def finish_step(self, micro_batches: int, batches_per_epoch: int) -> bool:
        """Count one optimizer step over `micro_batches`; True when it completed the epoch."""
        self.step += 1
        self.batches_into_epoch += micro_batches
        if self.batches_into_epoch < batches_per_epoch:
            return False
        self.epoch += 1
        self.batches_into_epoch = 0
        return True


@dataclass
class FitResult:
    metrics: dict[str, float]  # final validation metrics, e.g. {"val/loss": 0.01}
    monitor: str  # the metric a sweep optimises
    mode: str  # "min" or "max"
    best_metric: float | None
    steps: int
    train_seconds: float
    # Why training ended before its last step: "SIGTERM" (a stop signal, last.pt saved) or
    # "non-finite" (trainer.on_nonfinite=stop); None when it ran to the end.
    stopped: str | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values (on_nonfinite=skip, fp16 scaler)
    # The trained weights, only when a spawned rank 0 hands them back to a Python caller.
    model_state: dict | None = None


class TrainingLoop:
    def __init__(self, run: RunConfig, dist: DistInfo, run_dir: Path, stop: StopSignals | None = None):
        self.run = run
        self.cfg = run.trainer
        self.dist = dist
        self.device = dist.device
        self.run_dir = Path(run_dir)
        self.checkpoints = CheckpointStore(self.run_dir / "checkpoints", self.cfg.keep_last_k)
        self.stop = stop  # the stop signals this process watches (None: none)

    # --- the loop ----------------------------------------------------------------------------

    def fit(self, model: nn.Module, data: DataBundle, task, resume_from: Path | None = None) -> FitResult:
        cfg, dist = self.cfg, self.dist
        resumed = load_checkpoint(resume_from, self.device) if resume_from else None
        self.task, self.data = task, data
        train_loader = self._setup(model, data, resumed, resume_from)
        total_steps, batches_per_epoch = self.total_steps, len(train_loader)
        progress = self._restore(resumed) if resumed else Progress()
        agreement = StopAgreement(timeout_minutes=self.run.strategy.timeout_minutes)
        nonfinite = NonFiniteWatch(cfg.on_nonfinite, self.device, uses_scaler=self.precision.scaler is not None)

        metrics: dict[str, float] = {}
        stopped: str | None = None
        with RunLogger(self.run_dir, dist.is_main, total_steps, cfg.progress_bar) as logger, self._profiler() as profiler, agreement:
            logger.config(self.run.resolved)
            logger.advance(progress.step)
            if self.stop is not None:
                self.stop.lag_steps = agreement.lag_steps
                self.stop.poll(progress.step)
            if progress.step >= total_steps:
                # A finished run started again (a requeue, the same command): report its metrics.
                metrics = self.evaluate()
                logger.info(
                    f"nothing to train: the checkpoint is at step {progress.step} of {total_steps} (raise "
                    f"trainer.max_steps or trainer.max_epochs to continue); " + _format(metrics)
                )
            meter = TrainMeter()
            speed = ThroughputReporter.for_run(
                self.wrapped, self.device, cfg.precision, cfg.tf32, cfg.peak_tflops, dist.world_size,
                start_step=progress.step, info=logger.info,
            )
            started = time.perf_counter()  # the loop's time: set-up and imports are not in it
            while progress.step < total_steps and stopped is None:
                epoch = train_loader.batches(progress.epoch, skip_batches=progress.batches_into_epoch)
                for micro_batches in _groups(epoch, cfg.accumulate_grad_batches):
                    step = progress.step + 1
                    log_now = step % cfg.log_every_n_steps == 0 or step == total_steps
                    lr_used = self.scheduler.get_last_lr()[0]
                    grad_norm = self._optimizer_step(micro_batches, meter, nonfinite, progress, step,
                                                     measure_grad_norm=log_now or nonfinite.needs_grad_norm)
                    epoch_done = progress.finish_step(len(micro_batches), batches_per_epoch)
                    evaluate_now = self._evaluation_due(step, epoch_done, total_steps)
                    checkpoint_now = not evaluate_now and self._checkpoint_due(step)

                    # stop: the first non-finite step is read (one sync) only where it matters:
                    # before values are logged or weights evaluated or saved.
                    if (log_now or evaluate_now or checkpoint_now) and nonfinite.first_bad_step() is not None:
                        stopped = "non-finite"
                        logger.error(nonfinite.stop_message(progress.step, self.checkpoints.last))
                        metrics = {self.task.monitor: float("nan")}
                        break
                    if log_now:
                        values = {**meter.read(dist), "lr": lr_used, "grad_norm": float(grad_norm)}
                        if progress.skipped_steps:
                            values["train/skipped_steps"] = progress.skipped_steps
                        logger.scalars({**values, **speed.read(step, values)}, step)
                    logger.advance(1)
                    if profiler:
                        profiler.step()
                    if evaluate_now:
                        metrics = self._evaluate_and_checkpoint(progress, batches_per_epoch, logger)
                    elif checkpoint_now:
                        self._save(progress, best=False)
                    if step == total_steps:
                        break
                    if self.stop is not None and agreement.should_stop(self.stop.poll(step)):
                        stopped = self.stop.received or "a stop signal on another rank"
                        if cfg.checkpoint and not (evaluate_now or checkpoint_now):
                            self._save(progress, best=False)
                        logger.info(
                            f"stopped by {stopped} after step {step}"
                            + ("; last.pt saved: the same command continues the run" if cfg.checkpoint else
                               " (trainer.checkpoint=false: nothing saved)")
                        )
                        break
            train_seconds = time.perf_counter() - started
            logger.hparams(self.run.resolved, metrics, progress.step)
            logger.summary({
                "final": metrics, "monitor": self.task.monitor, "mode": self.task.mode,
                "best": progress.best_metric, "steps": progress.step, "train_seconds": train_seconds,
                "stopped": stopped, "skipped_steps": progress.skipped_steps,
            })
        return FitResult(
            metrics=metrics,
            monitor=self.task.monitor,
            mode=self.task.mode,
            best_metric=progress.best_metric,
            steps=progress.step,
            train_seconds=train_seconds,
            stopped=stopped,
            skipped_steps=progress.skipped_steps,
        )

    def _setup(self, model: nn.Module, data: DataBundle, resumed: dict | None, resume_from: Path | None) -> BatchLoader:
        """Place and wrap the model; build the loaders, optimizer, lr schedule and precision.
        Returns the training loader."""
        cfg, dist = self.cfg, self.dist
        self.model = model.to(self.device)
        if resumed and "shards" not in resumed:  # sharded weights load once the model is set up (_restore)
            load_model_weights(model, resumed, resume_from)
        # Under fsdp, bf16-mixed is FSDP2's own mixed precision (bf16 parameters, float32
        # gradient reduction) instead of autocast.
        fsdp = self.run.strategy.name == "fsdp"
        sharded_bf16 = fsdp and cfg.precision == "bf16-mixed"
        param_dtype = torch.bfloat16 if sharded_bf16 else None
        if fsdp:
            # FSDP2 shards the model in place; trainer.compile then compiles the sharded model,
            # and gradient sync is set on the model itself (trainer/compilation.py).
            self.wrapped = compile_for_training(wrap_model(model, self.run.strategy, dist, param_dtype),
                                                cfg.compile, cfg.compile_mode)
            self.synced = model
        else:
            # Compiled inside DDP, as torch.compile + DDP expects (trainer/compilation.py).
            self.wrapped = wrap_model(compile_for_training(model, cfg.compile, cfg.compile_mode),
                                      self.run.strategy, dist, param_dtype)
            self.synced = self.wrapped
        self.params = list(model.parameters())  # after sharding: FSDP2 makes them DTensors

        val_batch_size = cfg.val_batch_size or cfg.batch_size
        overfit = cfg.overfit_batches  # > 0: train and validate on the same first batches
        workers = worker_options(cfg, self.device)
        train_loader = build_train_loader(
            data.train, cfg.batch_size, dist.rank, dist.world_size, cfg.seed, cfg.drop_last, self.device,
            shuffle=not overfit, limit_batches=overfit, workers=workers,
        )
        self.val_loader = build_val_loader(
            data.train if overfit else data.val, val_batch_size, dist.rank, dist.world_size, self.device,
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
        steps_per_epoch = math.ceil(len(train_loader) / cfg.accumulate_grad_batches)
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else steps_per_epoch * cfg.max_epochs

        lr_scale = dist.world_size if self.run.strategy.scale_lr_by_world_size else 1
        if callable(self.run.optimizer):  # the Python API: optimizer(params)
            self.optimizer = self.run.optimizer([p for p in model.parameters() if p.requires_grad])
        else:
            self.optimizer = build_optimizer(self.run.optimizer, model, self.device, lr_scale)
        if callable(self.run.scheduler):  # the Python API: scheduler(optimizer)
            self.scheduler = self.run.scheduler(self.optimizer)
        else:
            self.scheduler = build_scheduler(self.run.scheduler, self.optimizer, self.total_steps)
        self.precision = Precision("32" if sharded_bf16 else cfg.precision, self.device)
        set_matmul_precision(self.device, cfg.tf32)
        return train_loader

    def _evaluation_due(self, step: int, epoch_done: bool, total_steps: int) -> bool:
        """At the last step, every eval_every_n_steps steps, or (by default) at each epoch's end."""
        every = self.cfg.eval_every_n_steps
        return step == total_steps or (step % every == 0 if every else epoch_done)

    def _checkpoint_due(self, step: int) -> bool:
        """last.pt between evaluations, every checkpoint_every_n_steps steps."""
        every = self.cfg.checkpoint_every_n_steps
        return self.cfg.checkpoint and every > 0 and step % every == 0

    def _optimizer_step(
        self, micro_batches: list[Batch], meter: TrainMeter, nonfinite: NonFiniteWatch, progress: Progress,
        step: int, measure_grad_norm: bool,
    ) -> torch.Tensor | None:
        """Forward/backward K micro-batches, then one optimizer step.

        Returns the gradient norm, or None when neither clipping, logging nor the non-finite
        check needs it (computing it costs a pass over all gradients).
        """
        total = sum(inputs.shape[0] for inputs, _ in micro_batches)
        last = len(micro_batches) - 1
        step_loss = None
        for i, (inputs, targets) in enumerate(micro_batches):
            # DDP decides in forward whether backward all-reduces: both go inside no_sync.
            with gradient_sync(self.synced, enabled=i == last):
                with self.precision.autocast():
                    loss = self.task.loss(self.wrapped(inputs), targets)
                # Weight each micro-batch by its share of samples, so K micro-batches of B give
                # exactly the gradient of one batch of K*B (also when the last batch is short).
                share = inputs.shape[0] / total
                self.precision.backward(loss if share == 1 else loss * share)
            meter.add(loss.detach(), inputs.shape[0], targets.numel() if targets.dim() > 1 else 0)
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
        self.precision.unscale_(self.optimizer)
        grad_norm = self._clip_gradients(measure_grad_norm)
        update = True
        if nonfinite.policy != "ignore":
            bad = nonfinite.is_bad(step_loss, grad_norm)
            nonfinite.record(bad, step, grad_norm if grad_norm is not None else step_loss)
            if nonfinite.policy == "skip" and bool(bad):  # the one host sync skip costs
                update = False
                progress.skipped_steps += 1
        if update and self.precision.step(self.optimizer) is False:
            progress.skipped_steps += 1  # GradScaler found inf/NaN gradients and skipped
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _clip_gradients(self, measure: bool) -> torch.Tensor | None:
        """Clip the (unscaled, reduced) gradients to grad_clip_norm; return their global norm
        (also over FSDP's shards), or None when nothing needs it."""
        if self.cfg.grad_clip_norm > 0:
            return clip_grad_norm(self.params, self.cfg.grad_clip_norm)
        return grad_norm(self.params) if measure else None

    def _profiler(self) -> contextlib.AbstractContextManager:
        """torch.profiler over `profile_steps` optimizer steps after two to settle (rank 0 only);
        the trace goes to <run dir>/profiler, for TensorBoard's PyTorch Profiler plugin or Perfetto."""
        if not (self.cfg.profile_steps and self.dist.is_main):
            return contextlib.nullcontext()
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        return profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=self.cfg.profile_steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.run_dir / "profiler"), worker_name="rank0"),
            record_shapes=True,
        )

    # --- evaluation and checkpoints ----------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Validation metrics over the whole validation set, identical for any number of ranks."""
        metrics = evaluate_model(self.model, self.val_loader, self.task, self.precision, self.dist)
        self.model.train()
        return {f"val/{k}": v for k, v in metrics.items()}

    def _evaluate_and_checkpoint(self, progress: Progress, batches_per_epoch: int, logger: RunLogger) -> dict[str, float]:
        metrics = self.evaluate()
        logger.scalars(metrics, progress.step)
        epochs = progress.epoch + progress.batches_into_epoch / batches_per_epoch
        logger.info(f"step {progress.step} epoch {epochs:.2f}: " + _format(metrics))
        value = metrics.get(self.task.monitor)
        improved = value is not None and math.isfinite(value) and (
            progress.best_metric is None
            or (value < progress.best_metric if self.task.mode == "min" else value > progress.best_metric)
        )
        if improved:
            progress.best_metric = value
        if self.cfg.checkpoint:
            self._save(progress, best=improved)
        return metrics

    def _save(self, progress: Progress, best: bool) -> None:
        """Rank 0 writes step-<N>.pt, last.pt (and best.pt); every rank learns whether it worked."""
        rng = gather_objects(self.dist, rng_state(self.device))  # every rank's, for exact resume
        if self.run.strategy.state_dict_type == "sharded":
            # Each rank writes its own shards (nothing gathered); the step file names them and
            # is written after them. A failed write raises on every rank alike.
            shards = self.checkpoints.shards_path(progress.step)
            save_sharded(shards, self.model, self.optimizer)
            weights = {"shards": shards.name}
        else:
            # Full, plain-tensor state on rank 0 whatever the strategy (FSDP gathers its
            # shards: every rank takes part); the optimizer's keyed by parameter name, so a
            # checkpoint resumes under another strategy.
            weights = {"model": full_model_state_dict(self.model),
                       "optimizer": full_optimizer_state_dict(self.model, self.optimizer)}
        failure = None
        if self.dist.is_main:
            state = {
                "format": CHECKPOINT_FORMAT,
                **weights,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.state_dict(),
                "progress": asdict(progress),
                "rng": rng,
                "config": self.run.resolved,
                "monitor": self.task.monitor,
                # What rebuilds the model and decodes its outputs from this file alone
                # (ringtrain sample / ringtrain evaluate).
                "data_dims": dict(self.data.dims),
                "vocab": self.data.vocab,
            }
            try:
                self.checkpoints.save(state, progress.step, best)
            except CheckpointError as err:
                failure = str(err)
        # Also the barrier: nobody reads or resumes before the file is complete, and a failed
        # save (a full disk) ends every rank with its one line instead of leaving them waiting.
        failure = broadcast_object(self.dist, failure)
        if failure:
            raise CheckpointError(failure)

    def _restore(self, state: dict) -> Progress:
        if "shards" in state:  # into the set-up model: each rank reads what its shards need
            load_sharded(state["shards"], self.model, self.optimizer)
        else:
            load_full_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler") or {})
        rng = state["rng"]
        set_rng_state(rng[self.dist.rank] if len(rng) == self.dist.world_size else rng[0], self.device)
        return Progress(**state["progress"])


def evaluate_model(model: nn.Module, loader: BatchLoader, task, precision: Precision, dist: DistInfo) -> dict[str, float]:
    """The task's metrics over every batch of `loader` on every rank (each rank has at least
    one): each batch's sums and counts, added up in float64 and all-reduced, then divided, so
    the value is the same for any number of ranks. Leaves the model in eval mode."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    # inference_mode where it is safe (no version counters, no view tracking); FSDP2 needs no_grad
    with inference_context(model):
        for inputs, targets in loader.batches():
            with precision.autocast():
                outputs = model(inputs)
            for key, value in task.eval_sums(outputs, targets).items():
                sums[key] = sums.get(key, 0) + value.double()
    keys = sorted(sums)  # the same task, so the same keys on every rank
    totals = all_reduce_sum(dist, torch.stack([sums[k] for k in keys]).to(dist.device)).cpu()
    return metrics_from_sums(dict(zip(keys, totals)))


class TrainMeter:
    """Train loss and throughput between two logging steps.

    Losses are kept as detached device tensors and summed only when read, so a step costs no
    device synchronisation and no extra arithmetic.
    """

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.losses: list[torch.Tensor] = []  # mean loss of each micro-batch
        self.sizes: list[int] = []  # its number of samples
        self.tokens = 0
        self.since = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: int, tokens: int) -> None:
        self.losses.append(loss)
        self.sizes.append(samples)
        self.tokens += tokens

    def read(self, dist: DistInfo) -> dict[str, float]:
        """The global mean train loss (all-reduced) and global throughput since the last read."""
        seconds = max(time.perf_counter() - self.since, 1e-9)
        sizes = torch.tensor(self.sizes, dtype=torch.float64, device=self.losses[0].device)
        loss_sum = torch.dot(torch.stack(self.losses).double(), sizes)
        totals = torch.stack([loss_sum, sizes.sum(), torch.tensor(float(self.tokens), dtype=torch.float64, device=sizes.device)])
        loss_sum, samples, tokens = all_reduce_sum(dist, totals.to(dist.device)).tolist()
        values = {"train/loss": loss_sum / samples, "throughput/samples_per_sec": samples / seconds}
        if tokens:
            values["throughput/tokens_per_sec"] = tokens / seconds
        self._reset()
        return values


def _format(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.5g}" for k, v in metrics.items())


def _groups(batches: Iterator[Batch], size: int) -> Iterator[list[Batch]]:
    """Micro-batches in groups of `size` (the last group of an epoch may be shorter)."""
    while group := list(islice(batches, size)):
        yield group
