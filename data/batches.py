"""What a batch is, how the model is called on it, and which of its outputs the task reads.

A batch is whatever the data's collate gives: torch's default collate of the Dataset's samples,
or the Dataset's own `collate_fn` when it defines one (torch DataLoader's argument name: a
callable taking the list of samples and returning the batch, e.g. padding variable-length rows
to the longest of the batch); the loader uses it (`collate_of`, `first_batch`). Such a Dataset
may also say how long its batches can get, as an int `max_sequence_length`: the run holds the
model's positions against it before the first step (config/builders.py). The batch is one of:
  * a pair of tensors `(inputs, target)`: the model is called as `model(inputs)` (ringtrain's
    own data sets, the fast path);
  * a longer tuple `(x1, x2, ..., target)`: `model(x1, x2, ...)`;
  * a mapping (Hugging Face style: input_ids, attention_mask, labels, pixel_values, ...):
    `model(**inputs)`, where the target is `task.target_key` (default: the key `labels` or
    `label`, as Hugging Face's data collators name it) and the inputs are `task.input_keys`
    (default: every other key whose value is a tensor; strings such as a raw `text` column
    are not model inputs).

A model may return a tensor, a tuple, a dict or a transformers `ModelOutput`; the task reads
`task.output_key` (default: `logits` when the output has it, else the tensor or the first
element). A task with `model_loss=True` trains on the loss the model computes itself when
given the target as `labels=` (Hugging Face models shift it for causal language modelling),
and validates with its own metrics on the logits.

Every caller (the training step, validation, `ringtrain evaluate`, `ringtrain sample`) goes
through `training_loss`, `eval_sums` or `logits`, so a batch or an output the task cannot use
is one ConfigError naming the keys and the fix, the same everywhere. A task object (ringtrain's own or a user's) may leave these settings out: then the
defaults above apply.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ringtrain.errors import ConfigError

# The keys Hugging Face's data collators (and torchvision-style dict data) give the target.
DEFAULT_TARGET_KEYS = ("labels", "label")


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device` (mappings key by key, tuples and lists item
    by item); anything else (strings, numbers) is left as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch) if not hasattr(batch, "_fields") \
            else type(batch)(*(to_device(value, device) for value in batch))
    return batch


def split_batch(task: Any, batch: Any) -> tuple[Any, torch.Tensor]:
    """(the model's inputs, the target) of one batch, as the module docstring describes."""
    if type(batch) is tuple and len(batch) == 2:  # the fast path: ringtrain's own (inputs, target)
        return batch
    if isinstance(batch, Mapping):
        return _split_mapping(task, batch)
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return (batch[0] if len(batch) == 2 else tuple(batch[:-1])), batch[-1]
    raise ConfigError(
        f"a batch is a {type(batch).__name__}{_shape_of(batch)}; a batch must be an (inputs, target) pair, a "
        f"tuple (inputs..., target) or a dict with the target under task.target_key: make the data's collate "
        f"give one of those"
    )


def _split_mapping(task: Any, batch: Mapping) -> tuple[dict[str, Any], torch.Tensor]:
    keys = list(batch)
    target_key = getattr(task, "target_key", None)
    if target_key is None:
        target_key = next((k for k in DEFAULT_TARGET_KEYS if k in batch), None)
        if target_key is None:
            raise ConfigError(
                f"batches are dicts with keys {keys} and none is the target (labels or label); set "
                f"task.target_key=<the key of the targets>"
            )
    elif target_key not in batch:
        raise ConfigError(f"batches are dicts with keys {keys}, without task.target_key={target_key!r}; set task.target_key to one of them")
    input_keys = getattr(task, "input_keys", None)
    if input_keys is None:
        inputs = {k: v for k, v in batch.items() if k != target_key and isinstance(v, torch.Tensor)}
        if not inputs:
            raise ConfigError(f"batches are dicts with keys {keys} and no tensor besides the target {target_key!r}; set task.input_keys")
        return inputs, batch[target_key]
    missing = [k for k in input_keys if k not in batch]
    if missing:
        raise ConfigError(f"batches are dicts with keys {keys}, without task.input_keys {missing}; set task.input_keys to keys of the batch")
    return {k: batch[k] for k in input_keys}, batch[target_key]


def call_model(model: nn.Module, inputs: Any, **extra: Any) -> Any:
    """model(inputs), model(*inputs) for a tuple, model(**inputs) for a mapping."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs, **extra)
    if isinstance(inputs, Mapping):
        return model(**inputs, **extra)
    return model(*inputs, **extra)


def pick_output(task: Any, outputs: Any) -> torch.Tensor:
    """The tensor the task reads from what the model returned (see the module docstring)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    key = getattr(task, "output_key", None)
    if isinstance(outputs, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
        chosen = key if key is not None else ("logits" if "logits" in outputs else None)
        value = outputs.get(chosen) if chosen is not None else None
        if isinstance(value, torch.Tensor):
            return value
        named = [k for k, v in outputs.items() if isinstance(v, torch.Tensor)]
        which = f"without task.output_key={key!r}" if key is not None else "without logits"
        raise ConfigError(
            f"the model returned a {type(outputs).__name__} {which} (it has {named}); set task.output_key to the "
            f"key of the predictions, e.g. task.output_key={named[0] if named else 'logits'}"
        )
    if isinstance(outputs, (tuple, list)) and outputs:
        index = 0 if key is None else key
        if isinstance(index, int) and -len(outputs) <= index < len(outputs) and isinstance(outputs[index], torch.Tensor):
            return outputs[index]
        raise ConfigError(
            f"the model returned a {type(outputs).__name__} of {len(outputs)} items and task.output_key={key!r} "
            f"does not pick a tensor of it; set task.output_key to an index (0 is the first)"
        )
    raise ConfigError(
        f"the model returned a {type(outputs).__name__}; the task reads a tensor, a tuple, a dict or a ModelOutput: "
        f"make the model's forward return one (and set task.output_key)"
    )


def model_loss(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself (task.model_loss=true): `loss` of a dict or
    ModelOutput, or the first element of a tuple (transformers' return_dict=False)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else (
        outputs[0] if isinstance(outputs, (tuple, list)) and outputs else None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(
            f"task.model_loss=true but the model returned a {type(outputs).__name__} without a scalar loss "
            f"(it computes one when given labels=); use a model that does, or task.model_loss=false"
        )
    return loss


def training_loss(task: Any, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(the batch's mean training loss, its target): the model called once on the batch."""
    inputs, target = split_batch(task, batch)
    if getattr(task, "model_loss", False):
        return model_loss(call_model(model, inputs, labels=target)), target
    return task.loss(pick_output(task, call_model(model, inputs)), target), target


def counted(task: Any, targets: torch.Tensor) -> int | torch.Tensor:
    """How many units a batch's training loss averages over: its samples, or what the task's
    `count` says (a tensor: a language model's tokens not labelled -100 vary per batch)."""
    count = getattr(task, "count", None)
    return count(targets) if callable(count) else samples_in(targets)


def summed_training_loss(task: Any, model: nn.Module, batch: Any, count: int | torch.Tensor) -> torch.Tensor:
    """The batch's training loss summed over its `count` units (`counted`): the task's
    `loss_sum`, else its mean loss (or the model's own, task.model_loss) times the count."""
    inputs, target = split_batch(task, batch)
    if getattr(task, "model_loss", False):
        mean = model_loss(call_model(model, inputs, labels=target))
        if not isinstance(count, torch.Tensor):
            return mean * count
        # Nothing to count (every label -100): the model's mean is 0/0; where() makes the batch's
        # share 0 and passes its backward no gradient, so the NaN never reaches the weights.
        return torch.where(count > 0, mean * count, torch.zeros_like(mean))
    outputs = pick_output(task, call_model(model, inputs))
    loss_sum = getattr(task, "loss_sum", None)
    return loss_sum(outputs, target) if callable(loss_sum) else task.loss(outputs, target) * count


def predictions(task: Any, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output the task reads, the target) of one batch: what validation scores. A
    model_loss task is scored by its own metrics too, on the logits."""
    inputs, target = split_batch(task, batch)
    return pick_output(task, call_model(model, inputs)), target


def logits(task: Any, model: nn.Module, inputs: Any) -> torch.Tensor:
    """The predictions for `inputs` alone (generation: no target)."""
    return pick_output(task, call_model(model, inputs))


def collate_of(dataset: Any) -> Callable[[list], Any] | None:
    """The dataset's own `collate_fn` (see the module docstring), or None for torch's default."""
    collate = getattr(dataset, "collate_fn", None)
    if collate is not None and not callable(collate):
        raise ConfigError(
            f"the {type(dataset).__name__} dataset's collate_fn is a {type(collate).__name__}, not a callable; make "
            f"it a function or method that takes the list of samples and returns the batch, or remove it"
        )
    return collate


def first_batch(dataset: Any, size: int) -> Any:
    """The dataset's first `size` samples as the loader batches them (trainer/loop/loaders.py):
    `get_batch` where the dataset has it, else its `collate_fn` (or torch's default collate)
    of its items."""
    count = min(size, len(dataset))
    if hasattr(dataset, "get_batch"):
        return dataset.get_batch(torch.arange(count))
    from torch.utils.data import default_collate

    return (collate_of(dataset) or default_collate)([dataset[i] for i in range(count)])


def samples_in(target: torch.Tensor) -> int:
    """The batch's number of samples (its target's first dimension)."""
    return target.shape[0]


def _shape_of(batch: Any) -> str:
    if isinstance(batch, (tuple, list)):
        return f" of {len(batch)} items"
    return f" of shape {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else ""
