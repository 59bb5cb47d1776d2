"""Checkpoints written in the background (trainer.async_checkpoint, on by default): what a save
copies, the writer thread, and real jobs killed, stopped or starved of disk while a write is
in flight (tests/interruptible_train.py holds a step file's write before its rename and
announces `interruptible: writing step=N`, so the tests act on that event, not on timings).

The other jobs of tests/test_resilience.py, tests/test_fsdp_training.py and
tests/test_training.py run with background saves too, since they are the default.
"""
from __future__ import annotations

import os
import re
import signal
import threading

import pytest
import torch

from ringtrain.checkpoints.background import BackgroundWriter, detached_copy
from helpers import TORCHRUN, job_ok
from test_resilience import (  # noqa: F401  (reference and full_file_system are fixtures)
    DDP,
    SIGNAL_STEP_SECONDS,
    SINGLE,
    assert_identical,
    assert_stopped_at_current_step,
    checkpoint,
    full_file_system,
    reference,
    resumed_from_step,
    run_job,
    training_job,
)

# Single process: 32 steps an epoch, saves at 7, 14, 21, 28, 32, 35 and 40.
HELD = 14  # the save whose write is held in flight


def _slow_writes(from_step: int, seconds: float = 600) -> dict[str, str]:
    return {"RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP": str(from_step), "RINGTRAIN_TEST_SLOW_WRITE_SECONDS": str(seconds)}


def _writing(step: int) -> str:
    return rf"^interruptible: writing step={step}$"


def _line_index(output: str, pattern: str) -> int:
    lines = output.splitlines()
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


# --- what a save copies, and the writer thread ------------------------------------------------


def test_the_copy_shares_no_memory_with_the_live_state_and_keeps_tied_tensors_one():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    state = {"model": {"embedding": weight.detach(), "head": weight.detach()},
             "optimizer": {"state": {"w": {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(1.0)}}},
             "progress": {"step": 7}, "rng": [{"cpu": torch.get_rng_state()}], "pair": (1, "a")}
    copy = detached_copy(state)
    expected = {key: value for key, value in state.items()}
    with torch.no_grad():  # what the next optimizer step does to the live tensors
        weight.add_(1.0)
        state["optimizer"]["state"]["w"]["exp_avg"].add_(1.0)
    assert not torch.equal(copy["model"]["embedding"], weight.detach())
    assert torch.equal(copy["model"]["embedding"] + 1.0, weight.detach())
    assert torch.equal(copy["optimizer"]["state"]["w"]["exp_avg"], torch.zeros(4, 3))
    assert copy["model"]["embedding"] is copy["model"]["head"]  # written once, as torch.save does for ties
    assert not copy["model"]["embedding"].requires_grad
    assert copy["progress"] == {"step": 7} and copy["pair"] == (1, "a") and copy.keys() == expected.keys()


def test_a_copy_reuses_the_memory_of_the_previous_one_where_it_fits():
    weight = torch.randn(4, 3)
    state = {"model": {"embedding": weight, "head": weight}, "rng": [torch.zeros(2)], "step": 1}
    first = detached_copy(state)
    weight.add_(1.0)
    second = detached_copy({**state, "rng": [torch.zeros(5)], "step": 2}, reuse=first)
    assert second["model"]["embedding"] is first["model"]["embedding"] is second["model"]["head"]
    assert torch.equal(second["model"]["embedding"], weight) and second["model"]["embedding"] is not weight
    assert second["rng"][0].shape == (5,) and second["step"] == 2  # a new shape gets new memory


def test_the_writer_runs_one_write_at_a_time_in_order_and_returns_a_failure_once():
    writer, order, release = BackgroundWriter(), [], threading.Event()

    def first():
        release.wait()
        order.append(1)

    assert writer.submit(first) is None
    assert writer.busy
    release.set()
    assert writer.submit(lambda: order.append(2)) is None  # waits for the first
    assert writer.wait() is None and order == [1, 2] and not writer.busy

    def full_disk():
        raise OSError(28, "No space left on device")

    writer.submit(full_disk)
    never = []
    failure = writer.submit(lambda: never.append(1))  # the failure comes back; nothing more is written
    assert isinstance(failure, OSError) and never == [] and writer.wait() is None


# --- real jobs ----------------------------------------------------------------------------------


def test_sigkill_while_a_background_write_is_in_flight_resumes_the_previous_checkpoint_bit_identical(
        tmp_path, reference):
    args = SINGLE + [f"hydra.run.dir={tmp_path / 'run'}"]
    with training_job(args, env=_slow_writes(HELD)) as job:
        job.wait_for_line(_writing(HELD))
        # Training goes on while step 14's file is written: the write is in the background.
        job.wait_for_step(HELD + 1)
        os.kill(job.proc.pid, signal.SIGKILL)
        status, _ = job.finish()
    assert status == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "checkpoints"
    # The write was in flight: its bytes in a temporary file, not yet named, last.pt the previous save.
    assert [p.name for p in checkpoints.iterdir() if p.name.startswith(f".step-{HELD:08d}.pt.tmp-")]
    assert not (checkpoints / f"step-{HELD:08d}.pt").exists()
    assert checkpoint(tmp_path / "run")["progress"]["step"] == 7

    output = job_ok(run_job(args))  # the same command
    assert resumed_from_step(output) == 7
    assert_identical(tmp_path / "run", reference(1))


@pytest.mark.slow
def test_sigterm_during_background_writes_waits_for_them_and_exits_143_with_a_loadable_last_pt(
        tmp_path, reference):
    args = SINGLE + [f"hydra.run.dir={tmp_path / 'run'}"]
    # Every write from step 14 on is held a second: the stop's own save is in flight at the exit.
    with training_job(args, step_seconds=SIGNAL_STEP_SECONDS, env=_slow_writes(HELD, seconds=1)) as job:
        job.wait_for_line(_writing(HELD))
        job.wait_for_step(HELD + 1)
        os.kill(job.proc.pid, signal.SIGTERM)
        seen = job.newest_step()
        status, output = job.finish()
    assert status == 143, output[-4000:]
    saved = assert_stopped_at_current_step(tmp_path / "run", output, HELD + 1, seen, 1)
    assert re.search(_writing(saved), output, re.M), "the stop's save was not held like a background write"
    # The process waited for the stop's write before exiting: the file was renamed into place.
    assert re.search(rf"^interruptible: written step={saved}$", output, re.M), output[-4000:]
    state = checkpoint(tmp_path / "run")  # loads with weights_only=True, complete
    assert state["progress"]["step"] == saved

    output = job_ok(run_job(args))
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(1))


@pytest.mark.slow
def test_synchronous_checkpoints_still_work_and_give_the_same_run(tmp_path, reference):
    args = SINGLE + ["trainer.async_checkpoint=false", f"hydra.run.dir={tmp_path / 'run'}"]
    # Held writes stop training: step 15 comes only after step 14's file is in place.
    status, output = run_job(args, env=_slow_writes(HELD, seconds=0.5))
    assert status == 0, output[-4000:]
    assert _line_index(output, rf"^interruptible: written step={HELD}$") < _line_index(
        output, rf"^interruptible: rank=0 pid=\d+ step={HELD + 1}$")
    assert_identical(tmp_path / "run", reference(1))


def test_a_full_disk_during_a_background_write_stops_every_rank_with_one_line_and_keeps_last_pt(full_file_system):
    directory, env = full_file_system
    # As tests/test_resilience.py's full-disk test, on two ranks: about 0.86 MB a checkpoint,
    # the 3rd does not fit; rank 0 learns it in its writer thread, every rank at the next save.
    args = DDP + ["model.hidden_sizes=[2048]", "trainer.checkpoint_every_n_steps=5",
                  f"hydra.run.dir={directory / 'run'}"]
    status, output = run_job(args, launcher=TORCHRUN, env=env)
    assert status != 0, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # Every rank learns it at the next save and ends; the job says it once (not once per rank).
    assert len(errors) == 1, output[-4000:]
    assert re.search(r"cannot save checkpoint \S+step-000000(10|15)\.pt: No space left on device; free space on",
                     errors[0]), errors[0]
    assert errors[0].endswith("the previous last.pt is intact")
    state = torch.load(directory / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["progress"]["step"] in (5, 10)
    assert not [p.name for p in (directory / "run" / "checkpoints").iterdir() if ".tmp-" in p.name]


def test_an_exception_waits_for_the_write_in_flight_before_leaving_the_checkpointer(tmp_path):
    from types import SimpleNamespace

    from ringtrain.checkpoints import CheckpointManager, Part
    from ringtrain.distributed import DistInfo

    trainer = SimpleNamespace(keep_last_k=1, async_checkpoint=True, checkpoint=True, checkpoint_every_n_steps=0)
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None)
    manager = CheckpointManager(tmp_path, trainer, dist)
    release, store = threading.Event(), manager._store

    def held_store(*args, **kwargs):
        release.wait()
        return store(*args, **kwargs)

    manager._store = held_store
    wait = manager.writer.wait

    def release_then_wait():  # the write finishes only for one who waits for it
        release.set()
        return wait()

    with pytest.raises(RuntimeError, match="a crash"), manager:
        manager.register(given=Part(lambda: {"progress": {"step": 3}, "model": {"w": torch.ones(2)}}, spread=True))
        manager.save(3, best=False)
        assert manager.writer.busy
        manager.writer.wait = release_then_wait
        raise RuntimeError("a crash")
    assert not manager.writer.busy
    assert torch.load(manager.last, weights_only=True)["progress"]["step"] == 3
