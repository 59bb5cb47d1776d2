"""Where a run writes, chosen so that a restarted job finds its own directory again, and the
claim one job holds on it.

`run_directory` is conf/train.yaml's hydra.run.dir (the `${ringtrain.run_dir:}` resolver):

  hydra.run.dir given        that directory, every time (the resolver is not asked)
  trainer.resume=<file>      the run directory of that checkpoint (<run>/checkpoints/<file>)
  SLURM (sbatch, submitit)   outputs/runs/slurm-<job id>[_<array task>]: kept across requeues
  torchrun, --rdzv-id=X      outputs/runs/torchrun-X (--standalone makes up an id: each start
                             of the command is a new run, restarts within it keep the id)
  torchrun without an id     outputs/runs/<date>_<time>_<pid> of the torchrun agent (below)
  anything else              outputs/runs/<date>_<time>_<pid>
Ranks other than 0 under torchrun resolve to "." and write nothing there: rank 0's directory
reaches them once the process group is up (run.py).

`RunDirectory` is rank 0's `flock` on `<run dir>/.lock` (dropped by the kernel however the job
ends, so a killed job never blocks its resume): a second job there is refused in one line. A
job refused before it trained takes back what it put there, and the directory if left empty.

torchrun restarts its workers (`--max-restarts`) with new pids and a new clock; their parent,
torchrun's agent, lives across the restarts. So a run without a run id is named by the agent's pid
and start (from /proc: the same on every attempt, and no other process, before or after, has
both), and a restarted rank 0 names the same directory, with nothing kept anywhere else. Without
/proc (macOS), or after the system clock was stepped between two attempts, a restart names a new
directory: `--rdzv-id` or hydra.run.dir name it for certain.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
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
    pid, started = os.getpid(), None  # now
    if under_torchrun():  # torchrun's agent, which outlives the workers it restarts (see the module docstring)
        pid = os.getppid()
        started = start_time(pid)
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"_{pid}"


def start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch: the boot time and the clock ticks
    after it (field 22 of /proc/<pid>/stat); None without /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # the name may hold spaces
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _other_rank() -> bool:
    return under_torchrun() and env_rank() != 0


def run_directory(resume: Any = None) -> str:
    if _other_rank():
        return "."
    if isinstance(resume, str) and resume != "auto" and Path(resume).is_file() and Path(resume).parent.name == "checkpoints":
        return str(Path(resume).resolve().parent.parent)
    return f"outputs/runs/{run_name()}"


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
