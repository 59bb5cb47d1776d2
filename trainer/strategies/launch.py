"""Starting N ranks on this machine without torchrun, through torch's elastic launcher (what
torchrun runs: README, "Distributed training", says what the ranks get), which ends the job
when one rank fails (the others get SIGTERM). ringtrain adds: arguments pickled as bytes, the
other stop signals (SIGUSR1, ...) passed on too, and a failure as one line with the rank's exit status.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from tqdm import tqdm

from ringtrain.errors import STOPPED_BY_SIGNAL_EXIT, USER_ERROR_EXIT, ConfigError, TrainingStopped, exit_on_user_error
from ringtrain.distributed import WorkerFailedError, exit_rank

# Signals elastic's agent itself turns into SignalException and passes on to the ranks.
_HANDLED_BY_ELASTIC = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
# Its loggers report every worker exit and restart in multi-line blocks; the ranks print
# their own one-line errors, and this module one line for the job.
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def launch_ranks(nprocs: int, fn: Callable[..., Any], args: tuple, max_restarts: int = 0,
                 stop_signals: Sequence[str] = ()) -> Any:
    """Run `fn(*args)` on `nprocs` ranks on this machine; return rank 0's result. A failing rank
    ends the job (after `max_restarts` restarts of the group) with WorkerFailedError carrying its
    exit status; a stop signal with TrainingStopped (143 for SIGTERM), last.pt saved."""
    # `args` go by value, as plain pickle bytes: handed to the launcher as they are, tensors in
    # them (the Python API's model and data sets) would be moved into shared memory, one storage
    # for all ranks, and each rank's optimizer would then update the same weights.
    try:
        pickled_args = pickle.dumps(args)
    except (pickle.PicklingError, AttributeError, TypeError) as err:  # a lambda, a class local to a function
        raise ConfigError(
            f"the {nprocs} ranks each need a copy of the model, data and task, and one does not "
            f"pickle ({' '.join(str(err).split())[:200]}); define those classes and functions at module level"
        ) from None
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=f"ringtrain-{uuid.uuid4()}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0",  # as torchrun --standalone
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        with _launching(stop_signals):
            results = elastic_launch(config, _run_rank)(fn, pickled_args)
    except ChildFailedError as err:
        if all(failure.exitcode == STOPPED_BY_SIGNAL_EXIT for failure in err.failures.values()):
            # A signal to the ranks alone (not to this process): they agreed, saved and stopped.
            raise TrainingStopped("stopped by a stop signal; the log says where the run stands", STOPPED_BY_SIGNAL_EXIT) from None
        if any(failure.exitcode == USER_ERROR_EXIT for failure in err.failures.values()):
            # A rank said the job's mistake in its one line (once for the job): nothing to add.
            raise WorkerFailedError("", exit_code=USER_ERROR_EXIT) from None
        rank, failure = min(err.failures.items())
        status = failure.exitcode if failure.exitcode > 0 else 128 + -failure.exitcode
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with status {status}"
        restarts = f" (after {max_restarts} restart{'s' * (max_restarts > 1)})" if max_restarts else ""
        raise WorkerFailedError(f"rank {rank} {how}{restarts}; its own output above says why", exit_code=status) from None
    except SignalException as err:
        name = signal.Signals(err.sigval).name
        logging.getLogger("ringtrain").warning(f"received {name}: passed on to the {nprocs} ranks, which stopped")
        raise TrainingStopped(f"stopped by {name}", 128 + int(err.sigval)) from None
    return pickle.loads(results[0])


def warn_if_ranks_share_cores(nprocs: int) -> None:
    """One warning line when `nprocs` CPU ranks would outnumber the cores, its message says the cost
    (a trial: 64 ranks on 2 cores took 95 s for 2 steps)."""
    try:
        cores = len(os.sched_getaffinity(0))  # what a container or taskset allows, not the machine's
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if nprocs > cores:
        logging.getLogger("ringtrain").warning(
            f"strategy.nproc_per_node={nprocs} starts {nprocs} CPU ranks on {cores} core{'s' * (cores != 1)}: "
            f"each rank gets a fraction of a core and the job runs slower than with fewer ranks; "
            f"use strategy.nproc_per_node={cores} or fewer"
        )


def _run_rank(fn: Callable[..., Any], pickled_args: bytes) -> bytes:
    """One rank's body. Its result travels back as bytes for the reason its arguments do (launch_ranks)."""
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N ranks with all cores' threads each would fight over the cores
        # (2.5x slower measured with 2 ranks on 2 cores). OMP_NUM_THREADS overrides this.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # tqdm's default multiprocessing lock is a semaphore this process would leave behind at
    # exit (the resource tracker warns of a leak); a rank is one process: a thread lock will do.
    tqdm.set_lock(threading.RLock())
    # A spawned child takes "spawn" as its default, so its DataLoader workers would each import
    # torch and the user's code afresh every epoch (an hf_rows classifier with 2 workers per
    # rank: 50 s instead of 1.8 s under torchrun). Back to the platform's default, as torchrun's.
    multiprocessing.set_start_method(None, force=True)
    launcher = os.getppid()
    try:
        with exit_on_user_error():  # a mistake is one line from the rank that found it, as under torchrun
            outcome = fn(*pickle.loads(pickled_args))
    except SystemExit as stop:  # exit_on_user_error's one line is printed: end as the crash below does
        exit_rank(0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1)
    except Exception:
        # A crash: print its traceback here, as a torchrun rank does (the launcher's report keeps
        # only the exit status), then end without interpreter finalisation: it would wait for
        # every non-daemon thread, and can abort on gloo's threads (exit_rank says why).
        traceback.print_exc()
        exit_rank(1)
    if getattr(outcome, "stopped_by_signal", False):
        # Stopped by a signal, last.pt saved. A launcher told to stop reads no results: a rank
        # that waited to hand its over would wait for elastic's 30-second shutdown deadline.
        exit_rank(STOPPED_BY_SIGNAL_EXIT)
    # Once the result is handed over, end before interpreter finalisation (atexit handlers run
    # before it), as exit_rank does, and for its reason: else a rank that succeeded may count as failed.
    atexit.register(os._exit, 0)
    _end_if_the_launcher_dies(launcher)
    return pickle.dumps(outcome)


def _end_if_the_launcher_dies(launcher: int) -> None:
    """A rank waits for the launcher to read its result; if the launcher was killed (SIGKILL,
    a dying node), the rank already stopped cleanly (SIGINT) but would wait forever."""
    if os.getppid() != launcher:
        os._exit(0)
    try:
        pidfd = os.pidfd_open(launcher)
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): the check above must do
        return

    def wait_for_the_launcher() -> None:
        select.select([pidfd], [], [])
        os._exit(0)

    threading.Thread(target=wait_for_the_launcher, name="ringtrain-launcher-watch", daemon=True).start()


@contextlib.contextmanager
def _launching(stop_signals: Sequence[str]) -> Iterator[None]:
    """Elastic's loggers quiet, and the stop signals its agent does not handle (SIGUSR1) raised
    as its SignalException, so it passes them on as it does SIGTERM, rather than dying and
    leaving the ranks behind; each put back as it was on leaving."""
    def stop(signum: int, frame: Any) -> None:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    main = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    extra = [getattr(signal, name) for name in stop_signals if main and getattr(signal, name) not in _HANDLED_BY_ELASTIC]
    with contextlib.ExitStack() as restore:
        for logger in map(logging.getLogger, _ELASTIC_LOGGERS):
            restore.callback(logger.setLevel, logger.level)
            logger.setLevel(logging.CRITICAL)
        for signum in extra:
            restore.callback(signal.signal, signum, signal.signal(signum, stop))  # the previous handler
        yield
