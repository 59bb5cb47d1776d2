"""How a torchrun worker restarted after a failure finds the run directory its job used.

Without an id (`--rdzv-id`, or the one `--standalone` makes up) the run directory is named by
the clock (storage/rundir.py), and torchrun restarts its workers (`--max-restarts`) with a
new clock. So rank 0 leaves a note naming its directory, and a restarted rank 0 reads it.

A note belongs to one torchrun agent (the workers' parent, living across their restarts),
named by its pid and start time (a later process given the same pid is not it), in a
directory of this user's own under the temp directory, where no other user can plant one.
Notes cannot pile up: rank 0 removes its note when no restart will follow (the run completed,
or no restarts are left), and every new note first sweeps away those of agents no longer
running (stopped by Ctrl-C, killed) and an earlier ringtrain's in the temp directory itself.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ringtrain.storage.atomic import write_text_atomically

NOTES_DIRECTORY = "ringtrain-restart-notes-{user}"  # under tempfile.gettempdir()
_PREFIX = "torchrun-"  # a note: torchrun-<agent pid>-<agent start>-<run id>.dir
_OLD_PREFIX = "ringtrain-torchrun-"  # an earlier ringtrain's: <temp dir>/ringtrain-torchrun-<pid>-<run id>.dir


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarts_left() -> int:
    """How many more times this torchrun agent restarts its workers after a failure."""
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return max(0, most - restart_count())


def restart_note() -> Path | None:
    """The note naming rank 0's run directory for the torchrun agent running this worker
    (None: there is no notes directory of this user's own to keep it in)."""
    directory = notes_directory()
    agent = os.getppid()
    started = process_start(agent)
    if directory is None or started is None:
        return None
    return directory / f"{_PREFIX}{agent}-{started}-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}.dir"


def leave_restart_note(run_dir: Path) -> None:
    """Rank 0 under torchrun: remember the run directory for restarted workers."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    sweep_stale_notes()
    if (note := restart_note()) is not None:
        with contextlib.suppress(OSError):  # no writable temp dir: a restart then starts a new directory
            write_text_atomically(note, str(run_dir))


def forget_restart_note(completed: bool) -> None:
    """Rank 0 under torchrun, as it ends: remove the note unless a restart will read it."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or (not completed and restarts_left() > 0):
        return
    if (note := restart_note()) is not None:
        with contextlib.suppress(OSError):
            note.unlink()


def directory_before_restart() -> str | None:
    """The run directory of this torchrun job's earlier attempt, when this is a restart."""
    if restart_count() == 0 or (note := restart_note()) is None:
        return None
    try:
        return note.read_text().strip() or None
    except OSError:
        return None


def sweep_stale_notes() -> None:
    """Remove the notes of torchrun agents that no longer run: nothing will read them."""
    directory = notes_directory()
    stale = [] if directory is None else [
        note for note in directory.glob(f"{_PREFIX}*.dir")
        if not _agent_runs(*note.name[len(_PREFIX):].split("-", 2)[:2])
    ]
    stale += [  # an earlier ringtrain's notes, named by the agent's pid alone
        note for note in Path(tempfile.gettempdir()).glob(f"{_OLD_PREFIX}*.dir")
        if not _agent_runs(note.name[len(_OLD_PREFIX):].split("-", 1)[0], None)
    ]
    for note in stale:
        with contextlib.suppress(OSError):  # removed meanwhile by another job's sweep, or another user's
            note.unlink()


def notes_directory() -> Path | None:
    """This user's notes directory, made if missing; None when that name is not this user's own
    directory (a note read from there could send a restart's checkpoints anywhere)."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    directory = Path(tempfile.gettempdir()) / NOTES_DIRECTORY.format(user=user)
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        status = os.lstat(directory)
    except OSError:
        return None
    if not directory.is_dir() or directory.is_symlink():
        return None
    if hasattr(os, "getuid") and (status.st_uid != os.getuid() or status.st_mode & 0o022):
        return None
    return directory


def process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat);
    None when no such process runs; without /proc (macOS) "" for any process that runs."""
    if os.name == "nt":  # where os.kill(pid, 0) would send Ctrl-C: take every agent as running
        return ""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold spaces
    except (OSError, IndexError):
        if os.path.exists("/proc/self/stat"):
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:  # another user's process: it runs
        pass
    return ""


def _agent_runs(pid: str, started: str | None) -> bool:
    """Whether the agent a note names still runs (`started` None: any process with that pid)."""
    if not pid.isdigit():
        return True  # not a note's name: leave the file alone
    now = process_start(int(pid))
    return now is not None and (started is None or now == started)
