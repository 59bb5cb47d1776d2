"""`trainer.compile`: torch.compile for training, falling back to eager mode when compiling fails.

The `CompiledModel` goes *inside* DDP, as nanoGPT and torchtitan order it: its compiled call
runs within DDP's forward, so dynamo's DDP optimizer splits the graph at DDP's buckets and the
all-reduce still overlaps the backward (torch 2.13's `optimize_ddp` default, shown by
`TORCH_LOGS=ddp_graphs`; tests/test_speed_features.py). That splitting refuses buckets
below DDP's 1 MiB first one, so strategies/ddp.py refuses `bucket_cap_mb` < 1 with compiling
(strategies/dp.py refuses DataParallel, which copies the model every forward). Under fsdp,
FSDP2 shards the model first, then it is compiled; dynamo runs FSDP2's hooks eagerly, breaking
the graph at each unit. There the backward probe reaches no parameter (FSDP2 gathers them
outside autograd): it costs one forward, and a backward that fails to compile raises.

A wrapper, not `torch.compile(model)` alone, because compile errors surface lazily, deep in the
loop, and a failed compile (no C++ compiler, an op inductor cannot lower) should cost speed, not
the run: a failing compiled forward is rerun eagerly, and if that works, ONE warning and eager
from then on; if eager fails too, its exception (the model's own) propagates. The first training
forward runs a probe, a compiled forward and backward through `torch.autograd.grad` (no `.grad`
touched, no DDP hook fired, RNG and buffers restored), so a failing backward compile is caught
before any gradient exists. Checkpoints hold the bare model (checkpoints/files.py
`unwrap_model`), so they load compiled or not. Evaluation runs eagerly: inference mode and each
new batch shape recompile, which pays off only for long evaluations.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch import nn

log = logging.getLogger("ringtrain")


def compile_for_training(model: nn.Module, enabled: bool, mode: str = "default") -> nn.Module:
    return CompiledModel(model, mode) if enabled else model


class CompiledModel(nn.Module):
    """`torch.compile(module)` with an eager fall-back. The bare `.module` is the only registered
    child, so parameters(), train()/eval() and `unwrap_model` see it as usual; the compiled one
    stays outside the tree (its `_orig_mod.` parameters must not appear twice)."""

    def __init__(self, module: nn.Module, mode: str = "default") -> None:
        super().__init__()
        self.module = module
        self.mode = mode
        self.__dict__["compiled"] = torch.compile(module, mode=None if mode == "default" else mode)
        self.backward_checked = False  # the probe has run (or compiling was given up)

    @property
    def is_compiled(self) -> bool:
        """False once compiling failed and the model runs eagerly."""
        return self.__dict__["compiled"] is not None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self.__dict__["compiled"]
        if compiled is None:
            return self.module(*args, **kwargs)
        if not self.backward_checked and self.module.training and torch.is_grad_enabled():
            self._probe_backward(compiled, args, kwargs)
            if not self.is_compiled:
                return self.module(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as error:
            compile_error = error
        # A compile error, or the model's own? Eager decides: its exception, if any, is the
        # one the user should see (and compiling stays on); if eager works, compiling failed.
        outputs = self.module(*args, **kwargs)
        self._give_up(compile_error)
        return outputs

    def _probe_backward(self, compiled: nn.Module, args: tuple, kwargs: dict) -> None:
        """Compile the forward and the backward graph now, on these inputs, without side effects."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        saved_buffers = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]
        compile_error = None
        try:
            # Dropout in the probe must not shift the random stream the run goes on to use.
            cuda_devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
            with torch.random.fork_rng(devices=cuda_devices):
                try:
                    outputs = compiled(*args, **kwargs)
                    differentiable = [t for t in _tensors(outputs) if t.requires_grad]
                    if differentiable and params:
                        total = torch.stack([t.float().sum() for t in differentiable]).sum()
                        torch.autograd.grad(total, params, allow_unused=True)
                except Exception as error:
                    compile_error = error
                if compile_error is not None:
                    # The model's own error (eager raises it too) propagates as it is.
                    self.module(*args, **kwargs)
        finally:
            with torch.no_grad():  # e.g. BatchNorm's running statistics: as if no probe ran
                for buffer, value in saved_buffers:
                    buffer.copy_(value)
        self.backward_checked = True
        if compile_error is not None:
            self._give_up(compile_error)

    def _give_up(self, error: BaseException) -> None:
        self.__dict__["compiled"] = None
        self.backward_checked = True
        detail = " ".join(str(error).split())[:240] or "no message"
        log.warning(
            f"trainer.compile: torch.compile failed ({type(error).__name__}: {detail}); "
            f"training continues in eager mode"
        )


def _tensors(outputs: Any) -> Iterator[torch.Tensor]:
    """The tensors in a model's outputs: a tensor, or tuples, lists and dicts of them."""
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple, dict)):
        for item in outputs.values() if isinstance(outputs, dict) else outputs:
            yield from _tensors(item)
