"""What to do when a loss or gradient norm is NaN or infinite: trainer.on_nonfinite, stop
(default), skip or ignore (README, "Non-finite values", says what each does and costs).

stop keeps each micro-batch's detached loss on a list, read with one host sync only where values
are about to be logged, evaluated or saved (`check`). A non-finite gradient shows in the next
step's loss; the checked step has none yet, so `check` also reads its gradient norm (when
measured) or else the weights' norm: no checkpoint (best.pt included) holds weights a
non-finite update touched.
Every rank decides alike: a rank's loss is its own (one micro-batch may give a NaN loss and a
finite gradient), so the flag is all-reduced first (skip: in the sync it costs anyway; stop: at
each check); the gradient norm is taken after DDP's all-reduce, the weights' norm is global.
With 16-mixed GradScaler already skips overflowing steps (float16 overflows are expected), counted
the same way; on_nonfinite then watches the loss only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as torch_dist

from ringtrain.distributed import DistInfo

_NONE_BAD = float("inf")  # "no non-finite step here", for the all-reduce that takes the earliest


class NonFiniteWatch:
    def __init__(self, policy: str, dist: DistInfo, uses_scaler: bool, weight_norm: Callable[[], torch.Tensor]):
        self.policy = policy
        self.uses_scaler = uses_scaler
        self.weight_norm = weight_norm  # the update's own norm where no gradient norm was measured
        self.dist = dist
        # stop: (step, loss) of every micro-batch since the last check, read at the next one.
        self._unchecked: list[tuple[int, torch.Tensor]] = []
        self._first_bad: int | None = None  # the first non-finite step found
        self._bad_value: float | None = None  # None: found on another rank
        self.first_skip: str | None = None  # skip: what was non-finite at the first skipped update
        self.needs_grad_norm = policy == "skip" and not uses_scaler  # skip decides on it at every step

    def allows_update(self, step: int, detached: list[tuple[torch.Tensor, Any]], grad_norm: torch.Tensor | None) -> bool:
        """After the backward of `step` (its micro-batches' detached (loss, count)): whether to
        apply the update."""
        losses = [loss for loss, _ in detached]
        if self.policy == "stop":
            self._unchecked.extend((step, loss) for loss in losses)
        if self.policy != "skip":
            return True
        bad = ~torch.isfinite(torch.stack(losses).float()).all()
        watched_norm = grad_norm if not self.uses_scaler else None
        if watched_norm is not None:
            bad = bad | ~torch.isfinite(watched_norm.float())
        if not self._across_ranks(bad, torch_dist.ReduceOp.MAX):  # the one host sync skip costs
            return True
        if self.first_skip is None:  # "loss nan", "gradient norm inf", or both; said once by the loop (fit.py)
            found = [f"loss {float(loss)}" for loss in losses if not torch.isfinite(loss.float())][:1]
            if watched_norm is not None and not torch.isfinite(watched_norm.float()):
                found.append(f"gradient norm {float(watched_norm)}")
            self.first_skip = " and ".join(found) or "loss on another rank"  # a second sync, once
        return False

    def check(self, step: int, grad_norm: torch.Tensor | None) -> bool:
        """stop: whether a loss since the last check, or the update of `step` (`grad_norm`, if
        measured), was non-finite. Every rank calls it (`weight_norm` may all-reduce)."""
        if self.policy != "stop" or self._first_bad is not None:
            return self._first_bad is not None
        steps = [s for s, _ in self._unchecked]
        losses = [loss for _, loss in self._unchecked]
        self._unchecked = []
        if not self.uses_scaler:  # the update of `step`: its gradient, else what it made
            losses.append((grad_norm if grad_norm is not None else self.weight_norm()).to(self.dist.device))
            steps.append(step)
        if not losses:  # 16-mixed, checked again at the same step (a stop signal after a log)
            return False
        values = torch.stack(losses)  # in the widest of their dtypes (bfloat16 losses, a float32 norm)
        bad = ~torch.isfinite(values)
        first = int(bad.nonzero()[0]) if bool(bad.any()) else None
        if first is None and not self.dist.is_distributed:
            return False
        earliest = self._across_ranks(torch.tensor(steps[first] if first is not None else _NONE_BAD,
                                                   dtype=torch.float64), torch_dist.ReduceOp.MIN)
        if earliest == _NONE_BAD:
            return False
        # The value is this rank's, or unknown here: the step is where another rank found it.
        self._first_bad = int(earliest)
        self._bad_value = float(values[first]) if first is not None and steps[first] == earliest else None
        return True

    def _across_ranks(self, value: torch.Tensor, op: torch_dist.ReduceOp) -> float:
        if self.dist.is_distributed:
            value = value.to(self.dist.device, torch.float64)
            torch_dist.all_reduce(value, op=op)
        return float(value)

    def stop_message(self, step: int, last_checkpoint: Path) -> str:
        saved = f"{last_checkpoint} is from before it" if last_checkpoint.exists() else "nothing was saved"
        return (
            f"non-finite loss or gradient norm ({'on another rank' if self._bad_value is None else self._bad_value}) "
            f"at step {self._first_bad}; stopped at step {step} "
            f"({saved}): lower optimizer.lr, clip with trainer.grad_clip_norm, or set trainer.on_nonfinite=skip"
        )
