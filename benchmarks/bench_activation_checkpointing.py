"""Activation checkpointing (model.activation_checkpointing / trainer.activation_checkpointing):
how much a training step's peak memory drops, and what the recomputation costs in step time.

ringtrain's Transformer at a size where activations dominate the step (8 layers x 256 wide,
batch 8 x 512 tokens: about 7 M parameters, ~120 MiB with gradients and AdamW's moments, against
~1 GiB of activations), with and without recomputing each block in backward: the same switch
trainer.activation_checkpointing sets (tests/test_activation_checkpointing.py holds the two to
the same gradients).

What is measured, per case, in a fresh subprocess (so neither case inherits the other's heap):
- memory: after a warm-up step (AdamW's moments exist, gradients cleared) the process's resident
  set is the baseline; the peak over one more step (forward, backward, optimizer step) above it
  is what the step needs on top: activations, gradients, the recomputation's transients. On CPU
  the peak is the kernel's VmHWM, reset through /proc/self/clear_refs before the step, and glibc
  is told to map every allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so that a freed
  tensor leaves the resident set at once instead of staying in malloc's free lists. On CUDA it is
  torch.cuda.max_memory_allocated over memory_allocated before the step.
- time: `--repeats` other subprocesses, malloc as usual, each timing `--steps` steps of each case,
  alternating step by step (plain, checkpointed, plain, ...) on the one model (the switch is
  read at every forward), after a warm-up step of each: load from elsewhere on a shared machine
  then falls on both alike.

    python benchmarks/bench_activation_checkpointing.py            # --seq-len 512 --batch 8 --layers 8
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def worker(args: argparse.Namespace) -> dict:
    """One case in this process: {"device", "baseline", "peak", "step_seconds": [...]}, bytes."""
    import torch
    import torch.nn.functional as F

    from ringtrain.models.transformer import Transformer

    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.manual_seed(0)
    model = Transformer(vocab_size=args.vocab, block_size=args.seq_len, n_layers=args.layers, n_heads=args.heads,
                        d_model=args.d_model, dropout=0.0, activation_checkpointing=args.checkpointing).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def step() -> None:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: AdamW's moments, kernels chosen, pages touched
    synchronize()
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "parameters": sum(p.numel() for p in model.parameters()), "threads": torch.get_num_threads()}
    if args.measure == "memory":
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            step()
            synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            baseline = _status_kib("VmRSS") * 1024
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            step()
            peak = _status_kib("VmHWM") * 1024
        result.update(baseline=baseline, peak=peak)
    else:
        seconds: dict[str, list[float]] = {"plain": [], "checkpointed": []}
        model.config.activation_checkpointing = True
        step()  # the other case's warm-up
        for _ in range(args.steps):
            for name in seconds:
                model.config.activation_checkpointing = name == "checkpointed"
                synchronize()
                start = time.perf_counter()
                step()
                synchronize()
                seconds[name].append(time.perf_counter() - start)
        result["step_seconds"] = seconds
    return result


def run_case(args: argparse.Namespace, checkpointing: bool, measure: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if measure == "memory":
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, __file__, "--worker", "--measure", measure, *sys.argv[1:]]
    if checkpointing:
        command.append("--checkpointing")
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"the {'checkpointed' if checkpointing else 'plain'} case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    import torch

    return (f"{os.cpu_count()} CPUs ({cpu}), load average {load}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {date.today().isoformat()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each case per timing process")
    parser.add_argument("--repeats", type=int, default=2, help="timing processes")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure", choices=["memory", "time"], default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    print(f"machine: {machine()}")
    cases = {"plain": False, "checkpointed": True}
    memory = {name: run_case(args, flag, "memory") for name, flag in cases.items()}
    print(f"device: {memory['plain']['device']}; Transformer {args.layers} layers x {args.d_model} wide, "
          f"{args.heads} heads, vocab {args.vocab}: {memory['plain']['parameters'] / 1e6:.1f} M parameters, fp32, "
          f"AdamW; batch {args.batch} x {args.seq_len} tokens; {memory['plain']['threads']} torch threads\n")
    what = "allocated by torch" if memory["plain"]["device"] != "cpu" else "resident set (VmHWM)"
    print(f"peak memory of a step, {what}, MiB")
    print(f"{'case':>13} {'baseline':>9} {'peak':>9} {'step needs':>11}")
    for name, m in memory.items():
        print(f"{name:>13} {m['baseline'] / MIB:>9.0f} {m['peak'] / MIB:>9.0f} {(m['peak'] - m['baseline']) / MIB:>11.0f}")
    plain, checkpointed = memory["plain"], memory["checkpointed"]
    above = (checkpointed["peak"] - checkpointed["baseline"]) / (plain["peak"] - plain["baseline"])
    print(f"checkpointed / plain: what a step needs {above:.2f}x (cut {1 - above:.0%}), "
          f"the whole process's peak {checkpointed['peak'] / plain['peak']:.2f}x\n")

    timings: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, seconds in run_case(args, False, "time")["step_seconds"].items():
            timings[name] += seconds
    print(f"step time, s ({args.repeats} processes x {args.steps} steps per case, alternating step by step)")
    print(f"{'case':>13} {'best':>7} {'median':>7}")
    for name, seconds in timings.items():
        print(f"{name:>13} {min(seconds):>7.3f} {statistics.median(seconds):>7.3f}")
    best = min(timings["checkpointed"]) / min(timings["plain"])
    median = statistics.median(timings["checkpointed"]) / statistics.median(timings["plain"])
    print(f"checkpointed / plain: {best:.2f}x best, {median:.2f}x median (slowdown {median - 1:+.0%})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
