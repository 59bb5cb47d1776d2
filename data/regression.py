"""The tutorial's data set (seed 000): y = weight * x + bias + noise_std * N(0, 1)."""
from __future__ import annotations

import torch

from ringtrain.data import DataModule, PairDataset, check_positive_ints


class RegressionData(DataModule):
    def __init__(
        self,
        num_samples: int = 10000,
        num_val_samples: int = 1000,
        weight: float = 2.0,
        bias: float = 3.0,
        noise_std: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.num_samples, self.num_val_samples = num_samples, num_val_samples
        self.weight, self.bias, self.noise_std, self.seed = weight, bias, noise_std, seed
        check_positive_ints(self, "num_samples", "num_val_samples")
        if noise_std < 0:
            raise ValueError(f"data.noise_std={noise_std} must be >= 0")
        self.dims = {"in_features": 1, "out_features": 1}

    def setup(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        total = self.num_samples + self.num_val_samples
        x = torch.randn(total, 1, generator=generator)
        y = self.weight * x + self.bias + self.noise_std * torch.randn(total, 1, generator=generator)
        n = self.num_samples
        self.train, self.val = PairDataset(x[:n], y[:n]), PairDataset(x[n:], y[n:])
