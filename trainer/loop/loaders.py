"""Batches in sampler order, gathered many batches at a time (what a batch is: data/batches.py).

A built-in data set is an in-memory tensor with `get_batch(indices)`: the loader gathers
GATHER_BATCHES batches with one indexing call and splits the result into views, instead of
`batch_size` `__getitem__` calls plus a collate per batch (most of a small model's loop time).
Any other map-style Dataset goes through one DataLoader in the same order (README: "Map-style Datasets").
Orders are index tensors, never lists (a list of a million indices costs ~90 ms an epoch).
"""
from __future__ import annotations

import functools
import math
import signal
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ringtrain.data.batches import collate_of, to_device

GATHER_BATCHES = 32  # amortises the indexing call; bounds the extra memory to a few dozen batches

Batch = Any


def is_stream(dataset: Dataset) -> bool:
    return isinstance(dataset, IterableDataset)


class ShuffledShards:
    """This rank's training order of each epoch: `DistributedSampler(dataset, world_size, rank,
    shuffle, seed, drop_last)` with `set_epoch(epoch)`, as a tensor (tests/test_data.py): N ranks
    of batch B train per step what one process does with batch N*B.

    A position in the epoch is global: `start` means the first `start` samples of the epoch's
    single-process permutation are consumed, whatever ranks or batch size consumed them (N ranks
    that each took k consumed exactly the first k*N). The rest is cut to a multiple of N
    (drop_last) or padded with the epoch's first samples, then dealt out every N-th: every rank
    gets as many (DDP needs equal batch counts), and a run continued on other ranks or another
    batch size trains each remaining sample once. `limit` > 0: the epoch is only the
    permutation's first `limit` samples (overfit_batches).
    """

    def __init__(self, length: int, rank: int, world_size: int, seed: int, shuffle: bool, drop_last: bool,
                 limit: int = 0):
        self.length, self.rank, self.world_size = length, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.end = min(length, limit) if limit else length  # where the epoch's order ends

    def __len__(self) -> int:
        return self.share(0)

    def share(self, start: int) -> int:
        """This rank's samples of the epoch after global position `start` (the same on every rank)."""
        left = max(0, self.end - start)
        return left // self.world_size if self.drop_last else -(-left // self.world_size)

    def indices(self, epoch: int, start: int = 0) -> torch.Tensor:
        if self.shuffle:
            order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.length)
        epoch_order = order[: self.end]
        order, total = epoch_order[start:], self.share(start) * self.world_size
        if total > len(order):
            # Pad with the epoch's first samples, as DistributedSampler does: a function of the
            # epoch alone, so a run resumed mid-epoch pads its last step as the uninterrupted one.
            missing = total - len(order)
            order = torch.cat([order, epoch_order.repeat(math.ceil(missing / len(epoch_order)))[:missing]])
        return order[self.rank : total : self.world_size]


class Shards:
    """rank, rank+N, rank+2N, ...: each validation sample on exactly one rank, no padding."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.length, self.rank, self.world_size = length, rank, world_size

    def share(self, start: int) -> int:
        return len(range(start + self.rank, self.length, self.world_size))

    def indices(self, epoch: int = 0, start: int = 0) -> torch.Tensor:
        """The same every epoch: the samples after the first `start`, every N-th."""
        return torch.arange(start + self.rank, self.length, self.world_size)


@dataclass(frozen=True)
class WorkerOptions:
    """torch DataLoader settings for Datasets without get_batch (trainer.num_workers etc.)."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int = 2
    seed: int = 0
    stop_signals: tuple[str, ...] = ()  # trainer.stop_signals: the workers ignore them

    def loader_arguments(self, dataset: Dataset) -> dict[str, Any]:
        """What a map-style set's DataLoader and a stream's StatefulDataLoader take alike."""
        return dict(num_workers=self.num_workers, pin_memory=self.pin_memory, collate_fn=collate_of(dataset),
                    prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
                    worker_init_fn=functools.partial(ignore_stop_signals, self.stop_signals))


def ignore_stop_signals(names: tuple[str, ...], worker_id: int) -> None:
    """A DataLoader worker's start: ignore the stop signals that torchrun (to the process group)
    and Ctrl-C send every worker, which would fail the rank's next batch before it saved; the
    main process stops the workers itself, and they exit when it dies (torch's watchdog)."""
    for name in names:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def worker_options(trainer, device: torch.device) -> WorkerOptions:
    """trainer.num_workers, pin_memory...; pin_memory null: on when the batches go to a CUDA device."""
    pin = device.type == "cuda" if trainer.pin_memory is None else trainer.pin_memory
    return WorkerOptions(
        num_workers=trainer.num_workers, pin_memory=pin, persistent_workers=trainer.persistent_workers,
        prefetch_factor=trainer.prefetch_factor, seed=trainer.seed, stop_signals=tuple(trainer.stop_signals),
    )


class BatchLoader:
    def __init__(self, dataset: Dataset, batch_size: int, order: ShuffledShards | Shards, device: torch.device,
                 drop_last: bool = False, workers: WorkerOptions = WorkerOptions()):
        self.dataset = dataset
        self.batch_size = batch_size
        self.order = order
        self.device = device
        self.drop_last = drop_last
        self.workers = workers
        self._loader: DataLoader | None = None  # built on first use, kept (persistent workers)
        self._epoch_order: list[int] = []  # the DataLoader's sampler: the epoch being read, set before each pass
        self._generator = torch.Generator()

    def __len__(self) -> int:  # batches per epoch
        return self.batches_left(0)

    def batches_left(self, start: int) -> int:
        """Batches of an epoch after its first `start` samples (the same on every rank)."""
        samples = self.order.share(start)
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def position(self, start: int, batches_done: int) -> int:
        """Samples of the epoch's global order consumed after `batches_done` batches from `start`
        on every rank (past the epoch's samples by the padding at its end)."""
        return start + min(batches_done * self.batch_size, self.order.share(start)) * self.order.world_size

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """The batches of `epoch`, on the device, after its first `start` samples (for resuming)."""
        indices = self.order.indices(epoch, start)[: self.batches_left(start) * self.batch_size]
        if hasattr(self.dataset, "get_batch"):
            chunk = GATHER_BATCHES * self.batch_size
            # A copy from pageable memory makes the host wait for it; from pinned (page-locked)
            # memory it is queued like a kernel and overlaps the GPU's work.
            pin = self.workers.pin_memory and self.device.type == "cuda"
            for first in range(0, len(indices), chunk):
                inputs, targets = self.dataset.get_batch(indices[first : first + chunk])
                if pin:
                    inputs, targets = inputs.pin_memory(), targets.pin_memory()
                inputs, targets = to_device((inputs, targets), self.device)
                yield from zip(inputs.split(self.batch_size), targets.split(self.batch_size))
            return
        self._epoch_order[:] = indices.tolist()
        # Worker seeds for this pass: a function of (seed, epoch), so a resumed run's workers
        # draw what the uninterrupted run's did, and the global RNG is left alone.
        self._generator.manual_seed(self.workers.seed * 1_000_003 + epoch)
        if self._loader is None:
            w = self.workers
            self._loader = DataLoader(
                self.dataset, batch_size=self.batch_size, sampler=self._epoch_order, drop_last=self.drop_last,
                generator=self._generator, persistent_workers=w.persistent_workers and w.num_workers > 0,
                **w.loader_arguments(self.dataset),
            )
        for batch in self._loader:
            yield to_device(batch, self.device)


def build_train_loader(
    dataset, batch_size, rank, world_size, seed, drop_last, device, shuffle=True, limit_batches=0,
    workers: WorkerOptions = WorkerOptions(),
) -> BatchLoader:
    # limit_batches (overfit_batches): the epoch is the order's first limit_batches global batches
    order = ShuffledShards(len(dataset), rank, world_size, seed, shuffle, drop_last,
                           limit=limit_batches * batch_size * world_size)
    return BatchLoader(dataset, batch_size, order, device, drop_last=drop_last, workers=workers)


def build_val_loader(
    dataset, batch_size, rank, world_size, device, limit_samples=0, limit_batches=0,
    workers: WorkerOptions = WorkerOptions(),
) -> BatchLoader:
    """Each sample on exactly one rank. The limits are global, so the ranks together validate on
    the samples one process would: `limit_samples` > 0 the first samples, `limit_batches` > 0
    (trainer.limit_val_batches) the first limit_batches * batch_size, whatever the ranks."""
    length = min([len(dataset), *(limit for limit in (limit_samples, limit_batches * batch_size) if limit)])
    return BatchLoader(dataset, batch_size, Shards(length, rank, world_size), device, workers=workers)
