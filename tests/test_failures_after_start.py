"""Mistakes that only show once the job runs (a constructor that raises while it is built, a
forward that fails on the first batch) and every mistake under torchrun: one `error:` line,
printed once for the whole job (not once per rank), exit 2 on every rank, no traceback of
ringtrain's. Real subprocesses: train.py alone and 2-rank gloo jobs under torchrun.

torchrun itself still ends with its own failure report (a ChildFailedError traceback listing
each rank's exit status) and status 1, whatever its workers do; the ranks' statuses are read
from that report.
"""
from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli, train_in_process
from helpers import TORCHRUN
from ringtrain.errors import ComponentFailed

FAILING = '''
"""Models that fail only once the job runs: the checks before work see nothing wrong."""
import os

import torch
from torch import nn


class FailsOnRankOne(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        # Data that differs by rank: only rank 1 meets it, and only in the job (the process group
        # is up).
        if os.environ.get("RANK") == "1" and torch.distributed.is_initialized():
            raise ValueError("a sample on rank 1 has no label")
        return self.linear(x)


class OpensAFile(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        if torch.empty(0).device.type != "meta":  # the check before work builds it on the meta device
            raise RuntimeError("cannot open weights file /nonexistent/weights.bin")
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.linear(x)
'''



def line_of(text: str) -> int:
    """The line of my_failing.py holding `text` (the file starts with FAILING's first line)."""
    return 1 + next(i for i, line in enumerate(FAILING.splitlines()) if text in line)


SMALL = ["~model.hidden_sizes", "~model.dropout", "data.num_features=8", "data.num_samples=64",
         "data.num_val_samples=16", "trainer.max_steps=2"]


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_failing.py").write_text(textwrap.dedent(FAILING), encoding="utf-8")
    return tmp_path


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def rank_statuses(output: str) -> list[int]:
    """Each rank's exit status, from torchrun's failure report."""
    return sorted(int(s) for s in re.findall(r"^\s+exitcode\s+:\s*(-?\d+)", output, re.MULTILINE))


def assert_no_traceback_of_ringtrains(output: str) -> None:
    """The one traceback allowed is torchrun's own (its launcher's frames)."""
    frames = re.findall(r'^\s*File "([^"]+)"', output, re.MULTILINE)
    assert all("torch/distributed" in f or f.startswith("<frozen") for f in frames), output[-4000:]


def test_a_constructor_that_raises_while_built_is_one_line_naming_it(user_dir, monkeypatch):
    """In process (ComponentFailed is a UserError: one `error:` line and exit 2, as every one)."""
    monkeypatch.syspath_prepend(str(user_dir))
    with pytest.raises(ComponentFailed) as failed:
        train_in_process(["model=mlp", "model._target_=my_failing.OpensAFile", *SMALL], user_dir / "run")
    message = str(failed.value)
    assert message.startswith("building the model my_failing.OpensAFile failed: RuntimeError: cannot open weights "
                              "file /nonexistent/weights.bin (raised at ") and "\n" not in message
    assert message.endswith(f"my_failing.py:{line_of('cannot open weights file')} in __init__); check the model.* settings")


def test_a_forward_failing_on_rank_1_only_is_said_once_and_the_job_exits_2(user_dir):
    proc = run_cli(["model=mlp", "model._target_=my_failing.FailsOnRankOne", "strategy=ddp", *SMALL,
                    "hydra.run.dir=run"], cwd=user_dir, launcher=TORCHRUN)
    output = proc.stdout + proc.stderr
    assert error_lines(output) == [
        "error: the first training step failed: ValueError: a sample on rank 1 has no label (raised at "
        f"my_failing.py:{line_of('raise ValueError')} "
        "in forward); the model, the task and the data do not fit each other (check model.*, task.* and data.*), "
        "or one of them has a bug"
    ], output[-4000:]
    # Rank 0 learned from the job's store that rank 1 said it: it ends with the same status,
    # silently, unless torchrun's SIGTERM, sent once rank 1 ended, stopped it first.
    statuses = rank_statuses(output)
    assert len(statuses) == 2 and 2 in statuses and set(statuses) <= {2, -15}, output[-4000:]
    assert_no_traceback_of_ringtrains(output)


def test_a_config_mistake_under_torchrun_is_said_once(user_dir):
    proc = run_cli(["strategy=ddp", "trainer.bach_size=3"], cwd=user_dir, launcher=TORCHRUN)
    output = proc.stdout + proc.stderr
    assert len(error_lines(output)) == 1 and "trainer.bach_size is not a setting" in error_lines(output)[0], output
    statuses = rank_statuses(output)  # a rank torchrun stopped first (SIGTERM) says nothing either
    assert len(statuses) == 2 and 2 in statuses and set(statuses) <= {2, -15}, output[-4000:]
    assert_no_traceback_of_ringtrains(output)
    assert not (user_dir / "outputs").exists()
