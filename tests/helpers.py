"""Helpers the tests share for real subprocesses: torchrun commands, exit-status checks, free
ports and watched jobs. Import them as `from helpers import ...` (pytest puts tests/ on sys.path);
tests/conftest.py holds the fixtures and the config and training helpers.
"""
from __future__ import annotations

import socket

# --- ports ------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now (for a process group's master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
