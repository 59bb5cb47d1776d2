"""Turning user mistakes into one line on stderr and a non-zero exit, instead of a traceback."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from data import DataError
from trainer.checkpoint import CheckpointError, RunDirError
from trainer.config import ConfigError
from trainer.distributed import DistributedSetupError, WorkerFailedError

# Exit status for a mistake in the configuration or inputs (argparse uses 2 as well).
USER_ERROR_EXIT = 2
USER_ERRORS = (ConfigError, DataError, CheckpointError, DistributedSetupError, RunDirError)


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    try:
        yield
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except WorkerFailedError as err:  # a spawned worker's own error is already printed above
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
