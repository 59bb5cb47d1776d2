"""The Python API: train your own model on your own Datasets, no Hydra or YAML needed.

    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    trainer = Trainer(max_epochs=10, batch_size=32, optimizer={"_target_": "torch.optim.SGD", "lr": 0.01})
    result = trainer.fit(model, train_set, val_set, task=RegressionTask())

Keyword arguments are the settings of conf/trainer/default.yaml (`max_steps`, `precision`,
`accumulate_grad_batches`, `grad_clip_norm`, `num_workers`, ...), checked exactly as the
YAML is. `optimizer` and `scheduler` are `_target_` dicts as in conf/optimizer/ and
conf/scheduler/, or callables: `optimizer(params)`, `scheduler(optimizer)`. `strategy` is
an option of conf/strategy/ ("single", "dp", "ddp", "fsdp"), that option with settings
changed (`{"name": "ddp", "nproc_per_node": 2}`), or a Strategy object (ringtrain.strategies);
with nproc_per_node=2 the ranks are started as from the command line, so model, data sets and task must pickle (define their classes in an importable
module, or under `if __name__ == "__main__":` in a script). After fit() the model you
passed holds the trained weights, also after a spawned run.
"""
from __future__ import annotations

import dataclasses
import difflib
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn
from torch.utils.data import Dataset

from ringtrain.data.bundle import DataBundle
from ringtrain.config.builders import check_components, check_task
from ringtrain.config.schema import RunConfig, TrainerConfig, check_options, strategy_option, trainer_config
from ringtrain.errors import ConfigError
from ringtrain.loop.progress import FitResult
from ringtrain.strategies.base import Strategy

DEFAULT_OPTIMIZER = {"_target_": "torch.optim.SGD", "lr": 0.01}


class Trainer:
    """A run's settings, checked when the Trainer is made: the options of
    conf/trainer/default.yaml as keywords, an optimizer and a scheduler (`_target_` dicts or
    callables), a strategy, and the run directory for checkpoints, metrics.json and
    TensorBoard events (a new one under outputs/runs/ when not given). `fit` trains a model
    with them; the module docstring has an example."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        optimizer: dict | Callable = DEFAULT_OPTIMIZER,
        scheduler: dict | Callable | None = None,
        strategy: str | dict | Strategy = "single",
        **trainer_options: Any,
    ) -> None:
        self.trainer = _trainer_options(trainer_options)
        self.strategy = strategy if isinstance(strategy, Strategy) else _strategy(strategy)
        check_options(self.trainer, self.strategy)
        check_components(None, None, None, optimizer if isinstance(optimizer, dict) else None,
                         scheduler if isinstance(scheduler, dict) else None, self.trainer.max_steps)
        self.optimizer, self.scheduler = optimizer, scheduler
        # A new directory per Trainer, as Hydra's run directories are (outputs/runs/<time>).
        self.run_dir = Path(run_dir) if run_dir else Path("outputs/runs") / time.strftime("%Y-%m-%d_%H-%M-%S-api")

    def fit(
        self,
        model: nn.Module,
        train_set: Dataset,
        val_set: Dataset,
        task: Any,
        *,
        vocab: dict | None = None,
    ) -> FitResult:
        """Train `model` in place on `train_set`, validate on `val_set`; return the final metrics.

        `task` gives the loss and metrics: ringtrain.data.tasks.RegressionTask(), ClassificationTask(),
        LanguageModelTask(), LossTask(loss=...) or any object with the same methods.
        `vocab` (data/vocab.py's plain form) is kept in checkpoints for sampling.
        """
        from ringtrain.run import BuiltComponents, launch

        if not isinstance(model, nn.Module):
            raise ConfigError(f"fit() needs an nn.Module as the model, got {type(model).__name__}")
        check_task(task)
        run = RunConfig(
            model=None, data=None, task=None, optimizer=self.optimizer, scheduler=self.scheduler,
            strategy=self.strategy, trainer=self.trainer, resolved=self._resolved(model, task),
        )
        built = BuiltComponents(model, DataBundle(train_set, val_set, vocab=vocab), task)
        result = launch(run, str(self.run_dir), built)
        if result.model_state is not None:  # trained in spawned processes: bring the weights home
            model.load_state_dict(result.model_state)
            result = dataclasses.replace(result, model_state=None)
        return result

    def _resolved(self, model: nn.Module, task: Any) -> dict:
        """What checkpoints and TensorBoard record of this run's settings (plain data)."""
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
    if isinstance(option, str):
        return strategy_option(option)
    if not isinstance(option, dict) or "name" not in option:
        raise ConfigError(
            f"strategy={option!r}: pass an option of conf/strategy/ (\"ddp\"), a dict naming one "
            f"({{\"name\": \"ddp\", \"nproc_per_node\": 2}}) or a Strategy object"
        )
    settings = dict(option)
    return strategy_option(settings.pop("name"), **settings)


def _trainer_options(values: dict) -> TrainerConfig:
    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"trainer has no setting {key!r}; {hint}the settings are {', '.join(sorted(fields))}")
    return trainer_config(**values)
