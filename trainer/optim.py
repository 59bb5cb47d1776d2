"""Optimizers and learning-rate schedules from `_target_` nodes (conf/optimizer/, conf/scheduler/),
and ringtrain's own schedules: a linear warm-up, then constant or cosine decay, stepped once per
optimizer step. Any torch (or user's) optimizer and scheduler works: ringtrain passes by name what
only it knows (`params`; `optimizer`, and `total_steps` where the scheduler takes it) and the node
gives the rest. ringtrain's own keys (OPTIMIZER_KEYS, SCHEDULER_KEYS) are read here, never passed on.
"""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LinearLR, LRScheduler, SequentialLR

from ringtrain.components import accepts, build, locate

OPTIMIZER_KEYS = ("decay_matrices_only",)
SCHEDULER_KEYS = ("warmup_steps",)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D (and larger) weights only: matrices and embeddings, never biases or norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(node: dict, model: nn.Module, device: torch.device, lr_scale: float = 1.0) -> torch.optim.Optimizer:
    node = dict(node)
    target = locate(node["_target_"], "optimizer")
    extra: dict[str, Any] = {"params": [p for p in model.parameters() if p.requires_grad]}
    if node.pop("decay_matrices_only", False):
        extra["params"] = parameter_groups(model, node.get("weight_decay", _default(target, "weight_decay", 0.0)))
    if lr_scale != 1.0:
        extra["lr"] = node.get("lr", _default(target, "lr", None)) * lr_scale
    if "fused" not in node and "foreach" not in node:
        if fused_by_default(target, device):
            extra["fused"] = True
        elif device.type == "cpu" and accepts(target, "foreach"):
            # torch's own choice on the CPU (no foreach kernels there), made once here instead of
            # at every step: 5-10 us a step of the default job's ~80.
            extra["foreach"] = False
    return build(node, "optimizer", **extra)


def fused_by_default(target: Any, device: torch.device) -> bool:
    """Whether an optimizer node that leaves `fused` and `foreach` unset gets `fused=True`, one
    kernel for the whole update: where it gains (README, "Optimizers and schedules")."""
    cpu_fused = device.type == "cpu" and isinstance(target, type) and issubclass(target, (torch.optim.Adam, torch.optim.AdamW))
    return accepts(target, "fused") and (device.type == "cuda" or cpu_fused)


def build_scheduler(node: dict | None, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """The schedule `node` describes (constant lr when None), with its warmup."""
    node = dict(node or {"_target_": f"{__name__}.WarmupConstant"})
    warmup = node.pop("warmup_steps", 0)
    target = locate(node["_target_"], "scheduler")
    extra: dict[str, Any] = {"optimizer": optimizer}
    if accepts(target, "total_steps"):
        extra["total_steps"] = total_steps
    if accepts(target, "warmup_steps"):  # ours: the warmup is part of the schedule
        return build(node, "scheduler", warmup_steps=warmup, **extra)
    if not warmup:
        return build(node, "scheduler", **extra)
    # Any other scheduler: a linear warm-up in front of it (SequentialLR).
    # start_factor 1/w ... 1 over the first w steps: step s uses lr * (s + 1) / w, as ours do.
    ramp = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=max(1, warmup - 1))
    after = build(node, "scheduler", **extra)
    return SequentialLR(optimizer, [ramp, after], milestones=[warmup])


def _default(target, name: str, fallback):
    parameter = inspect.signature(target).parameters.get(name)
    return fallback if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


class WarmupConstant(LRScheduler):
    """Linear warmup to the optimizer's lr over `warmup_steps` steps, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0, last_epoch: int = -1):
        if warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps={warmup_steps} must be >= 0")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        # Optimizer step s (0-based) of the warmup uses lr * (s + 1) / warmup_steps.
        factor = (self.last_epoch + 1) / self.warmup_steps if self.last_epoch < self.warmup_steps else 1.0
        return [base * factor for base in self.base_lrs]

    def step(self, epoch: int | None = None) -> None:
        # After the warmup the rates are what they are: a step only counts. LRScheduler.step would
        # set the same rates again, ~13 us a step, a tenth of the default job's loop overhead.
        if epoch is None and self.last_epoch >= self.warmup_steps:
            self.last_epoch += 1
        else:
            super().step(epoch)


class WarmupCosine(WarmupConstant):
    """Linear warmup, then a cosine decay from the optimizer's lr to `min_lr` at `total_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 min_lr: float = 0.0, last_epoch: int = -1):
        if min_lr < 0:
            raise ValueError(f"scheduler.min_lr={min_lr} must be >= 0")
        too_high = [group["lr"] for group in optimizer.param_groups if min_lr > group.get("initial_lr", group["lr"])]
        if too_high:
            raise ValueError(f"scheduler.min_lr={min_lr} exceeds optimizer.lr={too_high[0]}; lower it")
        self.total_steps, self.min_lr = total_steps, min_lr
        super().__init__(optimizer, warmup_steps, last_epoch)

    step = LRScheduler.step  # its rates change at every step

    def get_lr(self) -> list[float]:
        if self.last_epoch < self.warmup_steps:
            return super().get_lr()
        progress = min(1.0, (self.last_epoch - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return [self.min_lr + (base - self.min_lr) * cosine for base in self.base_lrs]
