"""User mistakes: one line on stderr and a non-zero exit, instead of a traceback.

Exit statuses of `python train.py` (and of each rank):
  0    the run is complete
  1    a crash (a traceback says where), or another rank's crash (one line on this rank)
  2    a mistake in the configuration or inputs, reported in one line before work starts
       where it can be
  3    trainer.on_nonfinite=stop ended the run on a NaN/inf (the log names the step)
  143  a stop signal (SIGTERM, SIGINT, SIGUSR1): the step finished, last.pt was saved, the
       log's last line is the command that continues the run (tools/continue_command.py;
       loop/signals.py says why 143)
The error classes' bases live here, importing nothing of ringtrain, so that every module
can raise one and `exit_on_user_error` can catch them all without importing those modules.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

# Exit status for a mistake in the configuration or inputs (argparse uses 2 as well).
USER_ERROR_EXIT = 2


NONFINITE_EXIT = 3
# A stop signal ended the run after last.pt was saved (ringtrain/loop/signals.py says why 143).
STOPPED_BY_SIGNAL_EXIT = 143


class UserError(Exception):
    """A mistake the user can fix (configuration, inputs, files, devices): the message is one
    line naming the problem and the fix; the process exits with USER_ERROR_EXIT."""


class ConfigError(UserError, ValueError):
    """A mistake in the user's configuration; the message is one line with the fix."""


class RankEnded(Exception):
    """This process ends because another one did (a spawned worker failed, a peer was lost);
    that one's own output says why. The message is printed and the process exits `exit_code`."""

    exit_code = 1


class TrainingStopped(Exception):
    """Training ended before its last step; `exit_code` is the process's status (above).
    What happened is already in the log, so nothing more is printed."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    # A spawned worker's own error is already printed above; a lost peer's is in its output.
    except RankEnded as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except TrainingStopped as err:
        sys.exit(err.exit_code)
