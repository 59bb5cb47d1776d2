"""The data's lengths against the batch and the number of ranks: a job whose ranks would get
no sample, or no batch, is refused in one line; `check_data_lengths` on every rank once the data
is built (ringtrain/run.py), `check_validation_limit` before anything starts (config/schema.py).
"""
from __future__ import annotations

from typing import Any

from ringtrain.errors import ConfigError


def check_data_lengths(train: int, val: int | None, trainer: Any, ranks: int) -> None:
    """Every rank needs a training and a validation sample of its own; under trainer.drop_last
    a whole batch of trainer.batch_size each, or an epoch would have no step."""
    for split, length in (("training", train), ("validation", val)):
        if length is not None and length < ranks:
            raise ConfigError(
                f"the {split} set has {length} samples but {ranks} processes need at least one each; "
                f"use fewer processes or more data"
            )
    batch = trainer.batch_size
    if trainer.drop_last and train < batch * ranks:
        on_ranks = f" on each of {ranks} processes ({batch * ranks} samples)" if ranks > 1 else ""
        raise ConfigError(
            f"trainer.drop_last=true drops every batch: the training set has {train} samples, too few for one "
            f"batch of trainer.batch_size={batch}{on_ranks}; set trainer.batch_size={train // ranks} or lower, "
            f"or trainer.drop_last=false (a step then trains on the whole set)"
        )


def check_validation_limit(trainer: Any, ranks: int) -> None:
    """trainer.limit_val_batches=K validates on one process's first K batches, shared among the
    ranks (loop/loaders.py build_val_loader): each rank needs one of those samples."""
    samples = trainer.limit_val_batches * (trainer.val_batch_size or trainer.batch_size)
    if 0 < samples < ranks:
        raise ConfigError(
            f"trainer.limit_val_batches={trainer.limit_val_batches} validates on {samples} samples (one process's "
            f"first batches), fewer than the {ranks} processes that share them; validate on at least {ranks} "
            f"samples (raise trainer.limit_val_batches or trainer.val_batch_size)"
        )
