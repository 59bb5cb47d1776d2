"""Linear regression, y = w x + b: the tutorial's model."""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LinearConfig:
    # Both sizes come from the regression data set; the defaults fit the tutorial's y = 2x + 3.
    in_features: int = 1
    out_features: int = 1

    def __post_init__(self) -> None:
        for name in ("in_features", "out_features"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"model.{name}={value!r} must be a positive integer; "
                    f"it is the data set's feature size, so fix it on the data side"
                )


class LinearRegression(nn.Module):
    """One affine map; parameters are `linear.weight` (out, in) and `linear.bias` (out,)."""

    def __init__(self, config: LinearConfig) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(config.in_features, config.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in_features) -> (N, out_features)."""
        return self.linear(x)
