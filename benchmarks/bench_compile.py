"""Compile time and step time: ringtrain's regional and whole-model compile against a raw loop
that compiles the whole model, each a process of its own (issue 37).

Each variant trains the same Transformer (models/transformer.py, `model=transformer` with
`model.n_layers=N model.d_model=64`, batch 32 x 64 tokens of data=tokens) with the same AdamW
(fused, as ringtrain builds it) for 3 + S steps, in a fresh process with an empty inductor (and Triton) cache, as a first run
compiles:
  raw       a hand-written loop over `torch.compile(model)`;
  regional  `python train.py ... trainer.compile=true` (each block compiled, the default);
  whole     the same with `trainer.compile_scope=whole`.
Both sides read the loss after every step (the clock needs the step done, on a GPU too).
`first 3 steps` is the time from the process's launch to the end of its third step: imports,
start-up, data, model, compiling and the steps themselves. `step` is the median time of the
steps after the third, on the clock and in the process's CPU time (which other processes' load
on a shared machine leaves out, mostly). `--threads` (1 by default) sets OMP_NUM_THREADS for every variant: on a
shared CPU, OpenMP threads that spin-wait for each other make step times swing by 10x. The device is ringtrain's `trainer.accelerator=auto`: the GPU when one
is visible, else the CPU (inductor's C++ backend).

    python benchmarks/bench_compile.py [--layers 16 32] [--variants raw,regional,whole] [--steps 10] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringtrain.callbacks import Callback

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BATCH, LR, BETAS, DECAY, WIDTH = 32, 1e-3, (0.9, 0.95), 0.1, 64
FIRST = 3  # the steps the compile time is measured to


def raw_loop(layers: int, steps: int) -> None:
    """The child process of `raw`: a hand-written loop that compiles the whole model."""
    import torch
    import torch.nn.functional as F

    from ringtrain.data.tokens import MarkovTokens
    from ringtrain.models.transformer import Transformer
    from ringtrain.optim import parameter_groups

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = MarkovTokens(seq_len=64)  # data=tokens's defaults, as ringtrain's run
    data.setup()
    windows = data.train.windows
    torch.manual_seed(0)
    model = Transformer(vocab_size=64, block_size=64, n_layers=layers, n_heads=4, d_model=WIDTH, dropout=0.0).to(device)
    # ringtrain's optimizer=adamw on this device: fused (ringtrain/optim.py fused_by_default)
    optimizer = torch.optim.AdamW(parameter_groups(model, DECAY), lr=LR, betas=BETAS, fused=True)
    compiled = torch.compile(model)
    order = torch.randperm(len(windows))
    for step in range(1, steps + 1):
        window = windows[order[(step - 1) * BATCH: step * BATCH]].to(device)
        loss = F.cross_entropy(compiled(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"STEP {step} {time.time()!r} {time.process_time()!r} {loss.item()!r}", flush=True)


class StepClock(Callback):
    """A ringtrain callback for the child processes: the same line as the raw loop's, each step."""

    def on_step_end(self, run, end) -> None:
        print(f"STEP {end.step} {time.time()!r} {time.process_time()!r} {end.losses[0][0].item()!r}", flush=True)


def command(variant: str, layers: int, steps: int) -> list[str]:
    if variant == "raw":
        return [sys.executable, str(Path(__file__).resolve()), "--child-raw", str(layers), "--steps", str(steps)]
    return [sys.executable, str(REPO / "train.py"), "model=transformer", f"model.n_layers={layers}",
            f"model.d_model={WIDTH}", "optimizer=adamw", f"optimizer.lr={LR}", f"trainer.batch_size={BATCH}",
            f"trainer.max_steps={steps}", "trainer.compile=true", f"trainer.compile_scope={variant}",
            "trainer.checkpoint=false", "trainer.progress_bar=false", "trainer.limit_val_batches=1", "logger=[]",
            "+callbacks.step_clock={_target_: bench_compile.StepClock}"]


def measure(variant: str, layers: int, steps: int, threads: int) -> dict[str, float]:
    """One process of `variant`: seconds to the end of step 3, the median step after, the last loss."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(threads),
               "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor", "TRITON_CACHE_DIR": f"{scratch}/triton"}
        launched = time.time()
        proc = subprocess.run(command(variant, layers, steps), cwd=scratch, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{variant} with {layers} blocks failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    if "torch.compile failed" in proc.stdout + proc.stderr:
        sys.exit(f"{variant} with {layers} blocks fell back to eager:\n{proc.stderr[-3000:]}")
    ends = {int(step): (float(at), float(cpu), float(loss)) for _, step, at, cpu, loss in
            (line.split() for line in proc.stdout.splitlines() if line.startswith("STEP "))}
    step_times = [ends[k][0] - ends[k - 1][0] for k in range(FIRST + 1, steps + 1)]
    step_cpu = [ends[k][1] - ends[k - 1][1] for k in range(FIRST + 1, steps + 1)]
    return {"first": ends[FIRST][0] - launched, "step": statistics.median(step_times),
            "step_cpu": statistics.median(step_cpu), "loss": ends[steps][2], "steps": [ends[k][2] for k in sorted(ends)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--variants", default="raw,regional,whole")
    parser.add_argument("--steps", type=int, default=10, help="steps after the first 3, for the step time")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every variant (CPU)")
    parser.add_argument("--child-raw", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_raw:
        raw_loop(args.child_raw, args.steps)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"torch {torch.__version__}, {device}, OMP_NUM_THREADS={args.threads}; each variant a fresh process "
          f"with empty compile caches")
    variants = args.variants.split(",")
    for layers in args.layers:
        results = {variant: measure(variant, layers, FIRST + args.steps, args.threads) for variant in variants}
        for variant, r in results.items():
            finite = all(abs(loss) < float("inf") for loss in r["steps"])
            print(f"{layers:3d} blocks  {variant:9s} first 3 steps {r['first']:7.1f} s   step {r['step'] * 1e3:8.1f} ms"
                  f" (CPU {r['step_cpu'] * 1e3:8.1f} ms)"
                  f"   last loss {r['loss']:.4f}{'' if finite else '  NOT FINITE'}")
        for variant in ("regional", "whole"):
            if variant in results and "raw" in results:
                print(f"{layers:3d} blocks  {variant} / raw: first 3 steps {results[variant]['first'] / results['raw']['first']:.2f}x")
        if {"regional", "whole"} <= results.keys():
            r, w = results["regional"], results["whole"]
            print(f"{layers:3d} blocks  regional / whole: first 3 steps {r['first'] / w['first']:.2f}x, "
                  f"step {r['step'] / w['step']:.3f}x (CPU time {r['step_cpu'] / w['step_cpu']:.3f}x)")


if __name__ == "__main__":
    main()
