"""ringtrain's default job vs the seed tutorial's own single-process loop, in the same run.

The tutorial (seed 000, `single_gpu_training`): y = 2x + 3 + 0.1 noise, 10 000 samples, a
per-sample `Dataset.__getitem__` + `DataLoader(batch_size=32, shuffle=True)`, SGD lr 0.01,
10 epochs, `loss.item()` every step. ringtrain's default job trains the same model on the same
data with the same hyperparameters (plus a validation pass and a checkpoint every epoch and
TensorBoard scalars every 50 steps, and the non-finite watch, on_nonfinite=stop).

A third loop shows where the time goes: `hand-written` is what a careful user writes without
a framework: batches gathered once per epoch, `loss.backward()`, `optimizer.step()`, nothing
else. Issue 21's targets: ringtrain faster than the tutorial, and at most 2x the hand-written
loop's time.

    python benchmarks/bench_tutorial_loop.py [--repeats 7] [--threads 1]

Prints each loop's seconds (best of N, interleaved), the learned w and b, and the ratios.
`no-ckpt` is ringtrain's job with trainer.checkpoint=false: what the durable saves cost.
`+1 callback` adds one empty user callback (an `on_step_end` that does nothing): its cost per
step is the difference over the job's 3 130 steps.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, Dataset

from ringtrain.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parent))  # EmptyCallback's module, by _target_


# --- the tutorial, as written (seed 000, section 3 and 4; prints removed) -------------------
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


def tutorial_loop() -> tuple[float, float, float]:
    batch_size, learning_rate, epochs = 32, 0.01, 10
    dataset = SimpleDataset(size=10000)
    dataloader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    model = SimpleModel()
    criterion = nn.MSELoss()
    optimizer = optim.SGD(model.parameters(), lr=learning_rate)
    start_time = time.perf_counter()
    for epoch in range(epochs):
        running_loss = 0.0
        for i, (inputs, labels) in enumerate(dataloader):
            optimizer.zero_grad()
            outputs = model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            if i % 100 == 99:
                running_loss = 0.0
    total_time = time.perf_counter() - start_time
    return total_time, model.linear.weight.item(), model.linear.bias.item()


# --- without a framework: batches gathered per epoch, nothing else -------------------------------
def hand_written_loop() -> tuple[float, float, float]:
    dataset = SimpleDataset(size=10000)
    model = SimpleModel()
    optimizer = optim.SGD(model.parameters(), lr=0.01, foreach=False)
    params = list(model.parameters())
    start_time = time.perf_counter()
    for epoch in range(10):
        order = torch.randperm(len(dataset))
        inputs, labels = dataset.x[order], dataset.y[order]
        for x, y in zip(inputs.split(32), labels.split(32)):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            for p in params:
                p.grad = None
    total_time = time.perf_counter() - start_time
    return total_time, model.linear.weight.item(), model.linear.bias.item()


# --- ringtrain's default job ------------------------------------------------------------------
class EmptyCallback(Callback):
    """A user's callback that does nothing at every step: what the hook call itself costs."""

    def on_step_end(self, run, step) -> None:
        pass


def ringtrain_default_job(*overrides: str) -> tuple[float, float, float]:
    from hydra import compose, initialize_config_dir

    from ringtrain.config import register_resolvers
    from ringtrain.config.schema import validate
    from ringtrain.run import train_rank

    register_resolvers()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["trainer.progress_bar=false", *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        result = train_rank(validate(cfg), run_dir, return_weights=True)
        weights = result.model_state
    return result.train_seconds, weights["linear.weight"].item(), weights["linear.bias"].item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    logging.disable(logging.INFO)  # ringtrain's per-epoch log lines
    loops = {
        "tutorial": tutorial_loop, "ringtrain": ringtrain_default_job,
        # The same job without its per-epoch checkpoints: what the saves cost, apart.
        "no-ckpt": lambda: ringtrain_default_job("trainer.checkpoint=false"),
        "+1 callback": lambda: ringtrain_default_job("+callbacks.empty._target_=bench_tutorial_loop.EmptyCallback"),
        "hand-written": hand_written_loop,
    }
    results = {name: [] for name in loops}
    for _ in range(args.repeats):  # interleaved, so drifting machine load hits all alike
        for name, loop in loops.items():
            results[name].append(loop())
    print(f"torch {torch.__version__}, {args.threads} thread(s), best of {args.repeats}")
    best = {}
    for name, runs in results.items():
        times = [r[0] for r in runs]
        best[name] = min(times)
        _, w, b = runs[-1]
        print(f"{name:12s} loop {best[name]:6.3f} s (median {statistics.median(times):6.3f})  w={w:.4f} b={b:.4f}")
    for name in ("ringtrain", "no-ckpt"):
        print(f"{name}: {best[name] / best['tutorial']:.2f}x the tutorial's time, "
              f"{best[name] / best['hand-written']:.2f}x the hand-written loop's")
    steps = 10 * 313
    print(f"one empty callback: {(best['+1 callback'] - best['ringtrain']) / steps * 1e6:+.2f} us per step "
          f"(best of each; {steps} steps)")


if __name__ == "__main__":
    main()
