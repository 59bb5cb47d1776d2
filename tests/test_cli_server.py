"""The suite's forked commands (tests/cli_server.py) start as a fresh interpreter would: a
command's import path is its own, whatever the commands before it had on theirs."""
from __future__ import annotations

import os
import sys

from conftest import ForkedCommands

PROBE = "import importlib.util, sys; print(importlib.util.find_spec('shadowing') is not None)\n"


def test_a_command_does_not_see_the_pythonpath_of_the_command_that_started_the_server(tmp_path):
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "shadowing.py").write_text("")
    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    commands = ForkedCommands()
    try:
        # The first command starts the server, with a PYTHONPATH of its own (as run_module's).
        first = commands.run([str(tmp_path / "probe.py")], None, tmp_path, {**env, "PYTHONPATH": str(tmp_path / "extra")}, 120)
        later = commands.run([str(tmp_path / "probe.py")], None, tmp_path, env, 120)
    finally:
        if commands._server is not None:
            commands._server.kill()
    assert (first.returncode, first.stdout) == (0, "True\n"), first.stderr
    assert (later.returncode, later.stdout) == (0, "False\n"), later.stderr  # as `python probe.py` prints
