"""What the strategies with one process per device (ddp, fsdp) share: the process group's options,
and joining it, under torchrun (or any launcher setting RANK / WORLD_SIZE / MASTER_*) or, with
`strategy.nproc_per_node=N` and no launcher, as one of N ranks started here (strategies/launch.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.distributed import DistInfo, join_process_group, launcher_ranks, runs_on_cpu, under_torchrun
from ringtrain.errors import ConfigError
from ringtrain.strategies import Strategy

BACKENDS = ("auto", "gloo", "nccl")


class ProcessGroupStrategy(Strategy):
    spans_processes = True

    def __init__(self, *, backend: str, nproc_per_node: int, timeout_minutes: float, max_restarts: int,
                 scale_lr_by_world_size: bool) -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"strategy.backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        for name, value in (("nproc_per_node", nproc_per_node), ("timeout_minutes", timeout_minutes)):
            if value <= 0:
                raise ConfigError(f"strategy.{name}={value} must be positive")
        if max_restarts < 0:
            raise ConfigError(f"strategy.max_restarts={max_restarts} must be >= 0 (0: a failed rank ends the job)")
        self.backend = backend  # auto: nccl when every rank has a CUDA device, else gloo
        self.nproc_per_node = nproc_per_node  # ranks to start when no launcher started this one
        self.timeout_minutes = timeout_minutes  # a collective that waits longer fails the job
        self.max_restarts = max_restarts  # restarts of the whole self-launched job after a rank fails
        self.scale_lr_by_world_size = scale_lr_by_world_size  # lr * world_size, the seed tutorial's rule

    def check(self, trainer: Any) -> None:
        super().check(trainer)
        _, local_ranks = launcher_ranks()
        if under_torchrun() and self.nproc_per_node not in (1, local_ranks):
            # nproc_per_node is how many ranks ringtrain starts itself; under torchrun it starts none.
            raise ConfigError(
                f"strategy.nproc_per_node={self.nproc_per_node} asks for {self.nproc_per_node} ranks on this machine, "
                f"but torchrun started {local_ranks} here; under torchrun its --nproc_per_node decides: drop "
                f"strategy.nproc_per_node, or run torchrun --nproc_per_node={self.nproc_per_node}"
            )
        if self.backend == "nccl" and (trainer.accelerator == "cpu" or not torch.cuda.is_available()):
            raise ConfigError(
                "strategy.backend=nccl needs a CUDA device on every rank and none is visible; "
                "use strategy.backend=gloo (or auto) on CPU"
            )

    def launch(self, fn: Callable[..., Any], *args: Any, stop_signals: Sequence[str] = (),
               accelerator: str = "auto") -> Any:
        if under_torchrun():
            return fn(*args)
        if self.nproc_per_node == 1:
            # Legitimate (a one-rank check of a ddp config), but most often a launcher forgotten: say so.
            logging.getLogger("ringtrain").warning(
                f"strategy={self.option} trains in this one process: no launcher started ranks; start N with "
                f"torchrun --nproc_per_node=N -m ringtrain strategy={self.option} ..., or strategy.nproc_per_node=N")
            return fn(*args)
        from ringtrain.strategies.launch import launch_ranks, warn_if_ranks_share_cores

        if runs_on_cpu(accelerator):
            warn_if_ranks_share_cores(self.nproc_per_node)
        return launch_ranks(self.nproc_per_node, fn, args, max_restarts=self.max_restarts, stop_signals=stop_signals)

    def planned_ranks(self) -> int:
        return launcher_ranks()[0] if under_torchrun() else self.nproc_per_node

    def lr_scale(self, world_size: int) -> float:
        return float(world_size) if self.scale_lr_by_world_size else 1.0

    def setup_process(self, accelerator: str) -> DistInfo:
        if not under_torchrun():  # nproc_per_node=1 without a launcher: one process, no group
            return super().setup_process(accelerator)
        return join_process_group(self.backend, accelerator, self.timeout_minutes)
