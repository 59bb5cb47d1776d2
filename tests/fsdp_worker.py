"""One rank of the 2-rank jobs in test_fsdp.py, and the training code the tests share with it.

`python tests/fsdp_worker.py SCENARIO OUT_DIR [IN_DIR]` runs under RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT (set by the test, as torchrun would) on gloo; rank 0 writes what
the test compares into OUT_DIR. The same `train` function runs the single-process reference
in the test itself, so the two runs differ only in the strategy.

Scenarios:
  train       each case in CASES for STEPS steps under fsdp; the adamw case also writes a
              full (model + optimizer) checkpoint at RESUME_STEP
  resume      fresh processes resume under fsdp from IN_DIR's step-RESUME_STEP checkpoints (one
              written under fsdp, one by a single process), and round-trip a sharded checkpoint
  ddp_resume  resume the fsdp checkpoint under DDP
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ringtrain.models.transformer import Transformer
from torch.distributed.fsdp import FSDPModule

from ringtrain.checkpoints.sharded import load_sharded, save_sharded
from ringtrain.checkpoints.state_dicts import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from ringtrain.config.schema import strategy_option
from ringtrain.strategies.fsdp import resolve_shard_classes, shard_model


def strategy_of(model: nn.Module):
    """The strategy whose model this is, for its no-sync, clipping and inference contexts."""
    return strategy_option("fsdp" if isinstance(model, FSDPModule) else "single")
from ringtrain.optim import parameter_groups

CONFIG = dict(vocab_size=16, block_size=16, n_layers=2, n_heads=2, d_model=32, dropout=0.0)
GLOBAL_BATCH = 8  # 2B: each of 2 ranks trains on B = 4 sequences per step
STEPS, RESUME_STEP = 40, 20
EVAL_EVERY = 10  # steps between evaluation forwards
CLIP = 0.05  # well under the unclipped norms (about 1 at the start), so it bites every step

# name -> (optimizer, micro-batches per rank, max grad norm, shard_model keyword arguments)
CASES: dict[str, tuple[str, int, float, dict]] = {
    "sgd": ("sgd", 1, 0.0, {}),
    "adamw": ("adamw", 1, 0.0, {}),
    # Nested units (MLP inside Block) and Embedding units; the tied token embedding is left
    # to the root, which must not change the result.
    "sgd_accumulate": ("sgd", 2, 0.0, {"shard_names": ["Block", "MLP", "Embedding"], "reshard_after_forward": False}),
    "sgd_clip": ("sgd", 1, CLIP, {}),
    "sgd_cpu_offload": ("sgd", 1, 0.0, {"cpu_offload": True}),
}
BF16_STEPS = 3


def build_model() -> Transformer:
    torch.manual_seed(0)  # the same initial weights in every process
    return Transformer(**CONFIG)


def build_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    # ringtrain's two groups (decay matrices only): the name-keyed state must keep them apart.
    # eps=1e-6, not 1e-8: the attention key bias has no true gradient (softmax ignores a shift
    # shared by all keys), so its gradient is pure roundoff, which eps=1e-8 lets Adam blow up
    # into lr-sized steps; summing in another order (2 ranks vs 1) then moves it by 1.7e-4.
    return torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-2, eps=1e-6)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed random token batch of optimizer step `step`, the same in every process."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, CONFIG["block_size"]), generator=generator)
    targets = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, CONFIG["block_size"]), generator=generator)
    return inputs, targets


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    *,
    rank: int = 0,
    world_size: int = 1,
    micro_batches: int = 1,
    clip: float = 0.0,
    early_gradients: list[bool] | None = None,
) -> list[float]:
    """Optimizer steps `steps` on this rank's rows of each global batch, as ringtrain's loop
    does them; returns the gradient norms before clipping (when clipping). `early_gradients`
    collects, for each micro-batch but the last, whether any parameter had a .grad after it:
    under FSDP2 that means it was reduce-scattered instead of accumulated locally."""
    params = list(model.parameters())
    norms = []
    for step in steps:
        inputs, targets = (t.chunk(world_size)[rank] for t in global_batch(step))
        pieces = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)))
        for i, (x, y) in enumerate(pieces):
            last = i == len(pieces) - 1
            with strategy_of(model).no_sync(model, enabled=last):
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
                (loss / len(pieces)).backward()
            if early_gradients is not None and not last:
                early_gradients.append(any(p.grad is not None for p in params))
        if clip:
            norms.append(strategy_of(model).clip_gradients(params, clip).item())
        optimizer.step()
        for param in params:
            param.grad = None
        if step % EVAL_EVERY == EVAL_EVERY - 1:
            # As ringtrain evaluates between steps: must leave training unchanged.
            with strategy_of(model).inference(model):
                model.eval()
                model(inputs)
                model.train()
    return norms


def sharded_model(
    shard_names: list[str] | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    model = build_model()
    classes = resolve_shard_classes(model, shard_names) if shard_names else None
    return shard_model(
        model, torch.device("cpu"), shard_classes=classes, reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype, cpu_offload=cpu_offload,
    )


def save_full_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    state = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    if rank == 0:
        torch.save(state, path)


def load_full_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    # Only rank 0 reads the file: the others pass {} and receive rank 0's state.
    state = torch.load(path, weights_only=True) if rank == 0 else {"model": {}, "optimizer": {}}
    load_full_model_state_dict(model, state["model"])
    load_full_optimizer_state_dict(model, optimizer, state["optimizer"])


# --- scenarios -----------------------------------------------------------------------------------


def scenario_train(out: Path, rank: int, world_size: int) -> None:
    report = {}
    for name, (optimizer_name, micro_batches, clip, options) in CASES.items():
        model = sharded_model(**options)
        optimizer = build_optimizer(model, optimizer_name)
        early_gradients: list[bool] = []
        common = dict(rank=rank, world_size=world_size, micro_batches=micro_batches, clip=clip,
                      early_gradients=early_gradients)
        if name == "adamw":
            train(model, optimizer, range(RESUME_STEP), **common)
            save_full_checkpoint(out / "adamw_step20.pt", model, optimizer, rank)
            norms = train(model, optimizer, range(RESUME_STEP, STEPS), **common)
        else:
            norms = train(model, optimizer, range(STEPS), **common)
        weights = full_model_state_dict(model)
        assert bool(weights) == (rank == 0), "full state must be on rank 0 only"
        if rank == 0:
            torch.save(weights, out / f"{name}.pt")
        report[name] = {"norms": norms, "early_gradients": early_gradients}

    # bf16 compute with float32 reduction and float32 sharded parameters: runs, stays close.
    model = sharded_model(param_dtype=torch.bfloat16)
    optimizer = build_optimizer(model, "sgd")
    train(model, optimizer, range(BF16_STEPS), rank=rank, world_size=world_size)
    report["bf16_param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    with strategy_of(model).inference(model):
        report["bf16_output_dtype"] = str(model(global_batch(0)[0]).dtype)
    weights = full_model_state_dict(model)
    if rank == 0:
        torch.save(weights, out / "sgd_bf16.pt")
        (out / "report.json").write_text(json.dumps(report))


def scenario_resume(out: Path, source: Path, rank: int, world_size: int) -> None:
    common = dict(rank=rank, world_size=world_size)
    # 1. fsdp checkpoint -> fsdp, via a sharded checkpoint round trip on the way.
    model = sharded_model()
    optimizer = build_optimizer(model, "adamw")
    load_full_checkpoint(source / "adamw_step20.pt", model, optimizer, rank)
    sharded_dir = out / "sharded"
    stale = sharded_model()  # an older save of the same name, which the next one replaces
    save_sharded(sharded_dir, stale, build_optimizer(stale, "adamw"))
    save_sharded(sharded_dir, model, optimizer)
    reloaded = sharded_model()
    reloaded_optimizer = build_optimizer(reloaded, "adamw")
    load_sharded(sharded_dir, reloaded, reloaded_optimizer)
    same = _same_full_state(model, optimizer, reloaded, reloaded_optimizer)
    train(reloaded, reloaded_optimizer, range(RESUME_STEP, STEPS), **common)
    weights = full_model_state_dict(reloaded)
    if rank == 0:
        torch.save(weights, out / "fsdp_resumed.pt")
        leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith("."))
        (out / "report.json").write_text(json.dumps({"sharded_same": same, "leftovers": leftovers}))

    # 2. single-process checkpoint (name-keyed state written without a process group) -> fsdp.
    model = sharded_model()
    optimizer = build_optimizer(model, "adamw")
    load_full_checkpoint(source / "single_step20.pt", model, optimizer, rank)
    train(model, optimizer, range(RESUME_STEP, STEPS), **common)
    weights = full_model_state_dict(model)
    if rank == 0:
        torch.save(weights, out / "single_to_fsdp.pt")


def scenario_ddp_resume(out: Path, source: Path, rank: int, world_size: int) -> None:
    model = nn.parallel.DistributedDataParallel(build_model())
    optimizer = build_optimizer(model.module, "adamw")
    # Every rank passes the whole state here, as ringtrain's loader gives it to every rank.
    state = torch.load(source / "adamw_step20.pt", weights_only=True)
    load_full_model_state_dict(model, state["model"])
    load_full_optimizer_state_dict(model, optimizer, state["optimizer"])
    train(model, optimizer, range(RESUME_STEP, STEPS), rank=rank, world_size=world_size)
    checkpoint = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    assert bool(checkpoint["model"]) == (rank == 0) and bool(checkpoint["optimizer"]) == (rank == 0)
    if rank == 0:
        torch.save(checkpoint, out / "ddp_resumed.pt")


def _same_full_state(model_a, optimizer_a, model_b, optimizer_b) -> bool:
    """Whether two models and optimizers hold identical full states (answer on rank 0)."""
    a = {"model": full_model_state_dict(model_a), "optimizer": full_optimizer_state_dict(model_a, optimizer_a)}
    b = {"model": full_model_state_dict(model_b), "optimizer": full_optimizer_state_dict(model_b, optimizer_b)}
    return _equal(a, b)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    from ringtrain.distributed import exit_rank, teardown_distributed

    scenario, out = sys.argv[1], Path(sys.argv[2])
    source = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if scenario == "train":
        scenario_train(out, rank, world_size)
    elif scenario == "resume":
        scenario_resume(out, source, rank, world_size)
    elif scenario == "ddp_resume":
        scenario_ddp_resume(out, source, rank, world_size)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    teardown_distributed()
    exit_rank(0)  # skips interpreter finalisation, which can abort after gloo (see exit_rank)


if __name__ == "__main__":
    main()  # the test puts the repository on PYTHONPATH
