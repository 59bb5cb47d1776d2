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
        tokens = torch.tensor(float(self.tokens), dtype=torch.float64, device=sizes.device)
        totals = torch.stack([loss_sum, sizes.sum(), tokens])
        loss_sum, samples, tokens = all_reduce_sum(dist, totals.to(dist.device)).tolist()
        values = {"train/loss": loss_sum / samples, "throughput/samples_per_sec": samples / seconds}
        if tokens:
            values["throughput/tokens_per_sec"] = tokens / seconds
        self._reset()
        return values
