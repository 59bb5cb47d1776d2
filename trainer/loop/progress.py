"""Where training stands (Progress, saved in every checkpoint) and what fit() returns (FitResult)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    batches_into_epoch: int = 0  # micro-batches of the current epoch already trained on
    best_metric: float | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values

    def finish_step(self, micro_batches: int, batches_per_epoch: int) -> bool:
        """Count one optimizer step over `micro_batches`; True when it completed the epoch."""
        self.step += 1
        self.batches_into_epoch += micro_batches
        if self.batches_into_epoch < batches_per_epoch:
            return False
        self.epoch += 1
        self.batches_into_epoch = 0
        return True

    def improves(self, value: float | None, mode: str) -> bool:
        """Whether `value` of the monitored metric beats the best so far (and becomes it)."""
        better = value is not None and math.isfinite(value) and (
            self.best_metric is None or (value < self.best_metric if mode == "min" else value > self.best_metric)
        )
        if better:
            self.best_metric = value
        return better

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


@dataclass
class FitResult:
    metrics: dict[str, float]  # final validation metrics, e.g. {"val/loss": 0.01}
    monitor: str  # the metric a sweep optimises
    mode: str  # "min" or "max"
    best_metric: float | None
    steps: int
    train_seconds: float
    # Why training ended before its last step: "SIGTERM" (a stop signal, last.pt saved) or
    # "non-finite" (trainer.on_nonfinite=stop); None when it ran to the end.
    stopped: str | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values (on_nonfinite=skip, fp16 scaler)
    # The trained weights, only when a spawned rank 0 hands them back to a Python caller.
    model_state: dict | None = None

    @property
    def stopped_by_signal(self) -> bool:
        """Ended early by a stop signal (last.pt saved), not by a non-finite value."""
        return self.stopped not in (None, "non-finite")
