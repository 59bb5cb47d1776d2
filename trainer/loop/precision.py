"""Mixed precision: the autocast context and, for float16, the gradient scaler.

  32          full float32, no autocast
  bf16-mixed  autocast to bfloat16 (CPU and GPU); bfloat16 has float32's range, so no scaler
  16-mixed    autocast to float16 on CUDA with a GradScaler against gradient underflow
and, on CUDA, whether float32 matmuls may use TensorFloat-32 tensor cores (`trainer.tf32`), and
whether only deterministic kernels run (`trainer.deterministic`).

GradScaler.step reads "were there infs?" on the host every step (16-mixed only), unless the
optimizer is fused: fused AdamW (the default on CUDA) skips the step on the device, no sync.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ringtrain.strategies.base import NOTHING


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """trainer.tf32, on CUDA only: float32 matmuls on TF32 tensor cores ("high", 7-8x an A100/H100's
    float32 rate) or in full float32 ("highest", torch's default). Not the newer
    `torch.backends.cuda.matmul.fp32_precision`: set alone, it makes the legacy getter that
    inductor's autotuning calls raise (torch >= 2.9). CPUs are left alone: there "high" may switch
    float32 matmuls to bfloat16 passes."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def use_deterministic_algorithms(on: bool) -> None:
    """trainer.deterministic, as Lightning's `deterministic=True`: torch raises on an op with no
    deterministic kernel, cuDNN never benchmarks, and cuBLAS gets the fixed workspace its
    deterministic matmuls need, read when CUDA creates its handle: so this runs on each rank before
    its device is set up, and keeps a value the user set (":16:8" trades speed for memory)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Precision:
    def __init__(self, name: str, device: torch.device):
        self.device = device
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        return NOTHING if self.dtype is None else torch.autocast(self.device.type, self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:  # before clipping or reading the norm
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
