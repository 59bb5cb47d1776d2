"""The two PyTorch calls of every training step, without their per-call Python wrappers.

`loss.backward()` and `optimizer.step()` each pass through a layer of Python before reaching
the C++ that does the work: `torch.autograd.backward` checks for tensor subclasses, builds the
initial gradient and validates its shape, stashes a context for compiler threads and looks at
the log level; `Optimizer.step` opens a profiler `record_function` and dispatches step hooks.
On a 2-core CPU that is ~25 us and ~25 us a step, profiler or not. A large model never
notices; the tutorial's two-parameter model, whose whole step is ~110 us, spends a third of
its time there.

So ringtrain makes the same C++ calls directly when nothing those layers do can apply:
  backward(loss)            the autograd engine, for a plain scalar tensor
  optimizer_step(optimizer) SGD's functional update, on the optimizer's own state
and falls back to the plain calls otherwise (tensor subclasses, other optimizers, an active
profiler, so traces keep their `Optimizer.step#...` ranges). Gradients, parameters and
momentum buffers are bit-identical to the plain calls (tests/test_training.py).
"""
from __future__ import annotations

import torch
from torch.optim.sgd import sgd

# What torch.autograd.backward hands the C++ engine in the end (torch >= 1.9).
_run_backward = torch.autograd.Variable._execution_engine.run_backward


def backward(loss: torch.Tensor) -> None:
    """`loss.backward()` for a scalar loss."""
    if type(loss) is not torch.Tensor or loss.dim() != 0:
        loss.backward()
        return
    # A fresh initial gradient, as torch.autograd.backward makes: d loss / d loss = 1.
    _run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`; for SGD, the same functional update `SGD.step` calls.

    Adam and AdamW keep `step()`: the models they train take milliseconds a step, where 25 us
    does not show, and their state initialisation is theirs to keep.
    """
    if type(optimizer) is not torch.optim.SGD or torch.autograd._profiler_enabled():
        optimizer.step()
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            momentum = group["momentum"]
            buffers = [optimizer.state[p].get("momentum_buffer") for p in params] if momentum else []
            sgd(
                params, [p.grad for p in params], buffers,
                foreach=group["foreach"], fused=group["fused"],
                weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            )
            for param, buffer in zip(params, buffers):  # sgd() creates them on the first step
                optimizer.state[param]["momentum_buffer"] = buffer
