"""Linear regression, y = w x + b: the tutorial's model."""
import torch
from torch import nn


class LinearRegression(nn.Module):
    """One affine map; parameters are `linear.weight` (out, in) and `linear.bias` (out,).

    Both sizes normally come from the data set (the regression data gives 1 and 1, the
    tutorial's y = 2x + 3), so conf/model/linear.yaml sets neither.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in_features) -> (N, out_features)."""
        return self.linear(x)

    def summary(self) -> str:
        """What was learned, in the tutorial's terms (ringtrain logs this after training)."""
        weight, bias = self.linear.weight.detach().cpu(), self.linear.bias.detach().cpu()
        if weight.numel() == 1:
            return f"learned w={weight.item():.4f} b={bias.item():.4f}"
        return f"learned weight {tuple(weight.shape)} (norm {weight.norm():.4f}), bias norm {bias.norm():.4f}"
