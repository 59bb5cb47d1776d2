"""A user's model and callbacks at the edges of a run: a model with lazy modules trains with
the default callbacks, and a callback that fails while the run ends (on_exception, on_fit_end)
never replaces how it ends. Each run is a real `python -m ringtrain --config-dir my_conf ...` in a
project folder outside the repository, as a user starts it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import QUIET, run_module
from helpers import ok, refused, user_package

NETS = '''
import torch
from torch import nn


class LazyMLP(nn.Module):
    """Its first layer's input size is learned from the first batch (nn.LazyLinear)."""

    def __init__(self, out_features: int = 1, fail: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, out_features))
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise ValueError("the user's model cannot take this batch")
        return self.body(x)
'''

CALLBACKS = '''
from ringtrain.callbacks import Callback


class Fragile(Callback):
    """Fails in both hooks of a run's end."""

    def on_exception(self, run, error):
        raise RuntimeError("fragile cannot clean up")

    def on_fit_end(self, run, result):
        raise RuntimeError("fragile cannot finish")
'''

LOGGERS = '''
import errno
import os

from ringtrain.loggers import Logger


class FillsTheDisk(Logger):
    """A logger whose store's disk is full from step `full_at` on."""

    def __init__(self, full_at: int = 3):
        self.full_at = full_at

    def start(self, run_dir, run_name, group, config):
        pass

    def log_metrics(self, metrics, step):
        if step >= self.full_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "metrics.db")

    def finish(self, summary, status):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "metrics.db")
'''

LAZY = '''
# @package _global_
defaults:
  - override /data: regression
model:
  _target_: mine.nets.LazyMLP
'''


@pytest.fixture
def project(tmp_path) -> Iterator[Path]:
    """A user's project: its package `mine` (a lazy model, a fragile callback) and my_conf/model/lazy.yaml."""
    files = {"mine/__init__.py": "", "mine/nets.py": NETS, "mine/callbacks.py": CALLBACKS,
             "mine/loggers.py": LOGGERS, "my_conf/model/lazy.yaml": LAZY}
    with user_package(tmp_path, files, "mine") as root:
        yield root


def train(project: Path, *args: str):
    return run_module("ringtrain", ["--config-dir", "my_conf", "model=lazy", "trainer.max_steps=3",
                                    f"hydra.run.dir={project / 'run'}", *args, *QUIET], cwd=project)


def test_a_model_with_lazy_modules_trains_with_the_default_callbacks_and_is_counted_after_its_first_step(project):
    proc = ok(train(project))
    assert json.loads((project / "run" / "metrics.json").read_text())["steps"] == 3
    # LazyLinear(8) over 1 feature, then Linear(8, 1): 8 + 8 + 8 + 1, known once the first batch went through.
    assert "model LazyMLP: 25 parameters, 25 trainable" in proc.stdout, proc.stdout[-3000:]


FRAGILE = "+callbacks.fragile={_target_: mine.callbacks.Fragile}"


def test_a_callback_failing_in_on_exception_leaves_the_runs_one_line_as_it_was(project):
    proc = train(project, "+model.fail=true", FRAGILE)
    refused(proc, "the first training step failed: ValueError: the user's model cannot take this batch")
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    # The callback's failure is said, in one line of the log.
    [warning] = [line for line in proc.stdout.splitlines() if "callbacks.fragile.on_exception failed" in line]
    assert "RuntimeError: fragile cannot clean up" in warning


def test_a_callback_failing_in_on_fit_end_leaves_the_run_complete(project):
    proc = ok(train(project, FRAGILE))
    assert json.loads((project / "run" / "metrics.json").read_text())["steps"] == 3
    assert "callbacks.fragile.on_fit_end failed: RuntimeError: fragile cannot finish" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_progress_bar_closes_without_having_been_made():
    from ringtrain.callbacks.console import ProgressBar

    ProgressBar().on_exception(None, RuntimeError("the run failed before on_fit_start"))


def test_a_disk_filling_during_a_loggers_write_is_one_line_and_the_last_checkpoint_loads(project):
    from ringtrain.checkpoints.files import read_checkpoint

    proc = train(project, "+logger.full={_target_: mine.loggers.FillsTheDisk}", "trainer.max_steps=8",
                 "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=2")
    refused(proc, "logger.full cannot write at step 3: No space left on device (metrics.db); free space there",
            "~logger.full", f"the checkpoints saved so far are kept ({project / 'run' / 'checkpoints'})")
    assert "Traceback" not in proc.stdout, proc.stdout[-3000:]
    # The save of step 2 (written in the background while step 3 ran) is complete, and verifies.
    state = read_checkpoint(project / "run" / "checkpoints" / "last.pt")
    assert state["progress"]["step"] == 2
