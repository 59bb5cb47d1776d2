"""The loggers of the `logger` config group (conf/logger/<name>.yaml): each receives one run's
hyperparameters and metrics through the interface here, on rank 0 only, and shares its helpers.
tensorboard.py and csv.py need nothing beyond ringtrain's own dependencies; wandb.py and
mlflow.py need their extras (`pip install 'ringtrain[wandb]'`, `'ringtrain[mlflow]'`)."""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ringtrain.errors import ConfigError


class Logger:
    continued: dict = {}  # the checkpoint's state_dict(): the logger run to continue

    def start(self, run_dir: Path, run_name: str, group: str | None, config: dict) -> None:
        """Before the first step. run_dir: the run's directory; run_name: the run's (or sweep
        job's) name; group: the sweep's name for jobs of a multirun (one run per job, grouped),
        else None; config: the resolved run config as plain nested data (the hyperparameters)."""
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """The metrics of `step`; one step may come in more than one call (training, then validation)."""
        raise NotImplementedError

    def finish(self, summary: dict, status: str) -> None:
        """After the last step, also on a stop or a failure: summary = {"final": {...metrics...},
        "best": {metric: value} or None, "steps": int, ...}; status is "completed" (an early
        stop a callback asked for too), "stopped" (a stop signal, a non-finite value: the run
        may be continued) or "failed". Flush and close."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Plain data kept in every checkpoint (its logger run's id), so that a resumed run
        continues the same logger run; {} keeps nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """What state_dict returned, given back before start() when the run resumes."""
        self.continued = state


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: bool, int, float and str kept, anything else (lists, None) as str."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


def final_and_best(summary: dict) -> dict[str, float]:
    """The end of a run as metrics: `final/<metric>` and `best/<metric>`, the names every logger uses."""
    return {f"{kind}/{name}": value for kind in ("final", "best") for name, value in (summary.get(kind) or {}).items()}


def import_extra(package: str) -> ModuleType:
    """The optional `package`, or one line naming the ringtrain extra that installs it (named alike)."""
    try:
        return importlib.import_module(package)
    except ImportError as err:
        if isinstance(err, ModuleNotFoundError) and err.name == package:
            raise ConfigError(f"logger.{package} needs the {package} package: pip install 'ringtrain[{package}]'") from None
        # Installed, but broken: a module it needs is missing, or a version that does not fit.
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"logger.{package}: {package} is installed but importing it failed ({type(err).__name__}: "
                          f"{reason}); reinstall it: pip install --force-reinstall 'ringtrain[{package}]'") from None
