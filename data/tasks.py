"""What a data set asks of a model: the training loss and the validation metrics.

A task turns model outputs and targets into
  loss(outputs, targets)        the mean training loss of a batch
  eval_sums(outputs, targets)   per-batch *sums* plus a "count", e.g. {"loss": Σ, "count": n}
and, where its loss averages over tokens rather than samples (targets of -100 ignored):
  loss_sum(outputs, targets)    the batch's loss summed over what it counts
  count(targets)                how many it counts: a tensor, since it varies per batch
Sums, not means, so that batches and ranks add up exactly: the validation metric of N ranks
is their summed sums over their summed counts, equal to the single-process metric, and the
training loss of an optimizer step is its micro-batches' and ranks' summed loss over their
summed count (data/batches.py step_losses), whatever the accumulation and the ranks. Every sum
is a tensor on the targets' device, so the sums of a batch stack and all-reduce as one.
`monitor` names the metric a sweep optimises and best.pt is chosen by, `mode` its direction;
both are constructor arguments, so `task.monitor=val/loss task.mode=min` overrides them.

Every task also says how a batch meets the model (data/batches.py): `input_keys` and
`target_key` for dict batches, `output_key` for a model that returns a dict, tuple or
ModelOutput, and `model_loss` to train on the loss the model computes itself (Hugging Face
models given `labels=`). Keyword-only, so `task.target_key=label` overrides them.

A user's own task is any object with `loss`, `eval_sums`, `monitor` and `mode` (the batch
settings and `metric_names`, which lets a misnamed monitor be refused before training, are optional); for a plain loss function, `LossTask(loss=..., metrics={...})` builds one.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


# F.cross_entropy's default ignore_index, and Hugging Face's padding label.
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """How a batch meets the model (data/batches.py); None: the defaults described there."""

    input_keys: tuple[str, ...] | None = None  # dict batches: the model's keyword inputs
    target_key: str | None = None  # dict batches: the target (default labels, else label)
    output_key: str | int | None = None  # the output the task reads (default logits / first)
    model_loss: bool = False  # train on the model's own loss, given the target as labels=

    def __post_init__(self) -> None:
        if self.input_keys is not None:
            object.__setattr__(self, "input_keys", tuple(self.input_keys))


@dataclass(frozen=True)
class RegressionTask(BatchSettings):
    """Mean squared error; outputs and targets are (N, out_features)."""

    monitor: str = "val/loss"
    mode: str = "min"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float(), targets)

    def metric_names(self) -> tuple[str, ...]:
        """eval_sums' metrics (its keys but "count"): known before training, so a monitor naming another is refused then."""
        return ("loss",)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        squared = (outputs.float() - targets).pow(2).flatten(1).mean(1)  # per-sample MSE
        return {"loss": squared.sum(), "count": torch.tensor(float(len(targets)), device=targets.device)}


@dataclass(frozen=True)
class ClassificationTask(BatchSettings):
    """Cross-entropy on logits (N, classes) against class ids (N,); accuracy is monitored."""

    monitor: str = "val/acc"
    mode: str = "max"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets)

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets, reduction="sum")

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != IGNORE_INDEX).sum()

    def metric_names(self) -> tuple[str, ...]:
        return ("loss", "acc")

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        outputs = outputs.float()
        return {
            "loss": F.cross_entropy(outputs, targets, reduction="sum"),
            "acc": (outputs.argmax(1) == targets).sum().float(),
            "count": self.count(targets).double(),
        }


@dataclass(frozen=True)
class LanguageModelTask(BatchSettings):
    """Next-token cross-entropy: logits (B, T, vocab) against token ids (B, T), per token.

    The targets are the next tokens already (ringtrain's text data); `shift_labels=True`
    reads Hugging Face's convention instead (labels equal to the input ids: position t's
    logits predict label t+1). Targets of -100 (padding) count neither in the loss nor in
    the token count.
    """

    monitor: str = "val/loss"
    mode: str = "min"
    shift_labels: bool = False
    float32_loss: bool = False

    def _logits(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, targets) flattened for the training loss. By default the logits as the model
        gives them, as nanoGPT and a hand-written loop pass them: under CUDA autocast the
        cross-entropy's kernels read bf16 logits, accumulate in float32 and keep the
        log-probabilities in bf16 (CPU autocast computes it in float32 regardless), and no copy
        of the largest tensor of a GPT step (B x T x vocab) is made. `float32_loss` upcasts
        them first, as Hugging Face's and torchtitan's losses do: a float32 copy and float32
        softmax kernels, 3.8 ms of a 45.5 ms GPT-2-small step on an H200 (benchmarks/RESULTS.md)."""
        if self.shift_labels:
            outputs, targets = outputs[:, :-1], targets[:, 1:]
        if self.float32_loss:
            outputs = outputs.float()
        return outputs.flatten(0, 1), targets.flatten()

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, flat = self._logits(outputs, targets)
        if logits.dtype == torch.float32:
            return F.cross_entropy(logits, flat)
        return self._low_precision_sum(logits, flat) / (flat != IGNORE_INDEX).sum()

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, flat = self._logits(outputs, targets)
        if logits.dtype == torch.float32:
            return F.cross_entropy(logits, flat, reduction="sum")
        return self._low_precision_sum(logits, flat)

    @staticmethod
    def _low_precision_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # bf16 or fp16 logits: each token's loss in their dtype, summed in float32, so the
        # step's loss (logged, watched for non-finite values) keeps float32's precision
        # rather than bf16's 3 digits; a kernel over B x T values, not B x T x vocab.
        return F.cross_entropy(logits, targets, reduction="none").float().sum()

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """The tokens the loss averages over: the targets not -100 (after the shift: a model
        that computes its own loss, task.model_loss, shifts Hugging Face labels the same way)."""
        return ((targets[:, 1:] if self.shift_labels else targets) != IGNORE_INDEX).sum()

    def metric_names(self) -> tuple[str, ...]:
        return ("loss",)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        # Validation scores in float32 always: its figures are compared across runs and
        # precisions, and it keeps nothing for a backward (the copy costs little there).
        if self.shift_labels:
            outputs, targets = outputs[:, :-1], targets[:, 1:]
        loss = F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten(), reduction="sum")
        return {"loss": loss, "count": (targets != IGNORE_INDEX).sum().double()}


@dataclass(frozen=True)
class LossTask(BatchSettings):
    """A user's loss callable (and optional metric callables), e.g. `torch.nn.SmoothL1Loss()`.

    Each callable takes (outputs, targets) and returns the batch *mean*; validation weights
    each batch's mean by its number of samples, so the metric over any split into batches and
    ranks equals the mean over the whole set. Metrics are reported as val/<name>.
    """

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    monitor: str = "val/loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, fn in {"loss": self.loss, **dict(self.metrics)}.items():
            if not callable(fn):
                raise ValueError(f"task.{name} must be callable (outputs, targets) -> mean, got {fn!r}")
        if "count" in self.metrics or "loss" in self.metrics:
            raise ValueError("task.metrics cannot be named 'loss' or 'count'; those are ringtrain's own")

    def metric_names(self) -> tuple[str, ...]:
        return ("loss", *self.metrics)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        n = float(len(targets))
        sums = {name: fn(outputs, targets).detach().double() * n for name, fn in {"loss": self.loss, **dict(self.metrics)}.items()}
        sums["count"] = torch.tensor(n, dtype=torch.float64, device=targets.device)
        return sums


Task = RegressionTask | ClassificationTask | LanguageModelTask | LossTask


def check_monitor(task) -> None:
    """The monitored metric must be one the task reports, and its direction min or max."""
    if getattr(task, "mode", None) not in ("min", "max"):
        raise ValueError(f"task.mode={getattr(task, 'mode', None)!r} must be min or max")
    if not str(getattr(task, "monitor", "")).startswith("val/"):
        raise ValueError(f"task.monitor={getattr(task, 'monitor', None)!r} must name a validation metric, e.g. val/loss")
    if (names := validation_metrics(task)) and task.monitor not in names:
        raise ValueError(f"task.monitor={task.monitor} is not a metric of this task; it reports {', '.join(sorted(names))}: "
                         f"monitor one of those")


def validation_metrics(task) -> tuple[str, ...]:
    """The metrics validation will report (val/<name>), where the task says (ringtrain's do:
    metric_names); () for a task that does not, whose metrics show at the first validation."""
    names = getattr(task, "metric_names", None)
    return tuple(f"val/{name}" for name in names()) if callable(names) else ()


def metrics_from_sums(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """Every summed quantity divided by the count: {"loss": Σ, "count": n} -> {"loss": Σ/n}."""
    count = float(totals["count"])
    return {key: float(value) / count for key, value in totals.items() if key != "count"}
