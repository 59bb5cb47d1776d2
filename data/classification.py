"""A synthetic classification task for the MLP: one Gaussian blob per class.

Class centres are drawn once from the seed and scaled so that two centres lie about
`class_separation` noise standard deviations apart whatever `num_features` is; a sample is
its class centre plus unit Gaussian noise. With the default separation of 6 the best
possible accuracy is about 99 %, and a model must learn real weights to get there (chance
is 1 / num_classes).
"""
from __future__ import annotations

import torch

from ringtrain.data import DataModule, PairDataset, check_positive_ints


class ClassificationData(DataModule):
    def __init__(
        self,
        num_samples: int = 10000,
        num_val_samples: int = 2000,
        num_features: int = 3072,  # 3 * 32 * 32, the tutorial MLP's input
        num_classes: int = 10,
        class_separation: float = 6.0,
        seed: int = 0,
    ) -> None:
        self.num_samples, self.num_val_samples = num_samples, num_val_samples
        self.num_features, self.num_classes = num_features, num_classes
        self.class_separation, self.seed = class_separation, seed
        check_positive_ints(self, "num_samples", "num_val_samples", "num_features")
        if num_classes < 2:
            raise ValueError(f"data.num_classes={num_classes} must be at least 2")
        if not class_separation > 0:
            raise ValueError(f"data.class_separation={class_separation} must be positive")
        self.dims = {"in_features": num_features, "num_classes": num_classes}

    def setup(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        d = self.num_features
        # Two independent centres with per-coordinate std s are s * sqrt(2d) apart on average.
        centres = torch.randn(self.num_classes, d, generator=generator) * (self.class_separation / (2 * d) ** 0.5)
        total = self.num_samples + self.num_val_samples
        labels = torch.randint(self.num_classes, (total,), generator=generator)
        inputs = centres[labels] + torch.randn(total, d, generator=generator)
        n = self.num_samples
        self.train, self.val = PairDataset(inputs[:n], labels[:n]), PairDataset(inputs[n:], labels[n:])
