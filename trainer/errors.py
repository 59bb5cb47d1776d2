"""User mistakes: one line on stderr and a non-zero exit, instead of a traceback.

ConfigError lives here (not in config.py) so that every module can raise it without
importing the validation code.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

# Exit status for a mistake in the configuration or inputs (argparse uses 2 as well).
USER_ERROR_EXIT = 2


class ConfigError(ValueError):
    """A mistake in the user's configuration; the message is one line with the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    from data.bundle import DataError
    from trainer.checkpoint import CheckpointError, RunDirError
    from trainer.distributed import DistributedSetupError

    return ConfigError, DataError, CheckpointError, DistributedSetupError, RunDirError


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    from trainer.distributed import WorkerFailedError

    try:
        yield
    except user_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except WorkerFailedError as err:  # a spawned worker's own error is already printed above
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
