"""One pass through the core: a training job is composed once and validated once per process,
and the checkpoint it continues from is read from disk once per process (counted by
tests/counting_train.py), on one process and on each rank of a torchrun job."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUIET, REPO
from helpers import TORCHRUN

COUNTING = str(REPO / "tests" / "counting_train.py")
JOB = ["model=mlp", "model.hidden_sizes=[8]", "data.num_samples=64", "data.num_val_samples=16",
       "trainer.batch_size=16", "trainer.progress_bar=false"]


def _counts(args: list[str], cwd: Path, launcher: list[str] | None = None) -> dict[str, tuple[int, int, list[str]]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run((launcher or [sys.executable]) + [COUNTING, *args, *QUIET], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"counts: rank=(\d+) compositions=(\d+) validations=(\d+) checkpoint_reads=\d+ ?(.*?) "
                       r"mode_probes=(\d+)", proc.stdout)
    # @hydra.main's own probe of hydra.mode (a composition before the job's) is not made: a run
    # whose command line is overrides only is composed once in all.
    assert all(probes == "0" for *_, probes in found), proc.stdout[-2000:]
    return {rank: (int(c), int(v), reads.split()) for rank, c, v, reads, _ in found}


def test_a_job_is_composed_and_validated_once_and_its_checkpoint_read_once(tmp_path):
    run_dir = tmp_path / "run"
    first = _counts(JOB + ["trainer.max_steps=4", f"hydra.run.dir={run_dir}"], tmp_path)
    assert first == {"0": (1, 1, [])}
    # The same command, continued (resume=auto): last.pt is read once, by the resume decision,
    # and that read is what the run restores.
    again = _counts(JOB + ["trainer.max_steps=8", f"hydra.run.dir={run_dir}"], tmp_path)
    assert again == {"0": (1, 1, ["last.pt"])}
    # trainer.resume=<file>: read once before Hydra composes (its stored config), and that is all.
    path = run_dir / "checkpoints" / "last.pt"
    continued = _counts(["trainer.max_steps=12", f"trainer.resume={path}", "trainer.progress_bar=false"], tmp_path)
    assert continued == {"0": (1, 1, ["last.pt"])}


@pytest.mark.slow  # each rank runs the one process's path, above
def test_each_torchrun_rank_composes_validates_and_reads_once(tmp_path):
    run_dir = tmp_path / "run"
    ddp = JOB + ["strategy=ddp", "trainer.batch_size=8", f"hydra.run.dir={run_dir}"]
    assert _counts(ddp + ["trainer.max_steps=4"], tmp_path, TORCHRUN) == {"0": (1, 1, []), "1": (1, 1, [])}
    assert _counts(ddp + ["trainer.max_steps=8"], tmp_path, TORCHRUN) == {
        "0": (1, 1, ["last.pt"]), "1": (1, 1, ["last.pt"])}


def test_evaluate_composes_its_job_once_and_reads_the_checkpoint_once(tmp_path):
    """The checkpoint's recipe replayed and the tool's settings: one composition, one read."""
    run_dir = tmp_path / "run"
    assert _counts(JOB + ["trainer.max_steps=4", f"hydra.run.dir={run_dir}"], tmp_path) == {"0": (1, 1, [])}
    path = run_dir / "checkpoints" / "last.pt"
    assert _counts(["evaluate", f"checkpoint={path}"], tmp_path) == {"0": (1, 0, ["last.pt"])}
