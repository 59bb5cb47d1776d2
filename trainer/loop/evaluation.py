"""Validation of a run (`Evaluator`), and a model's metrics over a loader, the same for any number
of ranks (`evaluate_parts`, which `ringtrain evaluate` uses too)."""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import nn

from ringtrain.callbacks import Callbacks, Run
from ringtrain.data.batches import predictions
from ringtrain.data.tasks import metrics_from_sums
from ringtrain.distributed import DistInfo, all_reduce_sum, gather_objects
from ringtrain.loop.loaders import BatchLoader
from ringtrain.loop.stopping import EVALUATING, LOADING_VALIDATION_BATCH, Watchdog
from ringtrain.strategies import Precision, Strategy

log = logging.getLogger("ringtrain")


class Evaluator:
    """Validation of one run: when it is due and what it measures. eval_every_fraction counts by
    the epoch's global position in samples (the same steps for any ranks, batch or accumulation,
    and after a mid-epoch resume); eval_every_minutes by rank 0's clock, agreed a step later."""

    def __init__(self, trainer: Any, parts: Any, task: Any, dist: DistInfo, watchdog: Watchdog):
        self.every, self.fraction, self.minutes = trainer.eval_every_n_steps, trainer.eval_every_fraction, trainer.eval_every_minutes
        self.parts, self.task, self.dist, self.watchdog = parts, task, dist, watchdog
        self.epoch_length = getattr(getattr(parts.train_loader, "order", None), "end", 0)  # 0: a stream's, no epochs
        self.samples_per_step = trainer.batch_size * trainer.accumulate_grad_batches * dist.world_size
        self.since = time.monotonic()
        self.position = parts.progress.samples_into_epoch  # the epoch's global position before the step

    def due(self, step: int, position: int, epoch_done: bool) -> bool:
        before, self.position = self.position, position
        if step == self.parts.total_steps or (self.every and step % self.every == 0):
            return True
        if self.fraction:
            mark = self.fraction * self.epoch_length
            return epoch_done or math.floor(position / mark) > math.floor(before / mark)
        return epoch_done and not (self.every or self.minutes)

    def time_is_up(self) -> bool:
        return bool(self.minutes) and self.dist.is_main and time.monotonic() - self.since >= 60 * self.minutes

    def validate(self, run: Run, callbacks: Callbacks) -> bool:
        """The validation metrics (val/<name>, val/<part>/<name>: evaluate_parts) into run.metrics,
        logged; whether the monitored one is the best so far."""
        parts = self.parts
        callbacks.call("on_validation_start", run)
        metrics = evaluate_parts(parts.model, parts.val_loaders, self.task, parts.precision, self.dist, parts.strategy,
                                 self.watchdog)
        parts.model.train()
        self.since = time.monotonic()
        run.metrics = {f"val/{k}": v for k, v in metrics.items()}
        run.log(run.metrics)
        # How far training is: the epoch, or for a stream, which has none, the samples drawn
        # (every step draws a full global batch, on as many ranks as saved a resumed run).
        where = f"epoch {run.epoch:.2f}" if self.epoch_length else f"({run.step * self.samples_per_step} samples)"
        log.info(f"step {run.step} {where}: " + " ".join(f"{k}={v:.5g}" for k, v in run.metrics.items()))
        callbacks.call("on_validation_end", run, run.metrics)
        return self.parts.progress.improves(run.metrics.get(self.task.monitor), self.task.mode)


def evaluate_parts(model: nn.Module, loaders: dict[str, BatchLoader], task, precision: Precision, dist: DistInfo,
                   strategy: Strategy, watchdog: Watchdog | None = None) -> dict[str, float]:
    """The task's metrics over named parts (a mixture's sources; {"": loader} for one), in one pass:
    the whole set's from the parts' sums, each named part's as <part>/<name>. Sums and counts are
    added up in float64 and all-reduced (on the CPU), so that the metrics are the same for any
    number of ranks (each has at least one batch). Leaves the model in eval mode."""
    model.eval()
    whole: dict[str, torch.Tensor] = {}
    by_part: dict[str, float] = {}
    for name, loader in loaders.items():
        sums: dict[str, torch.Tensor] = {}
        # The shards are not padded, so ranks may have a batch more or less. A sharded forward is a
        # collective: there, a rank that is done repeats its last batch, uncounted, until every
        # rank is (else the others would wait for it forever). Agreed before the first forward.
        lockstep = strategy.forwards_in_lockstep and dist.is_distributed
        most = max(gather_objects(dist, len(loader))) if lockstep else 0
        count, last = 0, None
        # Eagerly: blocks compiled for training would recompile for inference mode and each new shape.
        with strategy.inference(model), torch.compiler.set_stance("force_eager"):
            batches = loader.batches()
            for batch in (watchdog.watched(batches, LOADING_VALIDATION_BATCH, EVALUATING) if watchdog else batches):
                with precision.autocast():
                    outputs, targets = predictions(task, model, batch)
                for key, value in task.eval_sums(outputs, targets).items():
                    sums[key] = sums.get(key, 0) + value.double()
                count, last = count + 1, batch
            for _ in range(most - count):
                with precision.autocast():
                    predictions(task, model, last)
        keys = sorted(sums)  # the same task, so the same keys on every rank
        totals = dict(zip(keys, all_reduce_sum(dist, torch.stack([sums[k] for k in keys]).to(dist.device)).cpu()))
        for key, value in totals.items():
            whole[key] = whole.get(key, 0) + value
        if name:
            by_part.update({f"{name}/{k}": v for k, v in metrics_from_sums(totals).items()})
    return {**metrics_from_sums(whole), **by_part}
