"""Callbacks: the loop's optional behaviours, ringtrain's own (a module each, chosen by
conf/callbacks/, listed in docs/ARCHITECTURE.md) and a user's alike, and here their API (an
example: the README's "Callbacks and loggers").

A callback overrides the hooks it needs (HOOKS; a method named on_* that is not one is refused
before any work) and runs on every rank (the default: it may take part in collectives, and sees
every rank's batches) or on rank 0 alone (writing files, printing). Hooks get the `Run`, through
which a callback logs metrics, reads the model, and asks the loop to validate, save or stop. Its
state_dict is rank 0's, kept in every checkpoint under the callback's name and given back to it
on every rank when the run resumes.

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints. Never the config,
the loop, the job or the tools.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ringtrain.errors import ConfigError, component_failed

log = logging.getLogger("ringtrain")

HOOKS = (
    "on_fit_start",  # before the first step (after a checkpoint is restored)
    "on_step_start",  # before a step's first micro-batch: on_step_start(run, step_number)
    "on_step_end",  # after the optimizer step: on_step_end(run, StepEnd)
    "on_validation_start",  # before validation: on_validation_start(run)
    "on_validation_end",  # after it: on_validation_end(run, metrics), {"val/loss": ...}
    "on_log",  # metrics logged at a step, all of them at once: on_log(run, metrics, step)
    "on_save_checkpoint",  # before a checkpoint is written: on_save_checkpoint(run, checkpoint), add entries
    "on_load_checkpoint",  # a resumed run, its parts restored, before on_fit_start: on_load_checkpoint(run, checkpoint)
    "on_checkpoint_saved",  # once it is on disk (rank 0): on_checkpoint_saved(run, step, path)
    "on_stop_signal",  # a stop signal arrived (SIGTERM, Ctrl-C): on_stop_signal(run, name)
    "on_exception",  # the run failed: on_exception(run, error)
    "on_fit_end",  # after the last step, also after a stop: on_fit_end(run, result)
)
# The hooks of a run's end. Each callback gets its turn however the others fare, and one that
# raises is a warning: the run ends as it would have, its own error (one line, where it was one)
# or status never replaced by a callback's failure to close (a bar never made, a logger's store gone).
ENDING_HOOKS = ("on_exception", "on_fit_end")


class Callback:
    rank_zero_only = False  # True: run on rank 0 alone
    # True: on_step_end is called at logging steps only (it does nothing at others). Read again
    # after on_fit_start and at each logging step: a callback whose work at every step is done
    # (a summary printed, no progress bar to move) says so, and costs the steps nothing.
    logging_steps_only = False

    def state_dict(self) -> dict[str, Any]:
        """What to keep in checkpoints ({} keeps nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what state_dict returned (on every rank, when the run resumes)."""


@dataclass
class StepEnd:
    """What on_step_end gets: the step just taken and what it measured."""

    step: int  # optimizer steps taken, this one included
    epoch: float  # epochs done, fractional
    losses: list[tuple[torch.Tensor, Any]]  # each micro-batch's (loss, weight) on the device, not synced
    summed: bool  # the losses are sums over `weight` tokens (else means over `weight` samples)
    samples: int  # this rank's samples in the step
    tokens: int  # this rank's tokens in the step (0 when the data are not token ids)
    lr: float  # the learning rate the step used (the first parameter group's)
    grad_norm: torch.Tensor | None  # the global gradient norm, where measured (clipping, logging steps)
    applied: bool  # False: the update was skipped (non-finite values, float16 overflow)
    logging: bool  # a logging step (trainer.log_every_n_steps, and the last): log what you log now
    due: set[str] = field(default_factory=set)  # "validate", "save": what follows this step


@dataclass
class Control:
    """What callbacks ask of the loop (Run.request_*): a rank-0-only one's, in a job of several
    ranks, is `local` until every rank has agreed."""

    stop_reason: str | None = None
    validate: bool = False
    save: bool = False
    local: dict[str, Any] = field(default_factory=dict)  # rank 0's requests: stop_reason, validate, save


class Run:
    """What a hook sees of the run: the model and its training parts, where the run stands, and
    the ways to log and to steer. Built by the loop (ringtrain/loop/fit.py)."""

    def __init__(self, *, model, module, optimizer, scheduler, dist, run_dir: Path, config: dict, task: Any,
                 trainer: Any, total_steps: int, train_loader: Any = None, group: str | None = None):
        self.model, self.module, self.optimizer, self.scheduler = model, module, optimizer, scheduler
        self.train_loader = train_loader  # a BatchLoader (loop/loaders.py) or a StreamLoader (loop/streams.py)
        self.dist, self.run_dir, self.config, self.task, self.trainer = dist, Path(run_dir), config, task, trainer
        self.total_steps, self.group = total_steps, group  # group: the sweep of a multirun's job
        self.step, self.epoch, self.skipped_steps = 0, 0.0, 0
        self.metrics: dict[str, float] = {}  # the last validation's
        self.control = Control()
        self.logged: dict[str, float] = {}  # what hooks logged since the last on_log

    def log(self, metrics: dict[str, float]) -> None:
        """Record metrics at the current step; every logger and on_log gets them once the hooks of
        this round are done (one event per step, however many callbacks log)."""
        self.logged.update(metrics)

    def request_stop(self, reason: str) -> None:
        """End the run after this step (its checkpoint saved, exit 0). From a callback that runs on
        every rank it stops them all at once; from a rank-0-only one in a job of several ranks,
        a step later, once every rank has agreed."""
        self.control.stop_reason = self.control.stop_reason or reason

    def request_validation(self) -> None:
        """Validate after this step (as request_stop: at once, or once the ranks agree)."""
        self.control.validate = True

    def request_checkpoint(self) -> None:
        """Save a checkpoint after this step."""
        self.control.save = True


class Callbacks:
    """The run's callbacks by name; `call(hook, run, ...)` runs a hook on this rank."""

    def __init__(self, callbacks: dict[str, Callback], is_main: bool, several_ranks: bool = False):
        self.all = dict(callbacks)
        runs_here = {name: cb for name, cb in callbacks.items() if is_main or not cb.rank_zero_only}
        # Callback itself defines no hook: each hook is called only on the callbacks that define it.
        self._hooked = {hook: [cb for cb in runs_here.values() if callable(getattr(cb, hook, None))] for hook in HOOKS}
        self._every_step = self._with_work_at_every_step()
        self._several_ranks = several_ranks

    def _with_work_at_every_step(self) -> list[Callback]:
        return [cb for cb in self._hooked["on_step_end"] if not cb.logging_steps_only]

    def call(self, hook: str, run: Run, *args: Any) -> None:
        hooked = self._every_step if hook == "on_step_end" and not args[0].logging else self._hooked[hook]
        if not hooked and not run.logged:  # most hooks at most steps: nothing to do
            return
        for callback in hooked:
            if hook in ENDING_HOOKS:
                try:
                    getattr(callback, hook)(run, *args)
                except Exception as err:
                    name = next(name for name, cb in self.all.items() if cb is callback)
                    log.warning(str(component_failed(f"callbacks.{name}.{hook}", err, "the run ends as it would have without it")))
            elif callback.rank_zero_only and self._several_ranks:
                # A rank-0-only callback's requests wait for every rank's agreement (Control.local).
                asked, run.control = run.control, Control()
                try:
                    getattr(callback, hook)(run, *args)
                finally:
                    mine, run.control = run.control, asked
                    run.control.local.update({k: v for k, v in vars(mine).items() if k != "local" and v})
            else:
                getattr(callback, hook)(run, *args)
        if hook == "on_fit_start" or (hook == "on_step_end" and args[0].logging):
            self._every_step = self._with_work_at_every_step()
        if run.logged and hook != "on_log":
            logged, run.logged = run.logged, {}
            self.call("on_log", run, logged, run.step)

    def state_dict(self) -> dict[str, dict]:
        return {name: state for name, cb in self.all.items() if (state := cb.state_dict())}

    def load_state_dict(self, states: dict[str, dict]) -> None:
        for name, state in (states or {}).items():
            if name in self.all:
                self.all[name].load_state_dict(state)


def monitored(metrics: dict[str, float], monitor: str, setting: str) -> float:
    """The value of the validation metric `monitor`, or one line naming the metrics there are."""
    if monitor not in metrics:
        raise _not_a_metric(setting, monitor, metrics)
    return metrics[monitor]


def check_monitors(callbacks: dict[str, Callback], names: tuple[str, ...]) -> None:
    """Before the first step: each callback's `monitor` (early stopping's, best-k's, a user's
    own) is one of `names`, the metrics the task will report (data/tasks.py validation_metrics;
    none: the task does not say, and the first validation checks)."""
    for name, callback in callbacks.items():
        if names and isinstance(monitor := getattr(callback, "monitor", None), str) and monitor not in names:
            raise _not_a_metric(f"callbacks.{name}.monitor", monitor, names)


def _not_a_metric(setting: str, monitor: str, names: Iterable[str]) -> ConfigError:
    return ConfigError(f"{setting}={monitor} is not a metric of this task; it reports {', '.join(sorted(names))}: "
                       f"monitor one of those")


def unknown_hooks(cls: type) -> list[str]:
    """The methods named on_* of a callback class that ringtrain never calls (a misspelt hook,
    or another framework's name for one)."""
    return [name for name, _ in inspect.getmembers(cls, callable) if name.startswith("on_") and name not in HOOKS]
