"""Stop signals in real processes: finish the step, agree across ranks, exit with the documented status."""
from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest

from conftest import REPO
from helpers import Job, free_port
from ringtrain.errors import STOPPED_BY_SIGNAL_EXIT
from ringtrain.loop.stopping import Agreement, StopSignals

# Seconds a line or an exit may take: these processes do nothing slow.
WAIT = 20

# A training loop stand-in: each "step" sleeps, then polls like the Trainer does.
LOOP = r"""
import logging, sys, time
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
from ringtrain.errors import STOPPED_BY_SIGNAL_EXIT
from ringtrain.loop.stopping import StopSignals
step_seconds, grace = float(sys.argv[1]), float(sys.argv[2])
with StopSignals(repeat_grace_s=grace) as signals:
    signals.poll(0)
    print("ready", flush=True)
    for step in range(1, 100_000):
        time.sleep(step_seconds)
        print(f"finished step {step}", flush=True)
        if signals.poll(step):
            print(f"stopping after step {step}", flush=True)
            sys.exit(STOPPED_BY_SIGNAL_EXIT)
"""

# Two ranks at different speeds: only the Agreement keeps their decisions in step.
RANK = r"""
import logging, os, sys, time
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
import torch.distributed as dist
from ringtrain.distributed import exit_rank, teardown_distributed
from ringtrain.errors import STOPPED_BY_SIGNAL_EXIT
from ringtrain.loop.stopping import Agreement, StopSignals
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
with StopSignals() as signals:
    agreement = Agreement()
    signals.lag_steps = agreement.lag_steps
    signals.poll(0)
    print("ready", flush=True)
    for step in range(1, 100_000):
        time.sleep(0.02 if rank == 0 else 0.05)
        print(f"finished step {step}", flush=True)
        if agreement.exchange(stop_signal=signals.poll(step))["stop_signal"]:
            print(f"stopped at step {step}", flush=True)
            break
    agreement.__exit__(None, None, None)
teardown_distributed(clean_exit=True)
exit_rank(STOPPED_BY_SIGNAL_EXIT)
"""

FIRST_SIGNAL_LINE = re.compile(
    r"received (SIG\w+): finishing step (\d+), saving last.pt, then exiting; send it again to exit at once"
)


def python_job(script: str, args: list[str] = (), env: dict[str, str] | None = None) -> Job:
    """`python -c SCRIPT ARGS` as a watched Job."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return Job([sys.executable, "-c", script, *args], cwd=REPO, env=env)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_stop_signal_finishes_the_step_and_exits_with_the_documented_status(signum):
    with python_job(LOOP, ["0.3", "2.0"]) as process:
        process.wait_for_line("^finished step 2$", WAIT)
        process.send_signal(signum)
        status, output = process.finish(WAIT)

    assert status == STOPPED_BY_SIGNAL_EXIT == 143, output
    announced = FIRST_SIGNAL_LINE.search(output)
    assert announced and announced.group(1) == signum.name, output
    stopped_after = int(re.search(r"stopping after step (\d+)", output).group(1))
    finished = [int(n) for n in re.findall(r"^finished step (\d+)$", output, re.MULTILINE)]
    # The step in progress was finished, not cut short, and the line named the right step.
    assert finished[-1] == stopped_after == int(announced.group(2)), output


def test_second_signal_exits_at_once_with_128_plus_signum():
    with python_job(LOOP, ["8.0", "0.2"]) as process:  # steps far longer than the test waits
        process.wait_for_line("^ready$", WAIT)
        process.send_signal(signal.SIGTERM)
        process.wait_for_line("received SIGTERM: finishing step 1", WAIT)
        time.sleep(0.4)  # past the repeat grace
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        status, output = process.finish(timeout=5)

    assert status == 128 + signal.SIGINT, output
    assert time.monotonic() - sent < 3, "the second signal did not exit at once"
    assert "received SIGINT again: exiting at once with status 130, without saving" in output
    assert "stopping after" not in output and "finished step" not in output


def test_repeat_within_the_grace_is_the_same_request():
    """Ctrl-C reaches torchrun's workers directly and again through torchrun: one request."""
    with python_job(LOOP, ["0.5", "2.0"]) as process:
        process.wait_for_line("^ready$", WAIT)
        process.send_signal(signal.SIGINT)
        process.wait_for_line("received SIGINT: finishing step", WAIT)
        process.send_signal(signal.SIGINT)
        status, output = process.finish(WAIT)

    assert status == STOPPED_BY_SIGNAL_EXIT, output
    assert "taken as the same stop request" in output
    assert "stopping after step 1" in output


def test_two_ranks_stop_at_the_same_step_when_only_one_gets_the_signal():
    port = free_port()
    ranks = [
        python_job(RANK, env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for rank in range(2)
    ]
    try:
        ranks[1].wait_for_line("^finished step 5$", WAIT)
        ranks[1].send_signal(signal.SIGTERM)
        results = [rank.finish(WAIT) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill_leftovers()

    stopped = []
    for rank, (status, output) in enumerate(results):
        assert status == STOPPED_BY_SIGNAL_EXIT, f"rank {rank}:\n{output}"
        stopped.append(int(re.search(r"stopped at step (\d+)", output).group(1)))
    assert stopped[0] == stopped[1], f"ranks stopped at different steps {stopped}"
    # Rank 1's line counted the agreement's one-step lag, and only rank 1 got the signal.
    announced = FIRST_SIGNAL_LINE.search(results[1][1])
    assert announced and int(announced.group(2)) == stopped[1], results[1][1]
    assert "received" not in results[0][1]


def test_leaving_restores_the_previous_handler_and_wakeup_fd():
    def previous(signum, frame):
        pass

    original = signal.signal(signal.SIGUSR1, previous)
    try:
        with StopSignals(names=("SIGUSR1",)) as signals:
            assert signal.getsignal(signal.SIGUSR1) is not previous
            os.kill(os.getpid(), signal.SIGUSR1)
            deadline = time.monotonic() + 5
            while signals.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert signals.received == "SIGUSR1"
            assert signals.poll(3)
        assert signal.getsignal(signal.SIGUSR1) is previous
        current = signal.set_wakeup_fd(-1)
        assert current == -1
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_a_forked_child_does_not_signal_its_parent():
    """A child forked while StopSignals is active has its own handlers and no wakeup pipe."""
    calls = []
    original = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with StopSignals(names=("SIGUSR1",)) as signals:
            pid = os.fork()
            if pid == 0:  # the child: the previous handler is back and runs, nothing else
                ok = signal.set_wakeup_fd(-1) == -1
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)
                os._exit(0 if ok and calls == [signal.SIGUSR1] else 1)
            _, status = os.waitpid(pid, 0)
            time.sleep(0.2)  # time for the parent's watcher to see a byte, were one written
            assert os.waitstatus_to_exitcode(status) == 0
            assert signals.received is None
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_unknown_signal_name_is_one_clear_line():
    with pytest.raises(ValueError, match="unknown signal name 'SIGTREM'; use names like SIGTERM"):
        StopSignals(names=("SIGTREM",))


def test_agreement_without_a_process_group_is_the_local_flag():
    agreement = Agreement()
    assert agreement.lag_steps == 0
    assert agreement.exchange(stop_signal=False)["stop_signal"] is False
    assert agreement.exchange(stop_signal=True)["stop_signal"] is True
