"""A job loads what it uses: the ringtrain modules the default job (`python train.py`, a linear
regression on the CPU) has loaded when its first optimizer step starts, counted in the job's own
process by torch's global optimizer step pre-hook. Models, data sets, strategies, callbacks and
loggers the job did not choose are not among them; issue 36 asks for at most 40 in all."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

# `python train.py <args>`, with torch's hook noting, at the first optimizer step, every ringtrain
# module loaded by then.
COUNTING = """
import sys
from torch.optim.optimizer import register_optimizer_step_pre_hook

def first_step(optimizer, args, kwargs):
    if not loaded:
        loaded.extend(sorted(name for name in sys.modules if name.split(".")[0] == "ringtrain"))
        print("loaded at the first step:", *loaded, flush=True)

loaded = []
register_optimizer_step_pre_hook(first_step)
sys.argv = sys.argv[1:]
from ringtrain.__main__ import main
main()
"""


@pytest.fixture(scope="module")
def loaded_by_the_default_job(tmp_path_factory) -> list[str]:
    cwd = tmp_path_factory.mktemp("default_job")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", COUNTING, str(REPO / "train.py"), f"hydra.run.dir={cwd / 'run'}",
                           "trainer.max_steps=1"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("loaded at the first step:"))
    loaded = line.split(":", 1)[1].split()
    assert "ringtrain.models.linear" in loaded and "ringtrain.models.transformer" not in loaded
    return loaded


MOST = 40  # issue 36's bound


def test_the_default_job_loads_few_ringtrain_modules_before_its_first_step(loaded_by_the_default_job):
    loaded = loaded_by_the_default_job
    assert len(loaded) <= MOST, f"{len(loaded)} ringtrain modules before the first step: {' '.join(loaded)}"
