"""Process groups, rank information, and the few collectives the loop needs.

A launcher (torchrun, or strategies/launch.py) sets RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT for `join_process_group`. Global and node-local rank are kept apart:
nothing assumes one node. Also here: a failed collective (lost peer, timeout) as one line.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ringtrain.errors import RankEnded, UserError


class DistributedSetupError(UserError, RuntimeError):
    """The process group or device cannot be set up as configured; message says the fix."""


class WorkerFailedError(RankEnded):
    """A rank of a self-launched job failed; its own error was printed above. `exit_code`, the
    whole job's, is the worker's own (2 for a mistake in the configuration, 1 for a crash)."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None: no process group
    # A gloo group of all ranks, made at set-up while everyone still answers: after a
    # collective times out it asks who is missing (name_unresponsive_ranks).
    health_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def under_torchrun() -> bool:
    """True when a launcher (torchrun, or our own spawn) set the rank variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launcher_ranks() -> tuple[int, int]:
    """(all ranks, ranks on this node) the launcher started: WORLD_SIZE and LOCAL_WORLD_SIZE."""
    if not under_torchrun():
        return 1, 1
    world = int(os.environ["WORLD_SIZE"] or 1)
    return world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)


def runs_on_cpu(accelerator: str) -> bool:
    """Whether trainer.accelerator puts the ranks on the CPU (auto: when no CUDA device is visible)."""
    return accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())


def resolve_device(accelerator: str, local_rank: int) -> torch.device:
    if runs_on_cpu(accelerator):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DistributedSetupError(
            f"local rank {local_rank} needs CUDA device {local_rank} but only {count} are visible; "
            f"start at most {count} processes per node or use trainer.accelerator=cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def join_process_group(backend: str, accelerator: str, timeout_minutes: float) -> DistInfo:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = resolve_device(accelerator, local_rank)
    if backend == "auto":  # strategy.check refused nccl for ranks without a CUDA device
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    rendezvous: dict[str, Any] = {"init_method": "env://"}
    if (attempt := int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)) > 0:
        # Workers torchrun restarted keep this attempt's keys apart from earlier attempts'.
        # torchrun's agent hosts one TCPStore for the job, and every process group writes the same
        # keys in every attempt, so a restarted rank would read the killed attempt's: gloo dialled
        # the dead rank's old address ("Connection refused") or the ranks waited until the timeout.
        # (Elastic membership changes restart workers without counting a restart: not covered.)
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        store.set_timeout(timeout)
        # "default_pg" inside, as init_process_group itself does when it makes the store.
        rendezvous = {"store": dist.PrefixStore("default_pg", dist.PrefixStore(f"ringtrain/attempt-{attempt}", store))}
    dist.init_process_group(backend=backend, **rendezvous, rank=rank, world_size=world_size, timeout=timeout)
    health = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes)) if world_size > 1 else None
    return DistInfo(rank, local_rank, world_size, device, backend, health)


# What gloo and NCCL say when the other end of a collective went away.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "communicator was aborted")


def peer_lost(err: BaseException, rank: int) -> RankEnded | None:
    """The one-line error (exit 1) for a collective that failed because another rank ended
    (crashed, killed, its machine lost) while this one was talking to it, else None."""
    text = str(err).strip()
    if not isinstance(err, RuntimeError) or not any(marker in text.lower() for marker in _PEER_LOST):
        return None
    # "[/path/to/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:21635. This is ..."
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0][:200]
    return RankEnded(
        f"rank {rank}: another rank ended while this one was waiting for it ({cause}); its own output says "
        f"why. The checkpoints are intact: the same command with hydra.run.dir=<this run's directory> "
        f"continues from the last one"
    )


def is_timeout(err: BaseException) -> bool:
    """Whether `err` is a collective that gave up waiting (strategy.timeout_minutes)."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def name_unresponsive_ranks(info: DistInfo, timeout_minutes: float) -> str:
    """After a collective timed out: the line saying which rank stopped answering. The live
    ranks check in with rank 0 through monitored_barrier, which names on rank 0 the ranks that
    did not; the others learn at least whether rank 0 is the one missing."""
    # The live ranks timed out on the same collective, entered within about a step of each
    # other: a third of the timeout (5 to 30 s) is plenty, and every second delays the job's end.
    wait = timedelta(seconds=max(5.0, min(30.0, timeout_minutes * 60 / 3)))
    fix = (f"no reply within strategy.timeout_minutes={timeout_minutes:g}; every rank stops. Look at that rank's "
           f"machine (stopped, swapping, hung in I/O), or raise strategy.timeout_minutes for slow steps")
    if info.health_group is None:
        return f"a collective timed out: {fix}"
    try:
        dist.monitored_barrier(group=info.health_group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as err:
        # Rank 0's error in torch 2.13: "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in
        # 5000 ms" ("Rank 1 failed ..." for one): only the numbers after "Rank(s)" are missing.
        named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(err))
        missing = sorted({int(r) for r in re.findall(r"\d+", named.group(1))}) if named else []
        if info.rank == 0 and missing:
            return f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} stopped answering: {fix}"
        if info.rank != 0:
            return f"rank 0 stopped answering, or gave up on another rank: {fix}"
    return f"a collective timed out though every rank answers now (rank {info.rank}): {fix}"


def teardown_distributed(clean_exit: bool = True) -> None:
    """Leave the process group. After a clean run every rank waits for the others first, so
    none closes its connections while a peer may still be using them; after an error there
    is no waiting, since the peers may be gone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean_exit:
        dist.barrier()
    dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process after a clean teardown, without Python's interpreter finalisation:
    gloo's worker threads outlive destroy_process_group and free the last work objects a moment
    later, taking the GIL; during finalisation that aborts the process (SIGABRT in
    ~AsyncAllgatherWork, about 1 in 70 two-rank runs), and torchrun reports a run that succeeded
    as failed. Nothing of ours needs finalising: logs and streams are flushed here, files closed
    by then."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()


def broadcast_object(info: DistInfo, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not info.is_distributed:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(info: DistInfo, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not info.is_distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(info: DistInfo, tensor: torch.Tensor) -> torch.Tensor:
    if info.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
