"""Batches in sampler order, gathered many batches at a time.

Every built-in data set is an in-memory tensor with `get_batch(indices)`. The loader gathers
the samples of GATHER_BATCHES batches with one indexing operation and splits the result into
batch views, instead of `batch_size` Python `__getitem__` calls plus a collate per batch: for
small models that per-sample work is most of the tutorial loop's time. Any other torch
Dataset goes through a torch DataLoader with the same sampler.

The same DistributedSampler (shuffle, seed, epoch) orders the data for one process and for
many, so rank r of N sees exactly every N-th sample of the single-process order: a DDP run with
per-rank batch B consumes the same samples per step as one process with batch N*B.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

# Batches per gather: amortises the indexing call while bounding the extra memory to a few
# dozen batches.
GATHER_BATCHES = 32

Batch = tuple[torch.Tensor, torch.Tensor]


class ShardSampler:
    """rank, rank+N, rank+2N, ...: each validation sample on exactly one rank, no padding."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class BatchLoader:
    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        sampler: Iterable[int],
        device: torch.device,
        drop_last: bool = False,
        limit_batches: int = 0,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = sampler
        self.device = device
        self.drop_last = drop_last
        self.limit_batches = limit_batches  # > 0: only the first batches of each epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.sampler)
        batches = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return min(batches, self.limit_batches) if self.limit_batches else batches

    def batches(self, epoch: int = 0, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of `epoch`, on the device, from batch `skip_batches` on (for resuming)."""
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        if not hasattr(self.dataset, "get_batch"):
            yield from self._dataloader_batches(skip_batches)
            return
        indices = torch.tensor(list(self.sampler), dtype=torch.long)[: len(self) * self.batch_size]
        chunk = GATHER_BATCHES * self.batch_size
        for start in range(skip_batches * self.batch_size, len(indices), chunk):
            inputs, targets = self.dataset.get_batch(indices[start : start + chunk])
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            yield from zip(inputs.split(self.batch_size), targets.split(self.batch_size))

    def _dataloader_batches(self, skip_batches: int) -> Iterator[Batch]:
        loader = DataLoader(
            self.dataset, batch_size=self.batch_size,
            sampler=list(self.sampler)[skip_batches * self.batch_size : len(self) * self.batch_size],
            drop_last=self.drop_last, pin_memory=self.device.type == "cuda",
        )
        for inputs, targets in loader:
            yield inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)


def build_train_loader(
    dataset, batch_size, rank, world_size, seed, drop_last, device, shuffle=True, limit_batches=0
) -> BatchLoader:
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return BatchLoader(dataset, batch_size, sampler, device, drop_last=drop_last, limit_batches=limit_batches)


def build_val_loader(
    dataset, batch_size, rank, world_size, device, limit_samples=0, limit_batches=0
) -> BatchLoader:
    """Each sample on exactly one rank; `limit_samples` > 0 validates on the first samples only,
    `limit_batches` > 0 on each rank's first batches only."""
    length = min(len(dataset), limit_samples) if limit_samples else len(dataset)
    return BatchLoader(dataset, batch_size, ShardSampler(length, rank, world_size), device, limit_batches=limit_batches)
