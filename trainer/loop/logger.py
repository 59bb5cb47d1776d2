"""What a run reports: TensorBoard scalars and hparams, the progress bar, and log lines.

Only rank 0 reports; on other ranks every method is a no-op, so the loop never asks
"am I rank 0?" itself. The event file lives directly in the run directory, so
`tensorboard --logdir <sweep dir>` shows every job of a sweep as its own run.
Scalar tags: train/loss, val/<metric>, lr, grad_norm, throughput/samples_per_sec,
throughput/tokens_per_sec, throughput/step_ms, throughput/mfu_percent (when known),
memory/peak_allocated_gib (CUDA).
At each logging step the console gets the train loss and speed: in the progress bar's
postfix when the bar is on, else as one log line (also in train.log).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

from ringtrain.checkpoints.atomic import write_text_atomically
from ringtrain.checkpoints.json_text import json_text

log = logging.getLogger("ringtrain")


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}, with values TensorBoard's hparams accept."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:  # lists, None
            out[name] = str(value)
    return out


def _speed_fields(values: dict[str, float]) -> dict[str, str]:
    """The speed figures of a logging step, short enough for a progress bar."""
    fields = {}
    if "throughput/tokens_per_sec" in values:
        fields["tok/s"] = _si(values["throughput/tokens_per_sec"])
    elif "throughput/samples_per_sec" in values:
        fields["samples/s"] = _si(values["throughput/samples_per_sec"])
    if "throughput/step_ms" in values:
        ms = values["throughput/step_ms"]
        fields["ms/step"] = f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"
    if "throughput/mfu_percent" in values:
        fields["mfu"] = f"{values['throughput/mfu_percent']:.1f}%"
    if "memory/peak_allocated_gib" in values:
        fields["mem"] = f"{values['memory/peak_allocated_gib']:.2f}GiB"
    return fields


def _si(value: float) -> str:
    """12345.6 -> "12.3k"."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


class RunLogger:
    """Use as a context manager: the event file is flushed and closed on every exit, errors too."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, progress_bar: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self.writer = None
        self.bar = None
        self._console = contextlib.ExitStack()
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.writer = SummaryWriter(log_dir=str(run_dir))
        if progress_bar:
            self.bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)
            # Console log lines go through tqdm.write, above the bar instead of through it.
            self._console.enter_context(logging_redirect_tqdm())

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def config(self, resolved: dict) -> None:
        if self.writer:
            text = json.dumps(resolved, indent=2, default=str)
            self.writer.add_text("config", "```\n" + text + "\n```", 0)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """All `values` at `step`, as one event: SummaryWriter.add_scalar writes an event per tag
        at about 0.1 ms each, which small models feel at every logging step."""
        if not self.writer:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self.writer.file_writer.add_summary(summary, step)
        if "train/loss" in values:
            self._show_training(values, step)

    def _show_training(self, values: dict[str, float], step: int) -> None:
        shown = {"loss": f"{values['train/loss']:.4g}", **_speed_fields(values)}
        if self.bar:
            self.bar.set_postfix(shown, refresh=False)
        else:
            log.info(f"step {step}: " + " ".join(f"{key}={value}" for key, value in shown.items()))

    def advance(self, steps: int) -> None:
        if self.bar:
            self.bar.update(steps)

    def info(self, message: str) -> None:
        if self.enabled:
            log.info(message)

    def warning(self, message: str) -> None:
        if self.enabled:
            log.warning(message)

    def error(self, message: str) -> None:
        if self.enabled:
            log.error(message)

    def hparams(self, resolved: dict, final_metrics: dict[str, float], step: int) -> None:
        """Record the run's hyperparameters and final metrics for TensorBoard's HPARAMS tab.

        Only the session records are written, no experiment record: TensorBoard then builds
        the experiment from all runs it finds, marks the hyperparameters whose values differ
        between them and shows those first, which is what a sweep varies. The final metrics
        are scalars under `final/`, in this run's own event file (SummaryWriter.add_hparams
        would start a second event file in a sub-directory).
        """
        if not self.writer:
            return
        from torch.utils.tensorboard.summary import hparams

        values = flatten({k: v for k, v in resolved.items() if k != "hydra"})
        metrics = {f"final/{k}": (v if math.isfinite(v) else float("nan")) for k, v in final_metrics.items()}
        _, session_start, session_end = hparams(values, metrics)
        self.writer.file_writer.add_summary(session_start)
        self.writer.file_writer.add_summary(session_end)
        self.scalars(metrics, step)

    def summary(self, values: dict) -> None:
        """metrics.json in the run directory: final and best metrics, for scripts and sweeps;
        strict JSON, a non-finite metric as null (checkpoints/json_text.py)."""
        if self.enabled:
            write_text_atomically(self.run_dir / "metrics.json", json_text(values, indent=2, default=str))

    def close(self) -> None:
        self._console.close()
        if self.bar:
            self.bar.close()
            self.bar = None
        if self.writer:
            self.writer.flush()
            self.writer.close()
            self.writer = None
