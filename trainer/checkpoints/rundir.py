"""Where a run writes, chosen so that a restarted job finds its own directory again.

Auto-resume (trainer.resume=auto) continues from the run directory's own last.pt, so a job
that is started again must land in the same directory, and two different jobs never in one:

  hydra.run.dir given        that directory, every time
  SLURM (sbatch, submitit)   outputs/runs/slurm-<job id>[_<array task>]: SLURM keeps the job id
                             when it requeues a job
  torchrun, --rdzv-id=X      outputs/runs/torchrun-X: the id names the job, restarts keep it;
                             --standalone makes up a random id, so each start of the command
                             is a new run there (restarts within it keep the id)
  anything else              outputs/runs/<date>_<time>_<pid>: the pid keeps apart two jobs
                             started in the same second
torchrun without an id (a static rendezvous: --master-addr/--master-port) restarts its workers
with the same command but a new clock, so rank 0 leaves a note naming its directory for the
restarted workers (checkpoints/restart_notes.py).

While a job runs, its rank 0 holds `RunDirectoryLock` on the directory, so that a second job
(the same command started twice, two runs given one hydra.run.dir) is refused in one line
instead of writing the same checkpoints at the same time. Only then does rank 0 write the
job's `RunRecord` (.hydra/), so a refused job leaves the owner's record as it was.
`why_not_writable` says, before Hydra runs, why a run directory could not be made.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ringtrain.checkpoints.atomic import write_text_atomically

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not protected from a second job
    fcntl = None

log = logging.getLogger("ringtrain")


def run_name() -> str:
    """The default name of this job's run directory (see the module docstring)."""
    if os.environ.get("SLURM_JOB_ID"):
        array = os.environ.get("SLURM_ARRAY_TASK_ID")
        job = os.environ.get("SLURM_ARRAY_JOB_ID") if array else os.environ["SLURM_JOB_ID"]
        return f"slurm-{job}" + (f"_{array}" if array else "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return f"torchrun-{run_id}"
    return time.strftime("%Y-%m-%d_%H-%M-%S") + f"_{os.getpid()}"


# Where a job's record goes (hydra.output_subdir's value before ringtrain turned Hydra's
# writing off), carried in the job's own Hydra config (hydra.job.env_set), so that it reaches
# the job wherever the launcher runs it (tools/run_record.py).
RECORD_SUBDIR_VARIABLE = "RINGTRAIN_RECORD_SUBDIR"


@dataclass(frozen=True)
class RunRecord:
    """What Hydra's `hydra.output_subdir` (.hydra/) holds: the job's config.yaml, hydra.yaml and
    overrides.yaml. Written by the job itself once it owns its run directory (the lock held,
    the checkpoint to resume from accepted), not by Hydra when the job starts: a job refused
    then would have replaced the record of the run that owns the directory."""

    subdir: str
    files: dict[str, str]  # file name -> its text

    def write(self, run_dir: str | Path) -> None:
        for name, text in self.files.items():
            write_text_atomically(Path(run_dir) / self.subdir / name, text)


def why_not_writable(directory: str | Path) -> str | None:
    """Why a job cannot make `directory` and write into it (None: it can), found before
    anything is written: the nearest part of the path that exists must be a directory in
    which this process can make one (tried, and removed again: permissions, a read-only
    file system or a kernel file system that refuses it all say so only when tried)."""
    path = Path(directory).absolute()
    try:
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            return f"{path} is a file, not a directory"
        os.rmdir(tempfile.mkdtemp(prefix=".ringtrain-write-test-", dir=path))
    except OSError as err:
        return f"nothing can be written in {path} ({err.strerror})"
    return None


class RunDirectoryLock:
    """An exclusive claim on a run directory for the life of one job.

    An advisory `flock` on `<run dir>/.lock`. The kernel drops it when the holding process
    ends, however it ends (SIGKILL, the OOM killer, torchrun stopping its workers before a
    restart), so a lock left behind never blocks the resume that follows. The file holds the
    holder's pid and host, for the refusal message; it is left in place (deleting it would let
    a third job lock a new file while the second still holds the old one).
    Where the file system has no locks (some network file systems) the run goes on unprotected,
    with a warning.
    """

    NAME = ".lock"

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / self.NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; return None, or the one-line refusal when another job holds it."""
        if fcntl is None:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # an unwritable directory: the first checkpoint save says so
            log.warning(f"cannot create {self.path} ({err.strerror}): nothing stops a second job from using this directory")
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return (
                    f"{self.path.parent} is in use by another training job ({holder}); wait for it to end, "
                    f"stop it, or give this run its own hydra.run.dir"
                )
            log.warning(f"cannot lock {self.path} ({err.strerror}): nothing stops a second job from using this directory")
            return None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
