"""Stopping cleanly on SIGTERM, SIGINT and SIGUSR1: finish the step, agree, save, exit.

Week-long jobs run on preemptible machines and under SLURM: a cloud VM gets SIGTERM before
it is taken away, SLURM sends a chosen signal before the time limit (`--signal=USR1@120`),
a person presses Ctrl-C. None of these may cost the run more than the current step.

Two pieces, both small:
  * `StopSignals`, a context manager for the main thread: the first signal only records
    itself (`received`) and logs one line; the training loop asks `poll(step)` after every
    optimizer step. A second signal exits at once with status 128 + signum, without saving.
  * `StopAgreement`: the ranks decide together, at the same step, so every rank takes part in
    saving last.pt and none is left waiting in a collective. It costs no GPU synchronisation
    and no blocking collective per step (see the class).

How the Trainer uses them (every rank runs the same loop):

    with StopSignals() as signals:                # as early as possible: before it, a signal kills
        agreement = StopAgreement()               # every rank, after init_process_group
        signals.lag_steps = agreement.lag_steps   # only for the log line's step number
        if agreement.agree_now(signals.poll(progress.step)):  # a signal during set-up or loading:
            stop before the first step, every rank (nothing new to save), exit as below
        for each optimizer step `step`:
            ...train the step...
            if agreement.should_stop(signals.poll(step)):
                save last.pt (every rank takes part), agreement.close(), leave the group,
                exit with STOPPED_BY_SIGNAL_EXIT on every rank
A signal during the last step is moot: the run completes and exits 0.

Exit statuses of a ringtrain process:
  0                       the run is complete.
  STOPPED_BY_SIGNAL_EXIT  (143) stopped by a signal after saving last.pt; resume to continue.
                          Every rank exits with it, also those that did not get the signal.
  128 + signum            a second signal: exited at once without saving (130 SIGINT,
                          138 SIGUSR1, 143 SIGTERM); last.pt is the previous save's.
  1 / 2                   a crash / a mistake in the configuration (trainer/errors.py).

Why 143 (= 128 + SIGTERM), and not 0:
  * A stopped run is not finished. Anything that restarts on failure reads the exit status:
    torchrun `--max-restarts` restarts workers only on a non-zero status and takes 0 as done;
    a shell loop `until python train.py ...; do :; done`, Kubernetes `restartPolicy:
    OnFailure`, SLURM's `RequeueExit=` all do the same. Exit 0 would end the run there.
  * 143 is what these tools already read as "terminated, worth retrying": Kubeflow's ExitCode
    restart policy retries 128-255 (and 1, 2, 126, 127 are permanent), Kubernetes pod failure
    policies usually key on 137/143, and a shell reports a process killed by SIGTERM as 143.
    A distinct code such as 75 (EX_TEMPFAIL) would read as a permanent error to those.
  * When the launcher itself is being stopped (torchrun got SIGTERM/SIGINT and forwarded it,
    SLURM cancels the step) it does not restart anything, whatever the status: 143 does no
    harm there and lets a batch script requeue (`[ $? -eq 143 ] && scontrol requeue ...`).
  * Schedulers that requeue on preemption by themselves (SLURM `--requeue`, submitit) do not
    read the status; they see a job that ended early, which is true.
One status for every stop signal: what the caller needs to know is "stopped early, saved,
resume to continue", not which signal it was (the log says that).

Launchers forward signals, so the same stop request often arrives twice within milliseconds:
Ctrl-C reaches torchrun and its workers, then torchrun forwards SIGINT; SLURM signals every
process of a step, and torchrun forwards that too. A repeat within `repeat_grace_s` (2 s) of
the first is therefore taken as the same request, not as "exit at once".
torchrun SIGKILLs workers `--shutdown-timeout` seconds (default 30) after forwarding a signal:
the last step plus the save must fit in it. torchrun forwards only `--signals-to-handle`
(default SIGTERM,SIGINT,SIGHUP,SIGQUIT); add SIGUSR1 there when SLURM sends it to torchrun,
and drop SIGUSR1 from StopSignals where something else (submitit) handles it.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from datetime import timedelta
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from ringtrain.errors import STOPPED_BY_SIGNAL_EXIT  # noqa: F401  (the status this module's stops exit with)
from ringtrain.loop.watchdog import flush_within

DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
# A repeat this soon after the first signal is a launcher forwarding it, not a person insisting.
REPEAT_GRACE_SECONDS = 2.0

log = logging.getLogger("ringtrain")


class StopSignals:
    """Turn the first stop signal into a flag, the second (after the grace) into an exit.

    Signals are handled on a watcher thread, woken through `signal.set_wakeup_fd`: CPython
    runs a Python signal handler only when the main thread next executes Python code, which a
    rank stuck in a collective or another long C call never does, and "exit at once" must work
    exactly then. The C-level handler writes the signal number to a pipe (async-signal-safe);
    the watcher thread reads it, logs and exits; no logging or I/O happens in a signal handler,
    so nothing can re-enter a half-written stream. The Python-level handlers installed here
    do nothing themselves: they exist so the default action (terminate, KeyboardInterrupt)
    does not happen.

    Only the main thread can install handlers; entered elsewhere, this logs a warning and does
    nothing (signals keep their usual effect). Leaving restores the previous handlers and
    wakeup fd. While active it owns the wakeup fd (asyncio's use of it would be suspended).
    A process forked meanwhile gets the previous handlers back, so its signals never count as
    the parent's. Forked workers share the process group, so a signal sent to the whole group
    (Ctrl-C, torchrun's killpg, SLURM) reaches them too and may end them; torch's DataLoader
    then reports a dead worker. ringtrain's loaders start no worker processes.
    """

    def __init__(
        self,
        names: tuple[str, ...] | list[str] = DEFAULT_STOP_SIGNALS,
        lag_steps: int = 0,
        repeat_grace_s: float = REPEAT_GRACE_SECONDS,
    ):
        self.signums = tuple(_signal_number(name) for name in names)
        self.lag_steps = lag_steps  # steps between a rank seeing the signal and all stopping
        self.repeat_grace_s = repeat_grace_s
        self.received: str | None = None  # the first stop signal's name, e.g. "SIGTERM"
        self._received_at = 0.0
        self._polled_step: int | None = None
        self._lock = threading.Lock()
        self._installed = False
        self._previous_handlers: dict[int, object] = {}
        self._previous_wakeup_fd = -1
        self._read_fd = self._write_fd = -1
        self._watcher: threading.Thread | None = None

    def poll(self, step: int) -> bool:
        """Whether a stop signal has arrived; call it after optimizer step `step` finished."""
        # Under the lock the watcher takes too: the step its log line names is then the one
        # at which this poll, or the next one, first returns True.
        with self._lock:
            self._polled_step = step
            return self.received is not None

    # --- installing and restoring -------------------------------------------------------------

    def __enter__(self) -> "StopSignals":
        global _active
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals are handled only on the main thread; SIGTERM and Ctrl-C will not save last.pt")
            return self
        if _active is not None:
            raise RuntimeError("StopSignals is already active in this process; enter it once")
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd requires it: a handler never blocks
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signum in self.signums:
            self._previous_handlers[signum] = signal.signal(signum, _do_nothing)
        self._watcher = threading.Thread(target=self._watch, name="ringtrain-stop-signals", daemon=True)
        self._watcher.start()
        self._installed = True
        _active = self
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _active
        if not self._installed:
            return
        _restore_handlers(self._previous_handlers)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        os.close(self._read_fd)
        self._installed = False
        _active = None

    def _forget_in_forked_child(self) -> None:
        """In a forked child: no watcher thread exists, and the pipe is the parent's."""
        try:
            # The forking thread is the child's main thread (CPython re-initialises that
            # before running at-fork hooks), so this is allowed.
            signal.set_wakeup_fd(-1)
            _restore_handlers(self._previous_handlers)
        except ValueError:
            return  # keep the pipe open: a handler might still write to its fd number
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._installed = False

    # --- the watcher thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:  # closed under us on exit
                return
            if not data:
                return
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
            _exit_at_once(name, 128 + signum)


def _exit_at_once(name: str, status: int) -> None:
    """Log, flush what can be flushed within a second, and end the process with `status`."""
    flush_within(1.0, lambda: log.warning(f"received {name} again: exiting at once with status {status}, without saving"))
    os._exit(status)


def _do_nothing(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler: the watcher thread does the work (see StopSignals)."""


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


_active: StopSignals | None = None


def _after_fork_in_child() -> None:
    global _active
    if _active is not None:
        _active._forget_in_forked_child()
        _active = None


os.register_at_fork(after_in_child=_after_fork_in_child)


class StopAgreement:
    """All ranks decide to stop at the same step, off the critical path.

    Each `should_stop(local_flag)` call starts an asynchronous all_reduce(MAX) of this rank's
    flag and returns the result of the previous call's all_reduce. That one had a whole step
    to complete, so waiting for it costs nothing; no collective ever blocks the step, and the
    tensor is a 1-element CPU int on a separate gloo group, so there is no GPU synchronisation
    and no interference with DDP's NCCL or gloo traffic.
    The price is one step of lag: a flag raised at call i on any rank makes every rank's call
    i + 1 return True (`lag_steps` is 1). All ranks get the same answer at the same call index,
    because it is the same all_reduce's result. Not distributed (no default group, or one
    rank): `should_stop` returns the local flag directly, no lag.

    Rules: construct it on every rank at the same point (`new_group` is collective, and
    process groups must be created in the same order everywhere), call `should_stop` exactly
    once per optimizer step on every rank, and `close()` before leaving the process group.
    """

    def __init__(self, timeout_minutes: float | None = None):
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The job's collective timeout (strategy.timeout_minutes), not gloo's 30-minute
            # default: a rank that stops answering must fail the others as soon as DDP would.
            timeout = {"timeout": timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
            self._group = dist.new_group(backend="gloo", **timeout)

    @property
    def lag_steps(self) -> int:
        return 0 if self._group is None else 1

    def should_stop(self, local_flag: bool) -> bool:
        if self._group is None:
            return local_flag
        decided = False
        if self._pending is not None:
            work, flags = self._pending
            work.wait()
            decided = bool(flags.item())
        flags = torch.tensor([int(local_flag)], dtype=torch.int32)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flags)
        return decided

    def agree_now(self, local_flag: bool) -> bool:
        """Whether any rank's flag is up, decided now (a blocking all_reduce): once, before
        the first step, so a signal that came during set-up stops every rank before it trains."""
        if self._group is None:
            return local_flag
        assert self._pending is None, "agree_now comes before the first should_stop"
        flags = torch.tensor([int(local_flag)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flags.item())

    def close(self) -> None:
        """Wait for the last all_reduce: every rank started it, so it completes, and a
        collective still in flight must not meet a destroyed process group."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def __enter__(self) -> "StopAgreement":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            # After an error the peers may be gone; waiting for them could hang until the timeout.
            self._pending = None
