"""A Hugging Face model as a checkpoint keeps it: its class and its config, so that the model is
rebuilt from the checkpoint alone (ringtrain sample, evaluate, export), not from the directory
or the Hub name `from_pretrained` read it from, which may be gone or out of reach by then."""
from __future__ import annotations

import json
from typing import Any

from torch import nn


def architecture(model: nn.Module) -> dict[str, Any] | None:
    """{"class": import path, "config": the model's config as plain data} for a transformers
    model (one with a config and save_pretrained), else None."""
    config = getattr(model, "config", None)
    if not callable(getattr(model, "save_pretrained", None)) or not callable(getattr(config, "to_json_string", None)):
        return None
    # fully_shard (FSDP2) swaps the class for a subclass of torch.distributed's: the model's own is its base
    cls = next(c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed."))
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": json.loads(config.to_json_string())}


def from_architecture(described: dict[str, Any]) -> nn.Module:
    """The model `architecture` described, with fresh weights (its class built from its config)."""
    from ringtrain.components import locate

    cls = locate(described["class"], "the checkpoint's architecture")
    return cls(cls.config_class.from_dict(described["config"]))
