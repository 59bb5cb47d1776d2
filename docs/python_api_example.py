"""ringtrain's Python API: your model, your Datasets, no YAML. `--ddp`: 2 processes."""
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringtrain import Trainer
from ringtrain.data.tasks import RegressionTask


class Line(nn.Module):  # at module level, so spawned DDP ranks can unpickle it
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(2048, 1)
    y = 2 * x + 3 + 0.1 * torch.randn(2048, 1)
    ddp = "--ddp" in sys.argv  # batch_size is per rank: 2 x 16 = 32
    trainer = Trainer(max_epochs=4, batch_size=16 if ddp else 32, optimizer={"_target_": "torch.optim.SGD", "lr": 0.1},
                      strategy={"name": "ddp", "nproc_per_node": 2} if ddp else "single", progress_bar=False)
    model = Line()
    trainer.fit(model, TensorDataset(x[:1792], y[:1792]), TensorDataset(x[1792:], y[1792:]), task=RegressionTask())
    print(f"learned w={model.linear.weight.item():.6f} b={model.linear.bias.item():.6f}")
