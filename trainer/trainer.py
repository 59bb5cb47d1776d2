"""The Python API: your own model on your own Datasets, no Hydra or YAML (example:
docs/python_api_example.py).

Keyword arguments are the settings of conf/trainer/default.yaml, checked as the YAML is.
`optimizer` and `scheduler` are `_target_` dicts as in conf/optimizer/ and conf/scheduler/, or
callables `optimizer(params)`, `scheduler(optimizer)`. `strategy` is an option of
conf/strategy/ ("ddp"), one with settings changed (`{"name": "ddp", "nproc_per_node": 2}`), or
a Strategy; spawned ranks need the model, data sets, task and callbacks to pickle. `callbacks`
run besides the defaults (conf/callbacks/default.yaml); `loggers` default to TensorBoard.

Each fit() trains a new run in a directory of its own (under outputs/runs/ unless `run_dir` is
given) and continues another only when asked: `resume="auto"` or `resume=<checkpoint path>`.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import os
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn
from torch.utils.data import Dataset

from ringtrain.callbacks import HOOKS, Callback, unknown_hooks
from ringtrain.conf import composed
from ringtrain.config.builders import check_task
from ringtrain.config.schema import Job, TrainerConfig, check_optimization, check_options, strategy_option, trainer_config
from ringtrain.data import DataBundle
from ringtrain.errors import ConfigError
from ringtrain.loop import FitResult
from ringtrain.strategies import Strategy

DEFAULT_OPTIMIZER = {"_target_": "torch.optim.SGD", "lr": 0.01}
_runs = itertools.count()  # this process's runs, for directory names of their own


class Trainer:
    """A run's settings, checked when the Trainer is made; `fit` trains a model with them."""

    def __init__(self, run_dir: str | Path | None = None, *, optimizer: dict | Callable = DEFAULT_OPTIMIZER,
                 scheduler: dict | Callable | None = None, strategy: str | dict | Strategy = "single",
                 callbacks: list[Callback] | dict[str, Callback] = (), loggers: list | dict | None = None,
                 **trainer_options: Any) -> None:
        trainer_options.setdefault("resume", None)  # a run from Python continues one only when asked
        fields = sorted(f.name for f in dataclasses.fields(TrainerConfig))
        for key in trainer_options:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f"did you mean {close[0]}? " if close else ""
                raise ConfigError(f"trainer has no setting {key!r}; {hint}the settings are {', '.join(fields)}")
        self.trainer = trainer_config(**trainer_options)
        self.strategy = strategy if isinstance(strategy, Strategy) else _strategy(strategy)
        check_options(self.trainer, self.strategy)
        check_optimization(optimizer, scheduler, self.trainer.max_steps)  # the nodes; a callable is the caller's
        self.optimizer, self.scheduler = optimizer, scheduler
        self.callbacks = _named(callbacks)
        for name, callback in self.callbacks.items():
            if not isinstance(callback, Callback) or (unknown := unknown_hooks(type(callback))):
                raise ConfigError(f"callbacks[{name!r}] must be a ringtrain Callback whose hooks are among "
                                  f"{', '.join(HOOKS)}; {type(callback).__name__} is not" + (
                                      f" (it defines {', '.join(unknown)})" if isinstance(callback, Callback) else ""))
        self.loggers = _named(loggers) if loggers is not None else None
        self.run_dir = Path(run_dir) if run_dir else None

    def fit(self, model: nn.Module, train_set: Dataset, val_set: Dataset, task: Any, *,
            vocab: dict | None = None) -> FitResult:
        """Train `model` in place on `train_set`, validate on `val_set`; return the final metrics.
        `task` (data/tasks.py: RegressionTask(), LossTask(loss=...), ...) gives the loss and
        metrics; `vocab` (data/vocab.py's plain form) is kept in checkpoints for sampling."""
        from omegaconf import OmegaConf

        from ringtrain.loggers.tensorboard import TensorBoardLogger
        from ringtrain.run import launch

        if not isinstance(model, nn.Module):
            raise ConfigError(f"fit() needs an nn.Module as the model, got {type(model).__name__}")
        check_task(task)
        # ringtrain's own callbacks (conf/callbacks/default.yaml's nodes, composed by Hydra, built on each
        # rank as a command line's are) and logger are made for each run: their state is the run's.
        defaults = OmegaConf.to_container(composed()["callbacks"])
        loggers = self.loggers if self.loggers is not None else {"tensorboard": TensorBoardLogger()}
        data = DataBundle(train_set, val_set, vocab=vocab)
        job = Job(self.trainer, self.strategy, task, model, data, self.optimizer, self.scheduler,
                  {**defaults, **self.callbacks},
                  loggers, resolved=self._resolved(model, task))
        run_dir = self.run_dir or Path("outputs/runs") / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{os.getpid()}_api{next(_runs)}"
        result = launch(job, str(run_dir), return_weights=True)
        if result.model_state is not None:  # trained in spawned processes: bring the weights home
            model.load_state_dict(result.model_state)
            result = dataclasses.replace(result, model_state=None)
        return result

    def _resolved(self, model: nn.Module, task: Any) -> dict:
        """What checkpoints and loggers record of this run's settings (plain data)."""
        def describe(component: Any) -> Any:
            if isinstance(component, dict) or component is None:
                return component
            kind = component if isinstance(component, type) else type(component)
            return {"_target_": f"{kind.__module__}.{kind.__qualname__}", "built_in_python": True}

        return {
            "model": describe(model), "task": describe(task),
            "optimizer": describe(self.optimizer), "scheduler": describe(self.scheduler),
            "strategy": {**describe(self.strategy), **vars(self.strategy)}, "trainer": dataclasses.asdict(self.trainer),
        }


def _strategy(option: str | dict) -> Strategy:
    settings = {"name": option} if isinstance(option, str) else dict(option) if isinstance(option, dict) else {}
    if "name" not in settings:
        raise ConfigError(
            f"strategy={option!r}: pass an option of conf/strategy/ (\"ddp\"), a dict naming one "
            f"({{\"name\": \"ddp\", \"nproc_per_node\": 2}}) or a Strategy object"
        )
    return strategy_option(settings.pop("name"), **settings)


def _named(objects: Any) -> dict[str, Any]:
    """A list of objects by their class names (numbered when one repeats), or a dict as it is."""
    if isinstance(objects, dict):
        return dict(objects)
    named: dict[str, Any] = {}
    for obj in objects:
        name = type(obj).__name__
        named[name if name not in named else f"{name}-{len(named)}"] = obj
    return named
