"""Two ranks on data whose epoch does not split evenly over them, interrupted mid-epoch and
resumed: bit for bit the uninterrupted two-rank run, across epoch ends.

101 samples, batch 8 per rank, drop_last=false: each epoch pads the 101 samples to 102 (51 a
rank, the epoch's first sample twice) and ends in a short batch of 3 on each rank, 7 steps an
epoch. A run interrupted in the first epoch resumes from a position (`samples_into_epoch`)
whose rest of the epoch is odd again, so the resumed run must pad and cut exactly as the
uninterrupted one did, then go on through the ends of two epochs (steps 7 and 14) to step 18.
An MLP with dropout and Adam: the RNG and the optimizer state must come back exactly too.

Every job is tests/interruptible_train.py (train.py announcing each step), as in
tests/test_resilience.py, whose helpers these tests use.
"""
from __future__ import annotations

import os
import signal

import pytest

from helpers import TORCHRUN, job_ok
from test_resilience import assert_identical, checkpoint, resumed_from_step, run_job, training_job

pytestmark = pytest.mark.slow

SAMPLES, BATCH, STEPS_PER_EPOCH, STEPS = 101, 8, 7, 18
UNEVEN = [
    "model=mlp", "data.num_features=12", f"data.num_samples={SAMPLES}", "data.num_val_samples=33",
    "model.hidden_sizes=[16]", "model.dropout=0.1", "optimizer=adam", "optimizer.lr=0.01",
    f"trainer.batch_size={BATCH}", "trainer.drop_last=false", "trainer.seed=5",
    "trainer.checkpoint_every_n_steps=5", "trainer.log_every_n_steps=5", "strategy=ddp",
]
SELF_LAUNCHED = ["strategy.nproc_per_node=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """last.pt of the uninterrupted two-rank run (torchrun) to step STEPS."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    job_ok(run_job(UNEVEN + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"], launcher=TORCHRUN))
    state = checkpoint(run_dir)
    # The epochs are what the module docstring says: 7 steps of 8, 8, ..., 3 samples a rank.
    assert state["layout"]["world_size"] == 2, state["layout"]
    assert state["progress"]["step"] == STEPS
    assert state["progress"]["epoch"] == STEPS // STEPS_PER_EPOCH
    assert state["progress"]["samples_into_epoch"] == (STEPS % STEPS_PER_EPOCH) * BATCH * 2
    return state


def _mid_first_epoch(step: int) -> None:
    """A resume from `step` has the ends of two epochs ahead, and an odd rest of its epoch."""
    assert 0 < step < STEPS_PER_EPOCH, step
    assert (SAMPLES - step * BATCH * 2) % 2 == 1


def test_sigterm_mid_epoch_then_the_same_command_ends_bit_identical(tmp_path, reference):
    """Self-launched (strategy.nproc_per_node=2): SIGTERM to the parent at step 4 saves the
    current step; the same command continues it."""
    args = UNEVEN + SELF_LAUNCHED + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={tmp_path / 'run'}"]
    with training_job(args, step_seconds=0.2, hold_at_step=4) as job:
        job.wait_for_step(4)
        job.send_signal(signal.SIGTERM)
        status, output = job.finish(timeout=180)
        assert not job.kill_leftovers(), "workers were left behind"
    assert status == 143, output[-4000:]
    saved = checkpoint(tmp_path / "run")["progress"]
    _mid_first_epoch(saved["step"])
    assert saved["samples_into_epoch"] == saved["step"] * BATCH * 2

    output = job_ok(run_job(args))
    assert resumed_from_step(output) == saved["step"]
    assert_identical(tmp_path / "run", reference)


def test_a_run_to_step_4_then_continued_to_the_end_ends_bit_identical(tmp_path, reference):
    """Self-launched: trainer.max_steps=4 first (it ends, validates, saves), then the command
    with the whole max_steps in the same directory."""
    args = UNEVEN + SELF_LAUNCHED + [f"hydra.run.dir={tmp_path / 'run'}"]
    job_ok(run_job(args + ["trainer.max_steps=4"]))
    _mid_first_epoch(checkpoint(tmp_path / "run")["progress"]["step"])

    output = job_ok(run_job(args + [f"trainer.max_steps={STEPS}"]))
    assert resumed_from_step(output) == 4
    assert_identical(tmp_path / "run", reference)


def test_torchrun_max_restarts_heals_a_sigkilled_rank_1_bit_identical(tmp_path, reference):
    """torchrun --max-restarts=1: rank 1 SIGKILLed at step 6, after last.pt of step 5 (mid-epoch);
    torchrun restarts both workers, they resume from step 5 and train to the end."""
    args = UNEVEN + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={tmp_path / 'run'}"]
    with training_job(args, launcher=TORCHRUN + ["--max-restarts=1"], step_seconds=0.1) as job:
        first = job.wait_for_step(6, rank=1)
        os.kill(first, signal.SIGKILL)
        status, output = job.finish(timeout=240)
        assert status == 0, output[-6000:]
        assert job.pids[1] != first, "the workers were not restarted"
        assert not job.kill_leftovers(), "the launcher left workers behind"
    resumed = resumed_from_step(output)
    _mid_first_epoch(resumed)
    assert resumed >= 5, f"resumed from step {resumed}, before the checkpoint of step 5"
    assert_identical(tmp_path / "run", reference)
