"""What an fsdp checkpoint save costs rank 0: strategy.state_dict_type=full against sharded.

Why: `full` (the default) gathers the whole model and optimizer state on rank 0 and writes one
plain file; `sharded` has each rank write its own shards with torch.distributed.checkpoint and
gathers nothing. A model whose full state does not fit in rank 0's memory can only be saved
the sharded way; this shows how much the full way gathers, and what each costs in time.

For each world size: the same Transformer as benchmarks/bench_memory.py, sharded with FSDP2,
2 AdamW steps (so the optimizer has its moments), then each rank saves as the training loop
does (trainer/checkpoints/__init__.py), three times, on CPU/gloo in fresh spawned processes:
  full     full_model_state_dict + full_optimizer_state_dict (every rank takes part, rank 0
           receives), then rank 0 writes the file durably (trainer/checkpoints/files.py)
  sharded  save_sharded (trainer/checkpoints/sharded.py): every rank writes its shards, rank 0 renames
Reported: the tensor bytes the save gathers on rank 0 (counted from the gathered state dicts),
the median save time, and the bytes on disk. Then every rank loads the checkpoint back into
a freshly sharded model and optimizer, and the round trip is checked exact.

Then what checksums cost (trainer/checkpoints/files.py), one process, the same model after
2 AdamW steps, `--repeats` times each, medians:
  write    CheckpointManager.save of the full state (the background writer's work) with
           torch.save's CRC-32 on (ringtrain's checksums) and off; for a sharded checkpoint
           the CRC-32 of its shard files that CheckpointManager.save records
  stop     the training loop's CheckpointManager.save with background writes (bench_checkpoint_stop's
           measure: what training waits for), CRC-32 on and off
  load     verifying a file's checksums (resume, the tools), beside torch.load of it; a shards
           directory's
  hashes   CRC-32, Adler-32, BLAKE2b and SHA-256 over the same bytes, in memory

    python benchmarks/bench_checkpoint.py [--world-sizes 2 4] [--layers 8] [--d-model 512]
    python benchmarks/bench_checkpoint.py --checksums-only [--repeats 5]
"""
from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests")]

from bench_memory import MIB, parse_arguments, train_steps  # noqa: E402
from helpers import CheckpointStore  # noqa: E402
from ringtrain.checkpoints.files import check_file_bytes, check_shards, directory_checksums, save_checkpoint  # noqa: E402
from ringtrain.checkpoints.sharded import load_sharded, save_sharded  # noqa: E402
from ringtrain.models.transformer import Transformer  # noqa: E402
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


# --- what checksums cost ----------------------------------------------------------------------


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def with_crc32(enabled: bool, action: Callable[[], object]) -> Callable[[], object]:
    """`action` run with torch.save's CRC-32 on or off (a process-wide torch setting)."""
    def run():
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(enabled)
        try:
            return action()
        finally:
            torch.serialization.set_crc32_options(previous)
    return run


def trained_state(config: dict, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The Transformer after 2 AdamW steps on random tokens, one process."""
    torch.manual_seed(0)
    model = Transformer(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(2):
        tokens = torch.randint(0, config["vocab_size"], (batch, config["block_size"] + 1))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def paired_seconds(without: Callable[[], object], with_: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Medians of `without` and `with_` run alternately `repeats` times each, and the median of
    the pairs' differences (alternating keeps a changing machine load out of the difference)."""
    pairs = []
    for _ in range(repeats):
        pairs.append((median_seconds(without, 1), median_seconds(with_, 1)))
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(b - a for a, b in pairs))


def checksum_costs(config: dict, batch: int, repeats: int) -> None:
    from bench_checkpoint_stop import measure as measure_stop  # its Transformer is this one at the defaults

    model, optimizer = trained_state(config, batch)
    state = {"model": full_model_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
    print(f"\nchecksums: one process, median of {repeats}; 'added' is the median of paired differences\n")
    header = f"{'':>34} {'without (s)':>12} {'with (s)':>9} {'added (s)':>10}"
    print(header)
    print("-" * len(header))

    def row(name: str, without: float, with_: float, added: float) -> None:
        print(f"{name:>34} {without:>12.3f} {with_:>9.3f} {added:>10.3f}", flush=True)

    with tempfile.TemporaryDirectory() as directory:  # on the VM's disk, as bench_checkpoint_stop
        directory = Path(directory)
        store = CheckpointStore(directory, keep_last_k=1)  # tests/helpers.py: the manager, one process
        row("full: background write", *paired_seconds(with_crc32(False, lambda: store.save(state, 1, best=False)),
                                                      with_crc32(True, lambda: store.save(state, 1, best=False)),
                                                      repeats))
        size = (directory / "last.pt").stat().st_size
        save_sharded(directory / "step.shards", model, optimizer)
        hashing = median_seconds(lambda: directory_checksums(directory / "step.shards"), repeats)
        row("sharded: background write", 0.0, hashing, hashing)
        row("full: load (torch.load; verify)",
            *paired_seconds(lambda: torch.load(directory / "last.pt", weights_only=True),
                            lambda: (torch.load(directory / "last.pt", weights_only=True),
                                     check_file_bytes(directory / "last.pt")), repeats))
        recorded = directory_checksums(directory / "step.shards")
        verifying = median_seconds(lambda: check_shards(directory / "step.shards", recorded), repeats)
        row("sharded: verify on load", 0.0, verifying, verifying)
        data = (directory / "last.pt").read_bytes()
    # 8 steps between saves: on a quiet VM enough for the previous write to end, so a longer
    # write shows as a longer stop only where it no longer fits beside the steps.
    stops = {on: with_crc32(on, lambda: measure_stop(True, repeats, 8, batch))() for on in (False, True)}
    stop = {on: statistics.median(result["stopped"]) for on, result in stops.items()}
    row("full: training stop (background)", stop[False], stop[True], stop[True] - stop[False])
    print(f"\n{size / MIB:.1f} MiB checkpoint; hashes over it in memory (GB/s):")
    hashes = {"crc32": lambda: zlib.crc32(data), "adler32": lambda: zlib.adler32(data),
              "blake2b": lambda: hashlib.blake2b(data).digest(), "sha256": lambda: hashlib.sha256(data).digest()}
    print("  " + "  ".join(f"{name} {len(data) / median_seconds(run, repeats) / 1e9:.2f}" for name, run in hashes.items()))


def main() -> None:
    def more(parser):
        parser.add_argument("--checksums-only", action="store_true", help="only what checksums cost")
        parser.add_argument("--repeats", type=int, default=5, help="repetitions of each checksum measurement")

    args, config = parse_arguments(__doc__.splitlines()[0], more)
    n_params = sum(p.numel() for p in Transformer(**config).parameters())
    print(f"Transformer {args.layers} layers x {args.d_model} wide, vocab {args.vocab}: {n_params / 1e6:.1f} M "
          f"parameters, fp32, AdamW; torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.checksums_only:
        fsdp_saves(args, config)
    checksum_costs(config, args.batch, args.repeats)


def fsdp_saves(args, config: dict) -> None:
    print(f"\nstrategy=fsdp; CPU/gloo, spawned ranks; median of {REPEATS} saves\n")
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
