"""A new run's starting weights from a file, `trainer.init_from=<path>` (README.md "Starting
from trained weights"): a ringtrain checkpoint (plain or sharded), a .safetensors file or a
torch.save(model.state_dict()) file. Weights only, into the bare model after it is built and
before the strategy wraps or shards it, so every rank starts from the same file.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ringtrain.checkpoints.files import Unusable, read_checkpoint
from ringtrain.errors import ConfigError


def load_initial_weights(model: nn.Module, path: str | Path, trusted: bool = False) -> int:
    """Load the weights in `path` into the bare `model` after check_shapes_fit; returns how many
    tensors. `trusted`: a sharded checkpoint's index is unpickled whole (checkpoints/sharded.py)."""
    path = str(path)
    state = {"model": _read_safetensors(path)} if path.endswith(".safetensors") else _read_torch_file(path)
    if "shards" in state:  # a sharded fsdp checkpoint: DCP reads its shards into the model
        from ringtrain.checkpoints.sharded import load_sharded, sharded_model_shapes

        check_shapes_fit(model, sharded_model_shapes(state["shards"], trusted), f"trainer.init_from={path}")
        load_sharded(state["shards"], model, trusted=trusted)
        return len(model.state_dict())
    weights = state["model"]
    check_shapes_fit(model, {name: tensor.shape for name, tensor in weights.items()}, f"trainer.init_from={path}")
    model.load_state_dict(weights, strict=False)  # strict in substance: check_shapes_fit
    return len(weights)


def check_shapes_fit(model: nn.Module, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    """Every tensor named in `shapes` is one of `model`'s with that shape, and every tensor of the
    model is named, or tied to one that is (safetensors stores those once); else one ConfigError line."""
    expected = model.state_dict(keep_vars=True)
    fix = "start from weights of the same model, or set the model's sizes to the file's"
    for name, shape in shapes.items():
        if name not in expected:
            raise ConfigError(f"{source} holds {name!r}, which this model has not; {fix}")
        want, have = list(expected[name].shape), list(shape)
        if want != have:
            raise ConfigError(f"{source}: {name} has shape {have} there but {want} in this model; {fix}")
    loaded = {id(expected[name]) for name in shapes}  # a tied tensor is one object under two names
    missing = [name for name, tensor in expected.items() if name not in shapes and id(tensor) not in loaded]
    if missing:
        raise ConfigError(f"{source} holds no {missing[0]!r} ({len(missing)} of this model's {len(expected)} "
                          f"tensors are missing); {fix}")


def _read_torch_file(path: str) -> dict:
    """A ringtrain checkpoint (through the loader every tool uses, with its checks), else a
    plain `torch.save(model.state_dict())` file as {"model": ...}."""
    try:
        return read_checkpoint(path)
    except Unusable as err:  # a state_dict file carries torch.save's checksums too
        if err.damaged:
            raise ConfigError(f"trainer.init_from={path} {err}; pass an intact copy of it") from None
        refusal = err
    with contextlib.suppress(Exception):  # not a file torch reads either: refused below
        plain = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(plain, dict) and plain and all(isinstance(v, torch.Tensor) for v in plain.values()):
            return {"model": plain}
    raise ConfigError(
        f"trainer.init_from={path} is neither a ringtrain checkpoint nor a state_dict file ({refusal}); pass "
        f"a checkpoint, a torch.save(model.state_dict()) file or a .safetensors file"
    ) from None


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ConfigError(f"trainer.init_from={path} is a safetensors file but safetensors is not installed; "
                          f"pip install 'ringtrain[hf]' (or safetensors)") from None
    try:
        with safe_open(path, "pt", device="cpu") as file:
            return {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError) as err:
        detail = " ".join(str(err).split())[:200]
        raise ConfigError(f"trainer.init_from={path} cannot be read as safetensors ({detail}); pass a .safetensors file") from None
