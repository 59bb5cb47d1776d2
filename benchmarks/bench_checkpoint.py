"""What an fsdp checkpoint save costs rank 0: strategy.state_dict_type=full against sharded.

Why: `full` (the default) gathers the whole model and optimizer state on rank 0 and writes one
plain file; `sharded` has each rank write its own shards with torch.distributed.checkpoint and
gathers nothing. A model whose full state does not fit in rank 0's memory can only be saved
the sharded way; this shows how much the full way gathers, and what each costs in time.

For each world size: the same Transformer as benchmarks/bench_memory.py, sharded with FSDP2,
2 AdamW steps (so the optimizer has its moments), then each rank saves as the training loop
does (trainer/loop.py `_save`), three times, on CPU/gloo in fresh spawned processes:
  full     full_model_state_dict + full_optimizer_state_dict (every rank takes part, rank 0
           receives), then rank 0 writes the file durably (trainer/checkpoint.py)
  sharded  save_sharded (trainer/fsdp.py): every rank writes its shards, rank 0 renames
Reported: the tensor bytes the save gathers on rank 0 (counted from the gathered state dicts),
the median save time, and the bytes on disk. Then every rank loads the checkpoint back into
a freshly sharded model and optimizer, and the round trip is checked exact.

    python benchmarks/bench_checkpoint.py [--world-sizes 2 4] [--layers 8] [--d-model 512]
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_memory import MIB, parse_arguments, train_steps  # noqa: E402
from ringtrain.models.transformer import Transformer  # noqa: E402
from ringtrain.checkpoints.files import save_checkpoint  # noqa: E402
from ringtrain.checkpoints.sharded import load_sharded, save_sharded  # noqa: E402
from ringtrain.checkpoints.state_dicts import (  # noqa: E402
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from ringtrain.distributed import barrier, gather_objects, join_process_group, teardown_distributed  # noqa: E402
from ringtrain.strategies.launch import launch_ranks  # noqa: E402

REPEATS = 3


def tensor_bytes(state) -> int:
    """Bytes of every tensor in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def save(mode: str, model, optimizer, directory: Path, rank: int) -> int:
    """One save as the loop makes it; returns the tensor bytes gathered on this rank."""
    if mode == "sharded":
        save_sharded(directory / "step.shards", model, optimizer)
        return 0
    state = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    if rank == 0:
        save_checkpoint(directory / "step.pt", state)
    return tensor_bytes(state)


def load(mode: str, model, optimizer, directory: Path, rank: int) -> None:
    if mode == "sharded":
        load_sharded(directory / "step.shards", model, optimizer)
        return
    state = torch.load(directory / "step.pt", weights_only=True) if rank == 0 else {"model": {}, "optimizer": {}}
    load_full_model_state_dict(model, state["model"])
    load_full_optimizer_state_dict(model, optimizer, state["optimizer"])


def measure_rank(mode: str, config: dict, batch: int, directory: str) -> dict:
    """One rank (run by launch_ranks); rank 0's figures, and whether the round trip was exact."""
    info = join_process_group("gloo", "cpu", timeout_minutes=10)
    directory = Path(directory)
    model, optimizer = train_steps("fsdp", config, batch, info)
    gathered, seconds = 0, []
    for _ in range(REPEATS):
        barrier(info)
        started = time.perf_counter()
        gathered = save(mode, model, optimizer, directory, info.rank)
        barrier(info)  # the save is done when the last rank is done
        seconds.append(time.perf_counter() - started)

    fresh_model, fresh_optimizer = train_steps("fsdp", config, batch, info, steps=0)
    load(mode, fresh_model, fresh_optimizer, directory, info.rank)
    expected = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    loaded = {"model": full_model_state_dict(fresh_model),
              "optimizer": full_optimizer_state_dict(fresh_model, fresh_optimizer)}
    exact = info.rank != 0 or _equal(expected, loaded)
    everyone = gather_objects(info, exact)
    teardown_distributed()
    on_disk = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
    return {"gathered": gathered, "seconds": statistics.median(seconds), "on_disk": on_disk, "exact": all(everyone)}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    args, config = parse_arguments(__doc__.splitlines()[0])
    n_params = sum(p.numel() for p in Transformer(**config).parameters())
    print(f"Transformer {args.layers} layers x {args.d_model} wide, vocab {args.vocab}: {n_params / 1e6:.1f} M "
          f"parameters, fp32, AdamW, strategy=fsdp; CPU/gloo, spawned ranks; median of {REPEATS} saves\n")
    header = (f"{'ranks':>5} {'state_dict_type':>15} {'gathered on rank 0 (MiB)':>25} {'save (s)':>9} "
              f"{'on disk (MiB)':>14} {'round trip':>11}")
    print(header)
    print("-" * len(header))
    for world_size in args.world_sizes:
        for mode in ("full", "sharded"):
            with tempfile.TemporaryDirectory() as directory:
                result = launch_ranks(world_size, measure_rank, (mode, config, args.batch, directory))
            print(f"{world_size:>5} {mode:>15} {result['gathered'] / MIB:>25.1f} {result['seconds']:>9.2f} "
                  f"{result['on_disk'] / MIB:>14.1f} {'exact' if result['exact'] else 'DIFFERS':>11}")


if __name__ == "__main__":
    main()
