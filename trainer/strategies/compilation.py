"""`trainer.compile`: torch.compile for training, region by region (README, trainer.compile_scope;
benchmarks/bench_compile.py), falling back to eager mode when compiling fails.

Compiling `repeated_blocks` one by one costs about one block's compile: dynamo guards on a
block's class and shapes, not on the object, so one block's graph serves them all. In place
(`nn.Module.compile`), so no wrapper enters the module tree: state dicts keep their plain keys
(no `_orig_mod.`) and checkpoints load compiled or not.

The `CompiledModel` goes *inside* DDP, as nanoGPT and torchtitan order it: its compiled call
runs within DDP's forward, so dynamo's DDP optimizer splits the graph at DDP's buckets and the
all-reduce still overlaps the backward (torch 2.13's `optimize_ddp` default, shown by
`TORCH_LOGS=ddp_graphs`; tests/test_speed_features.py). That splitting refuses buckets below
DDP's 1 MiB first one, so strategies/ddp.py refuses `bucket_cap_mb` < 1 with compiling. Under
fsdp, FSDP2 shards the model first, then it is compiled; dynamo runs FSDP2's hooks eagerly,
breaking the graph at each unit. There the backward probe reaches no parameter (FSDP2 gathers
them outside autograd): it costs one forward, and a backward that fails to compile raises.

A wrapper around the model, because compile errors surface lazily, deep in the loop, and a
failed compile (no C++ compiler, an op inductor cannot lower) should cost speed, not the run: a
failing compiled forward is rerun eagerly, and if that works, ONE warning and eager from then
on; if eager fails too, its exception (the model's own) propagates. The first training forward
runs a probe, a compiled forward and backward through `torch.autograd.grad` (no `.grad`
touched, no DDP hook fired, RNG and buffers restored), so a failing backward compile is caught
before any gradient exists (inductor compiles the backward graph at the first backward).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from torch import nn

log = logging.getLogger("ringtrain")


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The nn.ModuleList of two or more modules of one class holding the most parameters (so the
    layers, not a list of experts inside a layer), or None."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(b) for b in m}) == 1]
    return max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()), default=None)


class CompiledModel(nn.Module):
    """The model, its repeated blocks (or itself) compiled in place, with an eager fall-back.
    The model is the only registered child, `.module` (as in DDP), so parameters() and
    train()/eval() see it as usual."""

    def __init__(self, module: nn.Module, mode: str = "default", regional: bool = True) -> None:
        super().__init__()
        self.module = module
        blocks = repeated_blocks(module) if regional else None
        for part in blocks if blocks is not None else [module]:
            part.compile(mode=None if mode == "default" else mode)
        self.is_compiled = True  # False once compiling failed and the model runs eagerly
        self.backward_checked = False  # the probe has run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_compiled and not self.backward_checked and self.module.training and torch.is_grad_enabled():
            self._probe_backward(args, kwargs)
        if not self.is_compiled:
            return self._eager(*args, **kwargs)
        try:
            return self.module(*args, **kwargs)
        except Exception as error:
            compile_error = error
        return self._fall_back(compile_error, args, kwargs)

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return self.module(*args, **kwargs)

    def _probe_backward(self, args: tuple, kwargs: dict) -> None:
        """Compile the forward and the backward graph now, on these inputs, without side effects."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        saved_buffers = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]
        try:
            # Dropout in the probe must not shift the random stream the run goes on to use.
            cuda_devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
            with torch.random.fork_rng(devices=cuda_devices):
                compile_error = None
                try:
                    outputs = self.module(*args, **kwargs)
                    differentiable = [t for t in _tensors(outputs) if t.requires_grad]
                    if differentiable and params:
                        total = torch.stack([t.float().sum() for t in differentiable]).sum()
                        torch.autograd.grad(total, params, allow_unused=True)
                except Exception as error:
                    compile_error = error
                if compile_error is not None:
                    self._fall_back(compile_error, args, kwargs)
        finally:
            with torch.no_grad():  # e.g. BatchNorm's running statistics: as if no probe ran
                for buffer, value in saved_buffers:
                    buffer.copy_(value)
        self.backward_checked = True

    def _fall_back(self, error: BaseException, args: tuple, kwargs: dict) -> Any:
        # A compile error, or the model's own? Eager decides (module docstring).
        outputs = self._eager(*args, **kwargs)
        self.is_compiled = False
        detail = " ".join(str(error).split())[:240] or "no message"
        log.warning(
            f"trainer.compile: torch.compile failed ({type(error).__name__}: {detail}); "
            f"training continues in eager mode"
        )
        return outputs


def _tensors(outputs: Any) -> Iterator[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple, dict)):
        for item in outputs.values() if isinstance(outputs, dict) else outputs:
            yield from _tensors(item)
