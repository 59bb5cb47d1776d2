"""The watchdog (ringtrain/loop/stopping.py): a rank that makes no progress for
strategy.timeout_minutes ends with one line naming it, whatever it is doing.

The watchdog ends its process, so each case runs in a subprocess: a tiny script for the
watchdog alone (fractions of a second), and a real 2-rank job whose user Dataset loops forever
on rank 1.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from conftest import QUIET, REPO
from helpers import Job

# Feeds for `fed_for` seconds (never silent for longer than `every`), then loops forever in
# Python, as a user's Dataset.__getitem__ with a bug does.
WATCHED = """
import sys, time
from ringtrain.loop.stopping import LOADING_TRAINING_BATCHES, TRAINING, Watchdog
timeout, grace, fed_for, every, spin_in = {timeout}, {grace}, {fed_for}, {every}, {spin_in}
with Watchdog(timeout, rank=3, grace_s=grace, setting="strategy.timeout_minutes=x") as dog:
    until = time.monotonic() + fed_for
    while time.monotonic() < until:
        dog.feed(TRAINING, 7)
        time.sleep(every)
    print("fed", flush=True)
    dog.feed(spin_in)
    print(time.monotonic(), flush=True)
    while True:
        pass
"""


def run_watched(timeout: float, grace: float = 0.0, fed_for: float = 0.0, every: float = 0.05,
                spin_in: str = "LOADING_TRAINING_BATCHES") -> tuple[subprocess.CompletedProcess, float]:
    """The script above; returns the process and the seconds from its last feed to its end."""
    code = WATCHED.format(timeout=timeout, grace=grace, fed_for=fed_for, every=every, spin_in=spin_in)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    ended = time.monotonic()
    last_feed = float(proc.stdout.split()[-1])
    return proc, ended - last_feed


def test_a_spinning_process_ends_after_the_timeout_with_one_line_naming_rank_activity_and_step():
    proc, after = run_watched(timeout=0.5, fed_for=1.5, every=0.05)
    # Fed every 0.05 s for 1.5 s (three timeouts): it did not fire while fed.
    assert proc.stdout.startswith("fed\n"), proc.stderr
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(
        r"error: rank 3 made no progress for \d+ s while loading the training batches after step 7, longer than "
        r"strategy.timeout_minutes=x; ending this rank, and with it the job. If it is only slow \(a first step that "
        r"compiles, a long evaluation or save\), raise strategy.timeout_minutes\n", proc.stderr), proc.stderr
    assert 0.5 <= after < 30, after


def test_outside_batch_loading_a_rank_gets_the_grace_so_a_stuck_peer_is_named_first():
    # In a step (collectives: it may be waiting for a peer) the limit is timeout + grace.
    proc, after = run_watched(timeout=0.3, grace=1.5, fed_for=0.2, spin_in="TRAINING")
    assert proc.returncode == 2, proc.stderr
    assert "while training step 7 (forward, backward, optimizer step)" in proc.stderr
    assert 1.8 <= after < 30, after


def test_a_phase_without_grace_after_one_with_it_is_held_to_the_timeout_alone():
    # The watcher last looked during a step (deadline: timeout + grace); the rank then stuck
    # loading batches must end a timeout after that feed, not at the step's later deadline.
    proc, after = run_watched(timeout=1.0, grace=20.0, fed_for=0.3, every=0.05)
    assert proc.returncode == 2, proc.stderr
    assert "while loading the training batches after step 7" in proc.stderr
    assert 1.0 <= after < 15, after


# A user's Dataset: y = 2x + 1. On rank 1, fetching sample STUCK_AFTER + 1 loops forever (having
# noted when it started, an event the test measures from).
STUCK_DATA = '''
import os, time
import torch
from torch.utils.data import Dataset


class Line(Dataset):
    def __init__(self, n: int, stuck_after: int = -1, stuck_file: str = ""):
        generator = torch.Generator().manual_seed(n)
        self.x = torch.randn(n, 1, generator=generator)
        self.y = 2 * self.x + 1
        self.stuck_after, self.stuck_file, self.fetched = stuck_after, stuck_file, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        self.fetched += 1
        if os.environ.get("RANK") == "1" and self.fetched == self.stuck_after + 1:
            with open(self.stuck_file, "w") as file:
                file.write(repr(time.monotonic()))
            while True:
                pass
        return self.x[index], self.y[index]
'''

STUCK_YAML = '''
# @package _global_
defaults:
  - override /task: regression
data:
  train:
    _target_: stuck_data.Line
    n: 512
    stuck_after: {stuck_after}
    stuck_file: {stuck_file}
  val:
    _target_: stuck_data.Line
    n: 64
  dims:
    in_features: 1
    out_features: 1
'''

TIMEOUT_MINUTES = 0.1  # 6 s: a step here takes milliseconds, a loaded machine's pauses a few seconds
BATCH, STUCK_AT_STEP = 16, 10


def test_a_rank_stuck_in_a_users_dataset_ends_a_two_rank_job_with_one_line_naming_it(tmp_path):
    stuck_file = tmp_path / "rank-1-stuck-at"
    (tmp_path / "stuck_data.py").write_text(STUCK_DATA)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "stuck.yaml").write_text(
        STUCK_YAML.format(stuck_after=BATCH * STUCK_AT_STEP, stuck_file=stuck_file))
    args = ["--config-dir", str(tmp_path / "conf"), "data=stuck", "strategy=ddp", "strategy.nproc_per_node=2",
            f"strategy.timeout_minutes={TIMEOUT_MINUTES}", f"trainer.batch_size={BATCH}", "trainer.max_steps=40",
            f"hydra.run.dir={tmp_path / 'run'}", *QUIET]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with Job([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env) as job:
        status, output = job.finish(timeout=600)
    ended_after = time.monotonic() - float(stuck_file.read_text())
    assert status != 0, output[-4000:]
    named = [line for line in output.splitlines() if "made no progress" in line]
    assert len(named) == 1 and re.fullmatch(
        rf"error: rank 1 made no progress for \d+ s while loading the training batches after step {STUCK_AT_STEP}, "
        rf"longer than strategy.timeout_minutes={TIMEOUT_MINUTES:g}; ending this rank, and with it the job. .*",
        named[0]), output[-4000:]
    # Rank 0 waited in the step's gradient all-reduce, which started as rank 1 got stuck and so
    # times out about when rank 1's watchdog fires: rank 0 ends on losing its peer, or names
    # rank 1 as the one that stopped answering, or is ended by the launcher first. Never is
    # rank 0 named as the one stuck.
    assert "rank 0 made no progress" not in output and "rank 0 stopped answering" not in output, output[-4000:]
    print(f"the job ended {ended_after:.1f} s after rank 1 got stuck (timeout {TIMEOUT_MINUTES * 60:g} s)")
    assert TIMEOUT_MINUTES * 60 <= ended_after < TIMEOUT_MINUTES * 60 + 60, ended_after
