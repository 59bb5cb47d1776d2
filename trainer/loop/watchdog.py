"""A rank that makes no progress for strategy.timeout_minutes ends, whatever it is doing.

The process group's timeout ends a rank that waits in a collective for too long. A rank stuck
anywhere else never enters one: a user's Dataset.__getitem__ that loops forever, a forward
that never returns, a read from a hung file system. Its peers then wait for it in their next
collective until it times out, and a job whose every rank is stuck (or a ddp job of one
process) would wait forever. A daemon thread on each rank watches the time since the loop last said
what it is doing (`feed`); when that exceeds the timeout it prints one line naming the rank,
what it was doing and at which step, and ends the process with USER_ERROR_EXIT (as the
collective timeout does: the fix is in the code or in strategy.timeout_minutes). The launcher
(torchrun, or strategies/launch.py) then ends the job; the peers' collectives fail at once,
as they do when a rank crashes. Checkpoints already written are intact (atomic writes).

    with watching(run.strategy.timeout_minutes, dist.rank, dist.world_size):  # run.py
        fit(...)                       # feeds: after set-up (a checkpoint loaded), each step,
                                       # each group of batches, each validation batch, each save

`feed` is one tuple assignment (no lock: the watcher reads the whole tuple or the previous
one), cheap enough for every batch.

A rank that is merely waiting for a stuck peer must not be the one named. While a rank loads
batches it cannot be waiting for another rank, so it is held to the timeout itself; in every
other phase (a step, an evaluation, a save: all may contain collectives) it gets `grace`
seconds more, so the stuck peer ends first and this rank's collective fails with the peer's
loss instead (or times out and names the peer, distributed.name_unresponsive_ranks).

The watcher needs the GIL to run: a pure-Python loop gives it up every few milliseconds, and
a call into C that blocks releases it; a C extension that spins while holding it would go
unnoticed (the collective timeout still covers the peers).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

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

    # --- the watcher thread -------------------------------------------------------------------

    def __enter__(self) -> "Watchdog":
        global _active
        self.feed(SETTING_UP, 0)
        _active = self
        self._thread = threading.Thread(target=self._watch, name="ringtrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _active
        _active = None
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while True:
            fed_at, activity, step = self._fed
            limit = self.timeout_s + (0.0 if activity.alone else self.grace_s)
            left = fed_at + limit - time.monotonic()
            if left <= 0:
                self._end(activity, step, time.monotonic() - fed_at)
            # No longer than the timeout itself: a feed meanwhile may start a phase without grace,
            # whose deadline is then earlier than this one (and never earlier than a timeout away).
            if self._done.wait(min(left, self.timeout_s)):
                return

    def _end(self, activity: Activity, step: int, stalled_s: float) -> None:
        line = (f"error: rank {self.rank} made no progress for {stalled_s:.0f} s while "
                f"{activity.doing.format(step=step)}, longer than {self.setting}; ending this rank, and with it "
                f"the job. If it is only slow (a first step that compiles, a long evaluation or save), raise "
                f"strategy.timeout_minutes\n")
        flush_within(1.0)
        os.write(2, line.encode())  # not print(): the stuck thread may hold sys.stderr's lock
        os._exit(USER_ERROR_EXIT)


def flush_within(seconds: float, last_words: Callable[[], None] | None = None) -> None:
    """Say `last_words` (a log call), then flush the logs and standard streams, on a thread of
    its own: a stream whose lock the stuck main thread holds (a write blocked on a full pipe)
    must not keep a process that is ending alive."""

    def flush() -> None:
        try:
            if last_words is not None:
                last_words()
            logging.shutdown()  # flushes train.log and the console handlers
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # ending matters more than the last lines
            pass

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(timeout=seconds)


_active: Watchdog | None = None


def watching(timeout_minutes: float | None, rank: int, world_size: int) -> contextlib.AbstractContextManager:
    """The watchdog of a run with strategy.timeout_minutes (ddp, fsdp); nothing without one."""
    if not timeout_minutes:
        return contextlib.nullcontext()
    timeout_s = timeout_minutes * 60
    # Time for a stuck peer to end and for this rank's collective to fail on it: a third of the
    # timeout, at least 10 s (a loaded machine), at most a minute.
    grace_s = max(10.0, min(60.0, timeout_s / 3)) if world_size > 1 else 0.0
    return Watchdog(timeout_s, rank, grace_s, f"strategy.timeout_minutes={timeout_minutes:g}")


def feed(activity: Activity, step: int | None = None) -> None:
    """Tell this process's watchdog what the rank is doing now; nothing when none watches."""
    watchdog = _active
    if watchdog is not None:
        watchdog.feed(activity, step)


def watched(items: Iterable[T], fetching: Activity, using: Activity) -> Iterator[T]:
    """`items`, the watchdog told `fetching` before each is fetched and `using` once it is."""
    iterator = iter(items)
    while True:
        feed(fetching)
        try:
            item = next(iterator)
        except StopIteration:
            return
        feed(using)
        yield item
