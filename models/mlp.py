"""Multi-layer perceptron classifier: in_features -> hidden_sizes -> num_classes logits."""
from collections.abc import Sequence

import torch
from torch import nn


class MLPClassifier(nn.Module):
    """Linear -> ReLU -> Dropout for each hidden size, then a Linear to the class logits.

    in_features and num_classes normally come from the data set (3072 = 3*32*32 images and
    10 classes for CIFAR-10 and the synthetic classification task).
    """

    def __init__(
        self, in_features: int, num_classes: int, hidden_sizes: Sequence[int] = (512,), dropout: float = 0.0
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("num_classes", num_classes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if not hidden_sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in hidden_sizes):
            raise ValueError(
                f"model.hidden_sizes={list(hidden_sizes)!r} must be a non-empty list of positive integers; "
                f"e.g. model.hidden_sizes=[512] or [512,256]"
            )
        if not 0 <= dropout < 1:
            raise ValueError(f"model.dropout={dropout!r} must be in [0, 1); use 0.0 to disable dropout")
        layers: list[nn.Module] = []
        width = in_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in_features) float, or (N, C, H, W) images flattened here -> (N, num_classes)."""
        if x.dim() > 2:
            x = x.flatten(1)
        return self.layers(x)
