"""DDP weak scaling in the shape of seed 003's table, plus the cost of the DDP wrapper itself.

Each job is a real `torchrun --standalone --nproc_per_node=N train.py strategy=ddp ...` with
a fixed per-rank batch (weak scaling: N ranks do N times the work per step). Throughput is
what ringtrain itself logs every 10 steps to TensorBoard, `throughput/tokens_per_sec` (or
samples): global (all-reduced over ranks) tokens per wall-clock second of that window. The
first window (start-up, first slow steps) is dropped and the median of the rest is taken, so a
passing hiccup of the machine does not decide the figure. Efficiency = throughput(N) / (N *
throughput(1)).

Every rank runs one CPU thread (OMP_NUM_THREADS=1, as torchrun sets for N > 1), so on a
machine with C cores the ideal holds up to N = C and beyond that ranks share cores.

    python benchmarks/bench_ddp_scaling.py [--procs 1 2 4 8] [--model transformer] [--steps 60]

Also prints `strategy=single` against `strategy=ddp` with one rank: what wrapping the model
in DDP (gradient hooks, bucketing, a 1-rank all-reduce) costs on one device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]

MODELS = {
    # model=transformer as configured: 2 layers, d_model 128, block 64; 32 x 64 tokens per rank and step
    "transformer": (["model=transformer", "optimizer=adamw"], "tokens", 32 * 64),
    "mlp": (["model=mlp"], "samples", 32),
}


def throughput(nprocs: int, strategy: str, model_args: list[str], unit: str, steps: int) -> float:
    """Median logged throughput of one job, first window dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as run_dir:
        args = model_args + [
            f"strategy={strategy}", f"trainer.max_steps={steps}", "trainer.log_every_n_steps=10",
            "trainer.checkpoint=false", "trainer.progress_bar=false", "trainer.limit_val_batches=1",
            f"hydra.run.dir={run_dir}",
        ]
        launcher = TORCHRUN + [f"--nproc_per_node={nprocs}"] if strategy == "ddp" else [sys.executable]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(launcher + [str(REPO / "train.py"), *args], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"job failed ({nprocs} procs, {strategy}):\n{proc.stderr[-3000:]}")
        windows = [e.value for e in EventAccumulator(run_dir).Reload().Scalars(f"throughput/{unit}_per_sec")]
    return statistics.median(windows[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--model", choices=sorted(MODELS), default="transformer")
    parser.add_argument("--steps", type=int, default=60, help="steps per job: 6 logged windows")
    args = parser.parse_args()
    model_args, unit, per_rank = MODELS[args.model]
    cores = os.cpu_count()

    print(f"model={args.model}, {per_rank} {unit} per rank and step, 1 thread per rank, {cores} CPU cores, gloo")
    print(f"{'procs':>5} {unit + '/s':>12} {'ms/step':>8} {'speed-up':>9} {'efficiency':>10}")
    base = None
    for n in args.procs:
        rate = throughput(n, "ddp", model_args, unit, args.steps)
        base = base or rate / n
        note = "" if n <= cores else f"   ({n} ranks share {cores} cores)"
        print(f"{n:>5} {rate:>12.0f} {n * per_rank / rate * 1e3:>8.1f} {rate / base:>8.2f}x "
              f"{rate / (n * base):>9.1%}{note}")

    single = throughput(1, "single", model_args, unit, args.steps)
    wrapped = throughput(1, "ddp", model_args, unit, args.steps)
    print(f"one device: strategy=single {single:.0f} {unit}/s, strategy=ddp (1 rank) {wrapped:.0f} {unit}/s, "
          f"DDP wrapper overhead {single / wrapped - 1:+.1%}")


if __name__ == "__main__":
    main()
