"""What to do when a loss or gradient norm is NaN or infinite: trainer.on_nonfinite.

  stop    (default) end the run, naming the first non-finite step. Sync-free: the step is
          tracked on the device and read only where values are about to be logged, evaluated
          or saved, so no checkpoint (best.pt included) ever holds weights a non-finite update
          touched. The run exits with status 3; in a sweep the job scores the worst value.
  skip    skip that optimizer update (the schedule still advances), count it
          (`train/skipped_steps` in TensorBoard and metrics.json) and go on. Deciding costs one
          flag read, a host sync, per step.
  ignore  apply every update, as a plain loop would.
Every rank decides alike: the decision uses the gradient norm after DDP's all-reduce, which
is the same on every rank. With 16-mixed, GradScaler already skips overflowing steps (that is
its job: a float16 overflow is expected now and then) and those skips are counted the same
way; on_nonfinite then watches the loss only.
"""
from __future__ import annotations

from pathlib import Path

import torch

class NonFiniteWatch:
    def __init__(self, policy: str, device: torch.device, uses_scaler: bool):
        self.policy = policy
        self.uses_scaler = uses_scaler
        # The first optimizer step with a non-finite value, 0 while there is none (on device).
        self._first_bad = torch.zeros((), dtype=torch.long, device=device)
        self._bad_value = torch.zeros((), device=device)

    @property
    def needs_grad_norm(self) -> bool:
        return self.policy != "ignore" and not self.uses_scaler

    def is_bad(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """A 0-dim bool tensor on the device: this step's loss or gradient norm is non-finite."""
        bad = ~torch.isfinite(loss.detach().float())
        if grad_norm is not None and not self.uses_scaler:
            bad = bad | ~torch.isfinite(grad_norm.detach().float())
        return bad

    def record(self, bad: torch.Tensor, step: int, value: torch.Tensor) -> None:
        """Remember `step` if it is the first bad one (no host sync)."""
        first = bad & (self._first_bad == 0)
        self._first_bad = torch.where(first, torch.full_like(self._first_bad, step), self._first_bad)
        self._bad_value = torch.where(first, value.detach().float(), self._bad_value)

    def first_bad_step(self) -> int | None:
        """The first non-finite step so far (reads one number from the device), or None."""
        if self.policy != "stop":
            return None
        step = int(self._first_bad)
        return step or None

    def stop_message(self, step: int, last_checkpoint: Path) -> str:
        first = self.first_bad_step()
        saved = f"{last_checkpoint} is from before it" if last_checkpoint.exists() else "nothing was saved"
        return (
            f"non-finite loss or gradient norm ({float(self._bad_value)}) at step {first}; stopped at step {step} "
            f"({saved}): lower optimizer.lr, clip with trainer.grad_clip_norm, or set trainer.on_nonfinite=skip"
        )
