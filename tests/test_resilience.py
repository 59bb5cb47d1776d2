"""Jobs that are killed, stopped, stalled or starved, for real: subprocesses on CPU.

Every job runs tests/interruptible_train.py, which is train.py with each optimizer step
announced on stdout (`interruptible: rank=R pid=P step=S`) and slowed down by a sleep, so a
test can interrupt it at a chosen step and signal the right process. The sleep costs no CPU
and changes no number: results are compared bit for bit (torch.equal) with uninterrupted runs.

The default suite keeps to the cases a user meets most; `-m slow` adds the longer variants
(a stalled rank waits out a collective timeout, self-launched DDP spawns slowly).
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import QUIET, REPO, compose_config, run_cli
from helpers import (
    TORCHRUN,
    Job,
    assert_same_state,
    alive,
    corrupt_tensor_bytes,
    job_ok,
    job_refused,
    refused,
    torchrun_static_rendezvous,
)

WRAPPER = REPO / "tests" / "interruptible_train.py"

# A small MLP with dropout (so the RNG state must be restored exactly) and Adam (so must the
# optimizer's). 512 samples of batch 16: 32 steps per epoch on one process, 16 per epoch on each
# of two ranks; last.pt every 7 steps and at every epoch's end.
MLP = [
    "model=mlp", "data.num_features=24", "data.num_samples=512", "data.num_val_samples=129",
    "model.hidden_sizes=[16]", "model.dropout=0.1", "optimizer=adam", "optimizer.lr=0.01",
    "trainer.batch_size=16", "trainer.seed=3", "trainer.checkpoint_every_n_steps=7",
    "trainer.log_every_n_steps=5",
]
STEPS = 40
SINGLE = MLP + [f"trainer.max_steps={STEPS}"]
DDP = MLP + [f"trainer.max_steps={STEPS}", "strategy=ddp"]
SELF_LAUNCHED = DDP + ["strategy.nproc_per_node=2"]
STEPS_PER_EPOCH = {1: 32, 2: 16}
EVERY = 7  # trainer.checkpoint_every_n_steps
# Steps of jobs that get a stop signal: long enough that the launcher's forwarding (torchrun
# polls its workers every 0.1 s) and the ranks' one-step agreement land a step or two later,
# not on the next periodic save.
SIGNAL_STEP_SECONDS = 0.2


# --- running and interrupting jobs ------------------------------------------------------------


def training_job(args: list[str], launcher: list[str] | None = None, cwd: Path | None = None,
                 step_seconds: float = 0.05, env: dict[str, str] | None = None, hold_at_step: int = 0) -> Job:
    """tests/interruptible_train.py ARGS (under `launcher`) as a watched Job, each step announced
    and `step_seconds` long. `hold_at_step`: every rank pauses a few seconds after that step
    (the test signals it then)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "RINGTRAIN_TEST_STEP_SECONDS": str(step_seconds), "RINGTRAIN_TEST_HOLD_AT_STEP": str(hold_at_step),
           **(env or {})}
    env.pop("PYTHONPATH", None)  # the worktree comes first through the wrapper itself
    return Job((launcher or [sys.executable]) + [str(WRAPPER), *args, *QUIET], cwd=cwd or REPO, env=env)


def run_job(args: list[str], launcher: list[str] | None = None, cwd: Path | None = None,
            timeout: float = 240, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a job to its end, uninterrupted (no sleeping between steps)."""
    with training_job(args, launcher, cwd, step_seconds=0, env=env) as job:
        return job.finish(timeout)


def checkpoint(run_dir: Path, name: str = "last.pt") -> dict:
    return torch.load(run_dir / "checkpoints" / name, weights_only=True)


def assert_identical(run_dir: Path, reference: dict) -> None:
    """Weights, optimizer and schedule state, progress: bit for bit those of `reference`."""
    state = checkpoint(run_dir)
    assert state["progress"] == reference["progress"]
    assert_same_state(state["model"], reference["model"], "model")
    assert_same_state(state["optimizer"], reference["optimizer"], "optimizer")
    assert_same_state(state["scheduler"], reference["scheduler"], "scheduler")


def periodic_save_steps(world_size: int) -> set[int]:
    """Steps at which last.pt is written anyway: every EVERY steps and at each epoch's end."""
    per_epoch = STEPS_PER_EPOCH[world_size]
    return {s for s in range(1, STEPS + 1) if s % EVERY == 0 or s % per_epoch == 0 or s == STEPS}


def interrupt_step(seed: str, world_size: int, lo: int = 8, hi: int = STEPS - 8) -> int:
    """A seeded random step, mid-epoch, after a periodic save and with three more steps before
    the next one (so a stop there, a step or two later, is not mistaken for a periodic save)."""
    saves = periodic_save_steps(world_size)
    candidates = [s for s in range(lo, hi) if not (set(range(s, s + 4)) & saves)]
    return random.Random(seed).choice(candidates)


def resumed_from_step(output: str) -> int:
    match = re.search(r"resuming from \S+ \(step (\d+)\)", output)
    assert match, "the job did not resume:\n" + output[-4000:]
    return int(match.group(1))


class References:
    """Uninterrupted runs, one process (1) or two ranks (2), each made when first needed."""

    def __init__(self, tmp_path_factory):
        self._factory = tmp_path_factory
        self._dirs: dict[int, Path] = {}
        self._states: dict[int, dict] = {}

    def run_dir(self, world_size: int) -> Path:
        if world_size not in self._dirs:
            run_dir = self._factory.mktemp(f"reference-{world_size}")
            args = (SINGLE if world_size == 1 else DDP) + [f"hydra.run.dir={run_dir}"]
            job_ok(run_job(args, launcher=TORCHRUN if world_size == 2 else None))
            self._states[world_size] = checkpoint(run_dir)
            assert self._states[world_size]["progress"]["step"] == STEPS
            self._dirs[world_size] = run_dir
        return self._dirs[world_size]

    def __call__(self, world_size: int) -> dict:
        """last.pt of the uninterrupted run."""
        self.run_dir(world_size)
        return self._states[world_size]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> References:
    return References(tmp_path_factory)


# --- 1. SIGKILL, then the same command ---------------------------------------------------------


@pytest.mark.slow  # ~20 s; the default suite's kill -9: test_async_checkpoint.py's, mid-write
def test_sigkill_mid_epoch_then_the_same_command_ends_bit_identical(tmp_path, reference):
    args = SINGLE + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("single-sigkill", 1)
    with training_job(args) as job:
        job.wait_for_step(step)
        os.kill(job.proc.pid, signal.SIGKILL)
        seen = job.newest_step()
        status, _ = job.finish()
    assert status == -signal.SIGKILL
    saved = checkpoint(tmp_path / "run")["progress"]["step"]
    assert 0 < saved <= seen + 3  # the step in flight, and output not yet read

    output = job_ok(run_job(args))  # the same command: trainer.resume=auto is the default
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(1))


# --- 2. SIGTERM and Ctrl-C: save at the current step, exit 143 ---------------------------------


def assert_stopped_at_current_step(run_dir: Path, output: str, signalled_after: int, seen: int, world_size: int,
                                   name: str = "SIGTERM", off_the_periodic_saves: bool = True) -> int:
    """last.pt holds the step the stop finished (not the last periodic save); returns it."""
    stopped = re.search(rf"stopped by {name} after step (\d+); last.pt saved", output)
    assert stopped, output[-4000:]
    step = checkpoint(run_dir)["progress"]["step"]
    assert step == int(stopped.group(1))
    # `seen`: the newest step announced when the signal went out. Then the step in flight, one
    # more for the ranks' agreement, and one for output not yet read.
    assert signalled_after <= step <= seen + 3, (signalled_after, seen, step)
    if off_the_periodic_saves:  # the step was chosen so: the stop itself must have saved
        last_periodic = max(s for s in periodic_save_steps(world_size) | {0} if s <= step)
        assert step > last_periodic, f"last.pt is the periodic save of step {last_periodic}"
    return step


def test_sigterm_saves_the_current_step_exits_143_and_the_same_command_continues(tmp_path, reference):
    args = SINGLE + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("single-sigterm", 1)
    with training_job(args, step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=step) as job:
        job.wait_for_step(step)
        os.kill(job.proc.pid, signal.SIGTERM)
        seen = job.newest_step()
        status, output = job.finish()
    assert status == 143, output[-4000:]
    saved = assert_stopped_at_current_step(tmp_path / "run", output, step, seen, 1)
    # The run's last word names the signal, not another stop's ("stopped early" is early stopping's).
    assert re.search(rf"stopped by SIGTERM: {saved} steps in [0-9.]+s$", output, re.MULTILINE), output[-4000:]

    output = job_ok(run_job(args))
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(1))


def continue_as_printed(output: str, cwd: Path) -> tuple[int, str]:
    """Run the command a stopped job printed as the one that continues it, as a user pastes it
    into a shell in the directory it names (steps not slowed down)."""
    printed = re.findall(rf"to continue this run, in {re.escape(str(cwd))}: (.+)$", output, re.MULTILINE)
    assert len(printed) == 1, output[-4000:]  # once, by rank 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RINGTRAIN_TEST_STEP_SECONDS": "0"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(printed[0], shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_run_stopped_without_hydra_run_dir_prints_the_command_that_continues_it(tmp_path, reference):
    """No hydra.run.dir: the same command started again would open a new time-stamped
    directory; the printed one continues this run from the step the stop saved."""
    step = interrupt_step("single-printed-command", 1)
    with training_job(SINGLE, cwd=tmp_path, step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=step) as job:
        job.wait_for_step(step)
        job.send_signal(signal.SIGTERM)
        seen = job.newest_step()
        status, output = job.finish()
    assert status == 143, output[-4000:]
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    saved = assert_stopped_at_current_step(run_dir, output, step, seen, 1)
    # Stopped before the first evaluation: no metrics to report, and no dangling comma.
    assert re.search(rf"stopped by SIGTERM: {saved} steps in [0-9.]+s$", output, re.MULTILINE), output[-4000:]

    output = job_ok(continue_as_printed(output, tmp_path))
    assert resumed_from_step(output) == saved
    assert [run_dir] == list((tmp_path / "outputs" / "runs").iterdir())  # no second directory
    assert_identical(run_dir, reference(1))


def test_the_continuing_command_points_resume_at_this_runs_last_pt_and_keeps_everything_else(tmp_path, monkeypatch):
    from ringtrain.tools.train import continue_command

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # as `python train.py` (not pytest's -m)
    run_dir = tmp_path / "outputs" / "runs" / "a b"
    argv = ["train.py", "--config-dir", "my conf", "model=mlp", "hydra.run.dir=old", "trainer.resume=null"]
    assert continue_command(argv, "outputs/runs/a b", None).endswith(
        f"train.py --config-dir 'my conf' model=mlp trainer.resume=auto 'hydra.run.dir={run_dir}'")
    # A step file given to trainer.resume would go back to that step: this run's last.pt instead.
    argv = ["train.py", "trainer.resume=old/checkpoints/step-7.pt", "trainer.max_steps=90"]
    assert continue_command(argv, str(run_dir), "old/checkpoints/step-7.pt").endswith(
        f"train.py trainer.max_steps=90 'trainer.resume={run_dir}/checkpoints/last.pt' 'hydra.run.dir={run_dir}'")
    assert continue_command(["train.py", "trainer.resume=auto"], str(run_dir), "auto").endswith(
        f"train.py trainer.resume=auto 'hydra.run.dir={run_dir}'")


def test_ctrl_c_five_seconds_in_stops_cleanly_with_143(tmp_path):
    args = SINGLE + [f"hydra.run.dir={tmp_path / 'run'}"]
    with training_job(args, step_seconds=0.1) as job:
        job.wait_for_step(1)  # at least started training, whatever the machine's load
        time.sleep(max(0.0, job.started + 5 - time.monotonic()))
        step = job.newest_step()
        os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        status, output = job.finish()
    assert status == 143, output[-4000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-4000:]
    assert re.search(r"stopped by SIGINT after step \d+", output)
    # Sent at whatever step 5 s reached: that step may be a periodic save itself.
    stopped = assert_stopped_at_current_step(tmp_path / "run", output, step, step, 1, name="SIGINT",
                                             off_the_periodic_saves=False)
    assert stopped < STEPS


# --- two ranks under torchrun ------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_worker_sigkilled_then_the_same_command_ends_bit_identical(tmp_path, reference):
    args = DDP + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("torchrun-sigkill", 2)
    victim = random.Random("torchrun-sigkill-rank").choice([0, 1])
    with training_job(args, launcher=TORCHRUN) as job:
        pid = job.wait_for_step(step, rank=victim)
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does
        seen = job.newest_step()
        status, output = job.finish(timeout=120)
        assert status != 0, output[-4000:]
        assert not job.kill_leftovers(), "the launcher left workers behind"
    saved = checkpoint(tmp_path / "run")["progress"]["step"]
    assert 0 < saved <= seen + 3  # the step in flight, and output not yet read

    output = job_ok(run_job(args, launcher=TORCHRUN))
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(2))


@pytest.mark.slow
def test_fsdp_sharded_checkpoints_survive_a_sigkilled_worker_bit_identical(tmp_path):
    """strategy.state_dict_type=sharded: each rank's shards plus the step file that names them."""
    from conftest import checkpoint_weights

    args = MLP + [f"trainer.max_steps={STEPS}", "strategy=fsdp", "strategy.state_dict_type=sharded"]
    job_ok(run_job(args + [f"hydra.run.dir={tmp_path / 'straight'}"], launcher=TORCHRUN))
    run_args = args + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("fsdp-sigkill", 2)
    with training_job(run_args, launcher=TORCHRUN) as job:
        os.kill(job.wait_for_step(step, rank=1), signal.SIGKILL)
        status, output = job.finish(timeout=120)
        assert status != 0, output[-4000:]
        assert not job.kill_leftovers(), "the launcher left workers behind"
    saved = checkpoint(tmp_path / "run")["progress"]["step"]
    assert 0 < saved < STEPS

    output = job_ok(run_job(run_args, launcher=TORCHRUN))
    assert resumed_from_step(output) == saved
    straight, resumed = checkpoint(tmp_path / "straight"), checkpoint(tmp_path / "run")
    assert resumed["progress"] == straight["progress"]
    assert_same_state(resumed["scheduler"], straight["scheduler"], "scheduler")
    assert_same_state(checkpoint_weights(tmp_path / "run"), checkpoint_weights(tmp_path / "straight"), "model")


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_the_current_step_on_every_rank_and_continues(tmp_path, reference):
    args = DDP + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("torchrun-sigterm", 2)
    with training_job(args, launcher=TORCHRUN, step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=step) as job:
        job.wait_for_step(step)
        job.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
        seen = job.newest_step()
        status, output = job.finish(timeout=120)
        assert not job.kill_leftovers(), "the launcher left workers behind"
    assert status != 0, output[-4000:]  # torchrun's own status after a signal (1)
    saved = assert_stopped_at_current_step(tmp_path / "run", output, step, seen, 2)
    # Each rank says it got the signal, once, in rank 0's format, the others with their rank.
    notices = re.findall(r"^\[[\d :,-]+\]\[ringtrain\](\[rank \d\])?\[WARNING\] - received SIGTERM: finishing step",
                         output, re.MULTILINE)
    assert sorted(notices) == ["", "[rank 1]"], output[-4000:]
    assert output.count("received SIGTERM") == 2, output[-4000:]

    output = job_ok(continue_as_printed(output, REPO))  # the torchrun command, as printed by rank 0
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(2))


# --- 3. torchrun --max-restarts: the job heals itself ------------------------------------------


def run_with_a_restart(args: list[str], cwd: Path, seed: str, launcher: list[str] | None = None,
                       pids: dict | None = None) -> str:
    """A job allowed one restart (torchrun's by default; `launcher=[sys.executable]` for a
    self-launched one, whose args allow it), one worker SIGKILLed mid-run; returns its output
    (and the launcher's pid in `pids`)."""
    launcher = launcher or (TORCHRUN + ["--max-restarts=1"])
    step = interrupt_step(seed, 2)
    victim = random.Random(seed + "-rank").choice([0, 1])
    with training_job(args, launcher=launcher, cwd=cwd) as job:
        if pids is not None:
            pids["launcher"] = job.proc.pid
        first = job.wait_for_step(step, rank=victim)
        os.kill(first, signal.SIGKILL)
        # The restarted workers must train on to the end, not hang (they once did, in a futex wait).
        status, output = job.finish(timeout=180)
        assert status == 0, output[-6000:]
        assert job.pids[victim] != first, "the workers were not restarted"
        assert not job.kill_leftovers(), "the launcher left workers behind"
    resumed_from_step(output)
    return output


@pytest.mark.slow
def test_torchrun_max_restarts_heals_a_sigkilled_worker_bit_identical(tmp_path, reference):
    run_with_a_restart(DDP + [f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, "restart")
    assert_identical(tmp_path / "run", reference(2))


@pytest.mark.slow
@pytest.mark.parametrize("rendezvous", ["standalone", "static"])
def test_torchrun_max_restarts_without_hydra_run_dir_finds_its_directory_again(tmp_path, reference, rendezvous):
    # Static: the run id is "none", so the run directory is named by the torchrun agent's pid and
    # start, which the restart shares (storage/rundir.py).
    launcher = torchrun_static_rendezvous("--max-restarts=1") if rendezvous == "static" else None
    job_pids: dict = {}
    run_with_a_restart(DDP, tmp_path, "restart-no-dir", launcher=launcher, pids=job_pids)
    runs = list((tmp_path / "outputs" / "runs").iterdir())
    assert len(runs) == 1, f"the restart started another run directory: {runs}"
    if rendezvous == "static":  # named by the torchrun process, the workers' agent
        assert runs[0].name.endswith(f"_{job_pids['launcher']}"), runs[0].name
    assert_identical(runs[0], reference(2))


# --- two ranks, self-launched (strategy.nproc_per_node=2): the parent spawns the workers --------


@pytest.mark.slow
def test_sigterm_to_the_self_launched_parent_is_forwarded_saves_and_exits_143(tmp_path, reference):
    args = SELF_LAUNCHED + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step("self-launched-sigterm", 2)
    with training_job(args, step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=step) as job:
        job.wait_for_step(step)
        job.send_signal(signal.SIGTERM)  # only the parent: `kill <pid>`, a scheduler
        seen = job.newest_step()
        status, output = job.finish(timeout=120)
        assert not job.kill_leftovers(), "workers were left behind"
    assert status == 143, output[-4000:]
    assert "received SIGTERM: passed on to the 2 ranks" in output
    saved = assert_stopped_at_current_step(tmp_path / "run", output, step, seen, 2)

    output = job_ok(run_job(args))
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(2))


@pytest.mark.slow
def test_self_launched_max_restarts_heals_a_sigkilled_rank_bit_identical(tmp_path, reference):
    """strategy.max_restarts: torch's elastic launcher restarts every rank after one is
    SIGKILLed (the OOM killer), and they resume from last.pt."""
    args = SELF_LAUNCHED + ["strategy.max_restarts=1", f"hydra.run.dir={tmp_path / 'run'}"]
    run_with_a_restart(args, tmp_path, "self-launched-restart", launcher=[sys.executable])
    assert_identical(tmp_path / "run", reference(2))


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker", "parent"])
def test_self_launched_job_sigkilled_then_the_same_command_ends_bit_identical(tmp_path, reference, victim):
    """The OOM killer picks a worker (the biggest process); `kill -9` or a dying node, the parent."""
    args = SELF_LAUNCHED + [f"hydra.run.dir={tmp_path / 'run'}"]
    step = interrupt_step(f"self-launched-sigkill-{victim}", 2)
    with training_job(args, step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=step) as job:
        worker = job.wait_for_step(step, rank=random.Random(victim).choice([0, 1]))
        os.kill(worker if victim == "worker" else job.proc.pid, signal.SIGKILL)
        seen = job.newest_step()
        status, output = job.finish(timeout=120)
        assert status != 0, output[-4000:]
        # The other worker (a worker whose parent died: both) must not go on training alone.
        job.wait_until(lambda: not any(alive(pid) for pid in job.all_pids), "the workers ending", timeout=60)
    saved = checkpoint(tmp_path / "run")["progress"]["step"]
    if victim == "parent":  # the kernel sends the orphans SIGINT: they stop, saving the current step
        assert_stopped_at_current_step(tmp_path / "run", job.output, step, seen, 2, name="SIGINT")
    else:
        assert 0 < saved <= seen + 3  # the step in flight, and output not yet read

    output = job_ok(run_job(args))
    assert resumed_from_step(output) == saved
    assert_identical(tmp_path / "run", reference(2))


# --- 4. broken and hostile checkpoints ------------------------------------------------------------


def copy_run_dir(source: Path, target: Path) -> None:
    """A copy of a run directory whose checkpoint names are hard links where the source's are."""
    import shutil

    shutil.copytree(source, target)
    names = sorted((source / "checkpoints").iterdir())
    for path in names:
        first = next(other for other in names if os.path.samefile(other, path))
        if first != path:
            (target / "checkpoints" / path.name).unlink()
            os.link(target / "checkpoints" / first.name, target / "checkpoints" / path.name)


def test_truncated_newest_checkpoint_falls_back_to_the_previous_step_file(tmp_path, reference):
    run_dir = tmp_path / "run"
    copy_run_dir(reference.run_dir(1), run_dir)  # a finished run: step-35.pt, step-40.pt = last.pt
    newest = run_dir / "checkpoints" / f"step-{STEPS:08d}.pt"
    for path in (run_dir / "checkpoints" / "last.pt", newest):  # hard links: one file, two names
        with open(path, "r+b") as file:
            file.truncate(os.path.getsize(path) // 2)

    output = job_ok(run_job(SINGLE + [f"hydra.run.dir={run_dir}"]))  # the same command again
    warnings = [line for line in output.splitlines() if "truncated or corrupt" in line]
    assert len(warnings) == 1, output[-4000:]
    assert "last.pt" in warnings[0] and f"falling back to {run_dir / 'checkpoints' / 'step-00000035.pt'}" in warnings[0]
    assert resumed_from_step(output) == 35
    assert_identical(run_dir, reference(1))


def test_random_bytes_in_the_newest_checkpoints_tensor_data_fall_back_and_end_bit_identical(tmp_path, reference):
    """4 KiB of random bytes inside last.pt's tensor data (its zip intact, torch.load would take
    them): the checksums catch it, one warning, the previous step file, the same result."""
    run_dir = tmp_path / "run"
    copy_run_dir(reference.run_dir(1), run_dir)  # a finished run: step-35.pt, step-40.pt = last.pt
    checkpoints = run_dir / "checkpoints"
    record = corrupt_tensor_bytes(checkpoints / "last.pt")  # step-40.pt too: hard links
    damaged = (checkpoints / "last.pt").read_bytes()

    output = job_ok(run_job(SINGLE + [f"hydra.run.dir={run_dir}"]))  # the same command again
    warnings = [line for line in output.splitlines() if "does not match its checksum" in line]
    assert len(warnings) == 1, output[-4000:]
    # One file under three names: the last step was also the best.
    assert f"{checkpoints / 'last.pt'} (= step-{STEPS:08d}.pt, best.pt) is corrupt: its record {record}" in warnings[0]
    assert f"falling back to {checkpoints / 'step-00000035.pt'}" in warnings[0]
    assert resumed_from_step(output) == 35
    assert_identical(run_dir, reference(1))
    # Set aside, never deleted: the damaged file under both its names.
    for name in ("last.pt", f"step-{STEPS:08d}.pt", "best.pt"):
        assert (checkpoints / "unreadable" / name).read_bytes() == damaged


class RunsCode:
    """Unpickling this runs `touch <marker>`: what a hostile "checkpoint" would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "the-code-ran"
    hostile = tmp_path / "downloaded" / "checkpoints" / "last.pt"
    hostile.parent.mkdir(parents=True)
    torch.save({"format": 1, "model": {"w": torch.zeros(2)}, "payload": RunsCode(marker)}, hostile)

    job_refused(run_job([f"trainer.resume={hostile}"]),
                f"checkpoint '{hostile}' cannot be read (loading it would run", "which ringtrain refuses")
    assert not marker.exists(), "loading the checkpoint ran its code"


# --- resuming from a checkpoint path alone ------------------------------------------------------

TINY_LM = [
    "model=transformer", "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.block_size=16",
    "data.num_train_tokens=20000", "data.num_val_tokens=4000", "trainer.batch_size=8",
]


@pytest.mark.slow
def test_resume_from_a_path_alone_continues_that_run_in_its_own_directory(tmp_path):
    run_dir = tmp_path / "lm"
    job_ok(run_job(TINY_LM + ["trainer.max_steps=6", f"hydra.run.dir={run_dir}"]))
    last = run_dir / "checkpoints" / "last.pt"

    # No model=..., no hydra.run.dir: the checkpoint says what the run is and where it lives.
    output = job_ok(run_job([f"trainer.resume={last}", "trainer.max_steps=10"], cwd=tmp_path))
    assert resumed_from_step(output) if "(step" in output else "resuming from" in output
    state = checkpoint(run_dir)
    assert state["progress"]["step"] == 10
    assert state["config"]["model"]["_target_"] == "ringtrain.models.transformer.Transformer"
    assert not (tmp_path / "outputs").exists(), "the continued run started a directory of its own"
    assert "done: 10 steps" in (run_dir / "train.log").read_text()

    # The checkpoint's options are replayed before the command line, so a key only they have is an
    # override like any other (it used to fail: "not a setting of this data").
    from ringtrain.config import CommandLine
    from ringtrain.tools.train import prepare

    args = [f"trainer.resume={last}", "data.num_val_tokens=2000"]
    config = compose_config(prepare(CommandLine("ringtrain", args))[0].hydra_args())
    assert config.data.num_val_tokens == 2000 and config.model._target_ == "ringtrain.models.transformer.Transformer"

    job_refused(run_job([f"trainer.resume={last}", "model.n_layers=3"], cwd=tmp_path),
                "model.n_layers (1 -> 3) differs from the checkpoint's")
    assert checkpoint(run_dir)["progress"]["step"] == 10  # untouched

    # Another model option: named as such, before anything is written (it used to suggest
    # +model.in_features=<value>, composed on the checkpoint's data).
    files = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    assert refused(run_cli([f"trainer.resume={last}", "model=mlp"], cwd=tmp_path)) == (
        f"error: {last} is a checkpoint of model=transformer, but the command line picks model=mlp; a continued "
        f"run keeps its model: drop model=mlp to continue it, or drop trainer.resume to start a new run with model=mlp"
    )
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == files
    assert not (tmp_path / "outputs").exists()


# --- 6. trainer.on_nonfinite with a learning rate that blows up ----------------------------------


def _all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def _tensorboard_tags(run_dir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return set(events.Tags()["scalars"])


@pytest.mark.parametrize("policy", ["stop", "skip", "ignore"])
def test_on_nonfinite_policies_behave_as_documented(tmp_path, policy):
    run_dir = tmp_path / "run"
    # Evaluated every step: best.pt is written before the first non-finite step, whatever follows.
    status, output = run_job(TINY_LM + [
        "optimizer.lr=1e6", "trainer.max_steps=12", "trainer.eval_every_n_steps=1", "trainer.log_every_n_steps=2",
        f"trainer.on_nonfinite={policy}", f"hydra.run.dir={run_dir}",
    ])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if policy == "stop":
        assert status == 3, output[-4000:]
        line = re.search(r"non-finite loss or gradient norm \(\S+\) at step (\d+); stopped at step (\d+)", output)
        assert line, output[-4000:]
        assert metrics["stopped"] == "non-finite" and metrics["steps"] < 12
        assert checkpoint(run_dir)["progress"]["step"] < int(line.group(1))  # last.pt is from before it
    else:
        assert status == 0, output[-4000:]
        assert metrics["steps"] == 12 and metrics["stopped"] is None
    if policy == "skip":
        assert metrics["skipped_steps"] > 0
        assert "train/skipped_steps" in _tensorboard_tags(run_dir)
        assert _all_finite(checkpoint(run_dir)["model"])  # no non-finite update was applied
    if policy == "ignore":
        assert metrics["nonfinite"] and all(metrics["final"][name] is None for name in metrics["nonfinite"])
    best = run_dir / "checkpoints" / "best.pt"
    assert best.exists(), output[-4000:]
    assert _all_finite(checkpoint(run_dir, "best.pt")["model"])


# --- 7. a full file system --------------------------------------------------------------------------

FULL_AFTER_BYTES = 2 * 1024 * 1024  # the file system's size: 2 MiB


@pytest.fixture
def full_file_system(tmp_path):
    """(directory, environment) of a file system that is full after FULL_AFTER_BYTES.

    A real tmpfs where mounting is allowed (root); elsewhere the job's checkpoint writes fail
    with ENOSPC once they add up to as much (tests/interruptible_train.py).
    """
    mount_point = Path(tempfile.mkdtemp(prefix="ringtrain-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_AFTER_BYTES}", "tmpfs", str(mount_point)],
                             capture_output=True).returncode == 0
    if not mounted:
        mount_point.rmdir()
        yield tmp_path, {"RINGTRAIN_TEST_DISK_FULL_AFTER_BYTES": str(FULL_AFTER_BYTES)}
        return
    try:
        yield mount_point, {}
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)
        mount_point.rmdir()


def test_a_save_into_a_full_file_system_fails_in_one_line_and_keeps_last_pt(full_file_system):
    directory, env = full_file_system
    # About 0.86 MB a checkpoint (weights and Adam's two moments): the 3rd save does not fit.
    args = MLP + ["model.hidden_sizes=[2048]", "trainer.max_steps=40", "trainer.checkpoint_every_n_steps=5",
                  f"hydra.run.dir={directory / 'run'}"]
    error = job_refused(run_job(args, env=env))
    assert re.search(r"cannot save checkpoint \S+step-000000(10|15)\.pt: No space left on device; free space on", error)
    assert error.endswith("the previous last.pt is intact")
    state = torch.load(directory / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["progress"]["step"] in (5, 10)
    assert not [p.name for p in (directory / "run" / "checkpoints").iterdir() if ".tmp-" in p.name]


# --- 5. a stalled rank ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_and_is_named(tmp_path):
    timeout_minutes = 0.25
    args = DDP + ["trainer.max_steps=400", f"strategy.timeout_minutes={timeout_minutes}",
                  f"hydra.run.dir={tmp_path / 'run'}"]
    with training_job(args, launcher=TORCHRUN) as job:
        stalled = job.wait_for_step(10, rank=1)
        os.kill(stalled, signal.SIGSTOP)  # alive but silent: swapping, hung in I/O, a debugger
        stopped_at = time.monotonic()
        status, output = job.finish(timeout=180)
        elapsed = time.monotonic() - stopped_at
        job.kill_leftovers()
    assert status != 0, output[-4000:]
    named = [line for line in output.splitlines() if "stopped answering" in line]
    assert len(named) == 1 and named[0].startswith("error: rank 1 stopped answering:"), output[-4000:]
    # torchrun's summary: every rank failed (rank 0 with its error, the stalled one killed).
    codes = re.findall(r"^\s*exitcode\s+: (-?\d+)", output, re.MULTILINE)
    assert sorted(codes) == ["-9", "2"], output[-4000:]
    # The collective timeout, the check-in that names the rank (5 s here), then torchrun's own
    # 30 s between SIGTERM and SIGKILL (a stopped process cannot act on SIGTERM; torchrun 2.13
    # waits a fixed 30 s there, --shutdown-timeout does not apply to a failed worker group).
    print(f"stalled rank: the job ended {elapsed:.1f} s after SIGSTOP")
    assert elapsed < timeout_minutes * 60 + 5 + 30 + 10, f"{elapsed:.0f} s"


# --- one job per run directory ------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_job_in_a_running_jobs_directory_is_refused_and_the_first_is_unharmed(tmp_path, reference):
    run_dir = tmp_path / "run"
    args = SINGLE + [f"hydra.run.dir={run_dir}"]
    release = tmp_path / "release-the-first-job"
    # The first job holds at step 5 until the second has ended: on a loaded machine the second's
    # start-up could otherwise outlast the first job. While held it writes nothing (its step-5
    # log line comes after the hold), so its record and log are compared as they were.
    with training_job(args, hold_at_step=5, env={"RINGTRAIN_TEST_HOLD_UNTIL_FILE": str(release)}) as job:
        job.wait_for_step(5)
        record = {path.name: path.read_bytes() for path in (run_dir / ".hydra").iterdir()}
        log = (run_dir / "train.log").read_bytes()
        # Another model into the same directory, while the first job trains.
        second = run_cli(args + ["model.hidden_sizes=[32]", "optimizer.lr=0.05"])
        assert {path.name: path.read_bytes() for path in (run_dir / ".hydra").iterdir()} == record
        assert (run_dir / "train.log").read_bytes() == log  # not a line of the refused job's
        release.touch()
        status, output = job.finish()
    assert sorted(record) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert refused(second) == (
        f"error: {run_dir} is in use by another training job (pid {job.proc.pid} on "
        f"{socket.gethostname()}); wait for it to end, stop it, or give this run its own hydra.run.dir"
    )
    assert status == 0, output[-4000:]
    assert_identical(run_dir, reference(1))  # the refused job wrote nothing
    assert (run_dir / ".hydra" / "config.yaml").read_bytes() == record["config.yaml"]
    job_ok(run_job(args))  # once the first has ended, the directory is free again (nothing to train)
