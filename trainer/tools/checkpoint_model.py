"""A trained model back from its checkpoint alone, for `ringtrain sample`, `evaluate`,
`consolidate` and `export`.

A checkpoint holds what rebuilds its model without the run's command line: the resolved model
node, the data's sizes (`data_dims`), a Hugging Face model's class and config (`architecture`:
no from_pretrained directory is read again, models/pretrained.py), adapters and the weights (the
model's, a callback's such as the EMA's, or a sharded directory read whole). A run with adapters
only names its frozen base (checkpoints/frozen_base.py), rebuilt from the config. The stored
config is checked first (config/trust.py): a checkpoint runs no code the user did not name.
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
from ringtrain.components import build
from ringtrain.config.builders import build_model, check_model
from ringtrain.config.trust import check_trusted
from ringtrain.errors import ConfigError, UserError, component_failed
from ringtrain.loop.precision import Precision
from ringtrain.models.pretrained import from_architecture

DEVICES = ("auto", "cpu", "cuda")


def read_checkpoint(path: str, own: Any = None, trust: bool = False) -> dict[str, Any]:
    """The checkpoint at `path` (weights_only, on the CPU, its tensors mapped), its stored config
    checked against the user's own config `own` (the command's) unless `trust`."""
    if not Path(path).is_file():
        raise CheckpointError(f"checkpoint={path!r} is not a file; pass one a run wrote, e.g. "
                              f"checkpoint=outputs/runs/<run>/checkpoints/last.pt")
    state = load_checkpoint(path, "cpu", mmap=True)
    if not trust:
        check_stored_config(state, path, own)
    return state


def check_stored_config(state: Mapping[str, Any], path: str, own: Any = None) -> None:
    """Refuse a checkpoint whose config would run code the user did not name (config/trust.py):
    every node of its config, and the class its architecture (a Hugging Face model) names."""
    architecture = state.get("architecture")
    named = {**state["config"], "architecture": {"_target_": architecture["class"]}} if architecture else state["config"]
    check_trusted(named, f"checkpoint {path}", own, "trust_checkpoint")


def model_node(state: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The checkpoint's model node; refused when the model was built in Python (no node)."""
    node = (state.get("config") or {}).get("model")
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise CheckpointError(f"checkpoint {path!r} holds no model config; pass a checkpoint written by train.py")
    if node.get("built_in_python"):
        raise CheckpointError(
            f"checkpoint {path!r} is of a model built in Python ({node['_target_']}), which its config cannot "
            f"rebuild; build that model yourself and load torch.load(path, weights_only=True)['model'] into it"
        )
    return dict(node)


def build_checked_model(state: Mapping[str, Any], path: str, node: Mapping[str, Any] | None = None) -> nn.Module:
    """The checkpoint's model with fresh weights: from its architecture when it keeps one and
    `node` (the model section, maybe changed by the command line) is its own, else from the node."""
    stored = model_node(state, path)
    node = dict(node) if node is not None else stored
    data_dims = state.get("data_dims") or {}
    trainer = (state.get("config") or {}).get("trainer") or {}
    try:
        if state.get("architecture") and node == stored and "base" not in state:
            model = from_architecture(state["architecture"])
        else:  # from the config; a frozen base the checkpoint only names, as the run built it
            check_model(node, data_dims, "the checkpoint's data_dims")
            torch.manual_seed(trainer.get("seed", 0))
            model = build_model(node, data_dims)
            if "base" in state and trainer.get("init_from"):
                load_initial_weights(model, trainer["init_from"])
    except UserError:
        raise
    except Exception as err:  # e.g. a from_pretrained directory that is gone: one line
        raise component_failed(f"building the checkpoint's model ({node['_target_']})", err,
                               "the files its config names must be where the run had them") from None
    adapter = (state.get("config") or {}).get("adapter")
    return build(adapter, "adapter").apply(model) if adapter else model


def rebuild_model(state: Mapping[str, Any], path: str, node: Mapping[str, Any] | None = None,
                  weights: str = "model") -> nn.Module:
    """The checkpoint's model with its weights: the model's own, or the ones a callback kept
    (`weights=ema`: the EMA callback's average). With a process group every rank calls it."""
    model = build_checked_model(state, path, node)
    try:
        if "shards" in state:
            load_sharded(state["shards"], model)
        elif "base" in state:  # adapters: the base rebuilt from the config must be the one trained on
            load_over_base(model, state, path)
        else:
            model.load_state_dict(state["model"])
        if weights != "model":
            model.load_state_dict(_callback_weights(state, weights, path), strict=False)
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"the weights in {path!r} do not fit the model built from its config ({detail}); drop the "
                              f"model.* overrides that change its shape") from None
    return model


def _callback_weights(state: Mapping[str, Any], name: str, path: str) -> dict[str, torch.Tensor]:
    kept = (state.get("callbacks") or {}).get(name) or {}
    if not isinstance(kept.get("weights"), Mapping):
        holders = [n for n, s in (state.get("callbacks") or {}).items() if isinstance(s, Mapping) and "weights" in s]
        raise ConfigError(f"weights={name}: checkpoint {path} keeps no weights of a callback {name!r} (it keeps "
                          f"{', '.join(['model', *holders])}); pass weights=model or one of those")
    return dict(kept["weights"])


def choose_device(name: str) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU; `cuda` without a GPU is refused."""
    if name not in DEVICES:
        raise ConfigError(f"device={name!r} is unknown; use one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu (or auto)")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def inference_precision(stored: Any, device: torch.device) -> Precision:
    """The run's `trainer.precision` for the forward passes; float16 needs CUDA, so a 16-mixed
    model runs in float32 on the CPU."""
    name = str(stored) if stored is not None else "32"
    if name == "16-mixed" and device.type != "cuda":
        name = "32"
    return Precision(name, device)
