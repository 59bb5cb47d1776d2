"""A synthetic classification task for the MLP: one Gaussian blob per class.

Class centres are drawn once from the seed and scaled so that two centres lie about
`class_separation` noise standard deviations apart whatever `num_features` is; a sample is
its class centre plus unit Gaussian noise. With the default separation of 6 the best
possible accuracy is about 99 %, and a model must learn real weights to get there (chance
is 1 / num_classes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from data.bundle import DataBundle, check_positive_ints
from data.tasks import ClassificationTask
from data.tensors import PairDataset


@dataclass
class ClassificationConfig:
    num_samples: int = 10000
    num_val_samples: int = 2000
    num_features: int = 3072  # 3 * 32 * 32, the tutorial MLP's input
    num_classes: int = 10
    class_separation: float = 6.0
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(self, "num_samples", "num_val_samples", "num_features")
        if self.num_classes < 2:
            raise ValueError(f"data.num_classes={self.num_classes} must be at least 2")
        if not self.class_separation > 0:
            raise ValueError(f"data.class_separation={self.class_separation} must be positive")


def build_classification(config: ClassificationConfig) -> DataBundle:
    generator = torch.Generator().manual_seed(config.seed)
    d = config.num_features
    # Two independent centres with per-coordinate std s are s * sqrt(2d) apart on average.
    centres = torch.randn(config.num_classes, d, generator=generator) * (config.class_separation / (2 * d) ** 0.5)
    total = config.num_samples + config.num_val_samples
    labels = torch.randint(config.num_classes, (total,), generator=generator)
    inputs = centres[labels] + torch.randn(total, d, generator=generator)
    n = config.num_samples
    return DataBundle(
        train=PairDataset(inputs[:n], labels[:n]),
        val=PairDataset(inputs[n:], labels[n:]),
        task=ClassificationTask(),
        model_dims={"in_features": d, "num_classes": config.num_classes},
    )
