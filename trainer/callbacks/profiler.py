"""The Profiler callback (trainer.profile_steps, debug=profiler): a torch.profiler trace of a few
optimizer steps, for TensorBoard's PyTorch Profiler plugin or Perfetto."""
from __future__ import annotations

import logging

from ringtrain.callbacks.base import Callback, Run, StepEnd

log = logging.getLogger("ringtrain")


class Profiler(Callback):
    """trainer.profile_steps > 0: torch.profiler over that many steps after two to settle, on
    rank 0; the trace goes to <run dir>/profiler/rank0.<n>.pt.trace.json and the log names it."""

    rank_zero_only = True

    def on_fit_start(self, run: Run) -> None:
        self.profiler = None
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
