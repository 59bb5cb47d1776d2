"""What a run measures and logs: the loss and the gradient norm (TrainMetrics), the learning rate
(LearningRateMonitor), a streamed data set's mixture and passes (StreamMetrics), the speed
(Throughput: at every logging step, samples/s and tokens/s of all ranks together, ms per step,
MFU and peak GPU memory), and where the time goes (Profiler).

MFU (model FLOPs utilisation, PaLM's definition, as nanoGPT and torchtitan report it) is

    model.flops_per_token() x tokens/s  /  (peak FLOP/s of one device x devices)

where tokens/s is the global rate all ranks together reach, `flops_per_token()` is the model's
own training-FLOPs estimate (models/transformer.py: 6N + attention), and the peak is
`trainer.peak_tflops` when set, else GPU_PEAKS's for the GPU and precision; lacking either, no MFU.

Everything here reads host-side values (a wall clock, sample counts, the caching allocator's
statistics): a step costs nothing on the device, a logging step one small all-reduce.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from ringtrain.callbacks import Callback, Run, StepEnd
from ringtrain.distributed import all_reduce_sum

log = logging.getLogger("ringtrain")


class TrainMetrics(Callback):
    """train/loss over the steps since the last logging step, on every rank together (one
    all-reduce at a logging step); grad_norm; train/skipped_steps once an update was skipped
    (non-finite values, float16 overflow).

    The losses stay detached tensors on the device until a logging step sums them, so a step
    costs no host synchronisation and no arithmetic; the logged loss weighs every sample, or
    every token (StepEnd.summed: labels -100 not counted), alike."""

    def __init__(self) -> None:
        self._steps: list[tuple[list[tuple[torch.Tensor, object]], bool]] = []  # (losses, summed) since the last log

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        self._steps.append((step.losses, step.summed))
        if not step.logging:
            return
        # A few ops for all the steps since the last read, not a few per step (50 steps of the
        # default job: ~0.5 ms a loop's worth of tiny tensor ops, ~10 us a step amortised).
        losses, weights, summed = zip(*[(*entry, summed) for entries, summed in self._steps for entry in entries])
        self._steps = []
        losses = torch.stack(losses).reshape(len(weights)).double()  # one value each
        if any(isinstance(weight, torch.Tensor) for weight in weights):  # token counts (tensors), else sample counts
            weights = torch.stack([torch.as_tensor(w, device=losses.device).reshape(()) for w in weights]).double()
        else:
            weights = torch.tensor(weights, dtype=torch.float64, device=losses.device)
        summed = torch.tensor(summed, device=losses.device)
        total, count = torch.where(summed, losses, losses * weights).sum(), weights.sum()
        total, count = all_reduce_sum(run.dist, torch.stack([total, count]).to(run.dist.device)).tolist()
        values = {"train/loss": total / max(count, 1.0)}
        if step.grad_norm is not None:
            values["grad_norm"] = float(step.grad_norm)
        if run.skipped_steps:
            values["train/skipped_steps"] = run.skipped_steps
        run.log(values)


class LearningRateMonitor(Callback):
    """The learning rate at each logging step: `lr`, and `lr-group<i>` for every further
    parameter group whose rate differs (Lightning's LearningRateMonitor)."""

    rank_zero_only = logging_steps_only = True

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        rates = [group["lr"] for group in run.optimizer.param_groups]
        run.log({"lr": step.lr, **{f"lr-group{i}": rate for i, rate in enumerate(rates) if i and rate != rates[0]}})


class StreamMetrics(Callback):
    """At each logging step, for a streamed training set (loop/streams.py) that can say them:
    each source's share of the samples drawn so far by every rank, `data/mix/<source>` (a
    mixture's `drawn_counts`), and the passes over the data every reader has completed,
    `data/epochs` (`completed_epochs`). Nothing for a map-style data set."""

    logging_steps_only = True

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        dataset = getattr(run.train_loader, "dataset", None)
        drawn, epochs = getattr(dataset, "drawn_counts", None), getattr(dataset, "completed_epochs", None)
        if not callable(getattr(run.train_loader, "state_dict", None)) or not (drawn or epochs):
            return
        state, values = run.train_loader.state_dict(), {}
        if callable(drawn):
            counts = drawn(state)  # this rank's readers; every rank's summed
            totals = all_reduce_sum(run.dist, torch.tensor([float(counts[n]) for n in counts], device=run.dist.device))
            values = {f"data/mix/{name}": share for name, share in zip(counts, (totals / totals.sum().clamp(min=1)).tolist())}
        if callable(epochs):
            values["data/epochs"] = epochs(state)
        run.log(values)


@dataclass(frozen=True)
class PeakTFLOPS:
    """Dense (no 2:4 sparsity) peak TFLOP/s of one GPU, from NVIDIA's data sheets.

    bf16 / fp16 are tensor-core rates with float32 accumulation (what PyTorch's matmuls use;
    GeForce cards run fp16-accumulate at twice that). None: the GPU has no such unit.
    """

    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float


# (pattern matched against the lower-cased device name, peaks), first match wins: the more
# specific names come before the ones they contain ("h100 nvl" before "h100").
GPU_PEAKS: list[tuple[str, PeakTFLOPS]] = [
    (r"h[12]00.*nvl", PeakTFLOPS(bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0)),
    (r"h100.*pcie", PeakTFLOPS(bf16=756.0, fp16=756.0, tf32=378.0, fp32=51.2)),
    (r"h[12]00", PeakTFLOPS(bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9)),  # SXM ("H100 80GB HBM3"); H200: H100's compute
    (r"a100", PeakTFLOPS(bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5)),  # SXM and PCIe alike
    (r"l40s", PeakTFLOPS(bf16=362.1, fp16=362.1, tf32=183.0, fp32=91.6)),
    (r"\bl4\b", PeakTFLOPS(bf16=121.0, fp16=121.0, tf32=60.0, fp32=30.3)),
    # A10's data sheet; AWS's A10G is a variant with the same GA102 tensor cores.
    (r"\ba10g?\b", PeakTFLOPS(bf16=125.0, fp16=125.0, tf32=62.5, fp32=31.2)),
    (r"rtx 4090", PeakTFLOPS(bf16=165.2, fp16=165.2, tf32=82.6, fp32=82.6)),
    (r"rtx 3090", PeakTFLOPS(bf16=71.0, fp16=71.0, tf32=35.6, fp32=35.6)),
    (r"v100s", PeakTFLOPS(bf16=None, fp16=130.0, tf32=None, fp32=16.4)),
    (r"v100.*pcie", PeakTFLOPS(bf16=None, fp16=112.0, tf32=None, fp32=14.0)),
    (r"v100", PeakTFLOPS(bf16=None, fp16=125.0, tf32=None, fp32=15.7)),  # SXM2
    (r"\bt4\b", PeakTFLOPS(bf16=None, fp16=65.0, tf32=None, fp32=8.1)),
]


def gpu_peaks(device_name: str) -> PeakTFLOPS | None:
    """The peaks of the GPU `torch.cuda.get_device_name()` calls `device_name`, if known."""
    return next((peaks for pattern, peaks in GPU_PEAKS if re.search(pattern, device_name.lower())), None)


def peak_tflops_for(peaks: PeakTFLOPS, precision: str, tf32: bool) -> float | None:
    """The peak that bounds a run in `precision` (trainer.precision) on that GPU."""
    if precision == "bf16-mixed":
        return peaks.bf16
    if precision == "16-mixed":
        return peaks.fp16
    return peaks.tf32 if tf32 and peaks.tf32 else peaks.fp32


class Throughput(Callback):
    def on_fit_start(self, run: Run) -> None:
        self.samples = self.tokens = 0
        self.last_step, self.since = run.step, time.perf_counter()
        self.flops_per_token, self.peak_flops = _flops(run)

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        self.samples += step.samples
        self.tokens += step.tokens
        if not step.logging:
            return
        now = time.perf_counter()
        counts = all_reduce_sum(run.dist, torch.tensor([float(self.samples), float(self.tokens)], device=run.dist.device))
        samples, tokens = counts.tolist()
        seconds = max(now - self.since, 1e-9)
        speed = {"throughput/samples_per_sec": samples / seconds,
                 "throughput/step_ms": seconds * 1e3 / max(step.step - self.last_step, 1)}
        if tokens:
            speed["throughput/tokens_per_sec"] = tokens / seconds
            if self.flops_per_token and self.peak_flops:
                speed["throughput/mfu_percent"] = 100.0 * self.flops_per_token * tokens / seconds / self.peak_flops
        if run.dist.device.type == "cuda":
            speed["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(run.dist.device) / 2**30
        run.log(speed)
        self.samples = self.tokens = 0
        self.last_step, self.since = step.step, now


def _flops(run: Run) -> tuple[float | None, float | None]:
    """(the model's flops_per_token(), the peak FLOP/s of every device together), where known."""
    trainer, device = run.trainer, run.dist.device
    estimate = getattr(run.model, "flops_per_token", None)
    flops_per_token = float(estimate()) if callable(estimate) else None
    per_device = trainer.peak_tflops or None
    if per_device is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peaks = gpu_peaks(name)
        per_device = peak_tflops_for(peaks, trainer.precision, trainer.tf32) if peaks else None
        if per_device is None and flops_per_token is not None and run.dist.is_main:
            log.info(f"MFU not logged: no peak FLOP/s known for {name!r} in precision {trainer.precision}; "
                     f"set trainer.peak_tflops=<its dense TFLOP/s> to log it")
    if per_device is not None and flops_per_token is None and trainer.peak_tflops and run.dist.is_main:
        log.info(f"MFU not logged: {type(run.model).__name__} has no flops_per_token() method")
    devices = run.dist.world_size * (len(run.module.device_ids) if isinstance(run.module, nn.DataParallel) else 1)
    return flops_per_token, per_device * 1e12 * devices if per_device else None


class Profiler(Callback):
    """trainer.profile_steps > 0 (conf/debug/profiler.yaml): torch.profiler over that many steps
    after two to settle, on rank 0; the log names the trace and what opens it."""

    rank_zero_only = True

    def on_fit_start(self, run: Run) -> None:
        self.profiler = None
        self.logging_steps_only = not run.trainer.profile_steps  # without a profiler, nothing to step
        if not run.trainer.profile_steps:
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        steps, trace_dir = run.trainer.profile_steps, run.run_dir / "profiler"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.dist.device.type == "cuda" else [])
        write_trace = tensorboard_trace_handler(str(trace_dir), worker_name="rank0")

        def write_and_say_where(profiler) -> None:
            write_trace(profiler)  # names the file rank0.<time>.pt.trace.json
            trace = max(trace_dir.glob("rank0.*.pt.trace.json"), key=lambda p: p.stat().st_mtime_ns)
            log.info(f"profiler trace of {steps} steps: {trace}; open it with TensorBoard's PyTorch Profiler plugin "
                     f"(pip install torch-tb-profiler; tensorboard --logdir {run.run_dir}) or on https://ui.perfetto.dev")

        self.profiler = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                                on_trace_ready=write_and_say_where, record_shapes=True)
        self.profiler.start()

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_fit_end(self, run: Run, result_or_error: object) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    on_exception = on_fit_end
