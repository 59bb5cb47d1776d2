"""The training loop of one rank: fit (top to bottom) and what it uses, one module a concern
(docs/ARCHITECTURE.md walks through them); here what they share: where training stands
(Progress, saved in every checkpoint), the data layout it was trained in (Layout), and what
fit() returns (FitResult).

May import: everything below the job (ringtrain.config and what it may). Never the job
(ringtrain.run) or the tools.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    # Samples of the current epoch's global order already trained on (loop/loaders.py
    # ShuffledShards): a position that means the same for any number of ranks or batch size.
    samples_into_epoch: int = 0
    best_metric: float | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values

    def finish_step(self, position: int, epoch_done: bool, applied: bool = True) -> None:
        """One optimizer step that brought the epoch to `position` (`applied`: not skipped)."""
        self.step += 1
        self.skipped_steps += not applied
        if epoch_done:
            self.finish_epoch()
        else:
            self.samples_into_epoch = position

    def finish_epoch(self) -> None:
        self.epoch += 1
        self.samples_into_epoch = 0

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
        vars(self).update(state)


@dataclass(frozen=True)
class Layout:
    """How a run's data is dealt out, saved in every checkpoint so that a run continued in
    another layout says what changed."""

    world_size: int
    batch_size: int  # per rank and micro-batch
    accumulate_grad_batches: int

    def changes_from(self, old: "Layout") -> str | None:
        """`world size 1 -> 2, per-rank batch 32 -> 32` (accumulation too when it changed), or None."""
        if old == self:
            return None
        text = f"world size {old.world_size} -> {self.world_size}, per-rank batch {old.batch_size} -> {self.batch_size}"
        if old.accumulate_grad_batches != self.accumulate_grad_batches:
            text += f", accumulation {old.accumulate_grad_batches} -> {self.accumulate_grad_batches}"
        return text


@dataclass
class FitResult:
    metrics: dict[str, float]  # final validation metrics, e.g. {"val/loss": 0.01}
    monitor: str  # the metric a sweep optimises
    mode: str  # "min" or "max"
    best_metric: float | None
    steps: int
    train_seconds: float
    # Why training ended before its last step ("SIGTERM", "non-finite", a callback's reason such
    # as early stopping's), and which kind of end that is: "signal" (last.pt saved, exit 143),
    # "non-finite" (trainer.on_nonfinite=stop, exit 3) or "requested" (by a callback, exit 0).
    stopped: str | None = None
    stop_kind: str | None = None
    skipped_steps: int = 0  # updates skipped for non-finite values (on_nonfinite=skip, fp16 scaler)
    # The trained weights, only when a spawned rank 0 hands them back to a Python caller.
    model_state: dict | None = None

    @property
    def stopped_by_signal(self) -> bool:
        return self.stop_kind == "signal"

    def summary(self) -> dict:
        """The run's end as metrics.json keeps it (non-finite metrics listed: null in the file)."""
        nonfinite = [name for name, value in self.metrics.items() if not math.isfinite(value)]
        return {"final": self.metrics, "monitor": self.monitor, "mode": self.mode, "best": self.best_metric,
                "steps": self.steps, "train_seconds": self.train_seconds, "stopped": self.stopped,
                "skipped_steps": self.skipped_steps, "nonfinite": nonfinite}
