"""In-memory data sets that hand out whole batches with one gather.

Both classes are ordinary map-style torch Datasets (`len`, `ds[i]`), so they work with a
torch DataLoader; they also have `get_batch(indices)`, which the Trainer's loader uses to
take a batch as one indexing operation instead of `batch_size` `__getitem__` calls plus a
collate (trainer/loop/loaders.py).
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class PairDataset(Dataset):
    """Samples are rows of `inputs` with the matching rows of `targets`."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]


class SequenceDataset(Dataset):
    """Next-token samples: row i of `windows` (N, T + 1) gives inputs [:-1] and targets [1:].

    `windows` may be a strided view of one long token stream (see `windows_of`): a batch is
    then gathered straight from the stream without copying the stream itself.
    """

    def __init__(self, windows: torch.Tensor):
        if windows.dim() != 2 or windows.size(1) < 2:
            raise ValueError(f"windows must be (N, T + 1) with T >= 1, got {tuple(windows.shape)}")
        self.windows = windows

    @property
    def seq_len(self) -> int:
        return self.windows.size(1) - 1

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.windows[index].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.windows[indices].long()
        return windows[:, :-1], windows[:, 1:]


def windows_of(stream: torch.Tensor, seq_len: int, stride: int | None = None) -> torch.Tensor:
    """Windows of seq_len + 1 tokens over a 1-D stream, one every `stride` tokens. A view.
    The default, stride = seq_len, cuts non-overlapping windows, each sharing its last token
    with the next window's first, so every token is a target exactly once."""
    return stream.unfold(0, seq_len + 1, stride or seq_len)
