"""The pre-check's dry step: the whole first step on two real samples, before any work.

`dry_step(model, data, task)` runs as the last part of validation (config/schema.py), so
before Hydra makes a run directory:
  1. the data is set up (its `prepare_data`, a download say, is not run: data that needs it
     first is left to the run) and its first two training samples are collated, as the
     loader collates them: with the Dataset's own `collate_fn` where it has one, else
     torch's default collate (samples a collate cannot stack are left to the run); its
     splits' lengths are kept for the pre-check's next check (`data_lengths`: a batch or a
     number of ranks the data cannot fill, config/data_lengths.py);
  2. the model is built on the meta device (no memory, no initialisation): a constructor
     that raises is one line with its message and the key to change;
  3. the sizes the model reports (embedding rows, positions) are held against the data's
     (config/sizes.py): the positions against the batch's length, or against the Dataset's
     int `max_sequence_length` where it has one and it is longer (a Dataset whose collate
     pads each batch to its longest row, data/hf_rows.py's, says so how long a later batch
     can be: data/batches.py);
  4. the batch goes through data/batches.py, the path every step takes: the task splits it,
     the model is called on it (on meta tensors) and the task reads the output and takes
     its loss. A batch or an output the task cannot use is the contract's one line.
A failure only the meta device has (an op without a meta kernel, reading a value) is not the
user's: the step stops there silently and the run goes on. Only classes are called (config/
components.py: a function `_target_` may do anything), so a model or task built by a
function skips steps 2 to 4. Each configuration is checked once per process (validation runs
ahead of Hydra and again in the run), and each data node set up once per process (a sweep).
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ringtrain.config.builders import build_data, build_model, check_task
from ringtrain.config.components import build, locate
from ringtrain.config.sizes import check_model_sizes, references_data_sizes, sequence_length
from ringtrain.data.batches import first_batch, split_batch, to_device, training_loss
from ringtrain.errors import ConfigError, UserError

META = torch.device("meta")
SAMPLES = 2  # a batch of two: batch norm and the like need more than one sample



class _SetUp(NamedTuple):
    """What step 1 learned of a data node, kept for the pre-check's next jobs and checks."""

    batch: Any  # the first SAMPLES training samples collated; None: the collate cannot stack them
    dims: dict
    longest: int | None  # the longest batch the training Dataset says it makes (max_sequence_length)
    lengths: tuple[int, int] | None  # (training, validation) samples; None: a Dataset without __len__


_checked: set[str] = set()
_set_up: dict[str, _SetUp | None] = {}  # None: the data needs its prepare_data first


def dry_step(model: Mapping, data: Mapping, task: Mapping) -> None:
    """Run steps 1 to 4 of the module docstring; raise ConfigError on the first mistake."""
    key = _key(model, data, task)
    if key in _checked or not all(_is_class(node) for node in (model, task)):
        return
    set_up = _data_set_up(data)
    if set_up is not None and set_up.batch is not None:
        built = _build_on_meta(model, set_up.dims)
        if built is not None:
            _forward(built, check_task(build(task, "task")), set_up.batch, set_up.dims, set_up.longest,
                     _length_option(data))
    _checked.add(key)


def _data_set_up(data: Mapping) -> _SetUp | None:
    """The data node set up once (step 1), or None when it cannot be before the run (it needs
    its prepare_data first)."""
    key = _key(data)
    if key not in _set_up:
        try:
            bundle = build_data(data, prepare=False)
        except UserError:
            if _prepares(data):
                bundle = None  # its prepare_data fetches what setup() reads: the run does both
            else:
                raise
        _set_up[key] = None if bundle is None else _SetUp(
            _first_batch(bundle), dict(bundle.dims), _longest_batch(bundle), _split_lengths(bundle))
    return _set_up[key]


def data_lengths(data: Mapping) -> tuple[int, int] | None:
    """The (training, validation) samples of the data as step 1 set it up, or None where it
    did not (a model or task built by a function; data that needs its prepare_data first) or
    the data has no length."""
    set_up = _set_up.get(_key(data))
    return None if set_up is None else set_up.lengths


def _split_lengths(bundle) -> tuple[int, int] | None:
    try:
        return len(bundle.train), len(bundle.val)
    except TypeError:  # a Dataset without __len__: the run's loader says what it lacks
        return None


def _longest_batch(bundle) -> int | None:
    longest = getattr(bundle.train, "max_sequence_length", None)
    return longest if isinstance(longest, int) and not isinstance(longest, bool) else None


def _first_batch(bundle) -> Any:
    try:
        return first_batch(bundle.train, SAMPLES)
    except ConfigError:  # a collate_fn that is not callable
        raise
    except Exception:  # samples the collate cannot stack: the run's loader says how
        return None


def _build_on_meta(node: Mapping, dims: dict) -> torch.nn.Module | None:
    if any(value is None for value in dims.values()) and references_data_sizes(node):
        return None
    with META:
        try:
            return build_model(node, dims)
        except ConfigError:
            raise
        except Exception as raised:
            err = raised.__cause__ if type(raised).__name__ == "InstantiationException" and raised.__cause__ else raised
            if isinstance(err, ConfigError):
                raise err from None
            if _meta_only(err):
                return None
            raise ConfigError(
                f"model ({node['_target_']}) raised {type(err).__name__}: {_one_line(err)}; fix the model.* "
                f"arguments it names"
            ) from None


def _length_option(data: Mapping) -> str:
    """What sets a longest batch, as the refusal names it: data.max_length for hf_rows."""
    return "data.max_length" if "max_length" in data else "the data's max_sequence_length"


def _forward(model: torch.nn.Module, task: Any, batch: Any, dims: dict, longest: int | None, option: str) -> None:
    inputs, _ = split_batch(task, batch)
    length = sequence_length(inputs)
    if length is not None and longest is not None and longest >= length:
        check_model_sizes(model, dims, longest, option)
    else:
        check_model_sizes(model, dims, length)
    try:
        with torch.no_grad():
            training_loss(task, model, to_device(batch, META))
    except ConfigError:
        raise
    except Exception as err:
        if _meta_only(err):
            return
        raise ConfigError(
            f"a training batch ({_describe(batch)}) through the model and the task raised {type(err).__name__}: "
            f"{_one_line(err)}; make the model, the data and the task fit each other"
        ) from None


def _is_class(node: Mapping) -> bool:
    return inspect.isclass(locate(node["_target_"], "?"))


def _prepares(data: Mapping) -> bool:
    target = locate(data["_target_"], "data") if "_target_" in data else None
    return callable(getattr(target, "prepare_data", None))


def _meta_only(err: Exception) -> bool:
    """An error of the meta device, not of the user's configuration."""
    return "meta" in str(err).lower() or isinstance(err, NotImplementedError)


def _describe(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return "a dict of " + ", ".join(f"{k} {_shape(v)}" for k, v in batch.items())
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of " + ", ".join(_shape(v) for v in batch)
    return _shape(batch)


def _shape(value: Any) -> str:
    return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" if isinstance(value, torch.Tensor) \
        else type(value).__name__


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def _key(*nodes: Mapping) -> str:
    return json.dumps(nodes, sort_keys=True, default=repr)
