"""The whole default job as a process, start to exit: `python train.py` against the seed
tutorial's own script run the same way, interleaved, plus where ringtrain's start-up goes.

The tutorial (seed 000, single-process section): y = 2x + 3 + noise, 10 000 samples,
DataLoader(batch_size=32, shuffle=True), SGD lr 0.01, 10 epochs, `loss.item()` every step
(bench_tutorial_loop.py's copy of it, run as a script). ringtrain's default job trains the same, and also validates, checkpoints (durably) and
logs to TensorBoard every epoch. Both run as fresh processes with one CPU thread.

    python benchmarks/bench_process.py [--repeats 5]

Prints each process's wall time (best and median of N, interleaved), the ratio, and a
start-up breakdown: importing torch, importing ringtrain's command, composing and checking
the config ahead of Hydra, and the job's own training seconds (its metrics.json).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench_tutorial_loop import SimpleDataset, SimpleModel, tutorial_loop  # noqa: E402  (this folder)

# The tutorial as a script of its own: the same classes and loop bench_tutorial_loop.py times.
TUTORIAL = "\n\n".join([
    "import time\nimport torch\nimport torch.nn as nn\nimport torch.optim as optim\n"
    "from torch.utils.data import DataLoader, Dataset",
    inspect.getsource(SimpleDataset), inspect.getsource(SimpleModel), inspect.getsource(tutorial_loop),
    "print('w={1:.4f} b={2:.4f}'.format(*tutorial_loop()))\n",
])

# Phases of ringtrain's start-up, each timed in a fresh process after the one before it.
STARTUP = '''
import time, sys
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import ringtrain.tools.train
from ringtrain.config.command_line import check_overrides
t2 = time.perf_counter()
check_overrides(sys.argv[1:])
t3 = time.perf_counter()
print(f"{t1 - t0} {t2 - t1} {t3 - t2}")
'''


def timed(command: list[str], cwd: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tutorial = Path(scratch) / "tutorial.py"
        tutorial.write_text(TUTORIAL)
        run_dir = Path(scratch) / "run"
        ringtrain = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", "trainer.resume=null"]
        times: dict[str, list[float]] = {"tutorial": [], "ringtrain": []}
        for _ in range(args.repeats):
            times["tutorial"].append(timed([sys.executable, str(tutorial)], scratch))
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            times["ringtrain"].append(timed(ringtrain, scratch))
        train_seconds = json.loads((run_dir / "metrics.json").read_text())["train_seconds"]
        phases = subprocess.run([sys.executable, "-c", STARTUP], cwd=scratch, capture_output=True, text=True,
                                check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()
    print(f"python {sys.version.split()[0]}, {args.repeats} interleaved runs of each process")
    for name, values in times.items():
        print(f"{name:10s} best {min(values):.2f} s   median {statistics.median(values):.2f} s")
    print(f"ringtrain / tutorial: best {min(times['ringtrain']) / min(times['tutorial']):.2f}x, "
          f"median {statistics.median(times['ringtrain']) / statistics.median(times['tutorial']):.2f}x")
    torch_s, command_s, check_s = (float(p) for p in phases)
    print(f"ringtrain start-up: import torch {torch_s:.2f} s, import ringtrain's command {command_s:.2f} s, "
          f"compose and check the config {check_s:.2f} s; training loop (last run) {train_seconds:.2f} s")


if __name__ == "__main__":
    main()
