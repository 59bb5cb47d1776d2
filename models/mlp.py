"""Multi-layer perceptron classifier: in_features -> hidden_sizes -> num_classes logits."""
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class MLPConfig:
    # in_features and num_classes come from the data set (3072 = 3*32*32 images, 10 classes).
    in_features: int = 3072
    num_classes: int = 10
    hidden_sizes: list[int] = field(default_factory=lambda: [512])
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("in_features", "num_classes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"model.{name}={value!r} must be a positive integer; "
                    f"it is set from the data set, so fix it on the data side"
                )
        sizes = self.hidden_sizes
        if (
            not isinstance(sizes, (list, tuple))
            or not sizes
            or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes)
        ):
            raise ValueError(
                f"model.hidden_sizes={sizes!r} must be a non-empty list of positive integers; "
                f"e.g. model.hidden_sizes=[512] or [512,256]"
            )
        self.hidden_sizes = list(sizes)  # a tuple from code or a ListConfig copy: store a list
        is_number = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
        if not is_number or not 0 <= self.dropout < 1:
            raise ValueError(
                f"model.dropout={self.dropout!r} must be in [0, 1); use 0.0 to disable dropout"
            )


class MLPClassifier(nn.Module):
    """Linear -> ReLU -> Dropout for each hidden size, then a Linear to the class logits."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        width = config.in_features
        for hidden in config.hidden_sizes:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(config.dropout)]
            width = hidden
        layers.append(nn.Linear(width, config.num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, in_features) float, or (N, C, H, W) images flattened here -> (N, num_classes)."""
        if x.dim() > 2:
            x = x.flatten(1)
        return self.layers(x)
