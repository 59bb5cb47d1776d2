"""A Hugging Face model as a checkpoint keeps it: its class and its config, as data, so that the
model is rebuilt (ringtrain sample, evaluate, export) without the directory or the Hub name
`from_pretrained` read it from, which may be gone or out of reach by then. The class that builds
it is the one the user's own model node names, never the checkpoint's."""
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


def from_architecture(described: dict[str, Any], loader: Any) -> nn.Module:
    """The model `architecture` described, with fresh weights, built by the class whose
    `from_pretrained` the user's model node names (`loader`): the checkpoint's config is data
    for it. An Auto class picks among the library's own classes by the config's model_type, as
    from_pretrained would from the directory's config.json, never a directory's code."""
    owner = getattr(loader, "__self__", None)
    if not isinstance(owner, type) or not isinstance(described, dict) or not isinstance(described.get("config"), dict):
        raise ValueError(f"{loader} is not a class's from_pretrained, or the checkpoint's architecture is not data")
    config = {key: value for key, value in described["config"].items() if key != "auto_map"}
    if callable(getattr(owner, "from_config", None)):  # an Auto class
        from transformers import AutoConfig

        return owner.from_config(AutoConfig.for_model(**config), trust_remote_code=False)
    return owner(owner.config_class.from_dict(config))
