"""The BestCheckpoints callback: keep the checkpoints of the `k` best validations by a metric
as `best-<metric>-<step>.pt` (Lightning's ModelCheckpoint(save_top_k=k)); last.pt as always."""
from __future__ import annotations

import logging
import math
from pathlib import Path

from ringtrain.callbacks.base import Callback, Run, monitored
from ringtrain.checkpoints.atomic import remove_if_present
from ringtrain.checkpoints.files import link_checkpoint

log = logging.getLogger("ringtrain")


class BestCheckpoints(Callback):
    """After each validation's checkpoint is on disk, a hard link to it named by the metric and
    the step joins the best `k` (by `monitor`, default the task's, in `mode`); the one that drops
    out is removed. A link keeps its checkpoint when rotation (trainer.keep_last_k) deletes the
    step file, and costs no space of its own. Rank 0; the ranking is kept in checkpoints."""

    rank_zero_only = True

    def __init__(self, k: int = 3, monitor: str | None = None, mode: str | None = None):
        if k < 1:
            raise ValueError(f"callbacks.best_checkpoints.k={k} must be >= 1")
        if mode not in (None, "min", "max"):
            raise ValueError(f"callbacks.best_checkpoints.mode={mode!r} must be min or max")
        self.k, self.monitor, self.mode = k, monitor, mode
        self.best: list[tuple[float, int, str]] = []  # (value, step, file name), best first
        self._pending: dict[int, float] = {}  # validated steps whose checkpoint is not on disk yet

    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        value = monitored(metrics, self.monitor or run.task.monitor, "callbacks.best_checkpoints.monitor")
        if math.isfinite(value):
            self._pending[run.step] = value

    def on_checkpoint_saved(self, run: Run, step: int, path: Path) -> None:
        if (value := self._pending.pop(step, None)) is None:
            return
        monitor, mode = self.monitor or run.task.monitor, self.mode or run.task.mode
        name = f"best-{monitor.replace('/', '_')}-{step:08d}.pt"
        ranked = sorted(self.best + [(value, step, name)], key=lambda item: item[0] if mode == "min" else -item[0])
        if (value, step, name) in ranked[: self.k]:
            link_checkpoint(path, path.parent / name)
        for _, _, dropped in ranked[self.k:]:
            remove_if_present(path.parent / dropped)
        self.best = ranked[: self.k]

    def state_dict(self) -> dict:
        return {"best": [list(item) for item in self.best]}

    def load_state_dict(self, state: dict) -> None:
        self.best = [tuple(item) for item in state.get("best", [])]
