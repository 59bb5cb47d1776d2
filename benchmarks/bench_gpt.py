"""GPT training throughput on one device: ringtrain against a hand-written loop, Lightning and
HF Accelerate, in one process.

Every row trains the same model (models/transformer.py in `experiment=gpt2_small`'s shape:
12 layers x 12 heads x 768, 1024 context, 50304-token vocabulary, no biases, no dropout) on
the same synthetic tokens (data/tokens.py), batch 16, AdamW (lr 6e-4, betas 0.9/0.95, weight
decay 0.1 on matrices), gradient clipping at 1.0, bf16 autocast, no gradient accumulation:

  ringtrain eager        `experiment=gpt2_small`, ringtrain's own loop (trainer.run.train_rank;
  ringtrain compiled     fused AdamW), checkpoints off, evaluation and the train-loss
                         read only after the last timed step; the second row adds trainer.compile
  ringtrain compiled     (each block compiled, trainer.compile_scope=regional, the default),
    whole                the third compiles the whole model (compile_scope=whole), as the raw loop
  raw loop eager         a hand-written loop: batches gathered from the token tensor, pinned and
                         copied non-blocking, autocast, backward, clip, fused AdamW (as ringtrain's)
  raw loop compiled      the same with torch.compile(model)
  Lightning              lightning.Trainer(precision="bf16-mixed", gradient_clip_val=1.0), a
                         DataLoader with pinned memory, AdamW foreach (Lightning refuses clipping
                         with a fused optimizer); skipped when lightning is missing
  Accelerate             Accelerator(mixed_precision="bf16"), prepare(), accelerator.backward,
                         accelerator.clip_grad_norm_, fused AdamW on CUDA; skipped when
                         accelerate is missing

Each row runs `--warmup` optimizer steps (compilation happens there), then `--windows` windows
of `--steps` steps, each timed between two device synchronisations; the fastest window counts
(a shared machine's load only ever slows a window down). `--rounds 2` or more runs the rows
again in reverse order (a GPU's clocks favour no row) and keeps each row's best. Printed per row: tokens/s, ms/step, MFU (from the
model's flops_per_token() and the device's peak, trainer/callbacks/metrics.py, or --peak-tflops),
peak GPU memory, and the ratio to the faster raw loop. `--profile DIR` profiles the last 2
warm-up steps of each row in the first round (torch.profiler; traces to DIR) and prints, per
step, what ringtrain's eager and compiled rows run that the raw loop's do not: wall and kernel
time, kernels by time, CPU-side ops and CUDA runtime calls by count.

    python benchmarks/bench_gpt.py              # a GPU; --warmup 10 --steps 50 --windows 3
    python benchmarks/bench_gpt.py --tiny       # CPU: a tiny GPT in float32, < 1 minute;
                                                # --warmup 3 --steps 20 --windows 5
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]

from ringtrain.callbacks.metrics import gpu_peaks, peak_tflops_for  # noqa: E402
from ringtrain.data.tokens import MarkovTokens  # noqa: E402
from ringtrain.models.transformer import Transformer  # noqa: E402
from ringtrain.optim import parameter_groups  # noqa: E402

GPT2_SMALL = dict(vocab_size=50304, block_size=1024, n_layers=12, n_heads=12, d_model=768)
TINY = dict(vocab_size=256, block_size=64, n_layers=2, n_heads=2, d_model=64)
LR, BETAS, WEIGHT_DECAY, CLIP = 6e-4, (0.9, 0.95), 0.1, 1.0


@dataclass
class Setup:
    shape: dict
    batch_size: int
    precision: str  # ringtrain's name: "bf16-mixed" or "32"
    device: torch.device
    warmup: int
    steps: int  # per timed window
    windows: int
    compile_mode: str = "default"  # torch.compile's mode for every compiled row (--compile-mode)
    profile: Path | None = None  # where the profiled steps' traces go (--profile)
    profiling: str | None = None  # the row whose warm-up ends with PROFILED profiled steps
    profiles: dict = field(default_factory=dict)  # row: StepProfile
    row_started: float = 0.0  # perf_counter() at the start of the row running now

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps * self.windows

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.shape["block_size"]

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def model(self) -> Transformer:
        torch.manual_seed(0)
        return Transformer(**self.shape, dropout=0.0, bias=False).to(self.device)

    def optimizer(self, model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameter_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, fused=fused or None)

    def data(self) -> MarkovTokens:
        """The tokens ringtrain's data=tokens builds for the same overrides."""
        block = self.shape["block_size"]
        tokens = MarkovTokens(vocab_size=self.shape["vocab_size"], seq_len=block,
                              num_train_tokens=(self.total_steps + 1) * self.tokens_per_step,
                              num_val_tokens=self.tokens_per_step)
        tokens.setup()
        return tokens


class StepClock:
    """Wall time of each window of `steps` steps after the warm-up, between device syncs. With
    --profile, the last PROFILED warm-up steps (compiled by then, outside every timed window)
    run under torch.profiler and leave a StepProfile in `setup.profiles`."""

    def __init__(self, setup: Setup):
        self.setup, self.done, self.marks = setup, 0, []
        self.first_step = 0.0  # seconds from the row's start (setup.row_started) to its first step's end
        self.profiler: torch.profiler.profile | None = None

    def _sync(self) -> None:
        if self.setup.device.type == "cuda":
            torch.cuda.synchronize(self.setup.device)

    def step_done(self) -> None:
        self.done += 1
        setup = self.setup
        if self.done == 1:
            self._sync()
            self.first_step = time.perf_counter() - setup.row_started
        if setup.profiling and self.done == setup.warmup - PROFILED:
            self._sync()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if setup.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.profile_start = time.perf_counter()
        if self.profiler is not None and self.done == setup.warmup:
            self._sync()
            wall = time.perf_counter() - self.profile_start
            self.profiler.stop()
            setup.profiles[setup.profiling] = StepProfile.of(self.profiler, wall, setup)
            self.profiler = None
        after_warmup = self.done - setup.warmup
        if after_warmup >= 0 and after_warmup % setup.steps == 0:
            self._sync()
            self.marks.append(time.perf_counter())

    @property
    def seconds(self) -> list[float]:
        """Each window's seconds."""
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


PROFILED = 2  # steps under the profiler, at the end of each row's warm-up (--profile)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass
class StepProfile:
    """One row's profiled steps, per step: the wall time, the GPU's kernel time, the kernels
    by name (count, microseconds) and the CPU-side ops by name (count)."""

    wall_ms: float
    kernel_ms: float
    kernels: dict  # name: [count, us] per step
    ops: dict  # name: count per step (aten ops, CUDA runtime calls, Python-side record_function ranges)

    @classmethod
    def of(cls, profiler: torch.profiler.profile, wall: float, setup: Setup) -> "StepProfile":
        from torch.autograd import DeviceType

        kernels: dict = {}
        ops: dict = {}
        for event in profiler.events():
            if event.device_type == DeviceType.CUDA:
                entry = kernels.setdefault(event.name, [0, 0.0])
                entry[0] += 1 / PROFILED
                entry[1] += event.time_range.elapsed_us() / PROFILED
            else:
                ops[event.name] = ops.get(event.name, 0) + 1 / PROFILED
        if setup.profile is not None:
            setup.profile.mkdir(parents=True, exist_ok=True)
            trace = setup.profile / f"trace_{setup.profiling.replace(' ', '_')}.json"
            profiler.export_chrome_trace(str(trace))
            with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
            trace.unlink()
        return cls(wall_ms=wall * 1e3 / PROFILED, kernel_ms=sum(us for _, us in kernels.values()) / 1e3,
                   kernels=kernels, ops=ops)

    def summary(self) -> str:
        launches = sum(n for name, n in self.ops.items() if name.startswith(("cudaLaunch", "cuLaunch")))
        syncs = sum(n for name, n in self.ops.items() if name.startswith(SYNCS))
        return (f"{self.wall_ms:.2f} ms wall, {self.kernel_ms:.2f} ms of kernels "
                f"({sum(n for n, _ in self.kernels.values()):.0f} kernels, {launches:.0f} launches, "
                f"{syncs:.0f} sync or blocking-copy calls) per step")


def print_profile_differences(profiles: dict) -> None:
    """What each ringtrain row runs that its raw loop does not, per step: kernels by time,
    then CPU-side ops by count."""
    for row in [row for row in profiles if row.startswith("ringtrain")]:
        mode = "eager" if row.endswith("eager") else "compiled"
        ours, raw = profiles[row], profiles.get(f"raw loop {mode}")
        if raw is None:
            continue
        mode = row.removeprefix("ringtrain ")
        print(f"\nprofile, {mode}: ringtrain {ours.summary()}")
        print(f"profile, {mode}: raw loop  {raw.summary()}")
        names = set(ours.kernels) | set(raw.kernels)
        rows = sorted(((ours.kernels.get(n, [0, 0])[1] - raw.kernels.get(n, [0, 0])[1], n) for n in names), reverse=True)
        print(f"kernels whose time per step differs most (ringtrain - raw, us; count ringtrain/raw):")
        for delta, name in [r for r in rows if abs(r[0]) >= 5][:12] + [r for r in rows if r[0] <= -5][-4:]:
            print(f"  {delta:+9.1f} us  {ours.kernels.get(name, [0])[0]:4.0f}/{raw.kernels.get(name, [0])[0]:<4.0f} {name[:110]}")
        extra = sorted(((ours.ops.get(n, 0) - raw.ops.get(n, 0), n) for n in set(ours.ops) | set(raw.ops)), reverse=True)
        print("CPU-side ops ringtrain calls more often per step (count ringtrain/raw):")
        for delta, name in [e for e in extra if e[0] >= 1][:25]:
            print(f"  {delta:+6.0f}  {ours.ops.get(name, 0):5.0f}/{raw.ops.get(name, 0):<5.0f} {name[:100]}")
        fewer = [e for e in extra if e[0] <= -1][-10:]
        if fewer:
            print("... and less often:", ", ".join(f"{name[:60]} ({delta:+.0f})" for delta, name in fewer))


# --- the rows --------------------------------------------------------------------------------


def ringtrain_row(setup: Setup, compile: bool, scope: str = "regional") -> "StepClock":
    from hydra import compose, initialize_config_dir

    from ringtrain.callbacks import Callback
    from ringtrain.config import register_resolvers
    from ringtrain.config.schema import validate
    from ringtrain.run import train_rank

    register_resolvers()

    shape, total = setup.shape, setup.total_steps
    overrides = [
        "experiment=gpt2_small", f"trainer.compile={str(compile).lower()}", f"trainer.precision={setup.precision}",
        f"trainer.accelerator={setup.device.type}", f"trainer.batch_size={setup.batch_size}", f"trainer.max_steps={total}",
        "trainer.checkpoint=false", "trainer.progress_bar=false", "trainer.limit_val_batches=1",
        f"trainer.eval_every_n_steps={total}", f"trainer.log_every_n_steps={total}",
        f"model.block_size={shape['block_size']}", f"model.n_layers={shape['n_layers']}",
        f"model.n_heads={shape['n_heads']}", f"model.d_model={shape['d_model']}", f"data.vocab_size={shape['vocab_size']}",
        f"data.num_train_tokens={(total + 1) * setup.tokens_per_step}", f"data.num_val_tokens={setup.tokens_per_step}",
        f"optimizer.lr={LR}", f"trainer.grad_clip_norm={CLIP}", f"trainer.compile_scope={scope}",
        f"trainer.compile_mode={setup.compile_mode}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        job = validate(compose(config_name="train", overrides=overrides))
    clock = StepClock(setup)

    class Clock(Callback):  # the step's end, as the raw loop's clock reads it
        def on_step_end(self, run, step):
            clock.step_done()

    job.callbacks["clock"] = Clock()
    with tempfile.TemporaryDirectory() as run_dir:
        train_rank(job, run_dir)
    return clock


def raw_loop_row(setup: Setup, compile: bool) -> "StepClock":
    windows = setup.data().train.windows
    model = setup.model()
    on_cuda = setup.device.type == "cuda"
    optimizer = setup.optimizer(model, fused=True)  # ringtrain's own choice on CUDA and CPU (optim.py)
    mode = None if setup.compile_mode == "default" else setup.compile_mode
    forward = torch.compile(model, mode=mode) if compile else model
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    clock = StepClock(setup)
    for step in range(setup.total_steps):
        batch = windows[order[step * setup.batch_size : (step + 1) * setup.batch_size]]
        if on_cuda:
            batch = batch.pin_memory()
        batch = batch.to(setup.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with setup.autocast():
            logits = forward(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step_done()
    loss.item()  # the loss a loop prints, read once at the end as ringtrain's row does
    return clock


def _token_loader(setup: Setup) -> torch.utils.data.DataLoader:
    dataset = setup.data().train
    return torch.utils.data.DataLoader(dataset, batch_size=setup.batch_size, shuffle=True, drop_last=True,
                                       pin_memory=setup.device.type == "cuda",
                                       generator=torch.Generator().manual_seed(0))


def lightning_row(setup: Setup) -> "StepClock":
    import lightning as L

    class GPTModule(L.LightningModule):
        def __init__(self, model: Transformer):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs).flatten(0, 1), targets.flatten())

        def configure_optimizers(self):
            # foreach, not fused: Lightning refuses gradient clipping with a fused optimizer
            # under its mixed-precision plugin (bf16 included).
            return setup.optimizer(self.model, fused=False)

    clock = StepClock(setup)

    class Clock(L.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            clock.step_done()

    trainer = L.Trainer(
        accelerator="gpu" if setup.device.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if setup.precision == "bf16-mixed" else "32-true",
        max_steps=setup.total_steps, gradient_clip_val=CLIP, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Clock()],
    )
    trainer.fit(GPTModule(setup.model()), _token_loader(setup))
    return clock


def accelerate_row(setup: Setup) -> "StepClock":
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16" if setup.precision == "bf16-mixed" else "no",
                              cpu=setup.device.type == "cpu")
    model = setup.model()
    optimizer = setup.optimizer(model, fused=setup.device.type == "cuda")
    model, optimizer, loader = accelerator.prepare(model, optimizer, _token_loader(setup))
    clock = StepClock(setup)
    steps = 0
    while steps < setup.total_steps:
        for inputs, targets in loader:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.step_done()
            steps += 1
            if steps == setup.total_steps:
                break
    loss.item()
    return clock


ROWS: dict[str, tuple[str | None, Callable[[Setup], "StepClock"]]] = {
    # name: (package it needs, the row)
    "ringtrain eager": (None, lambda s: ringtrain_row(s, compile=False)),
    "ringtrain compiled": (None, lambda s: ringtrain_row(s, compile=True)),
    "ringtrain compiled whole": (None, lambda s: ringtrain_row(s, compile=True, scope="whole")),
    "raw loop eager": (None, lambda s: raw_loop_row(s, compile=False)),
    "raw loop compiled": (None, lambda s: raw_loop_row(s, compile=True)),
    "Lightning": ("lightning", lightning_row),
    "Accelerate": ("accelerate", accelerate_row),
}
RAW_ROWS = ("raw loop eager", "raw loop compiled")


def _missing(package: str | None) -> str | None:
    if package is None:
        return None
    try:
        __import__(package)
    except Exception as error:  # not installed, or built for another torch
        return f"skipped: {package} cannot be imported ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
    return None


def _peak_tflops(setup: Setup, given: float) -> float | None:
    if given:
        return given
    if setup.device.type != "cuda":
        return None
    peaks = gpu_peaks(torch.cuda.get_device_name(setup.device))
    return peak_tflops_for(peaks, setup.precision, tf32=True) if peaks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT in float32 on the CPU, under a minute")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 10, --tiny 3)")
    parser.add_argument("--steps", type=int, help="steps per timed window (default 50, --tiny 20)")
    parser.add_argument("--windows", type=int, help="timed windows; the fastest counts (default 3, --tiny 5)")
    parser.add_argument("--batch-size", type=int, help="default 16, --tiny 8")
    parser.add_argument("--precision", choices=["32", "bf16-mixed"], help="default bf16-mixed, --tiny 32")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak for MFU; 0: look the GPU up")
    parser.add_argument("--rows", nargs="*", choices=list(ROWS), help="only these rows")
    parser.add_argument("--compile-mode", default="default", help="torch.compile's mode in the compiled rows, e.g. "
                        "max-autotune-no-cudagraphs (ringtrain's trainer.compile_mode)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help=f"profile the last {PROFILED} warm-up steps of each row in the first round; "
                             "print what ringtrain's steps run that the raw loop's do not; traces go to DIR")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the rows this often, alternately forward and reversed; each keeps its best")
    args = parser.parse_args()

    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --tiny for the CPU version")
    device = torch.device("cpu" if args.tiny else "cuda")
    setup = Setup(
        shape=TINY if args.tiny else GPT2_SMALL, batch_size=args.batch_size or (8 if args.tiny else 16),
        precision=args.precision or ("32" if args.tiny else "bf16-mixed"), device=device,
        warmup=args.warmup if args.warmup is not None else (3 if args.tiny else 10),
        steps=args.steps or (20 if args.tiny else 50), windows=args.windows or (5 if args.tiny else 3),
        profile=args.profile, compile_mode=args.compile_mode,
    )
    if args.profile is not None and setup.warmup < PROFILED + 2:
        parser.error(f"--profile profiles the last {PROFILED} warm-up steps: give --warmup {PROFILED + 2} or more")
    if setup.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # ringtrain's trainer.tf32 default, for every row
    logging.disable(logging.WARNING)  # ringtrain's, Lightning's and Accelerate's INFO/WARNING lines
    warnings.filterwarnings("ignore")  # e.g. Lightning's advice about DataLoader workers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    flops_per_token = Transformer(**setup.shape).flops_per_token()
    peak = _peak_tflops(setup, args.peak_tflops)
    print(f"device {name}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"model {setup.shape}, batch {setup.batch_size} x {setup.shape['block_size']} tokens, "
          f"precision {setup.precision}, per row {setup.warmup} warm-up steps, then the fastest of "
          f"{setup.windows} windows of {setup.steps} steps; compile mode {setup.compile_mode}; "
          f"peak {f'{peak:g} TFLOP/s' if peak else 'unknown (no MFU)'}")

    results: dict[str, float | str] = {}
    row_caches: dict[str, str] = {}
    chosen = [row for row in ROWS if not args.rows or row in args.rows]
    for round_ in range(args.rounds):
        # Later rounds run the rows in reverse order, then forward again: a device that warms
        # up or throttles over the run favours no row. Each row keeps its best round.
        for row in chosen if round_ % 2 == 0 else chosen[::-1]:
            package, run_row = ROWS[row]
            if isinstance(results.get(row), str):
                continue
            if skip := _missing(package):
                results[row] = skip
                continue
            torch.compiler.reset()  # every compiled row compiles from the same state
            # ... and its first round from empty on-disk caches (its first step's time is compile time)
            caches = row_caches.setdefault(row, tempfile.mkdtemp(prefix="bench_gpt_cache_"))
            os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = f"{caches}/inductor", f"{caches}/triton"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            profiled = args.profile is not None and round_ == 0 and row.startswith(("ringtrain", "raw"))
            setup.profiling = row if profiled else None
            try:
                setup.row_started = time.perf_counter()
                clock = run_row(setup)
                seconds = min(clock.seconds)
            except Exception as error:  # one row's failure is a result too; the others still run
                results[row] = f"failed: {type(error).__name__}: {' '.join(str(error).split())[:120]}"
                print(f"{row}: {results[row]}", flush=True)
                continue
            memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            speed = setup.steps * setup.tokens_per_step / seconds
            results[row] = max(speed, results.get(row, 0.0))
            results[row + " memory"] = memory
            results.setdefault(row + " first step", clock.first_step)  # the first round's: compile caches empty
            print(f"round {round_ + 1} {row}: {speed:,.0f} tok/s, first step after {clock.first_step:.1f} s", flush=True)  # the table comes last
        if round_ == 0:
            print_profile_differences(setup.profiles)  # before later rounds: a deadline may cut them

    raw = [results[r] for r in RAW_ROWS if isinstance(results.get(r), float)]
    best_raw = max(raw) if raw else None
    print()
    print("| row | tok/s | ms/step | MFU | peak memory | vs best raw loop | first step (round 1) |")
    print("|---|---|---|---|---|---|---|")
    for row in ROWS:
        if row not in results:
            continue
        value = results[row]
        if isinstance(value, str):
            print(f"| {row} | {value} | | | | | |")
            continue
        ms = setup.tokens_per_step / value * 1e3
        mfu = f"{100 * flops_per_token * value / (peak * 1e12):.1f} %" if peak else "-"
        memory = results[row + " memory"]
        memory_text = f"{memory:.2f} GiB" if memory is not None else "-"
        ratio = f"{value / best_raw:.2f}x" if best_raw else "-"
        print(f"| {row} | {value:,.0f} | {ms:.1f} | {mfu} | {memory_text} | {ratio} | {results[row + ' first step']:.1f} s |")


if __name__ == "__main__":
    main()
