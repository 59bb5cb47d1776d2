"""The Loggers callback: hands the run's hyperparameters and metrics to the loggers of the
`logger` group (ringtrain/loggers/: TensorBoard, CSV, Weights & Biases, MLflow), on rank 0."""
from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator

from ringtrain.callbacks import Callback, Run
from ringtrain.errors import UserError

log = logging.getLogger("ringtrain")


class Loggers(Callback):
    rank_zero_only = True

    def __init__(self, loggers: dict) -> None:
        self.loggers = dict(loggers)
        # Those whose start() returned, the only ones to log to and to finish: finish() on a logger
        # that never started raised an AttributeError that replaced the error that stopped the run.
        self.started: dict = {}

    def state_dict(self) -> dict:
        return {key: state for key, logger in self.loggers.items()
                if callable(getattr(logger, "state_dict", None)) and (state := logger.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        for key, saved in state.items():
            if key in self.loggers and callable(getattr(self.loggers[key], "load_state_dict", None)):
                self.loggers[key].load_state_dict(saved)

    def on_fit_start(self, run: Run) -> None:
        for key, logger in self.loggers.items():
            with self._writing(key, run):
                logger.start(run.run_dir, run.run_dir.name, run.group, run.config)
            self.started[key] = logger

    def on_log(self, run: Run, metrics: dict[str, float], step: int) -> None:
        for key, logger in self.started.items():
            with self._writing(key, run):
                logger.log_metrics(metrics, step)

    def on_fit_end(self, run: Run, result) -> None:
        best = {result.monitor: result.best_metric} if result.best_metric is not None else None
        # An early stop a callback asked for ends the run as complete; a stop signal or a
        # non-finite value leaves it to be continued or looked into.
        stopped = result.stopped is not None and result.stop_kind != "requested"
        self._finish({**result.summary(), "best": best}, "stopped" if stopped else "completed")

    def on_exception(self, run: Run, error: BaseException) -> None:
        self._finish({"final": run.metrics, "best": None, "steps": run.step}, "failed", failing=True)

    def _finish(self, summary: dict, status: str, failing: bool = False) -> None:
        started, self.started = self.started, {}  # once: a failure in on_fit_end must not finish them again
        for key, logger in started.items():
            try:
                with self._writing(key, None):
                    logger.finish(summary, status)
            except Exception as err:
                if not failing:
                    raise
                # The run is failing already: its own error is the one to report; the others still close.
                log.warning(f"logger.{key} could not record the failed run: {type(err).__name__}: {err}")

    @contextlib.contextmanager
    def _writing(self, key: str, run: Run | None) -> Iterator[None]:
        """A logger's write that fails on the file system (a full disk, a store gone) ends the run in
        one line naming the logger and the fix, not in its library's tracebacks; the checkpoints
        saved so far are untouched (a save in flight completes: checkpoints/__init__.py)."""
        try:
            yield
        except OSError as err:
            self.started.pop(key, None)  # its store is full or gone: not finished either
            reason = err.strerror or str(err) or type(err).__name__
            where = f" ({err.filename})" if err.filename else ""
            fix = ("free space there" if err.errno in (errno.ENOSPC, errno.EDQUOT)
                   else "check that it is writable and its file system healthy")
            step = f" at step {run.step}" if run is not None else ""
            kept = f"; the checkpoints saved so far are kept ({run.run_dir / 'checkpoints'})" if run is not None else ""
            raise UserError(f"logger.{key} cannot write{step}: {reason}{where}; {fix}, or leave the logger out "
                            f"(~logger.{key}){kept}") from None
