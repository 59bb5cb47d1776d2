"""Helpers the tests share for real subprocesses: torchrun commands, exit-status checks, free
ports and watched jobs. Import them as `from helpers import ...` (pytest puts tests/ on sys.path);
tests/conftest.py holds the fixtures and the config and training helpers.
"""
from __future__ import annotations

import socket
import subprocess
import sys

# --- ports ------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now (for a process group's master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- torchrun ----------------------------------------------------------------------------------

# Two ranks on this machine. --standalone: a rendezvous of its own on a free port, so jobs that
# run side by side (two test sessions on one machine) never meet on torchrun's default port.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun_static_rendezvous(*options: str) -> list[str]:
    """torchrun, two ranks, without --standalone or --rdzv-id: a static rendezvous on a free
    master port, whose run id is "none" (so a run directory is named by the clock)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
            *options]


# --- exit statuses -----------------------------------------------------------------------------


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A finished command that exited 0 (else the tail of its stderr shows why); returns it."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def refused(proc: subprocess.CompletedProcess, *phrases: str) -> str:
    """A finished command that exited 2 with exactly one line on stderr, `error: ...`, holding
    every phrase; returns that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def job_ok(result: tuple[int, str]) -> str:
    """A Job's `finish()` (status, output) for a job that exited 0; returns its output."""
    status, output = result
    assert status == 0, output[-6000:]
    return output


def job_refused(result: tuple[int, str], *phrases: str) -> str:
    """A Job's `finish()` (status, output) for a job that exited 2 with one `error:` line among
    its output (stdout and stderr together, logging included) and no traceback, the line
    holding every phrase; returns that line."""
    status, output = result
    assert status == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]
