"""The training metrics a run logs: the loss and the gradient norm (TrainMetrics), the learning
rate (LearningRateMonitor), a streamed data set's mixture and passes (StreamMetrics)."""
from __future__ import annotations

import torch

from ringtrain.callbacks import Callback, Run, StepEnd
from ringtrain.distributed import all_reduce_sum


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
