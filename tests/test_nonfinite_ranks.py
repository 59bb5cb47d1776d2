"""Every rank takes the same non-finite decision: a 2-rank ddp job whose loss is NaN on one rank
only (its gradient finite) skips that update on both ranks under on_nonfinite=skip, counted
once, and stops every rank at once under stop, exit 3, naming the step (no collective left
waiting for the rank that stopped)."""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import run_cli

# A loss whose value is NaN on rank 1 at its third micro-batch while its gradient stays finite
# (a NaN constant has no gradient); the model writes its weights' sum at every forward, per rank.
USER_CODE = '''
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class NaNOnRankOne:
    def __init__(self):
        self.calls = 0

    def __call__(self, outputs, targets):
        loss = F.mse_loss(outputs.float(), targets)
        self.calls += 1
        if torch.is_grad_enabled() and dist.is_initialized() and dist.get_rank() == 1 and self.calls == 3:
            loss = loss + torch.tensor(float("nan"))
        return loss


class RecordingLine(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features)

    def forward(self, x):
        if self.training and dist.is_initialized():  # not in ringtrain's meta-device pre-check
            with open(f"weights-rank{dist.get_rank()}.txt", "a") as file:
                file.write(f"{float(self.weight.detach().sum()):.10f} {float(self.bias.detach().sum()):.10f}\\n")
        return super().forward(x)
'''
TASK = """
_target_: ringtrain.data.tasks.LossTask
loss: {_target_: nan_rank.NaNOnRankOne}
"""
MODEL = """
_target_: nan_rank.RecordingLine
"""
RUN = ["task=nan_on_rank_one", "model=recording_line", "strategy=ddp", "strategy.nproc_per_node=2",
       "trainer.batch_size=8", "trainer.max_steps=6", "trainer.log_every_n_steps=1", "strategy.timeout_minutes=1"]


@pytest.fixture()
def project(tmp_path):
    (tmp_path / "nan_rank.py").write_text(USER_CODE)
    (tmp_path / "conf" / "task").mkdir(parents=True)
    (tmp_path / "conf" / "model").mkdir()
    (tmp_path / "conf" / "task" / "nan_on_rank_one.yaml").write_text(textwrap.dedent(TASK))
    (tmp_path / "conf" / "model" / "recording_line.yaml").write_text(textwrap.dedent(MODEL))
    return tmp_path


@pytest.mark.slow
def test_skip_skips_the_same_update_on_every_rank(project):
    proc = run_cli(["--config-dir", str(project / "conf"), *RUN, "trainer.on_nonfinite=skip",
                    f"hydra.run.dir={project / 'run'}"], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = ((project / f"weights-rank{r}.txt").read_text().splitlines() for r in (0, 1))
    assert len(rank0) == 6 and rank0 == rank1  # the replicas never diverged
    assert rank0[2] == rank0[3]  # the update of step 3 was skipped: step 4 saw step 3's weights
    metrics = json.loads((project / "run" / "metrics.json").read_text())
    assert metrics["skipped_steps"] == 1


def test_stop_ends_every_rank_at_once_with_the_nonfinite_line(project):
    proc = run_cli(["--config-dir", str(project / "conf"), *RUN, f"hydra.run.dir={project / 'run'}"],
                   cwd=project, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "non-finite loss or gradient norm (on another rank) at step 3; stopped at step 3" in output
    assert "timed out" not in output and "stopped answering" not in output
