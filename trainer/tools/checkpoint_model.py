"""A trained model back from its checkpoint alone, for `ringtrain sample`, `evaluate`, `consolidate` and `export`.

A ringtrain checkpoint holds what rebuilds the model without the run's command line: the
resolved model node (`config["model"]`, a `_target_` plus its arguments), the sizes the data
gave the model (`data_dims`) and the weights (`model`, or the `shards` directory of a sharded
fsdp checkpoint, read whole into this process's model). `rebuild_model` checks the node
against its target's signature first (trainer/components.py), so a user's model whose
package is not importable from here is one line naming the fix, not a traceback.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.config.builders import build_model, check_model
from ringtrain.checkpoints.files import CheckpointError, load_checkpoint
from ringtrain.errors import ConfigError, UserError, component_failed
from ringtrain.checkpoints.sharded import load_sharded
from ringtrain.loop.precision import Precision

DEVICES = ("auto", "cpu", "cuda")


def read_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint at `path` (weights_only, on the CPU), or a CheckpointError naming the fix.
    `mmap`: map the tensors instead of reading them (cheap when only the config is wanted)."""
    if not Path(path).is_file():
        raise CheckpointError(
            f"checkpoint={path!r} is not a file; pass one a run wrote, e.g. "
            f"checkpoint=outputs/runs/<run>/checkpoints/last.pt"
        )
    return load_checkpoint(path, "cpu", mmap=mmap)


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


def build_checked_model(node: Mapping[str, Any], data_dims: Mapping[str, Any]) -> nn.Module:
    """The model `node` describes, with the data's sizes filled in, its node checked first."""
    check_model(node, data_dims, "the checkpoint's data_dims")
    try:
        return build_model(node, data_dims)
    except UserError:
        raise
    except Exception as err:  # e.g. from_pretrained's directory is gone: one line, not Hydra's block
        raise component_failed(
            f"building the checkpoint's model ({node['_target_']})", err,
            "the files its config names (a from_pretrained directory, say) must be where the run had them",
        ) from None


def rebuild_model(node: Mapping[str, Any], data_dims: Mapping[str, Any], state: Mapping[str, Any],
                  path: str) -> nn.Module:
    """Build the model `node` describes, with the data's sizes filled in, and load the weights
    of the checkpoint `state` (read from `path`). With a process group every rank calls it."""
    model = build_checked_model(node, data_dims)
    try:
        if "shards" in state:
            load_sharded(state["shards"], model)
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as err:
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(
            f"the weights in {path!r} do not fit the model built from its config ({detail}); drop the "
            f"model.* overrides that change its shape"
        ) from None
    return model


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
    """The run's `trainer.precision` for the forward passes; float16 needs CUDA, so a
    16-mixed model runs in float32 on the CPU."""
    name = str(stored) if stored is not None else "32"
    if name == "16-mixed" and device.type != "cuda":
        name = "32"
    return Precision(name, device)
