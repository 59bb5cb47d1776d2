"""strategy=dp: nn.DataParallel over the visible GPUs, in one process (the seed tutorials'
CIFAR-10 example). With fewer than 2 GPUs it warns and runs on one device. ddp is faster,
even on one machine: DataParallel copies the model to every GPU in every forward."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ringtrain.distributed import DistInfo
from ringtrain.errors import ConfigError
from ringtrain.strategies import Strategy

log = logging.getLogger(__name__)


class DataParallel(Strategy):
    """nn.DataParallel (conf/strategy/dp.yaml)."""

    option = "dp"

    def check(self, trainer: Any) -> None:
        super().check(trainer)
        if trainer.compile:
            raise ConfigError(
                "trainer.compile=true does not work with strategy=dp (DataParallel copies the model in every "
                "forward); use strategy=ddp or strategy=single"
            )

    def setup_module(self, model: nn.Module, dist: DistInfo, trainer: Any) -> nn.Module:
        gpus = torch.cuda.device_count() if dist.device.type == "cuda" else 0
        if gpus < 2:
            log.warning("strategy=dp needs 2 or more CUDA GPUs; %s visible, running on %s without DataParallel",
                        gpus, dist.device)
            return model
        return nn.DataParallel(model)
