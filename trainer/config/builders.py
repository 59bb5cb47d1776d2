"""A run's data, task and model: checked before any work, built on each rank, the model with the
sizes the data dictates to it (`dims`, e.g. vocab_size, in_features, num_classes).

The data knows them as a data component's `dims` attribute (ringtrain's know theirs from their
arguments before `setup()`, where they can), or for `data.train` / `data.val` nodes `data.dims`,
else the training Dataset's `dims`. The data's lengths are held against the batch and the number
of ranks too (`check_data_lengths`, `check_validation_limit`).

Which model arguments get them, by the model node's own key `fill_sizes` (never passed on), and
`${data.dims.<name>}` anywhere in the model node: README, "Sizes the data dictates". By default a
`**kwargs` catch-all gets none: torchvision's and timm's factories pass it on to a class that may
not take `in_features`. Where the sizes are known only once the data is built (a text file's
vocabulary), `resolve` leaves the references as text for `fill_data_sizes` to fill when the model
is built, on each rank or from a checkpoint.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ringtrain.components import build, check, check_built, locate, parameters_of
from ringtrain.data import DataBundle, DataError
from ringtrain.data.tasks import check_monitor
from ringtrain.distributed import DistInfo, barrier
from ringtrain.errors import ConfigError

FILL_KEY = "fill_sizes"
FILL_MODES = ("named", "all", "none")
DIMS_REFERENCE = re.compile(r"\$\{data\.dims\.(\w+)\}")
POSITION_NAMES = ("n_positions", "max_position_embeddings", "block_size")


def resolve(cfg: Any) -> dict:
    from omegaconf import OmegaConf

    names = set(DIMS_REFERENCE.findall(str(cfg.get("model"))))  # a config's text shows its interpolations as written
    if not names:  # nothing waits for the data: resolved as composed (a tenth of the round trip below)
        return OmegaConf.to_container(cfg, resolve=True)
    plain = OmegaConf.to_container(cfg, resolve=False)
    data = plain.get("data") if isinstance(plain.get("data"), dict) else {}
    given = data.get("dims") if isinstance(data.get("dims"), dict) else None  # split data's own dims
    later = {name: "\\${data.dims.%s}" % name for name in names if given is None or name not in given}
    if later:  # resolves to the literal ${data.dims.<name>}
        plain["data"] = {**data, "dims": {**(given or {}), **later}}
    resolved = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    if later and given is None:
        del resolved["data"]["dims"]
    return resolved


def fill_data_sizes(node: Any, dims: Mapping[str, Any], key: str = "model") -> Any:
    if isinstance(node, Mapping):
        return {k: fill_data_sizes(v, dims, f"{key}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [fill_data_sizes(v, dims, f"{key}.{i}") for i, v in enumerate(node)]
    match = DIMS_REFERENCE.fullmatch(node) if isinstance(node, str) else None
    if match is None:
        return node
    if match[1] not in dims:
        raise ConfigError(
            f"{key}={node} but the data gives no {match[1]} (it gives {', '.join(dims) or 'no sizes'}); "
            f"set {key} to a number"
        )
    return dims[match[1]]


def names_filled(node: Mapping, names: list[str]) -> list[str]:
    """Which of the data's size `names` the model node's target gets from the data."""
    mode = node.get(FILL_KEY, "named")
    if isinstance(mode, (list, tuple)) and all(isinstance(name, str) for name in mode):
        mode = list(mode)
    elif mode not in FILL_MODES:
        raise ConfigError(
            f"model.{FILL_KEY}={mode!r} is not a way to fill the data's sizes; use named (the arguments the "
            f"model names), all (also **kwargs), none, or a list of size names"
        )
    if mode == "none":
        return []
    parameters = parameters_of(locate(node["_target_"], "model"))
    if parameters is None:  # a builtin without a signature
        return []
    named = {n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if isinstance(mode, list):
        for name in mode:
            if name not in names:
                raise ConfigError(f"model.{FILL_KEY} lists {name!r} but the data gives {', '.join(names) or 'no sizes'}; drop it")
            if name not in named and not takes_any:
                raise ConfigError(f"model.{FILL_KEY} lists {name!r} but {node['_target_']} takes no argument {name!r}; drop it")
        return [name for name in names if name in mode and name not in node]
    return [name for name in names if name not in node and (name in named or (mode == "all" and takes_any))]


def model_arguments(node: Mapping, dims: Mapping[str, int]) -> dict[str, int]:
    # What the data would fill were the node to set no size; one the node sets as well must agree.
    fillable = names_filled({k: v for k, v in node.items() if k not in dims}, list(dims))
    for name in fillable:
        if name in node and node[name] != dims[name]:
            raise ConfigError(
                f"model.{name}={node[name]} but the data has {name}={dims[name]}; drop the model.{name} override "
                f"(the data sets it) or set model.{FILL_KEY}=none to set every size yourself"
            )
    return {name: dims[name] for name in fillable if name not in node}


def check_model_sizes(model: nn.Module, dims: Mapping[str, Any], train: Any, data_node: Any) -> None:
    """The data's vocabulary and sequence length against the model's embedding rows
    (`get_input_embeddings()`, else `config.vocab_size`) and positions (POSITION_NAMES): a model
    too small is one line naming both numbers, not an index error deep in an embedding."""
    vocab = dims.get("vocab_size")
    embeddings = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    rows = (embeddings.num_embeddings if isinstance(embeddings, nn.Embedding)
            else getattr(getattr(model, "config", None), "vocab_size", None))
    if isinstance(vocab, int) and isinstance(rows, int) and vocab > rows:
        raise ConfigError(
            f"the data's vocabulary has {vocab} tokens but the model's input embedding has {rows} rows; set the "
            f"model's vocab_size to ${{data.dims.vocab_size}} (or at least {vocab})"
        )
    limit = position_limit(model)
    sequence_length = longest_sequence(train) if limit is not None else None  # a sample read only for this
    if sequence_length is not None and limit is not None and sequence_length > limit[1]:
        length_option = next((f"data.{key}" for key in ("seq_len", "max_length") if isinstance(data_node, Mapping)
                              and key in data_node), "the data's max_sequence_length")
        raise ConfigError(
            f"the data's sequences are {sequence_length} tokens long but the model has {limit[1]} positions "
            f"({limit[0]}); raise the model's {limit[0]} to {sequence_length} or shorten {length_option}"
        )


def position_limit(model: nn.Module) -> tuple[str, int] | None:
    """(the name, the number) of the longest sequence the model takes, where it says."""
    for owner in (getattr(model, "config", None), model):
        for name in POSITION_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return name, value
    return None


def longest_sequence(dataset: Any) -> int | None:
    """The longest sequence of token ids the training data feeds: what the Dataset says
    (`max_sequence_length`), else the length of its first sample's ids (fixed-length windows)."""
    if (said := getattr(dataset, "max_sequence_length", None)) is not None:
        return said
    try:
        sample = dataset[0]
    except Exception:  # an IterableDataset, or a Dataset that is not indexed this way
        return None
    ids = sample[0] if isinstance(sample, (tuple, list)) else sample.get("input_ids") if isinstance(sample, Mapping) else None
    if isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.is_floating_point():
        return ids.numel()
    return None


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
    return check(node, "model", kind=nn.Module, provided=filled, reserved=(FILL_KEY,), provided_by=provided_by)


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
