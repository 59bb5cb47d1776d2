"""A component that fails after the checks before work passed ends the run as a mistake in
one line (exit 2), not as a traceback from inside ringtrain.

The checks before work (config/) catch what a config shows; some things only show when the
components run: a constructor that raises while it is built for real (a file it opens, a
check on its arguments), or a model, task and data that do not fit each other (a shape, a
dtype, a key), which fails the first training step. Those are the user's to fix, so the line
names what failed, the exception, the line that raised it and what to check
(ringtrain.errors.component_failed). A failure of the process group keeps its own one-line
report (ringtrain.distributed), and a failure after the first step its traceback.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ringtrain.distributed import DistInfo, is_timeout, peer_lost
from ringtrain.errors import RankEnded, UserError, component_failed


@contextlib.contextmanager
def failures_reported_as_mistakes(what: str, fix: str, dist: DistInfo,
                                  armed: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """An exception inside (while `armed()`) is re-raised as `what` failed: ..., `fix`."""
    try:
        yield
    except (UserError, RankEnded):
        raise
    except Exception as err:
        if not armed() or (dist.is_distributed and (is_timeout(err) or peer_lost(err, dist.rank))):
            raise
        raise component_failed(what, err, fix) from err


def component_name(node: dict | None) -> str:
    """The component a config node builds, for the line: its _target_ (or its splits')."""
    node = node or {}
    target = node.get("_target_") or (node.get("train") or {}).get("_target_")
    return f" {target}" if target else ""
