"""Optimizers and learning-rate schedules, built from `_target_` nodes (conf/optimizer/,
conf/scheduler/); ringtrain's own two schedules are in ringtrain/loop/schedules.py.

Any `torch.optim` optimizer and any `torch.optim.lr_scheduler` scheduler (or a user's) works:
ringtrain passes what only it knows, by argument name, and the node gives the rest:
  optimizer  `params` (the model's parameters); `fused=True` on CUDA when the optimizer has a
             fused kernel and the node leaves `fused` unset
  scheduler  `optimizer`, and `total_steps` when the scheduler takes it (ours, OneCycleLR)
ringtrain's own keys, read here and never passed to the target:
  optimizer.decay_matrices_only  weight decay on 2-D+ weights only, never biases or norms (adamw)
  scheduler.warmup_steps         linear warmup before any scheduler (torch's SequentialLR);
                                 ringtrain's own schedules take it as an argument instead
The schedule steps once per optimizer step.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LinearLR, LRScheduler, SequentialLR

from ringtrain.config.components import accepts, build, locate

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
    """The optimizer `node` describes, over `model`'s parameters."""
    node = dict(node)
    decay_matrices_only = node.pop("decay_matrices_only", False)
    target = locate(node["_target_"], "optimizer")
    extra: dict[str, Any] = {}
    if decay_matrices_only:
        extra["params"] = parameter_groups(model, node.get("weight_decay", _default(target, "weight_decay", 0.0)))
    else:
        extra["params"] = [p for p in model.parameters() if p.requires_grad]
    if lr_scale != 1.0:
        extra["lr"] = node.get("lr", _default(target, "lr", None)) * lr_scale
    # One fused CUDA kernel for the whole update instead of several launches per tensor.
    if device.type == "cuda" and "fused" not in node and accepts(target, "fused"):
        extra["fused"] = True
    return build(node, "optimizer", **extra)


def build_scheduler(node: dict | None, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """The schedule `node` describes (constant lr when None), with its warmup."""
    node = dict(node or {"_target_": "ringtrain.loop.schedules.WarmupConstant"})
    warmup = node.pop("warmup_steps", 0)
    target = node["_target_"]
    extra: dict[str, Any] = {"optimizer": optimizer}
    if accepts(target, "total_steps"):
        extra["total_steps"] = total_steps
    if accepts(target, "warmup_steps"):  # ours: the warmup is part of the schedule
        return build(node, "scheduler", warmup_steps=warmup, **extra)
    if not warmup:
        return build(node, "scheduler", **extra)
    # start_factor 1/w ... 1 over the first w steps: step s uses lr * (s + 1) / w, as ours do.
    ramp = LinearLR(optimizer, start_factor=1.0 / warmup, end_factor=1.0, total_iters=max(1, warmup - 1))
    after = build(node, "scheduler", **extra)
    return SequentialLR(optimizer, [ramp, after], milestones=[warmup])


def _default(target, name: str, fallback):
    parameter = inspect.signature(target).parameters.get(name)
    return fallback if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default
