"""A component that fails after the checks before work passed ends the run as a mistake in
one line (exit 2), not as a traceback from inside ringtrain.

Some things show only when the components run: a constructor that raises when built for real
(a file it opens), or a model, task and data that do not fit (a shape, a dtype, a key) and fail
the first step. Those are the user's to fix, so the line names what failed, the exception, where
it was raised and what to check (errors.py component_failed). A process group's failure keeps
its own line (distributed.py), and a failure after the first step its traceback.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ringtrain.distributed import DistInfo, is_timeout, peer_lost
from ringtrain.errors import ComponentFailed, RankEnded, UserError, component_failed


@contextlib.contextmanager
def failures_reported_as_mistakes(what: str, fix: str, dist: DistInfo,
                                  armed: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """An exception inside (while `armed()`) is re-raised as `what` failed: ..., `fix`."""
    try:
        yield
    except RankEnded:
        raise
    except UserError as err:  # already one line; inside, it refuses the run (nothing of it is kept)
        if armed() and not isinstance(err, ComponentFailed):
            raise ComponentFailed(str(err)) from err
        raise
    except Exception as err:
        if not armed() or (dist.is_distributed and (is_timeout(err) or peer_lost(err, dist.rank))):
            raise
        raise component_failed(what, err, fix) from err


def component_name(node: dict | None) -> str:
    """The component a config node builds, for the line: its _target_ (or its splits')."""
    node = node if isinstance(node, dict) else {}
    target = node.get("_target_") or (node.get("train") or {}).get("_target_")
    return f" {target}" if target else ""
