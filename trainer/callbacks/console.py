"""What the console shows of training: the model's parameters per module at the start, trainable
and frozen (ModelSummary, Lightning's), and a progress bar with the loss and the speed, or, with
trainer.progress_bar=false, one log line per logging step which train.log keeps too (ProgressBar).
Both on rank 0.
"""
from __future__ import annotations

import contextlib
import logging

from torch.nn.parameter import UninitializedParameter

from ringtrain.callbacks import Callback, Run, StepEnd

log = logging.getLogger("ringtrain")


class ModelSummary(Callback):
    """One line per module down to `max_depth` (1: the model's children), then the totals."""

    rank_zero_only = True

    def __init__(self, max_depth: int = 1) -> None:
        if max_depth < 0:
            raise ValueError(f"callbacks.model_summary.max_depth={max_depth} must be >= 0 (0: the totals only)")
        self.max_depth = max_depth

    def on_fit_start(self, run: Run) -> None:
        # Reported now, and no step needs it; but a lazy module's parameters (nn.LazyLinear) have
        # no size until the first forward: then after the first step.
        self.logging_steps_only = not any(isinstance(p, UninitializedParameter) for p in run.model.parameters())
        if self.logging_steps_only:
            self.report(run)

    def on_step_end(self, run: Run, step: StepEnd) -> None:
        if not self.logging_steps_only:
            self.logging_steps_only = True
            self.report(run)

    def report(self, run: Run) -> None:
        trainable, total = count(run.model)
        rows = [(name, type(module).__name__, *count(module)) for name, module in run.model.named_modules()
                if name and name.count(".") < self.max_depth]
        width = max([len(name) for name, *_ in rows] + [6])
        lines = [f"  {name:<{width}}  {kind:<24} {_si(n)} params ({_si(t)} trainable)" for name, kind, t, n in rows]
        frozen = f", {_si(total - trainable)} frozen" if trainable < total else ""
        log.info("\n".join([f"model {type(run.model).__name__}: {_si(total)} parameters, "
                            f"{_si(trainable)} trainable{frozen}", *lines]))


def count(module) -> tuple[int, int]:
    """(trainable, all) parameters of `module`, a shared one once."""
    params = list(module.parameters())  # parameters() yields a tied tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


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
