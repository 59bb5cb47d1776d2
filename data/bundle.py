"""What every data set builder returns, and the checks their configs share."""
from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

from data.tasks import Task


class DataError(ValueError):
    """A data set that cannot be built as configured; the message names the key and the fix."""


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    task: Task
    # Model sizes the data dictates, e.g. {"vocab_size": 65}; filled into the model config.
    model_dims: dict[str, int]


def check_positive_ints(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"data.{name}={value!r} must be a positive integer")
