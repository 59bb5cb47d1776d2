"""How long a checkpoint save stops training: synchronous (trainer.async_checkpoint=false)
against background writes (true, the default).

Why: a synchronous save makes training wait for torch.save, the write and both fsyncs; a
background save only for the copy of the state to CPU memory, the file being written by a
thread while training goes on.

One process, the Transformer of benchmarks/bench_memory.py (8 layers x 512, vocab 8192:
29.5 M parameters, fp32, AdamW, so a checkpoint holds weights and two moments, ~340 MiB). The
real `CheckpointManager.save` (trainer/checkpoints/__init__.py) with the single strategy's
state gathering, in a temporary directory (keep_last_k=1).
Between two saves, `--steps` training steps on random tokens (the time a background write has;
a save that comes before the previous write finished waits for it, and that wait is counted
as stopped time). Each mode saves `--saves` times; the first save of each is a warm-up.
Reported: the median and best time `save` kept training stopped, the ratio, and the mean time
of the training steps between saves (with background saves a write runs beside them).

    python benchmarks/bench_checkpoint_stop.py [--saves 6] [--steps 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from ringtrain.checkpoints import CheckpointManager, Part  # noqa: E402
from ringtrain.distributed import DistInfo  # noqa: E402
from ringtrain.models.transformer import Transformer  # noqa: E402
from ringtrain.strategies import Single  # noqa: E402

CONFIG = dict(vocab_size=8192, block_size=128, n_layers=8, n_heads=8, d_model=512, dropout=0.0)


def _manager(directory: Path, background: bool) -> CheckpointManager:
    trainer = SimpleNamespace(keep_last_k=1, async_checkpoint=background, checkpoint=True, checkpoint_every_n_steps=0)
    return CheckpointManager(directory, trainer, DistInfo(rank=0, local_rank=0, world_size=1,
                                                          device=torch.device("cpu"), backend=None))


def _train_step(model, optimizer, generator, batch: int) -> float:
    started = time.perf_counter()
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["block_size"] + 1), generator=generator)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def measure(background: bool, saves: int, steps: int, batch: int) -> dict:
    """Stopped seconds per save (warm-up dropped) and mean step seconds between saves."""
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    strategy, step = Single(), 0
    stopped, step_seconds = [], []

    def state() -> dict:  # what the run registers: the strategy's weights and the rest (the manager adds format)
        return {**strategy.checkpoint_weights(model, optimizer, lambda: Path(directory) / f"step-{step}.shards"),
                "scheduler": {"last_epoch": step}, "progress": {"step": step}, "rng": [], "config": {"model": dict(CONFIG)}}

    with tempfile.TemporaryDirectory() as directory:
        checkpoints = _manager(Path(directory), background)
        checkpoints.register(state=Part(state, spread=True))
        for save in range(saves + 1):
            for _ in range(steps):
                step_seconds.append(_train_step(model, optimizer, generator, batch))
                step += 1
            started = time.perf_counter()
            checkpoints.save(step, best=False)
            stopped.append(time.perf_counter() - started)
        checkpoints.flush()
        written = torch.load(checkpoints.last, weights_only=True, mmap=True)
        exact = all(torch.equal(written["model"][k], v) for k, v in model.state_dict().items())
    return {"stopped": stopped[1:], "step": statistics.mean(step_seconds[steps:]), "exact": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=6, help="timed saves per mode (after one warm-up)")
    parser.add_argument("--steps", type=int, default=8, help="training steps between saves")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_params = sum(p.numel() for p in Transformer(**CONFIG).parameters())
    print(f"Transformer 8 layers x 512, vocab 8192: {n_params / 1e6:.1f} M parameters, fp32, AdamW; "
          f"one process, {args.threads} threads; {args.steps} steps between saves; median of {args.saves} saves\n")
    results = {mode: measure(mode == "background", args.saves, args.steps, args.batch)
               for mode in ("synchronous", "background")}
    header = f"{'save':>12} {'stopped, median (s)':>20} {'best (s)':>9} {'mean step (s)':>14} {'last.pt':>8}"
    print(header)
    print("-" * len(header))
    for mode, result in results.items():
        print(f"{mode:>12} {statistics.median(result['stopped']):>20.3f} {min(result['stopped']):>9.3f} "
              f"{result['step']:>14.3f} {'exact' if result['exact'] else 'DIFFERS':>8}")
    ratio = statistics.median(results["background"]["stopped"]) / statistics.median(results["synchronous"]["stopped"])
    print(f"\nbackground / synchronous stop: {ratio:.2f} (median)")


if __name__ == "__main__":
    main()
