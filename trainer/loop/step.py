"""One optimizer step: K micro-batches (autocast forward, scaled backward, gradients reduced
across ranks on the last one only), then unscale, clip, the non-finite watch, step, schedule."""
from __future__ import annotations

import torch

from ringtrain.data.batches import samples_in, split_batch, training_loss
from ringtrain.loop.loaders import Batch
from ringtrain.loop.meter import TrainMeter, tokens_in
from ringtrain.loop.nonfinite import NonFiniteWatch
from ringtrain.loop.parts import TrainingParts
from ringtrain.loop.progress import Progress


def optimizer_step(parts: TrainingParts, task, micro_batches: list[Batch], meter: TrainMeter,
                   nonfinite: NonFiniteWatch, progress: Progress, step: int, grad_clip_norm: float,
                   measure_grad_norm: bool) -> torch.Tensor | None:
    """Forward/backward `micro_batches`, then one optimizer step.

    Returns the gradient norm, or None when neither clipping, logging nor on_nonfinite=skip
    needs it (computing it costs a pass over all gradients: most steps leave it out).
    """
    strategy, precision = parts.strategy, parts.precision
    total = 0 if len(micro_batches) == 1 else sum(samples_in(split_batch(task, batch)[1]) for batch in micro_batches)
    last = len(micro_batches) - 1
    losses = []
    for i, batch in enumerate(micro_batches):
        with strategy.no_sync(parts.module, enabled=i == last):
            with precision.autocast():
                loss, targets = training_loss(task, parts.module, batch)
            # Weight each micro-batch by its share of samples, so K micro-batches of B give
            # exactly the gradient of one batch of K*B (also when the last batch is short).
            samples = samples_in(targets)
            precision.backward(loss if not total else loss * (samples / total))
        loss = loss.detach()  # the one device op the loop adds: the meter and the watch share it
        meter.add(loss, samples, tokens_in(targets))
        losses.append(loss)
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
