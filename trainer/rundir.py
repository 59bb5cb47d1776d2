"""Where a run writes, chosen so that a restarted job finds its own directory again.

Auto-resume (trainer.resume=auto) continues from the run directory's own last.pt, so a job
that is started again must land in the same directory, and two different jobs never in one:

  hydra.run.dir given        that directory, every time
  SLURM (sbatch, submitit)   outputs/runs/slurm-<job id>[_<array task>]: SLURM keeps the job id
                             when it requeues a job
  torchrun, --rdzv-id=X      outputs/runs/torchrun-X: the id names the job, restarts keep it
  anything else              outputs/runs/<date>_<time>_<pid>: the pid keeps apart two jobs
                             started in the same second
torchrun without an id restarts its workers with the same command but a new clock, so rank 0
leaves a note (`restart_note`) naming its directory, keyed by the torchrun agent's pid (the
workers' parent, alive across restarts), and a restarted rank 0 reads it
(`directory_before_restart`).
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


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


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_note() -> Path:
    """The note naming rank 0's run directory for the torchrun agent running this worker."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return Path(tempfile.gettempdir()) / f"ringtrain-torchrun-{os.getppid()}-{run_id}.dir"


def leave_restart_note(run_dir: Path) -> None:
    """Rank 0 under torchrun: remember the run directory for restarted workers."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    note = restart_note()
    tmp = note.with_name(note.name + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(str(run_dir))
        os.replace(tmp, note)
    except OSError:  # no writable temp dir: a restart then starts a new directory
        pass


def forget_restart_note() -> None:
    """Rank 0 under torchrun, after the run completed: no restart will read the note again.
    (Kept after a failure or a stop: torchrun may restart the workers then.) Without this every
    torchrun job left a note in the temp directory for good."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    try:
        restart_note().unlink()
    except OSError:
        pass


def directory_before_restart() -> str | None:
    """The run directory of this torchrun job's earlier attempt, when this is a restart."""
    if restart_count() == 0:
        return None
    try:
        return restart_note().read_text().strip() or None
    except OSError:
        return None
