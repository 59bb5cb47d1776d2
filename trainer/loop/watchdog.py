"""A rank that makes no progress for strategy.timeout_minutes ends, whatever it is doing.

A rank stuck outside a collective (a __getitem__ that never returns, a looping forward, a hung
file system) never hits the collective timeout, and its peers wait until theirs fires, or
forever when all are stuck. So a daemon thread per rank watches the time since the loop last
said what the rank does (`feed`, one tuple assignment: cheap per batch); past the timeout it
prints one line naming the rank, activity and step, and exits USER_ERROR_EXIT, which ends the
job as a crash does.

A rank merely waiting for a stuck peer must not be the one named: loading batches it cannot be
waiting, so the timeout holds; in a step, evaluation or save (collectives) it gets `grace`
seconds more. The watcher needs the GIL: a C extension spinning while holding it goes
unnoticed (the collective timeout still covers the peers).
"""
from __future__ import annotations

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

    def watched(self, items: Iterable[T], fetching: Activity, using: Activity) -> Iterator[T]:
        """`items`, fed as `fetching` before each is fetched and `using` once it is."""
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


def watching(timeout_minutes: float | None, rank: int, world_size: int) -> Watchdog:
    """The watchdog of a run with strategy.timeout_minutes (ddp, fsdp); one that never fires without."""
    if not timeout_minutes:
        return Watchdog(0.0, rank)
    timeout_s = timeout_minutes * 60
    # Time for a stuck peer to end and for this rank's collective to fail on it: a third of the
    # timeout, at least 10 s (a loaded machine), at most a minute.
    grace_s = max(10.0, min(60.0, timeout_s / 3)) if world_size > 1 else 0.0
    return Watchdog(timeout_s, rank, grace_s, f"strategy.timeout_minutes={timeout_minutes:g}")
