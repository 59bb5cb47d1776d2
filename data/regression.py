"""The tutorial's data set (seed 000): y = weight * x + bias + noise_std * N(0, 1)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from data.bundle import DataBundle, check_positive_ints
from data.tasks import RegressionTask
from data.tensors import PairDataset


@dataclass
class RegressionConfig:
    num_samples: int = 10000
    num_val_samples: int = 1000
    weight: float = 2.0
    bias: float = 3.0
    noise_std: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_ints(self, "num_samples", "num_val_samples")
        if self.noise_std < 0:
            raise ValueError(f"data.noise_std={self.noise_std} must be >= 0")


def build_regression(config: RegressionConfig) -> DataBundle:
    generator = torch.Generator().manual_seed(config.seed)
    total = config.num_samples + config.num_val_samples
    x = torch.randn(total, 1, generator=generator)
    y = config.weight * x + config.bias + config.noise_std * torch.randn(total, 1, generator=generator)
    n = config.num_samples
    return DataBundle(
        train=PairDataset(x[:n], y[:n]),
        val=PairDataset(x[n:], y[n:]),
        task=RegressionTask(),
        model_dims={"in_features": 1, "out_features": 1},
    )
