"""The validation metrics of a model over a loader, the same for any number of ranks; used by
the loop and by `ringtrain evaluate`."""
from __future__ import annotations

import torch
from torch import nn

from ringtrain.data.batches import predictions
from ringtrain.data.tasks import metrics_from_sums
from ringtrain.distributed import DistInfo, all_reduce_sum, gather_objects
from ringtrain.loop.loaders import BatchLoader
from ringtrain.loop.precision import Precision
from ringtrain.loop.watchdog import EVALUATING, LOADING_VALIDATION_BATCH, watched
from ringtrain.strategies.base import Strategy


def evaluate_model(model: nn.Module, loader: BatchLoader, task, precision: Precision, dist: DistInfo,
                   strategy: Strategy) -> dict[str, float]:
    """The task's metrics over every batch of `loader` on every rank (each rank has at least
    one): each batch's sums and counts, added up in float64 and all-reduced, then divided, so
    the value is the same for any number of ranks. Leaves the model in eval mode."""
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    # The shards are not padded, so ranks may have a batch more or less. A sharded forward is a
    # collective: there, a rank that is done repeats its last batch, uncounted, until every
    # rank is (else the others would wait for it forever). Agreed before the first forward.
    lockstep = strategy.forwards_in_lockstep and dist.is_distributed
    most = max(gather_objects(dist, len(loader))) if lockstep else 0
    count, last = 0, None
    with strategy.inference(model):
        for batch in watched(loader.batches(), LOADING_VALIDATION_BATCH, EVALUATING):
            with precision.autocast():
                outputs, targets = predictions(task, model, batch)
            for key, value in task.eval_sums(outputs, targets).items():
                sums[key] = sums.get(key, 0) + value.double()
            count, last = count + 1, batch
        for _ in range(most - count):
            with precision.autocast():
                predictions(task, model, last)
    keys = sorted(sums)  # the same task, so the same keys on every rank
    totals = all_reduce_sum(dist, torch.stack([sums[k] for k in keys]).to(dist.device)).cpu()
    return metrics_from_sums(dict(zip(keys, totals)))
