"""ringtrain's learning-rate schedules (conf/scheduler/): a linear warm-up, then constant or
cosine decay, per optimizer step."""
from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler


class WarmupConstant(LRScheduler):
    """Linear warmup to the optimizer's lr over `warmup_steps` steps, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 0, last_epoch: int = -1):
        if warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps={warmup_steps} must be >= 0")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The lr multiplier of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return 1.0

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def step(self, epoch: int | None = None) -> None:
        # After the warm-up the lr no longer changes: count the step and leave the optimizer
        # alone. LRScheduler.step costs ~3 us of Python a step, which a small model feels.
        if epoch is None and self._constant_from_here():
            self.last_epoch += 1
            self._step_count += 1  # as LRScheduler.step counts: the state saved is the same
            return
        super().step(epoch)

    def _constant_from_here(self) -> bool:
        """Whether the lr of the next step is the one the optimizer already has."""
        return self.last_epoch >= self.warmup_steps


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

    def _constant_from_here(self) -> bool:
        return False  # the cosine changes the lr at every step

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step < self.warmup_steps:
            return [base * self.factor(step) for base in self.base_lrs]
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return [self.min_lr + (base - self.min_lr) * cosine for base in self.base_lrs]
