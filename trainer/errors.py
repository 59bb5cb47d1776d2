"""User mistakes: one line on stderr and a non-zero exit, instead of a traceback.

Exit statuses of `python train.py` (and of each rank; the README lists them too): 0 the run is
complete; 1 a crash (a traceback says where), or another rank's crash (one line on this rank);
and the three below. The error bases live here, importing nothing of ringtrain, so every module
can raise one and `exit_on_user_error` catch them all without importing those modules.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from datetime import timedelta
from typing import Iterator

USER_ERROR_EXIT = 2  # as argparse's: a mistake in the configuration or inputs, in one line, before work starts where it can
NONFINITE_EXIT = 3  # trainer.on_nonfinite=stop ended the run on a NaN/inf (the log names the step)
# A stop signal (SIGTERM, SIGINT, SIGUSR1): the step finished, last.pt was saved, the log's last
# line is the command that continues the run (loop/stopping.py says why 143).
STOPPED_BY_SIGNAL_EXIT = 143


class UserError(Exception):
    """A mistake the user can fix (configuration, inputs, files, devices): the message is one
    line naming the problem and the fix; the process exits with USER_ERROR_EXIT."""


class ConfigError(UserError, ValueError):
    """A mistake in the user's configuration; the message is one line with the fix."""


class ComponentFailed(UserError):
    """A component (model, data, task) raised while built or in its first step, after the checks
    passed: a mismatch between them, or a bug in one. The line names it, the exception and where."""


def component_failed(what: str, err: BaseException, fix: str) -> ComponentFailed:
    """`what` failed with `err`: one line with the exception, the line that raised it (the
    innermost outside torch, Hydra and OmegaConf: the component's own), `fix`."""
    cause = err
    # Hydra's instantiate wraps a constructor's exception in its own: report the constructor's.
    while type(cause).__name__ == "InstantiationException" and cause.__cause__ is not None:
        cause = cause.__cause__
    text = " ".join(str(cause).split())[:300] or "no message"
    frames = traceback.extract_tb(cause.__traceback__)
    own = [f for f in frames if not any(f"{os.sep}{lib}{os.sep}" in f.filename for lib in ("torch", "hydra", "omegaconf"))]
    where = "an unknown place"
    if (frame := (own or frames or [None])[-1]) is not None:
        path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd() + os.sep) else frame.filename
        where = f"{path}:{frame.lineno} in {frame.name}"
    return ComponentFailed(f"{what} failed: {type(cause).__name__}: {text} (raised at {where}); {fix}")


class _Ending(Exception):
    def __init__(self, message: str = "", exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class RankEnded(_Ending):
    """This process ends because another one did (a spawned worker failed, a peer was lost);
    that one's own output says why. The message is printed and the process exits `exit_code`."""


class TrainingStopped(_Ending):
    """Training ended before its last step; `exit_code` is the process's status (above).
    What happened is already in the log, so nothing more is printed."""


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except UserError as err:
        if first_to_report(USER_ERROR_EXIT):
            print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    # A spawned worker's own error is already printed above; a lost peer's is in its output.
    except RankEnded as err:
        status = err.exit_code
        if not first_to_report(status):  # another rank said the job's mistake (its status 2): this rank ended because of it
            with contextlib.suppress(Exception):
                key = _REPORTED.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + "/status"
                status = int(_job_store().get(key))
        elif str(err):
            print(f"error: {err}", file=sys.stderr)
        sys.exit(status)
    except TrainingStopped as err:
        sys.exit(err.exit_code)


# This process's answer, once asked: whether it is the rank that reports the job's error.
_first_to_report: bool | None = None
_REPORTED = "ringtrain/attempt-{}/reported"


def first_to_report(status: int) -> bool:
    """Whether this process says the job's error: alone always; among a job's ranks, which
    usually all meet a mistake at once, only the first to ask (the others exit with its status
    silently: the line is printed once per job). A rank that raises a mistake asks before it
    leaves the process group, so a peer that then finds it gone learns it was reported."""
    global _first_to_report
    if _first_to_report is None:
        _first_to_report = True  # alone, or the job's store is gone (the launcher ended): say it rather than lose it
        if (store := _job_store()) is not None:
            with contextlib.suppress(Exception):
                key = _REPORTED.format(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
                _first_to_report = store.add(key, 1) == 1
                if _first_to_report:
                    store.set(key + "/status", str(status))
    return _first_to_report


def _job_store():
    """A client of the store torchrun's agent (or the self-launched job's) keeps for its
    workers, or None: not one of several ranks, or no agent store (a launcher of another kind)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                        timeout=timedelta(seconds=10))
    except Exception:
        return None
