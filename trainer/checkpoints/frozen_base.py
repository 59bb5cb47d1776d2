"""Checkpoints of a run with adapters (adapter=lora): the frozen base weights are not copied into
every checkpoint. They come from where the run took them (its model config: a from_pretrained
directory, trainer.init_from, a seed), and the checkpoint names them by a CRC-32 over their
bytes (`base`), so a resume or a tool that rebuilt them from elsewhere refuses weights that are
not the ones the adapters were trained on. A LoRA step file of GPT-2 small is ~1 % of a full one.
"""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoints.files import CheckpointError


def base_identity(model: nn.Module) -> dict[str, Any]:
    """The frozen parameters' count, elements and the CRC-32 of their bytes (of the bare, unsharded model)."""
    frozen = [param for param in model.parameters() if not param.requires_grad]
    crc = 0
    for param in frozen:
        crc = zlib.crc32(param.detach().cpu().contiguous().view(torch.uint8).numpy(), crc)
    return {"crc32": crc, "tensors": len(frozen), "elements": sum(param.numel() for param in frozen)}


def trainable_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: tensor for name, tensor in weights.items() if name in trainable}


def load_over_base(model: nn.Module, state: dict[str, Any], path: str | Path, found: dict | None = None) -> None:
    """Load a checkpoint's trainable weights into `model`, whose frozen base was built again
    from the run's config: refused unless that base is, byte for byte, the one stored `state`
    names. `found`: the model's base_identity, where the caller has it already."""
    found, kept = found or base_identity(model), state["base"]
    if found != kept:
        raise CheckpointError(
            f"checkpoint '{path}' holds adapters trained on other base weights than this model's (CRC-32 "
            f"{kept['crc32']:08x} over {kept['tensors']} frozen tensors, here {found['crc32']:08x} over "
            f"{found['tensors']}); rebuild the base the run trained on (its from_pretrained directory, "
            f"trainer.init_from) unchanged")
    here = model.state_dict()
    if reshaped := [name for name, tensor in state["model"].items() if name in here and here[name].shape != tensor.shape]:
        # The adapters' shapes are their rank's (lora_A is r x in): name the one the run trained with.
        r = ((state.get("config") or {}).get("adapter") or {}).get("r", "?")
        name = reshaped[0]
        raise CheckpointError(f"checkpoint '{path}' holds adapters trained with adapter.r={r} ({name} is "
                              f"{list(state['model'][name].shape)} there, {list(here[name].shape)} here); resume with "
                              f"adapter.r={r}")
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    # Every name a frozen tensor has: a tied one (GPT-2's lm_head.weight, the token embedding's)
    # is listed once by named_parameters() but is a key of the state dict under each name.
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    if wrong := sorted(unexpected or set(missing) - frozen - buffers):
        raise CheckpointError(f"checkpoint '{path}' does not fit this model's adapters ({wrong[0]}, and "
                              f"{len(wrong) - 1} more); apply the adapter settings the run trained with")
