"""The notes that let a torchrun worker restarted after a failure find its job's run directory
(ringtrain/storage/rundir.py) are read by the restart and do not pile up.

In-process: this test process plays a torchrun worker (the TORCHELASTIC_* variables torchrun
sets), whose agent is its parent, and the temp directory is the test's own. The restart itself,
under a real torchrun, is tests/test_resilience.py's
test_torchrun_max_restarts_without_hydra_run_dir_finds_its_directory_again.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ringtrain.storage.rundir import (
    directory_before_restart,
    forget_restart_note,
    leave_restart_note,
    notes_directory,
    process_start,
    restart_note,
)


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """This process as attempt 0 of a torchrun worker allowed one restart; its own temp dir."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    return monkeypatch


def ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def test_a_restarted_rank_0_reads_the_note_its_first_attempt_left(worker, tmp_path):
    run_dir = tmp_path / "outputs" / "runs" / "2026-01-01_00-00-00_123"
    leave_restart_note(run_dir)
    note = restart_note()
    assert note.read_text() == str(run_dir)
    assert note.parent == Path(tempfile.gettempdir()) / f"ringtrain-restart-notes-{os.getuid()}"
    assert note.name == f"torchrun-{os.getppid()}-{process_start(os.getppid())}-none.dir"
    assert directory_before_restart() is None, "a first attempt is no restart"
    worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert directory_before_restart() == str(run_dir)


def test_a_note_is_kept_while_a_restart_can_follow_and_removed_when_none_can(worker, tmp_path):
    leave_restart_note(tmp_path / "run")
    forget_restart_note(completed=False)  # a failure or a stop: torchrun restarts the workers
    assert restart_note().exists()
    worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the restart, which the agent allowed once
    forget_restart_note(completed=False)
    assert not restart_note().exists(), "no restart is left, yet the note was kept"

    worker.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    leave_restart_note(tmp_path / "run")
    forget_restart_note(completed=True)
    assert not restart_note().exists(), "the run completed, yet the note was kept"


def test_a_new_note_sweeps_away_the_notes_of_agents_that_no_longer_run(worker, tmp_path):
    notes = notes_directory()
    dead = ended_pid()
    mine = os.getpid()
    stale = [
        notes / f"torchrun-{dead}-{process_start(mine)}-none.dir",  # its agent has ended
        notes / f"torchrun-{mine}-1-none.dir",  # a pid reused: the agent started at another time
        tmp_path / f"ringtrain-torchrun-{dead}-0b1e.dir",  # an earlier ringtrain's, in the temp dir
    ]
    live = [
        notes / f"torchrun-{mine}-{process_start(mine)}-0b1e-77.dir",  # an agent that runs
        tmp_path / f"ringtrain-torchrun-{mine}-none.dir",  # an earlier ringtrain's, agent running
        notes / "torchrun-notes.txt",  # not a note
    ]
    for path in stale + live:
        path.write_text("/somewhere")

    leave_restart_note(tmp_path / "run")

    assert [p for p in stale if p.exists()] == []
    assert [p for p in live if not p.exists()] == []
    assert restart_note().exists()


def test_no_note_is_read_from_or_left_in_a_notes_directory_others_can_write(worker, tmp_path):
    notes = notes_directory()
    notes.chmod(0o777)  # any user could leave a note there, naming any directory
    try:
        assert notes_directory() is None
        leave_restart_note(tmp_path / "run")
        assert list(notes.iterdir()) == []
        worker.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        assert directory_before_restart() is None
    finally:
        notes.chmod(0o700)


def test_no_note_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    leave_restart_note(tmp_path / "run")
    assert list(tmp_path.iterdir()) == []


def test_the_start_time_of_a_process_that_ended_is_none():
    assert process_start(ended_pid()) is None
    assert process_start(os.getpid()) == process_start(os.getpid()) != ""
