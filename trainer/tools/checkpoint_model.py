"""A trained model back from its checkpoint, for `ringtrain sample`, `evaluate`, `consolidate` and
`export`: built from the job the command composed (the checkpoint's recipe replayed, so every
`_target_` is ringtrain's or the user's own) with the data's sizes the checkpoint keeps. A Hugging
Face model is built from the config the checkpoint keeps (`architecture`), so its directory is not
needed again; a run with adapters only names its frozen base (checkpoints/frozen_base.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoints.files import CheckpointError, load_checkpoint
from ringtrain.checkpoints.frozen_base import load_over_base
from ringtrain.checkpoints.initial_weights import load_initial_weights
from ringtrain.checkpoints.sharded import load_sharded
from ringtrain.components import build, is_node, locate
from ringtrain.config.builders import build_model, check_model
from ringtrain.errors import ConfigError, UserError, component_failed
from ringtrain.models.pretrained import from_architecture
from ringtrain.tools import composed_job


def read_checkpoint(path: str, loaded: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint at `path`: as the command line's read left it (`loaded`, by path), else read now."""
    if loaded and path in loaded:
        return loaded[path].state
    if not Path(path).is_file():
        raise CheckpointError(f"checkpoint={path!r} is not a file; pass one a run wrote, e.g. "
                              f"checkpoint=outputs/runs/<run>/checkpoints/last.pt")
    return load_checkpoint(path, mmap=True)


def build_checked_model(state: Mapping[str, Any], path: str, job: Mapping[str, Any] | None = None,
                        trusted: bool = False) -> nn.Module:
    """The model of `job` (None: composed now from the checkpoint's recipe) with fresh weights, its adapters applied."""
    if job is None:
        job = composed_job(dict(state), path)
    node = job.get("model")
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise CheckpointError(f"checkpoint {path!r}: the job composed for it has no model; pass a checkpoint of a run")
    data_dims = state.get("data_dims") or {}
    trainer = job.get("trainer") or {}
    try:
        target = locate(node["_target_"], "model")
        if state.get("architecture") and "base" not in state and getattr(target, "__name__", "") == "from_pretrained":
            model = from_architecture(state["architecture"], target)
        else:  # from the node; a frozen base the checkpoint only names, as the run built it
            check_model(node, data_dims, "the checkpoint's data_dims")
            torch.manual_seed(trainer.get("seed", 0))
            model = build_model(node, data_dims)
            if "base" in state and trainer.get("init_from"):
                load_initial_weights(model, trainer["init_from"], trusted)
    except UserError:
        raise
    except Exception as err:  # e.g. a from_pretrained directory that is gone: one line
        raise component_failed(f"building the checkpoint's model ({node['_target_']})", err,
                               "the files its config names must be where the run had them") from None
    adapter = job.get("adapter")
    return build(adapter, "adapter").apply(model) if adapter else model


def rebuild_model(state: Mapping[str, Any], path: str, job: Mapping[str, Any] | None = None, weights: str = "model",
                  trusted: bool = False) -> nn.Module:
    """The checkpoint's model with its weights: the model's own, or a callback's (`weights=ema`).
    With a process group every rank calls it."""
    model = build_checked_model(state, path, job, trusted)
    try:
        if "shards" in state:
            load_sharded(state["shards"], model, trusted=trusted)
        elif "base" in state:  # adapters: the base rebuilt from the config must be the one trained on
            load_over_base(model, state, path)
        else:
            model.load_state_dict(state["model"])
        if weights != "model":
            kept = (state.get("callbacks") or {}).get(weights) or {}
            if not isinstance(kept.get("weights"), Mapping):
                holders = [n for n, s in (state.get("callbacks") or {}).items() if isinstance(s, Mapping) and "weights" in s]
                raise ConfigError(f"weights={weights}: checkpoint {path} keeps no weights of a callback {weights!r} (it "
                                  f"keeps {', '.join(['model', *holders])}); pass weights=model or one of those")
            model.load_state_dict(dict(kept["weights"]), strict=False)
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"the weights in {path!r} do not fit the model built from its config ({detail}); drop the "
                              f"model.* overrides that change its shape") from None
    return model


def task_kind(node: Any) -> Any:
    """What the job's task node builds (a class, or a function), None for no node or a target not
    importable here."""
    if not is_node(node):
        return None
    try:
        return locate(node["_target_"], "task")
    except ConfigError:
        return None
