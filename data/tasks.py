"""What a data set asks of a model: the training loss and the validation metrics.

A task turns model outputs and targets into
  loss(outputs, targets)        the mean training loss of a batch (what backward() sees)
  eval_sums(outputs, targets)   per-batch *sums* plus a "count", e.g. {"loss": Σ, "count": n}
Sums, not means, so that batches and ranks add up exactly: the validation metric of N ranks
is their summed sums over their summed counts, equal to the single-process metric. Every sum
is a tensor on the targets' device, so the sums of a batch stack and all-reduce as one.
`monitor` names the metric a sweep optimises and best.pt is chosen by, `mode` its direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RegressionTask:
    """Mean squared error; outputs and targets are (N, out_features)."""

    monitor: str = "val/loss"
    mode: str = "min"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float(), targets)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        squared = (outputs.float() - targets).pow(2).flatten(1).mean(1)  # per-sample MSE
        return {"loss": squared.sum(), "count": torch.tensor(float(len(targets)), device=targets.device)}


@dataclass(frozen=True)
class ClassificationTask:
    """Cross-entropy on logits (N, classes) against class ids (N,); accuracy is monitored."""

    monitor: str = "val/acc"
    mode: str = "max"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), targets)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        outputs = outputs.float()
        return {
            "loss": F.cross_entropy(outputs, targets, reduction="sum"),
            "acc": (outputs.argmax(1) == targets).sum().float(),
            "count": torch.tensor(float(len(targets)), device=targets.device),
        }


@dataclass(frozen=True)
class LanguageModelTask:
    """Next-token cross-entropy: logits (B, T, vocab) against token ids (B, T), per token."""

    monitor: str = "val/loss"
    mode: str = "min"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten())

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(outputs.float().flatten(0, 1), targets.flatten(), reduction="sum")
        return {"loss": loss, "count": torch.tensor(float(targets.numel()), device=targets.device)}


Task = RegressionTask | ClassificationTask | LanguageModelTask


def metrics_from_sums(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """Every summed quantity divided by the count: {"loss": Σ, "count": n} -> {"loss": Σ/n}."""
    count = float(totals["count"])
    return {key: float(value) / count for key, value in totals.items() if key != "count"}
