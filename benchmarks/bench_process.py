"""The whole default job as a process, start to exit: `python train.py` against the seed
tutorial's own script run the same way, interleaved, plus where ringtrain's start-up goes.

The tutorial (seed 000, single-process section): y = 2x + 3 + noise, 10 000 samples,
DataLoader(batch_size=32, shuffle=True), SGD lr 0.01, 10 epochs, a loss print every 100
steps. ringtrain's default job trains the same, and also validates, checkpoints (durably) and
logs to TensorBoard every epoch. Both run as fresh processes with one CPU thread.

    python benchmarks/bench_process.py [--repeats 5]

Prints each process's wall time (best and median of N, interleaved), the ratio, and a
start-up breakdown: importing torch, importing ringtrain's command, composing and checking
the config ahead of Hydra, and the job's own training seconds (its metrics.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TUTORIAL = '''
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset


class SimpleDataset(Dataset):
    def __init__(self, size=10000):
        self.x = torch.randn(size, 1)
        self.y = 2 * self.x + 3 + 0.1 * torch.randn(size, 1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)


dataloader = DataLoader(SimpleDataset(size=10000), batch_size=32, shuffle=True)
model = SimpleModel()
criterion = nn.MSELoss()
optimizer = optim.SGD(model.parameters(), lr=0.01)
for epoch in range(10):
    running_loss = 0.0
    for i, (inputs, labels) in enumerate(dataloader):
        optimizer.zero_grad()
        loss = criterion(model(inputs), labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        if i % 100 == 99:
            print(f"Epoch [{epoch + 1}/10], Step [{i + 1}], Loss: {running_loss / 100:.4f}")
            running_loss = 0.0
print(f"w={model.linear.weight.item():.4f} b={model.linear.bias.item():.4f}")
'''

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
