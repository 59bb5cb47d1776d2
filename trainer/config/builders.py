"""A run's data, task and model: checked before any work, built on each rank.

The data decides some of the model's sizes (`dims`; how they reach the model: config/sizes.py):
a data component's `dims` attribute (ringtrain's know theirs from their arguments before
`setup()`, where they can), or for `data.train` / `data.val` nodes `data.dims`, else the
training Dataset's `dims`. The data's lengths are held against the batch and the number of
ranks too (`check_data_lengths`, `check_validation_limit`).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from ringtrain.components import build, check, check_built
from ringtrain.config.sizes import FILL_KEY, fill_data_sizes, model_arguments, names_filled
from ringtrain.data.bundle import DataBundle, DataError
from ringtrain.data.tasks import check_monitor
from ringtrain.distributed import DistInfo, barrier
from ringtrain.errors import ConfigError

SPLIT_DATA_KEYS = ("train", "val", "dims")  # ringtrain's own keys in a data node with train/val splits


def check_data(node: Mapping) -> dict[str, int | None] | None:
    """Check the data node; return the sizes it will give the model (None: unknown until built)."""
    if "_target_" in node:
        target = check(node, "data")
        if not hasattr(target, "setup"):
            return None  # built on each rank; its sizes are known then
        module = _construct(lambda: build(node, "data"))
        return dict(getattr(module, "dims", {}))
    if "train" not in node or "val" not in node:
        raise ConfigError(
            "data needs a _target_ (a data component) or train and val nodes (two Datasets), e.g. "
            "data.train._target_=my_pkg.data.MyDataset; see README 'Your own model and data'"
        )
    for key in node:
        if key not in SPLIT_DATA_KEYS:
            raise ConfigError(f"data.{key} is not a key of split data; use data.train, data.val and data.dims")
    for split in ("train", "val"):
        check(node[split], f"data.{split}", kind=Dataset)
    dims = node.get("dims")
    if dims is not None and not isinstance(dims, Mapping):
        raise ConfigError(f"data.dims={dims!r} must map size names to integers, e.g. {{num_classes: 10}}")
    return dict(dims) if dims is not None else None


def check_task(task: Any) -> Any:
    for method in ("loss", "eval_sums"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(
                f"task._target_ built a {type(task).__name__} without a {method}() method; a task needs "
                f"loss(outputs, targets) and eval_sums(outputs, targets) (see ringtrain/data/tasks.py, or use ringtrain.data.tasks.LossTask)"
            )
    try:
        check_monitor(task)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return task


def build_data(node: Mapping, dist: DistInfo | None = None) -> DataBundle:
    """The train and validation splits the data node describes (on each rank). A component's
    `prepare_data()` (a download) runs once per machine, on local rank 0, while the other ranks
    wait; then every rank runs `setup()`."""
    if "_target_" in node:
        component = build(node, "data")
        if hasattr(component, "prepare_data"):
            if dist is None or dist.local_rank == 0:
                _construct(component.prepare_data)
            if dist is not None:
                barrier(dist)
        if hasattr(component, "setup"):
            _construct(component.setup)
        for split in ("train", "val"):
            if not hasattr(component, split):
                raise ConfigError(
                    f"data._target_ built a {type(component).__name__} without a {split!r} attribute; a data "
                    f"component needs train and val Datasets (or use data.train and data.val nodes)"
                )
        return DataBundle(
            train=component.train, val=component.val,
            dims=dict(getattr(component, "dims", {}) or {}), vocab=getattr(component, "vocab", None),
            val_sources=dict(getattr(component, "val_sources", {}) or {}),
        )
    train, val = (build(node[split], f"data.{split}") for split in ("train", "val"))
    dims = node.get("dims") or getattr(train, "dims", None) or {}
    return DataBundle(train=train, val=val, dims=dict(dims), vocab=getattr(train, "vocab", None))


def check_model(node: Mapping, dims: Mapping[str, Any] | None, provided_by: str) -> Any:
    """Hold the model node against its target (components.py), with the data's sizes
    `dims` (None: not known before the data is built) as the arguments ringtrain fills."""
    filled = None if dims is None else names_filled(node, list(dims))
    return check(node, "model", kind=nn.Module, provided=filled, reserved=(FILL_KEY,),
                 provided_by=provided_by if dims is not None else "")


def build_model(node: Mapping, dims: Mapping[str, int]) -> nn.Module:
    arguments = fill_data_sizes({k: v for k, v in node.items() if k != FILL_KEY}, dims)
    model = build(arguments, "model", **model_arguments(node, dims))
    return check_built(model, "model", nn.Module)


def _construct(make):
    """Run a data component's constructor or setup; its ValueErrors are the user's mistakes."""
    try:
        return make()
    except (DataError, ConfigError):
        raise
    except ValueError as err:
        raise ConfigError(f"data: {' '.join(str(err).split())}") from None


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
