"""The BestCheckpoints callback: keep the checkpoints of the `k` best validations by a metric
as `best-<metric>-<step>.pt` (Lightning's ModelCheckpoint(save_top_k=k)); last.pt as always."""
from __future__ import annotations

import logging
import math
from pathlib import Path

from ringtrain.callbacks import Callback, Run, monitored
from ringtrain.checkpoints.files import link_checkpoint, step_checkpoint_name
from ringtrain.storage import remove_if_present

log = logging.getLogger("ringtrain")


class BestCheckpoints(Callback):
    """After each validation's checkpoint is on disk, a hard link to it named by the metric and
    the step joins the best `k` (by `monitor`, default the task's, in `mode`); the one that drops
    out is removed. A link keeps its checkpoint when rotation (trainer.keep_last_k) deletes the
    step file, and costs no space of its own. Rank 0; the ranking is kept in checkpoints, with
    the validation whose checkpoint it is (saved before its own link exists): a resumed run
    ranks that one too and makes the disk hold exactly the best `k`, whatever a stop between a
    save and its link, or a line of training the run left, put there."""

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
        if (value := self._pending.pop(step, None)) is not None:
            self._rank(run, [(value, step, self._name(run, step))], path)

    def on_fit_start(self, run: Run) -> None:  # the disk made the best k (a resume: see the class docstring)
        directory = run.run_dir / "checkpoints"
        resumed, self._pending = [(v, s, self._name(run, s)) for s, v in self._pending.items()], {}
        self._rank(run, resumed, directory / step_checkpoint_name(resumed[0][1]) if resumed else None)
        kept = {name for _, _, name in self.best}
        prefix = self._name(run, 0).rsplit("-", 1)[0] + "-"
        for stray in directory.glob(f"{prefix}*.pt") if directory.is_dir() else ():
            if stray.name not in kept:
                remove_if_present(stray)

    def _rank(self, run: Run, new: list[tuple[float, int, str]], path: Path | None) -> None:
        mode = self.mode or run.task.mode
        entries = {name: (value, step, name) for value, step, name in self.best + new}  # one per step
        ranked = sorted(entries.values(), key=lambda item: item[0] if mode == "min" else -item[0])
        # The one that drops out goes before the new link is made: a kill -9 between the two
        # leaves k-1 files, never k+1 (the new one is linked when the run resumes: on_fit_start).
        for _, _, dropped in ranked[self.k:]:
            remove_if_present(run.run_dir / "checkpoints" / dropped)
        for value, step, name in new:
            if (value, step, name) in ranked[: self.k] and path is not None and path.is_file():
                link_checkpoint(path, path.parent / name)
        self.best = ranked[: self.k]

    def _name(self, run: Run, step: int) -> str:
        return f"best-{(self.monitor or run.task.monitor).replace('/', '_')}-{step:08d}.pt"

    def state_dict(self) -> dict:
        return {"best": [list(item) for item in self.best], "pending": [[s, v] for s, v in self._pending.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.best = [tuple(item) for item in state.get("best", [])]
        self._pending = {int(s): float(v) for s, v in state.get("pending", [])}
