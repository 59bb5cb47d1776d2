"""ringtrain's own data sets and tasks: plain `Dataset`s inside small data components, a module
each. Each option in conf/data/ is a `_target_` pointing at one of these classes, built exactly
as a user's data component is; conf/task/ points at the tasks in data/tasks.py.

Here, what ringtrain trains on: a data component's train and validation splits, the sizes they
dictate to the model, and (for text) the vocabulary to decode samples with.

A data component is anything a `_target_` builds that has `train` and `val` Datasets. If it
also has `setup()`, it follows LightningDataModule's contract: the constructor only stores
and checks its arguments (ringtrain builds it once during validation, before any work, to
catch mistakes), and `setup()` builds the splits, on every rank. ringtrain's own data sets
(regression, classification, tokens, text, token_file, cifar10) are such `DataModule`s.

The in-memory data sets ringtrain's own hand out (`PairDataset`, `SequenceDataset` over
`windows_of` a token stream): ordinary map-style torch Datasets (`len`, `ds[i]`) that also have
`get_batch(indices)`, which the Trainer's loader uses to take a batch as one gather instead of
`batch_size` `__getitem__` calls plus a collate (trainer/loop/loaders.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ringtrain.errors import UserError


class DataError(UserError, ValueError):
    """A data set that cannot be built as configured; the message names the key and the fix."""


def looked_in(path: str | Path) -> str:
    """Where a path that is not there was looked for: the working directory, for a relative
    path (hydra.job.chdir or a launcher may have moved it), nothing for an absolute one."""
    return "" if Path(path).expanduser().is_absolute() else f" (looked in {Path.cwd()})"


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    # Model sizes the data dictates, e.g. {"vocab_size": 65}: a model argument of that name
    # that the config leaves unset is filled with it.
    dims: dict[str, int] = field(default_factory=dict)
    # How to decode token ids back to text (data/vocab.py), for text data; kept in checkpoints.
    vocab: dict[str, Any] | None = None
    # The validation set's named parts (a mixture's sources, data/mixture.py), each also
    # validated alone: val/<name>/<metric> beside the whole set's val/<metric>.
    val_sources: dict[str, Dataset] = field(default_factory=dict)


class DataModule:
    """Base of ringtrain's data components: a cheap, checking constructor, then `setup()`.

    `dims` is known from the constructor's arguments where it can be (so a model that does not
    fit is refused before any data is built); a size whose value only `setup()` can know is
    listed with the value None. `train` and `val` exist after `setup()`.
    """

    train: Dataset
    val: Dataset
    vocab: dict[str, Any] | None = None

    def __init__(self) -> None:
        self.dims: dict[str, int] = {}

    def setup(self) -> None:
        raise NotImplementedError


def check_positive_ints(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"data.{name}={value!r} must be a positive integer")


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
