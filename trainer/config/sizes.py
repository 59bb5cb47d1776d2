"""The sizes the data dictates to the model (`dims`, e.g. vocab_size, in_features, num_classes).

Which model arguments get them, by the model node's own key `fill_sizes` (never passed on):
  named (default)  an argument the target names and the node leaves unset; a `**kwargs`
                   catch-all gets nothing (torchvision's and timm's factories pass it on to a
                   class that may not take `in_features`)
  all              also into a `**kwargs` catch-all (a factory of yours that forwards them)
  none             nothing: the node sets every size itself
  [names]          exactly these sizes, named or through `**kwargs`
The node may set a size the data fills only to the same value.

Anywhere inside the model node (a nested `transformers.GPT2Config` node too),
`${data.dims.vocab_size}` is the data's value. Where the sizes are known only once the data is
built (a text file's vocabulary), `resolve` leaves the references as text for
`fill_data_sizes` to fill when the model is built, on each rank or from a checkpoint.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ringtrain.components import locate, parameters_of
from ringtrain.errors import ConfigError

FILL_KEY = "fill_sizes"
FILL_MODES = ("named", "all", "none")
DIMS_REFERENCE = re.compile(r"^\$\{data\.dims\.(\w+)\}$")
POSITION_NAMES = ("n_positions", "max_position_embeddings", "block_size")


def resolve(cfg: Any) -> dict:
    """The composed config resolved to plain data, a `${data.dims.<name>}` the config cannot give
    yet left as text (see the module docstring)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=False)
    data = plain.get("data") if isinstance(plain.get("data"), dict) else {}
    given = data.get("dims") if isinstance(data.get("dims"), dict) else None  # split data's own dims
    names = set(re.findall(r"\$\{data\.dims\.(\w+)\}", json.dumps(plain.get("model"), default=str)))
    later = {name: "\\${data.dims.%s}" % name for name in names if given is None or name not in given}
    if later:  # resolves to the literal ${data.dims.<name>}
        plain["data"] = {**data, "dims": {**(given or {}), **later}}
    resolved = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    if later and given is None:
        del resolved["data"]["dims"]
    return resolved


def fill_data_sizes(node: Any, dims: Mapping[str, Any], key: str = "model") -> Any:
    """`node` with every `${data.dims.<name>}` replaced by the data's value."""
    if isinstance(node, Mapping):
        return {k: fill_data_sizes(v, dims, f"{key}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [fill_data_sizes(v, dims, f"{key}.{i}") for i, v in enumerate(node)]
    match = DIMS_REFERENCE.match(node) if isinstance(node, str) else None
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
    """The data's sizes the model gets (see the module docstring); refuse a disagreeing one."""
    filled = names_filled(node, list(dims))
    for name, value in dims.items():
        # Set in the node as well: refused where the data would fill it, when the values differ.
        unset = {k: v for k, v in node.items() if k != name}
        if name in node and node[name] != value and name in names_filled(unset, list(dims)):
            raise ConfigError(
                f"model.{name}={node[name]} but the data has {name}={value}; drop the model.{name} override "
                f"(the data sets it) or set model.{FILL_KEY}=none to set every size yourself"
            )
    return {name: dims[name] for name in filled}


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
