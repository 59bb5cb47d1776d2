"""The train loss and throughput between two logging steps."""
from __future__ import annotations

import time

import torch

from ringtrain.distributed import DistInfo, all_reduce_sum


def tokens_in(targets: torch.Tensor) -> int:
    """The tokens a batch trains on when its targets are token ids, integers of (batch,
    positions); 0 for other data (regression values, class ids), whose speed is samples/s."""
    return targets.numel() if targets.dim() == 2 and not targets.is_floating_point() else 0


class TrainMeter:
    """Losses are kept as detached device tensors and summed only when read, so a step costs
    no device synchronisation and no extra arithmetic."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.means: list[torch.Tensor] = []  # the mean loss of a micro-batch ...
        self.sizes: list[int] = []  # ... over this many samples
        self.sums: list[torch.Tensor] = []  # the summed loss of a micro-batch ...
        self.counts: list[torch.Tensor] = []  # ... over this many (tokens)
        self.samples = 0
        self.tokens = 0
        self.since = time.perf_counter()

    def add_mean(self, loss: torch.Tensor, samples: int, tokens: int) -> None:
        self.means.append(loss)
        self.sizes.append(samples)
        self.samples += samples
        self.tokens += tokens

    def add_sum(self, loss_sum: torch.Tensor, count: torch.Tensor, samples: int, tokens: int) -> None:
        """A micro-batch whose loss is summed over `count` (data/batches.py counted)."""
        self.sums.append(loss_sum)
        self.counts.append(count)
        self.samples += samples
        self.tokens += tokens

    def read(self, dist: DistInfo) -> dict[str, float]:
        """The global mean train loss (all-reduced) and global throughput since the last read."""
        seconds = max(time.perf_counter() - self.since, 1e-9)
        device = (self.means or self.sums)[0].device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        if self.means:
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=device)
            loss_sum, count = loss_sum + torch.dot(torch.stack(self.means).double(), sizes), count + sizes.sum()
        if self.sums:
            loss_sum = loss_sum + torch.stack(self.sums).double().sum()
            count = count + torch.stack(self.counts).double().sum()
        samples = torch.tensor(float(self.samples), dtype=torch.float64, device=device)
        tokens = torch.tensor(float(self.tokens), dtype=torch.float64, device=device)
        totals = torch.stack([loss_sum, count, samples, tokens])
        loss_sum, count, samples, tokens = all_reduce_sum(dist, totals.to(dist.device)).tolist()
        values = {"train/loss": loss_sum / max(count, 1.0)}
        if samples:
            values["throughput/samples_per_sec"] = samples / seconds
        if tokens:
            values["throughput/tokens_per_sec"] = tokens / seconds
        self._reset()
        return values
