"""One class per way of training (single, dp, ddp, fsdp), chosen by `_target_` in
conf/strategy/, a module each, plus what they share (the process-group base, starting ranks
through torch's elastic launcher, compiling the model); here the strategy interface, what every
strategy does as one process on one device (which is `strategy=single`), and the numeric
precision and determinism every strategy computes with.

A strategy is Lightning Fabric's idea without its class tree: docs/ARCHITECTURE.md's Strategies
table lists its methods in the order a run calls them, what each strategy does, and how to add yours.

Mixed precision (`Precision`, trainer.precision): the autocast context and, for float16, the
gradient scaler.
  32          full float32, no autocast
  bf16-mixed  autocast to bfloat16 (CPU and GPU); bfloat16 has float32's range, so no scaler
  16-mixed    autocast to float16 on CUDA with a GradScaler against gradient underflow

GradScaler.step reads "were there infs?" on the host every step (16-mixed only), unless the
optimizer is fused: fused AdamW (the default on CUDA) skips the step on the device, no sync.

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoints.state_dicts import full_model_state_dict, full_optimizer_state_dict
from ringtrain.distributed import DistInfo, launcher_ranks, resolve_device
from ringtrain.errors import ConfigError

NOTHING = contextlib.nullcontext()  # what does nothing around a step; keeps no state, so one serves every step


class Strategy:
    """One process, one device. Subclasses override what differs."""

    # Whether the ranks are separate processes in one process group (ddp, fsdp).
    spans_processes = False
    # Whether a forward pass is itself a collective (fsdp all-gathers each layer's shards), so
    # every rank must run as many as the others, in evaluation too (loop/evaluation.py).
    forwards_in_lockstep = False
    # How long a collective may wait for another rank (None: there are no other ranks).
    timeout_minutes: float | None = None
    # The conf/strategy option this class is, for messages (a subclass of yours inherits it).
    option = "single"

    def check(self, trainer: Any) -> None:
        """Refuse trainer settings this strategy cannot honour, and ranks started in a way it
        does not match (ConfigError, one line). A subclass calls super().check(trainer)."""
        ranks, _ = launcher_ranks()
        if ranks > 1 and not self.spans_processes:
            # Each rank would train alone, as a job of its own: rank 0 in the run directory, the
            # others (told to write nothing there) in the current folder, and resume from it next time.
            raise ConfigError(
                f"torchrun started {ranks} ranks, but strategy={self.option} trains in one process; "
                f"add strategy=ddp (or strategy=fsdp), or run without torchrun"
            )

    def launch(self, fn: Callable[..., Any], *args: Any, stop_signals: Sequence[str] = (),
               accelerator: str = "auto") -> Any:
        """Run `fn(*args)` on every rank this strategy trains with; return rank 0's result.
        `stop_signals` sent to this process reach every rank (they stop as the loop does);
        `accelerator` is trainer.accelerator, the device the ranks will use."""
        return fn(*args)

    def planned_ranks(self) -> int:
        """How many ranks `launch` will run on, known before any work: the pre-check holds the
        data and the batch against it (config/builders.py)."""
        return 1

    def setup_process(self, accelerator: str) -> DistInfo:
        """This process's rank, world size and device (and its process group, if any)."""
        return DistInfo(0, 0, 1, resolve_device(accelerator, 0), None)

    def autocast_precision(self, precision: str) -> str:
        """The precision the loop's autocast runs (a strategy may do mixed precision itself)."""
        return precision

    def setup_module(self, model: nn.Module, dist: DistInfo, trainer: Any) -> nn.Module:
        """The module the loop calls: `model` placed, and compiled when trainer.compile is on."""
        if not trainer.compile:  # a job that does not compile never loads the compile module
            return model
        from ringtrain.strategies.compilation import CompiledModel

        return CompiledModel(model, trainer.compile_mode, regional=trainer.compile_scope == "regional")

    def no_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Forward and backward inside reduce gradients across ranks only when `enabled`."""
        return NOTHING

    def gradient_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """The global norm of all gradients (every rank calls it)."""
        return self.total_norm([p.grad for p in params if p.grad is not None])

    def weight_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor:
        """The global norm of all weights (every rank calls it): non-finite when any weight is."""
        return self.total_norm([p.detach() for p in params])

    def total_norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all `tensors` together (0 for none); a strategy that shards them reduces it across ranks."""
        return torch.nn.utils.get_total_norm(tensors)

    def clip_gradients(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm`; return the norm before. The
        norm is total_norm's, the full model's on every rank, so all scale alike (every rank calls it)."""
        params = [p for p in params if p.grad is not None]
        total = self.total_norm([p.grad for p in params])
        # torch's foreach kernels refuse lists mixing tensor types (fsdp: parameters it does not
        # manage next to sharded DTensors): each type is clipped apart, with the one global norm.
        for kind in {type(p.grad) for p in params}:
            group = [p for p in params if type(p.grad) is kind]
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
        return total

    def inference(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """The context evaluation runs in."""
        return torch.inference_mode()

    def lr_scale(self, world_size: int) -> float:
        """The factor the optimizer's learning rate is multiplied by."""
        return 1.0

    def checkpoint_weights(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                           shards_path: Callable[[], Path]) -> dict[str, Any]:
        """The model and optimizer part of a checkpoint, in ringtrain's plain format: full
        state, keyed by parameter name, on rank 0 (every rank takes part). A strategy that
        writes each rank's shards instead returns {"shards": <directory name>}."""
        return {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}


class Single(Strategy):
    """One process on one device (conf/strategy/single.yaml)."""


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
