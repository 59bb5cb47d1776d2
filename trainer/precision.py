"""Mixed precision: the autocast context and, for float16, the gradient scaler.

  32          full float32, no autocast
  bf16-mixed  autocast to bfloat16 (CPU and GPU); bfloat16 has float32's range, so no scaler
  16-mixed    autocast to float16 on CUDA with a GradScaler against gradient underflow
"""
from __future__ import annotations

import contextlib

import torch


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
        # Only float16 needs loss scaling; without one, every call below is the plain operation.
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (before clipping or reading their norm)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step; with 16-mixed it is skipped when gradients overflowed. Returns
        whether the step was applied (GradScaler lowers its scale when it skips one)."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
