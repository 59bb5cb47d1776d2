"""The EarlyStopping callback (Lightning's EarlyStopping, ringtrain's names)."""
from __future__ import annotations

import math

from ringtrain.callbacks import Callback, Run, monitored


class EarlyStopping(Callback):
    """The settings as conf/callbacks/early_stopping.yaml says; the run ends after the checkpoint
    of the validation that ends it. It runs on every rank and decides from the all-reduced metrics,
    so every rank stops at the same step; its best and its count are kept in checkpoints, so a
    resumed run stops where it would have."""

    def __init__(self, monitor: str | None = None, mode: str | None = None, patience: int = 3, min_delta: float = 0.0):
        if mode not in (None, "min", "max"):
            raise ValueError(f"callbacks.early_stopping.mode={mode!r} must be min or max")
        if patience < 1 or min_delta < 0:
            raise ValueError(f"callbacks.early_stopping: patience={patience} must be >= 1 and min_delta={min_delta} >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.waited = 0

    def on_fit_start(self, run: Run) -> None:
        self._stop_when_out_of_patience(run)  # resumed from the checkpoint of the validation that ended the run

    def _stop_when_out_of_patience(self, run: Run) -> None:
        if self.waited >= self.patience:
            best = "a finite value" if self.best is None else f"{self.best:.6g}"
            run.request_stop(f"early stopping: {self.monitor or run.task.monitor} did not improve on {best} "
                             f"(by more than {self.min_delta:g}) in {self.patience} validations")

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        monitor, mode = self.monitor or run.task.monitor, self.mode or run.task.mode
        value = monitored(metrics, monitor, "callbacks.early_stopping.monitor")
        better = math.isfinite(value) and (self.best is None or (
            value < self.best - self.min_delta if mode == "min" else value > self.best + self.min_delta))
        if better:
            self.best, self.waited = value, 0
            return
        self.waited += 1
        self._stop_when_out_of_patience(run)

    def state_dict(self) -> dict:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.waited = state.get("best"), state.get("waited", 0)
