"""The ModelSummary callback: at the start, the model's parameters per module, trainable and
frozen (Lightning's ModelSummary), logged on rank 0."""
from __future__ import annotations

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


def _si(value: int) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if value >= factor:
            return f"{value / factor:.1f} {suffix}"
    return str(value)
