"""A run's components: all checked before any work (`check_components`), built on each rank.

The data decides some of the model's sizes (its `dims`, e.g. in_features, num_classes,
vocab_size): which model arguments get them, and `${data.dims.<name>}` anywhere in the model
node, is config/sizes.py.

Where the data's sizes come from:
  * a data component built from `data._target_`: its `dims` attribute (ringtrain's
    DataModules know theirs from their arguments before `setup()`, where they can);
  * `data.train` / `data.val` nodes (two Datasets): `data.dims` in the node, else a `dims`
    attribute of the training Dataset.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from ringtrain.checkpoints.initial_weights import check_shapes_fit, initial_weight_shapes
from ringtrain.data.bundle import DataBundle, DataError
from ringtrain.data.tasks import check_monitor
from ringtrain.config.components import build, check, check_built
from ringtrain.distributed import DistInfo, barrier
from ringtrain.errors import ConfigError
from ringtrain.config.optim import OPTIMIZER_KEYS, SCHEDULER_KEYS, build_optimizer, build_scheduler
from ringtrain.config.sizes import FILL_KEY, fill_data_sizes, model_arguments, names_filled

# ringtrain's own keys in a data node with train/val splits.
SPLIT_DATA_KEYS = ("train", "val", "dims")


def check_components(model: Mapping | None, data: Mapping | None, task: Mapping | None,
                     optimizer: Any, scheduler: Any, max_steps: int, init_from: str | None = None) -> None:
    """Every mistake in the component nodes, as a ConfigError, before anything is built.

    Cheap constructions run as well, so that the components' own argument checks fire now:
    the data component (its constructor only checks, by contract), the task, the optimizer
    and schedule on a stand-in parameter (the model, on the meta device, is config/dry_step.py's
    business). Only classes are constructed here: a
    function `_target_` may do anything when called (print, load files, train), so it is
    held against its signature alone and first called when the rank builds it. The model
    built there is also held against `init_from`'s tensor shapes (trainer.init_from).
    """
    dims = check_data(data) if data is not None else {}
    if task is not None and inspect.isclass(check(task, "task")):
        check_task(build(task, "task"))
    if model is not None:
        target = check_model(model, dims, f"the data ({data.get('_target_', 'data.train/val')}, which gives "
                                          f"{', '.join(dims or {}) or 'no sizes'})")
        # The dry step (config/dry_step.py) builds the model on meta; here only for init_from's shapes.
        if init_from is not None and inspect.isclass(target) and dims is not None \
                and all(value is not None for value in dims.values()):
            dry = _dry_build_model(model, dims)
            if dry is not None:
                check_shapes_fit(dry, initial_weight_shapes(init_from), f"trainer.init_from={init_from}")
    optimizer_class = scheduler_class = False
    if isinstance(optimizer, Mapping):
        optimizer_class = inspect.isclass(check(optimizer, "optimizer", kind=torch.optim.Optimizer, provided={"params"},
                                                reserved=OPTIMIZER_KEYS, passed={"params"}))
    if isinstance(scheduler, Mapping):
        scheduler_class = inspect.isclass(check(scheduler, "scheduler", kind=LRScheduler, provided={"optimizer", "total_steps"},
                                                reserved=SCHEDULER_KEYS, passed={"optimizer"}))
    if optimizer_class:
        stand_in = nn.Linear(2, 2)
        built = check_built(build_optimizer(optimizer, stand_in, torch.device("cpu")), "optimizer", torch.optim.Optimizer)
        if scheduler is None or scheduler_class:
            check_built(build_scheduler(scheduler, built, max(max_steps, 1000)), "scheduler", LRScheduler)


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


def build_data(node: Mapping, dist: DistInfo | None = None, prepare: bool = True) -> DataBundle:
    """The train and validation splits the data node describes (on each rank).

    A component's `prepare_data()` (a download, say) runs once per machine, on local rank 0,
    while the other ranks wait; then every rank runs `setup()`. `prepare=False` skips it
    (the pre-check's dry step, config/dry_step.py).
    """
    if "_target_" in node:
        component = build(node, "data")
        if prepare and hasattr(component, "prepare_data"):
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
        )
    train, val = (build(node[split], f"data.{split}") for split in ("train", "val"))
    dims = node.get("dims") or getattr(train, "dims", None) or {}
    return DataBundle(train=train, val=val, dims=dict(dims), vocab=getattr(train, "vocab", None))


def check_model(node: Mapping, dims: Mapping[str, Any] | None, provided_by: str) -> Any:
    """Hold the model node against its target (config/components.py), with the data's sizes
    `dims` (None: not known before the data is built) as the arguments ringtrain fills."""
    filled = None if dims is None else names_filled(node, list(dims))
    return check(node, "model", kind=nn.Module, provided=filled, reserved=(FILL_KEY,),
                 provided_by=provided_by if dims is not None else "")


def build_model(node: Mapping, dims: Mapping[str, int]) -> nn.Module:
    """The model `node` describes, given the data's sizes (config/sizes.py)."""
    arguments = fill_data_sizes({k: v for k, v in node.items() if k != FILL_KEY}, dims)
    model = build(arguments, "model", **model_arguments(node, dims))
    return check_built(model, "model", nn.Module)


def _dry_build_model(node: Mapping, dims: Mapping[str, int]) -> nn.Module | None:
    """Build the model on the meta device, so its own argument checks run now; a model that
    cannot be built there (it loads files, say) is simply built later (None)."""
    with torch.device("meta"):
        try:
            return build_model(node, dims)
        except ConfigError:
            raise
        except Exception:
            return None


def _construct(make):
    """Run a data component's constructor or setup; its ValueErrors are the user's mistakes."""
    try:
        return make()
    except (DataError, ConfigError):
        raise
    except ValueError as err:
        raise ConfigError(f"data: {' '.join(str(err).split())}") from None
