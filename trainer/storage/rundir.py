"""Where a run writes, chosen so that a restarted job finds its own directory again, and the
claim one job holds on it.

`run_directory` is conf/train.yaml's hydra.run.dir (the `${ringtrain.run_dir:}` resolver):

  hydra.run.dir given        that directory, every time (the resolver is not asked)
  trainer.resume=<file>      the run directory of that checkpoint (<run>/checkpoints/<file>)
  SLURM (sbatch, submitit)   outputs/runs/slurm-<job id>[_<array task>]: kept across requeues
  torchrun, --rdzv-id=X      outputs/runs/torchrun-X (--standalone makes up an id: each start
                             of the command is a new run, restarts within it keep the id)
  a torchrun restart         the directory rank 0 noted before (the restart notes below)
  anything else              outputs/runs/<date>_<time>_<pid>
Ranks other than 0 under torchrun resolve to "." and write nothing there: rank 0's directory
reaches them once the process group is up (run.py).

`RunDirectory` is rank 0's `flock` on `<run dir>/.lock` (dropped by the kernel however the job
ends, so a killed job never blocks its resume): a second job there is refused in one line. A
job refused before it trained takes back what it put there, and the directory if left empty.

Restart notes: without an id (`--rdzv-id`, or the one `--standalone` makes up) the run
directory is named by the clock, and torchrun restarts its workers (`--max-restarts`) with a
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
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from ringtrain.distributed import env_rank, under_torchrun
from ringtrain.storage import write_text_atomically

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not protected from a second job
    fcntl = None

log = logging.getLogger("ringtrain")
RECORD_SUBDIR = ".hydra"  # the job's record: config.yaml, hydra.yaml, overrides.yaml (as Hydra writes it)


def run_name() -> str:
    if os.environ.get("SLURM_JOB_ID"):
        array = os.environ.get("SLURM_ARRAY_TASK_ID")
        job = os.environ.get("SLURM_ARRAY_JOB_ID") if array else os.environ["SLURM_JOB_ID"]
        return f"slurm-{job}" + (f"_{array}" if array else "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return f"torchrun-{run_id}"
    return time.strftime("%Y-%m-%d_%H-%M-%S") + f"_{os.getpid()}"


def _other_rank() -> bool:
    return under_torchrun() and env_rank() != 0


def run_directory(resume: Any = None) -> str:
    if _other_rank():
        return "."
    if isinstance(resume, str) and resume != "auto" and Path(resume).is_file() and Path(resume).parent.name == "checkpoints":
        return str(Path(resume).resolve().parent.parent)
    return (directory_before_restart() if under_torchrun() else None) or f"outputs/runs/{run_name()}"


def log_file(path: str) -> str:
    """train.log for rank 0; nowhere for the other ranks of a torchrun job, which log to the console."""
    return os.devnull if _other_rank() else path


def rank_tag() -> str:
    """`[rank N]` in the log lines of torchrun's ranks other than 0."""
    return f"[rank {env_rank()}]" if _other_rank() else ""


class RunDirectory:
    LOCK = ".lock"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None
        self._found: set[str] | None = None  # the entries there before this job
        self._sizes: dict[str, int] = {}  # and its files' sizes (a log this job appends to goes back to them)
        self._lock_text = b""  # what the lock file said before this job wrote its own

    def claim(self) -> str | None:
        """Take the directory; None, or the one-line refusal when another job holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        self._found = set(os.listdir(self.path))
        self._sizes = {name: (self.path / name).stat().st_size for name in self._found if (self.path / name).is_file()}
        if fcntl is None:
            return None
        lock = self.path / self.LOCK
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # an unwritable directory: the first save says so
            log.warning(f"cannot create {lock} ({err.strerror}): nothing stops a second job from using this directory")
            return None
        self._lock_text = os.pread(fd, 200, 0)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = self._lock_text.decode(errors="replace").strip() or "unknown"
                return (f"{self.path} is in use by another training job ({holder}); wait for it to end, stop it, "
                        f"or give this run its own hydra.run.dir")
            log.warning(f"cannot lock {lock} ({err.strerror}): nothing stops a second job from using this directory")
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return None

    def write_record(self, files: dict[str, str]) -> None:
        """The job's .hydra/ record, written once the directory is this job's (Hydra would have
        written it as the job started, over the record of a run a refused job found there)."""
        for name, text in files.items():
            write_text_atomically(self.path / RECORD_SUBDIR / name, text)

    def release(self, refused: bool = False) -> None:
        """Let the directory go; `refused`: the job trained nothing, so take back what it added (log,
        record, lines appended to the run's train.log), and the directory if that leaves it empty."""
        if refused and self._found is not None:
            for handler in list(logging.getLogger().handlers):  # train.log, if this job made it
                if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == self.path.absolute():
                    handler.close()
                    logging.getLogger().removeHandler(handler)
            for name in set(os.listdir(self.path)) - self._found:
                entry = self.path / name
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            for name, size in self._sizes.items():
                if name != self.LOCK and (self.path / name).is_file() and (self.path / name).stat().st_size > size:
                    os.truncate(self.path / name, size)
            if self.LOCK in self._found and self._fd is not None:  # a run's lock file: as it was
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._lock_text, 0)
        if refused:  # also refused before the claim (a logger that cannot work): the folder Hydra made
            remove_if_empty(self.path)
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None


def remove_if_empty(path: Path) -> None:
    """Remove `path` if it is empty, then its parents under the current directory while they are
    (outputs/runs/ that the refused job's directory was the first of)."""
    path, here = path.absolute(), Path.cwd()
    with contextlib.suppress(OSError):  # not empty (or not ours to remove): stop there
        if here in path.parents:
            os.removedirs(path.relative_to(here))
        elif path != here:
            path.rmdir()


NOTES_DIRECTORY = "ringtrain-restart-notes-{user}"  # under tempfile.gettempdir()
_PREFIX = "torchrun-"  # a note: torchrun-<agent pid>-<agent start>-<run id>.dir
_OLD_PREFIX = "ringtrain-torchrun-"  # an earlier ringtrain's: <temp dir>/ringtrain-torchrun-<pid>-<run id>.dir


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_note() -> Path | None:
    """The note naming rank 0's run directory for the torchrun agent running this worker
    (None: there is no notes directory of this user's own to keep it in)."""
    agent = os.getppid()
    if (directory := notes_directory()) is None or (started := process_start(agent)) is None:
        return None
    return directory / f"{_PREFIX}{agent}-{started}-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}.dir"


def leave_restart_note(run_dir: Path) -> None:
    """Rank 0 under torchrun: the note for restarted workers, once the stale ones are swept away."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
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
    if (note := restart_note()) is not None:
        with contextlib.suppress(OSError):  # no writable temp dir: a restart then starts a new directory
            write_text_atomically(note, str(run_dir))


def forget_restart_note(completed: bool) -> None:
    """Rank 0 under torchrun, as it ends: remove the note unless a restart will read it."""
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)  # restarts this torchrun agent makes
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or (not completed and most > restart_count()):
        return
    if (note := restart_note()) is not None:
        with contextlib.suppress(OSError):
            note.unlink()


def directory_before_restart() -> str | None:
    if restart_count() > 0 and (note := restart_note()) is not None:
        with contextlib.suppress(OSError):
            return note.read_text().strip() or None
    return None


def notes_directory() -> Path | None:
    """This user's notes directory, made if missing; None when that name is not this user's own
    directory (a note read from there could send a restart's checkpoints anywhere)."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    directory = Path(tempfile.gettempdir()) / NOTES_DIRECTORY.format(user=user)
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        status = os.lstat(directory)  # a link (to anywhere) is not a directory here
    except OSError:
        return None
    mine = not hasattr(os, "getuid") or (status.st_uid == os.getuid() and not status.st_mode & 0o022)
    return directory if stat.S_ISDIR(status.st_mode) and mine else None


def process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat);
    None when no such process runs; without /proc (macOS) "" for any process that runs."""
    if os.name == "nt":  # where os.kill(pid, 0) would send Ctrl-C: take every agent as running
        return ""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
        return line.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold spaces
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
