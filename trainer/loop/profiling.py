"""trainer.profile_steps (debug=profiler): a torch.profiler trace of a few optimizer steps,
written where the run says, for TensorBoard's PyTorch Profiler plugin or Perfetto."""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from ringtrain.distributed import DistInfo

log = logging.getLogger("ringtrain")


def step_profiler(profile_steps: int, dist: DistInfo, run_dir: Path) -> contextlib.AbstractContextManager:
    """torch.profiler over `profile_steps` optimizer steps after two to settle (rank 0 only);
    the trace goes to <run dir>/profiler, for TensorBoard's PyTorch Profiler plugin or Perfetto."""
    if not (profile_steps and dist.is_main):
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device.type == "cuda" else [])
    trace_dir = run_dir / "profiler"
    write_trace = tensorboard_trace_handler(str(trace_dir), worker_name="rank0")

    def write_and_say_where(profiler) -> None:
        write_trace(profiler)  # names the file rank0.<time>.pt.trace.json
        trace = max(trace_dir.glob("rank0.*.pt.trace.json"), key=lambda p: p.stat().st_mtime_ns)
        log.info(f"profiler trace of {profile_steps} steps: {trace}; open it with TensorBoard's PyTorch Profiler "
                 f"plugin (pip install torch-tb-profiler; tensorboard --logdir {run_dir}) or on https://ui.perfetto.dev")

    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=profile_steps, repeat=1),
                   on_trace_ready=write_and_say_where, record_shapes=True)
