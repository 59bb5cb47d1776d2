"""MLflow, to a local SQLite store by default (conf/logger/mlflow.yaml: where, how to see it, the
experiments): MLflow 3's own default backend; its file store, ./mlruns, refuses to start unless
MLFLOW_ALLOW_FILE_STORE=true."""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Iterator

from ringtrain.errors import ConfigError
from ringtrain.loggers import Logger, final_and_best, flatten, import_extra

log = logging.getLogger("ringtrain")
RUN_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MLflowLogger(Logger):
    """Params: the config flattened (model.d_model); metrics with their step; at the end
    final/<metric> and best/<metric> at the last step, and the run's status."""

    def __init__(self, tracking_uri: str = "sqlite:///outputs/mlflow.db", experiment_name: str | None = None):
        self.mlflow = import_extra("mlflow")
        self.tracking_uri, self.experiment_name = tracking_uri, experiment_name
        # The client opens the store (a local one is created): a URI it cannot use is refused before the run starts.
        with _one_process_at_a_time(self.tracking_uri):
            try:
                self.client = self.mlflow.MlflowClient(self.tracking_uri)
            except self.mlflow.exceptions.MlflowException as err:
                reason = " ".join(err.message.split()).split(". See ")[0][:300]
                raise ConfigError(f"logger.mlflow.tracking_uri={tracking_uri!r} cannot be used ({reason}); use a local "
                                  f"store (sqlite:///outputs/mlflow.db) or a tracking server's http(s):// URI") from None

    def start(self, run_dir: Path, run_name: str, group: str | None, config: dict) -> None:
        name = self.experiment_name or group or "ringtrain"
        with _one_process_at_a_time(self.tracking_uri):
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        # The run a resumed run logged to, if this store has it (another tracking_uri, or a
        # deleted run: a new run, said in one line).
        logged: dict = {}
        resumed, saved = None, self.continued
        if saved.get("run_id") and saved.get("tracking_uri") == self.tracking_uri:
            with contextlib.suppress(self.mlflow.exceptions.MlflowException):
                resumed = self.client.get_run(saved["run_id"])
        if saved.get("run_id") and resumed is None:
            log.info(f"logger.mlflow: run {saved['run_id']} of the checkpoint is not in {self.tracking_uri}; starting a new run")
        if resumed:
            self.run_id, logged = resumed.info.run_id, resumed.data.params
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"ringtrain.run_dir": str(run_dir), **({"ringtrain.group": group} if group else {})}
            self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        # MLflow refuses a longer value (a long list in the config): it is cut to fit. A param
        # is written once: a continued run adds the new ones (MLflow refuses changing one; the
        # checkpoints keep the config each part of the run had).
        longest = self.mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
        params = [self.mlflow.entities.Param(key, str(value)[:longest]) for key, value in flatten(config).items()
                  if key not in logged]
        self.client.log_batch(self.run_id, params=params)

    def state_dict(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri} if hasattr(self, "run_id") else {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        milliseconds = int(time.time() * 1000)
        values = [self.mlflow.entities.Metric(key, float(value), milliseconds, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=values)

    def finish(self, summary: dict, status: str) -> None:
        self.log_metrics(final_and_best(summary), summary["steps"])
        self.client.set_terminated(self.run_id, RUN_STATUS[status])


@contextlib.contextmanager
def _one_process_at_a_time(tracking_uri: str) -> Iterator[None]:
    """Hold a lock beside a local SQLite store: jobs of a sweep that start together (the joblib
    launcher) would otherwise each make a new store's tables, and one of them fail ("table runs
    already exists", "duplicate column name"), or each create the same experiment."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    lock_path = Path(tracking_uri.removeprefix("sqlite:///") + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
