"""Per-rank training memory under ddp and fsdp: parameters + gradients + optimizer state.

Why: strategy=fsdp exists for models whose training state does not fit on one device. This
counts the bytes of that state each rank holds, at the moment it is largest (after the
backward of an optimizer step, when the gradients exist and the AdamW moments do too), for
DDP (every rank a full copy) and FSDP2 (trainer/strategies/fsdp.py: every rank 1/N), at each world size.

Bytes are counted from the tensors themselves, not from the process: for a sharded DTensor
only its local shard (`to_local()`), a tied parameter once. Not counted: activations (the same
per-rank batch under both), DDP's communication buckets (none extra here: ringtrain's
gradient_as_bucket_view makes the gradients the buckets), and FSDP's transient all-gathered
copy of the unit running at the moment (one Block, or the root with the embeddings).

Each configuration runs 2 AdamW steps in fresh spawned processes on CPU/gloo:

    python benchmarks/bench_memory.py [--world-sizes 2 4] [--layers 8] [--d-model 512] [--vocab 8192]
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

REPO = Path(__file__).resolve().parents[1]

from ringtrain.models.transformer import Transformer  # noqa: E402
from ringtrain.distributed import gather_objects, join_process_group, teardown_distributed  # noqa: E402
from ringtrain.strategies.launch import launch_ranks  # noqa: E402
from ringtrain.strategies.fsdp import shard_model  # noqa: E402
from ringtrain.optim import parameter_groups  # noqa: E402

MIB = 2**20


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for `tensor`: its shard for a DTensor."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())  # a tied parameter once
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(value)
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ),
    }


def train_steps(strategy: str, config: dict, batch: int, info, steps: int = 2,
                after_backward: Callable | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The Transformer under ddp or fsdp, `steps` AdamW steps on random tokens; returns the
    (bare, or sharded in place) model and its optimizer. `after_backward(step, model,
    optimizer)` runs before each optimizer step, when the gradients exist."""
    torch.manual_seed(0)
    model = Transformer(**config)
    if strategy == "ddp":
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)
    else:
        wrapped = shard_model(model, info.device, shard_classes=None, reshard_after_forward=True,
                              param_dtype=None, cpu_offload=False)
    # After sharding: the optimizer must see (and keep state for) the sharded parameters.
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-4)
    generator = torch.Generator().manual_seed(info.rank)
    for step in range(steps):
        tokens = torch.randint(0, config["vocab_size"], (batch, config["block_size"] + 1), generator=generator)
        logits = wrapped(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        if after_backward is not None:
            after_backward(step, model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def measure_rank(strategy: str, config: dict, batch: int) -> list[dict[str, int]]:
    """One rank (run by launch_ranks): 2 AdamW steps; every rank's byte counts, in rank order."""
    info = join_process_group("gloo", "cpu", timeout_minutes=10)
    counts: dict[str, int] = {}

    def count(step, model, optimizer):
        if step == 1:  # gradients present and the AdamW moments made by step 0: the peak
            counts.update(state_bytes(model, optimizer))

    train_steps(strategy, config, batch, info, after_backward=count)
    everyone = gather_objects(info, counts)
    teardown_distributed()
    return everyone


def parse_arguments(description: str, more: Callable[[argparse.ArgumentParser], None] | None = None
                    ) -> tuple[argparse.Namespace, dict]:
    """The world sizes, the batch and the Transformer's shape from the command line, and the
    Transformer's arguments (this script's and bench_checkpoint.py's, which adds its own
    options through `more`)."""
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    args = parser.parse_args()
    config = dict(vocab_size=args.vocab, block_size=args.block_size, n_layers=args.layers,
                  n_heads=args.heads, d_model=args.d_model, dropout=0.0)
    return args, config


def main() -> None:
    args, config = parse_arguments(__doc__.splitlines()[0])
    n_params = sum(p.numel() for p in Transformer(**config).parameters())
    print(f"Transformer {args.layers} layers x {args.d_model} wide, vocab {args.vocab}, block {args.block_size}: "
          f"{n_params / 1e6:.1f} M parameters (tied head), fp32, AdamW; 2 steps, CPU/gloo, spawned ranks")
    print("bytes per rank after backward of step 2 (MiB); fsdp ranks differ by padding, the largest shown\n")
    header = f"{'ranks':>5} {'strategy':>8} {'params':>9} {'grads':>9} {'optimizer':>10} {'total':>9} {'fsdp/ddp':>9}"
    print(header)
    print("-" * len(header))
    for world_size in args.world_sizes:
        totals = {}
        for strategy in ("ddp", "fsdp"):
            ranks = launch_ranks(world_size, measure_rank, (strategy, config, args.batch))
            largest = max(ranks, key=lambda counts: sum(counts.values()))
            totals[strategy] = total = sum(largest.values())
            ratio = f"{total / totals['ddp']:>9.3f}" if strategy == "fsdp" else f"{'':>9}"
            print(f"{world_size:>5} {strategy:>8} {largest['params'] / MIB:>9.1f} {largest['grads'] / MIB:>9.1f} "
                  f"{largest['optimizer'] / MIB:>10.1f} {total / MIB:>9.1f} {ratio}")


if __name__ == "__main__":
    main()
