"""One optimizer step: K micro-batches (autocast forward, scaled backward, gradients reduced
across ranks on the last one only), then unscale, clip, the non-finite watch, step, schedule."""
from __future__ import annotations

import torch

from ringtrain.data.batches import counted, samples_in, split_batch, summed_training_loss, training_loss
from ringtrain.distributed import DistInfo, all_reduce_sum
from ringtrain.loop.loaders import Batch
from ringtrain.loop.meter import TrainMeter, tokens_in
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.parts import TrainingParts
from ringtrain.loop.progress import Progress


def optimizer_step(parts: TrainingParts, task, micro_batches: list[Batch], meter: TrainMeter,
                   nonfinite: NonFiniteWatch, progress: Progress, step: int, grad_clip_norm: float,
                   measure_grad_norm: bool, dist: DistInfo) -> torch.Tensor | None:
    """Forward/backward `micro_batches`, then one optimizer step.

    Returns the gradient norm, or None when neither clipping, logging nor on_nonfinite=skip
    needs it (computing it costs a pass over all gradients: most steps leave it out).
    """
    strategy, precision = parts.strategy, parts.precision
    if len(micro_batches) == 1 and not dist.is_distributed:
        losses = [_backward_mean(parts, task, micro_batches[0], meter)]
    else:
        losses = _backward_weighted(parts, task, micro_batches, meter, dist)
    precision.unscale_(parts.optimizer)
    if grad_clip_norm > 0:
        grad_norm = strategy.clip_gradients(parts.params, grad_clip_norm)
    else:
        grad_norm = strategy.gradient_norm(parts.params) if measure_grad_norm else None
    if not nonfinite.allows_update(step, losses, grad_norm):
        progress.skipped_steps += 1
    elif precision.step(parts.optimizer) is False:
        progress.skipped_steps += 1  # GradScaler found inf/NaN gradients and skipped
    parts.scheduler.step()
    # What optimizer.zero_grad(set_to_none=True) does, without its ~8 us of Python a step
    # (a profiler range and per-device grouping); it also clears parameters the optimizer lacks.
    for param in parts.params:
        param.grad = None
    return grad_norm


def _backward_mean(parts: TrainingParts, task, batch: Batch, meter: TrainMeter) -> torch.Tensor:
    """One micro-batch on one process: the task's mean loss is the step's loss."""
    with parts.precision.autocast():
        loss, targets = training_loss(task, parts.module, batch)
    parts.precision.backward(loss)
    loss = loss.detach()  # the one device op the loop adds: the meter and the watch share it
    meter.add_mean(loss, samples_in(targets), tokens_in(targets))
    return loss


def _backward_weighted(parts: TrainingParts, task, micro_batches: list[Batch], meter: TrainMeter,
                       dist: DistInfo) -> list[torch.Tensor]:
    """Micro-batches (on every rank): each one's summed loss over the whole step's count.

    The step's loss is the sum over every micro-batch and rank of what the loss averages over
    (samples, or a language model's tokens not labelled -100), divided by their number, so K
    micro-batches of B on N ranks give exactly the gradient of one batch of K*N*B, also when
    the micro-batches count different numbers of tokens. DDP and FSDP average the ranks'
    gradients, so each rank's share is scaled by N. Sample counts are the same on every rank
    (the loaders deal each rank as many samples); token counts are summed across the ranks,
    one small all-reduce a step, without a host sync.
    """
    strategy, precision, world = parts.strategy, parts.precision, dist.world_size
    targets = [split_batch(task, batch)[1] for batch in micro_batches]
    counts = [counted(task, target) for target in targets]
    by_tokens = any(isinstance(count, torch.Tensor) for count in counts)
    if by_tokens:  # at least 1: a step with nothing to count trains on nothing, not on NaN
        total = all_reduce_sum(dist, sum(counts).float()).clamp(min=1)
    else:
        total = sum(counts) * world
    last, losses = len(micro_batches) - 1, []
    for i, (batch, target, count) in enumerate(zip(micro_batches, targets, counts)):
        with strategy.no_sync(parts.module, enabled=i == last):
            with precision.autocast():
                if by_tokens:
                    loss = summed_training_loss(task, parts.module, batch, count)
                    share = loss * (world / total)
                else:
                    loss, _ = training_loss(task, parts.module, batch)
                    weight = count * world / total
                    share = loss if weight == 1 else loss * weight
            precision.backward(share)
        loss = loss.detach()
        if by_tokens:
            meter.add_sum(loss, count, samples_in(target), tokens_in(target))
        else:
            meter.add_mean(loss, samples_in(target), tokens_in(target))
        losses.append(loss)
    return losses
