"""The EMA callback: an exponential moving average of the trainable weights, which validation
(and `ringtrain evaluate|sample|export weights=ema`) can use instead of the weights themselves."""
from __future__ import annotations

import torch

from ringtrain.callbacks import Callback, Run, StepEnd
from ringtrain.errors import ConfigError


class EMA(Callback):
    """Averages after every applied update (conf/callbacks/ema.yaml), each trainable parameter on
    every rank (under fsdp each rank its own shards, placed as the parameter is). With `validate`,
    validation runs on the averages (so the logged val/ metrics, best.pt's choice and early
    stopping are theirs); the weights train on unchanged. Checkpoints keep them in full, by name."""

    def __init__(self, decay: float = 0.999, validate: bool = True):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"callbacks.ema.decay={decay} must be between 0 and 1, e.g. 0.999")
        self.decay, self.validate = decay, validate
        self.averages: dict[str, torch.Tensor] = {}
        self._saved: dict[str, torch.Tensor] = {}  # from a checkpoint, placed at on_fit_start
        self._trained: list[torch.Tensor] = []  # the weights, held aside while validation uses the average

    def on_fit_start(self, run: Run) -> None:
        self.params = {name: p for name, p in run.model.named_parameters() if p.requires_grad}
        self.averages = {name: _placed_like(self._saved[name], p, name) if self._saved else p.detach().clone()
                         for name, p in self.params.items()}

    @torch.no_grad()
    def on_step_end(self, run: Run, step: StepEnd) -> None:
        if not step.applied:
            return
        for (name, param), average in zip(self.params.items(), self.averages.values()):
            if average.shape != param.shape:
                raise ConfigError(f"callbacks.ema: {name} changed shape from {tuple(average.shape)} to "
                                  f"{tuple(param.shape)} during training; an average needs fixed shapes: drop the EMA callback")
            average.lerp_(param.detach(), 1.0 - self.decay)

    @torch.no_grad()
    def on_validation_start(self, run: Run) -> None:
        if self.validate:
            self._trained = [param.detach().clone() for param in self.params.values()]
            for param, average in zip(self.params.values(), self.averages.values()):
                param.copy_(average)

    @torch.no_grad()
    def on_validation_end(self, run: Run, metrics: dict[str, float]) -> None:
        for param, trained in zip(self.params.values(), self._trained):
            param.copy_(trained)
        self._trained = []

    def state_dict(self) -> dict:
        """The averages in full (gathered from the shards under fsdp: every rank calls this)."""
        averages = self.averages or self._saved  # before on_fit_start places a checkpoint's: those
        return {"decay": self.decay, "weights": {name: (a.full_tensor() if hasattr(a, "full_tensor") else a).detach().cpu()
                                                 for name, a in averages.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._saved = state["weights"]


def _placed_like(saved: torch.Tensor, param: torch.Tensor, name: str) -> torch.Tensor:
    """A checkpoint's full average as the parameter is: on its device, sharded as it is."""
    if tuple(saved.shape) != tuple(param.shape):
        raise ConfigError(f"callbacks.ema: the checkpoint's average of {name} has shape {tuple(saved.shape)}, the "
                          f"model's {tuple(param.shape)}; continue with the model it was trained with")
    if hasattr(param, "device_mesh"):  # a DTensor (fsdp): this rank's shard of it
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(param.dtype), param.device_mesh, param.placements)
    return saved.to(device=param.device, dtype=param.dtype).clone()
