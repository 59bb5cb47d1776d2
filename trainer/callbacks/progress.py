"""What the console shows of training: a progress bar with the loss and the speed, or, with
trainer.progress_bar=false, one log line per logging step (which train.log keeps too)."""
from __future__ import annotations

import contextlib
import logging

from ringtrain.callbacks import Callback, Run, StepEnd

log = logging.getLogger("ringtrain")


class ProgressBar(Callback):
    rank_zero_only = True

    def __init__(self) -> None:
        self.bar = None  # made in on_fit_start: a run may fail before it (on_exception closes what there is)
        self._console = contextlib.ExitStack()

    def on_fit_start(self, run: Run) -> None:
        if run.trainer.progress_bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True)
            self._console.enter_context(logging_redirect_tqdm())  # log lines above the bar, not through it
        self.logging_steps_only = self.bar is None  # without a bar, nothing to do at a step

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, run: Run, metrics: dict[str, float], step: int) -> None:
        if "train/loss" not in metrics:
            return
        # The loss and the speed figures, short enough for a progress bar.
        shown = {"loss": f"{metrics['train/loss']:.4g}"}
        if "throughput/tokens_per_sec" in metrics:
            shown["tok/s"] = _si(metrics["throughput/tokens_per_sec"])
        elif "throughput/samples_per_sec" in metrics:
            shown["samples/s"] = _si(metrics["throughput/samples_per_sec"])
        if (ms := metrics.get("throughput/step_ms")) is not None:
            shown["ms/step"] = f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"
        if "throughput/mfu_percent" in metrics:
            shown["mfu"] = f"{metrics['throughput/mfu_percent']:.1f}%"
        if "memory/peak_allocated_gib" in metrics:
            shown["mem"] = f"{metrics['memory/peak_allocated_gib']:.2f}GiB"
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
        else:
            log.info(f"step {step}: " + " ".join(f"{key}={value}" for key, value in shown.items()))

    def on_fit_end(self, run: Run, result_or_error: object) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._console.close()

    on_exception = on_fit_end


def _si(value: float) -> str:
    """12345.6 -> "12.3k"."""
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"
