"""How a run stops from outside its step: a stop signal (`StopSignals`, `Agreement`: finish the
step, agree, save, exit 143), or a rank that makes no progress for strategy.timeout_minutes
(`Watchdog`: it ends, whatever it is doing). What each does for the user, and why the watchdog
(no collective timeout ends a rank stuck outside one), the README says ("Stop signals", "A
watchdog"); here, how.

`StopSignals` records the first signal (the loop polls it after every step); a second, 2 s or
more later (a repeat within 2 s is a launcher forwarding it), exits at once, unsaved. `Agreement`
has the ranks decide at the same step, so all take part in the save and none waits in a
collective: each step starts an async all-reduce of the flags on a gloo group of its own, read
a step later, so no step waits and the GPU never syncs; the price is one step of lag.

Why 143 (128 + SIGTERM), not 0: a stopped run is not finished, and what restarts on failure
(torchrun --max-restarts, a shell `until` loop, Kubernetes OnFailure, SLURM RequeueExit) reads
143 as "terminated, worth retrying". One status for every stop signal; the log names which.

The watchdog is a daemon thread per rank that watches the time since the loop last said what
the rank does (`feed`, one tuple assignment: cheap per batch). It needs the GIL: a C extension
spinning while holding it goes unnoticed (the collective timeout still covers the peers).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import TypeVar

import torch
import torch.distributed as dist

from ringtrain.errors import USER_ERROR_EXIT

T = TypeVar("T")


@dataclass(frozen=True)
class Activity:
    """What a rank is doing, as the watchdog's line names it (`{step}`: the step it stands at)."""

    doing: str
    alone: bool = False  # no collective in it: the rank cannot be waiting for another


SETTING_UP = Activity("setting up training (the model, its checkpoint, the optimizer)")
LOADING_TRAINING_BATCHES = Activity("loading the training batches after step {step}", alone=True)
TRAINING = Activity("training step {step} (forward, backward, optimizer step)")
LOADING_VALIDATION_BATCH = Activity("loading a validation batch at step {step}", alone=True)
EVALUATING = Activity("evaluating at step {step}")
SAVING = Activity("saving the checkpoint of step {step}")


class Watchdog:
    """Ends this process when it is not fed for `timeout_s` (+ `grace_s` outside `alone` phases)."""

    def __init__(self, timeout_s: float, rank: int, grace_s: float = 0.0, setting: str = "") -> None:
        self.timeout_s, self.rank, self.grace_s = timeout_s, rank, grace_s
        self.setting = setting  # the option that sets the timeout, for the line
        self._fed: tuple[float, Activity, int] = (time.monotonic(), SETTING_UP, 0)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def feed(self, activity: Activity, step: int | None = None) -> None:
        """This rank is doing `activity` from now on (at `step`; None keeps the last one)."""
        self._fed = (time.monotonic(), activity, self._fed[2] if step is None else step)

    def watched(self, items: Iterable[T], fetching: Activity, using: Activity) -> Iterator[T]:
        self.feed(fetching)
        for item in items:
            self.feed(using)
            yield item
            self.feed(fetching)

    def __enter__(self) -> "Watchdog":
        self.feed(SETTING_UP, 0)
        if self.timeout_s:  # none without a timeout (one process): feeding it costs the same
            self._thread = threading.Thread(target=self._watch, name="ringtrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while True:
            fed_at, activity, step = self._fed
            limit = self.timeout_s + (0.0 if activity.alone else self.grace_s)
            left = fed_at + limit - time.monotonic()
            if left <= 0:
                line = (f"error: rank {self.rank} made no progress for {time.monotonic() - fed_at:.0f} s while "
                        f"{activity.doing.format(step=step)}, longer than {self.setting}; ending this rank, and with it "
                        f"the job. If it is only slow (a first step that compiles, a long evaluation or save), raise "
                        f"strategy.timeout_minutes\n")
                flush_within(1.0)
                os.write(2, line.encode())  # not print(): the stuck thread may hold sys.stderr's lock
                os._exit(USER_ERROR_EXIT)
            # No longer than the timeout itself: a feed meanwhile may start a phase without grace,
            # whose deadline is then earlier than this one (and never earlier than a timeout away).
            if self._done.wait(min(left, self.timeout_s)):
                return


def flush_within(seconds: float, last_words: Callable[[], None] | None = None) -> None:
    """Say `last_words` (a log call), then flush the logs and standard streams, on a thread of
    its own: a stream whose lock the stuck main thread holds (a write blocked on a full pipe)
    must not keep a process that is ending alive."""

    def flush() -> None:
        with contextlib.suppress(Exception):  # ending matters more than the last lines
            if last_words is not None:
                last_words()
            logging.shutdown()  # flushes train.log and the console handlers
            sys.stdout.flush()
            sys.stderr.flush()

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(timeout=seconds)


def watching(timeout_minutes: float | None, rank: int, world_size: int) -> Watchdog:
    """The watchdog of a run with strategy.timeout_minutes (ddp, fsdp); one that never fires without."""
    if not timeout_minutes:
        return Watchdog(0.0, rank)
    timeout_s = timeout_minutes * 60
    # Time for a stuck peer to end and for this rank's collective to fail on it: a third of the
    # timeout, at least 10 s (a loaded machine), at most a minute.
    grace_s = max(10.0, min(60.0, timeout_s / 3)) if world_size > 1 else 0.0
    return Watchdog(timeout_s, rank, grace_s, f"strategy.timeout_minutes={timeout_minutes:g}")


log = logging.getLogger("ringtrain")


class StopSignals:
    """Signals are handled on a watcher thread woken through `signal.set_wakeup_fd`: CPython runs a
    Python handler only when the main thread next runs Python code, which a rank stuck in a
    collective or a long C call never does, and "exit at once" must work exactly then. The C
    handler writes the signal number to a pipe (async-signal-safe), so no logging or I/O in a
    handler re-enters a half-written stream; the Python handlers only replace the default action
    (terminate, KeyboardInterrupt). While active it owns the wakeup fd (suspending asyncio's).
    DataLoader workers ignore the stop signals sent to the process group (loop/loaders.py)."""

    def __init__(self, names: tuple[str, ...] | list[str] = ("SIGTERM", "SIGINT", "SIGUSR1"), repeat_grace_s: float = 2.0):
        self.signums = tuple(_signal_number(name) for name in names)
        self.lag_steps = 0  # steps between a rank seeing the signal and all stopping (Agreement's)
        self.repeat_grace_s = repeat_grace_s
        self.received: str | None = None  # the first stop signal's name, e.g. "SIGTERM"
        self._received_at = 0.0
        self._polled_step: int | None = None
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._read_fd = self._write_fd = -1
        self._watcher: threading.Thread | None = None  # while installed

    def poll(self, step: int) -> bool:
        """Whether a stop signal has arrived, after optimizer step `step`. Under the lock the watcher
        takes too: the step its line names is the one at which this poll, or the next, first says so."""
        with self._lock:
            self._polled_step = step
            return self.received is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals are handled only on the main thread; SIGTERM and Ctrl-C will not save last.pt")
            return self
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it: a handler never blocks
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in self.signums:  # a Python handler that does nothing: the watcher thread does the work
            self._previous_handlers[signum] = signal.signal(signum, lambda signum, frame: None)
        self._watcher = threading.Thread(target=self._watch, name="ringtrain-stop-signals", daemon=True)
        self._watcher.start()
        # A process forked meanwhile (a DataLoader worker) gets the previous handlers back, so its
        # signals never count as this one's; the hook holds no reference that keeps this alive.
        this = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (signals := this()) and signals._forget_in_forked_child())
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._watcher is None:
            return
        _restore_handlers(self._previous_handlers)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns
        self._watcher.join(timeout=5)
        os.close(self._read_fd)
        self._watcher = None

    def _forget_in_forked_child(self) -> None:
        """In a forked child: no watcher thread exists, and the pipe is the parent's."""
        if self._watcher is None:
            return
        try:
            # The forking thread is the child's main thread (CPython re-initialises that
            # before running at-fork hooks), so this is allowed.
            signal.set_wakeup_fd(-1)
            _restore_handlers(self._previous_handlers)
        except ValueError:
            return  # keep the pipe open: a handler might still write to its fd number
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watcher = None

    def _watch(self) -> None:
        with contextlib.suppress(OSError):  # the read end closed under us on exit
            while data := os.read(self._read_fd, 64):  # b"": the write end closed on exit
                for signum in data:
                    # The wakeup fd carries every signal with a Python handler, not only ours.
                    if signum in self.signums:
                        self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.received is None:
            with self._lock:
                self._received_at = now
                self.received = name
                polled = self._polled_step
            finishing = "the current step" if polled is None else f"step {polled + 1 + self.lag_steps}"
            log.warning(
                f"received {name}: finishing {finishing}, saving last.pt, then exiting; send it again to exit at once"
            )
        elif now - self._received_at < self.repeat_grace_s:
            log.warning(
                f"received {name} {now - self._received_at:.2f} s after {self.received}: taken as the same stop "
                f"request (launchers forward signals); send it again to exit at once"
            )
        else:
            status = 128 + signum
            flush_within(1.0, lambda: log.warning(f"received {name} again: exiting at once with status {status}, "
                                                  f"without saving"))
            os._exit(status)


def _restore_handlers(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        # None: the previous handler was set outside Python; the default is the closest we can do.
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _signal_number(name: str) -> int:
    number = getattr(signal, name, None)
    if not isinstance(number, signal.Signals) or not name.startswith("SIG") or name.startswith("SIG_"):
        raise ValueError(f"unknown signal name '{name}'; use names like SIGTERM, SIGINT, SIGUSR1")
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{name} cannot be caught; use SIGTERM, SIGINT, SIGUSR1 or SIGUSR2")
    return int(number)


class Agreement(contextlib.AbstractContextManager):
    """The flags every rank agrees on, a step late (see the module); one process gets its own at
    once. Make it on every rank at the same point (new_group is collective) and call `exchange`
    once per step on every rank."""

    FLAGS = ("stop_signal", "stop_request", "validate", "save")

    def __init__(self, timeout_minutes: float | None = None):
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The job's collective timeout, not gloo's 30-minute default.
            timeout = {"timeout": timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
            self._group = dist.new_group(backend="gloo", **timeout)
        self.lag_steps = 0 if self._group is None else 1  # steps between a flag raised and agreed

    def exchange(self, **flags: bool) -> dict[str, bool]:
        """This rank's flags now; every rank's (any raised) from one step ago."""
        if self._group is None:
            return dict.fromkeys(self.FLAGS, False) | flags
        mine = torch.tensor([int(flags.get(name, False)) for name in self.FLAGS], dtype=torch.int32)
        agreed = dict.fromkeys(self.FLAGS, False)
        if self._pending is not None:
            work, previous = self._pending
            work.wait()
            agreed = dict(zip(self.FLAGS, map(bool, previous.tolist())))
        self._pending = (dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._group, async_op=True), mine)
        return agreed

    def agree_now(self, local_flag: bool) -> bool:
        """Whether any rank's flag is up, now: once, before the first step (a signal during set-up)."""
        if self._group is None:
            return local_flag
        flags = torch.tensor([int(local_flag)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags.item())

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        # The last all-reduce: every rank started it, so it completes, and it must not meet a
        # destroyed process group. After an error the peers may be gone: do not wait for them.
        if exc_type is None and self._pending is not None:
            self._pending[0].wait()
        self._pending = None
