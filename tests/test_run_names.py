"""The default name of a run directory (ringtrain/storage/rundir.py run_name): a torchrun job
without a run id is named by its agent, so the workers torchrun restarts name the same directory.

Here a process plays torchrun's agent: it starts its "workers" (the TORCHELASTIC_* variables
torchrun sets) one after another, as restarts, each printing the name it resolves. The restart
itself, under a real torchrun, is tests/test_resilience.py's
test_torchrun_max_restarts_without_hydra_run_dir_finds_its_directory_again.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time

from ringtrain.storage.rundir import run_name, start_time

AGENT = r"""
import json, os, subprocess, sys, time
started = time.time()
env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
worker = [sys.executable, "-c", "from ringtrain.storage.rundir import run_name; print(run_name())"]
names = []
for attempt in range(2):  # the first attempt and its restart: new processes, new pids, a later clock
    env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    names.append(subprocess.run(worker, env=env, capture_output=True, text=True, check=True).stdout.strip())
    time.sleep(1.1)  # the restart's own clock a second later: it must not enter the name
print(json.dumps({"pid": os.getpid(), "started": started, "names": names}))
"""


def agent_run() -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, check=True).stdout)


def test_a_restarted_torchrun_worker_names_the_directory_of_its_first_attempt():
    first, second = agent_run(), agent_run()
    assert first["names"][0] == first["names"][1], "the restart named another directory"
    name = first["names"][0]
    assert name.endswith(f"_{first['pid']}"), name  # the agent's pid, not a worker's
    named_at = datetime.datetime.strptime(name.rsplit("_", 1)[0], "%Y-%m-%d_%H-%M-%S").timestamp()
    assert abs(named_at - first["started"]) < 2, "not the agent's start"
    assert second["names"][0] != name, "another torchrun job named the same directory"


def test_a_run_outside_torchrun_is_named_by_its_own_process_and_clock(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    before = time.time()
    name = run_name()
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_{os.getpid()}", name), name
    named_at = datetime.datetime.strptime(name.rsplit("_", 1)[0], "%Y-%m-%d_%H-%M-%S").timestamp()
    assert before - 1 <= named_at <= time.time()


def test_a_process_start_time_is_when_it_started_and_none_once_it_ended():
    before = time.time()
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    started = start_time(process.pid)
    after = time.time()
    process.communicate()
    assert before - 1 <= started <= after + 1  # /proc/stat's boot time is whole seconds
    assert start_time(process.pid) is None
