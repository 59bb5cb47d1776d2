"""Process groups, rank information, starting workers, and the few collectives the loop needs.

Two ways into a multi-process run, both ending in the same `setup_distributed`:
  * torchrun (or any launcher that sets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)
  * `spawn_workers`, used when `strategy=ddp strategy.nproc_per_node=N` runs without torchrun:
    it sets the same variables for N local processes, so the rest of the code cannot tell.
Global rank (`rank`) and node-local rank (`local_rank`) are kept apart: nothing assumes one node.
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from ringtrain.errors import RankEnded, UserError


class DistributedSetupError(UserError, RuntimeError):
    """The process group or device cannot be set up as configured; message says the fix."""


class WorkerFailedError(RankEnded):
    """A worker started by spawn_workers failed; its own error was printed above.

    `exit_code` is what the whole job exits with: the worker's own status (2 when it reported a
    mistake in the configuration, 1 for a crash).
    """

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


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


def resolve_device(accelerator: str, local_rank: int) -> torch.device:
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DistributedSetupError(
            f"local rank {local_rank} needs CUDA device {local_rank} but only {count} are visible; "
            f"start at most {count} processes per node or use trainer.accelerator=cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def resolve_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistributedSetupError(
            "strategy.backend=nccl needs a CUDA device on every rank and this rank has none; "
            "use strategy.backend=gloo (or auto)"
        )
    return requested


def setup_distributed(strategy: str, backend: str, accelerator: str, timeout_minutes: float) -> DistInfo:
    """Join the process group for strategy=ddp or fsdp; describe the single process otherwise."""
    if strategy not in ("ddp", "fsdp") or not under_torchrun():
        return DistInfo(0, 0, 1, resolve_device(accelerator, 0), None)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = resolve_device(accelerator, local_rank)
    backend = resolve_backend(backend, device)
    timeout = timedelta(minutes=timeout_minutes)
    restarted = _store_for_restarted_workers(rank, world_size, timeout)
    dist.init_process_group(
        backend=backend, **({"store": restarted} if restarted else {"init_method": "env://"}),
        rank=rank, world_size=world_size, timeout=timeout,
    )
    health = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes)) if world_size > 1 else None
    return DistInfo(rank, local_rank, world_size, device, backend, health)


def _store_for_restarted_workers(rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """For workers torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0): the env:// store with
    this attempt's keys kept apart from the earlier attempts'. None otherwise (env:// as usual).

    torchrun's agent hosts one TCPStore for the whole job (MASTER_PORT) and restarted workers
    meet in it again, but every process group writes the same key names in every attempt
    (default_pg/..., the groups new_group() numbers in the same order). A restarted rank read
    the killed attempt's keys: gloo's connectFullMesh dialled the dead rank's old address
    ("timed out connecting: Connection refused") or the ranks waited on each other in a futex
    until the collective timeout, and the restarted job failed or hung. A prefix per attempt
    gives each attempt fresh keys. (Elastic membership changes restart workers without
    counting a restart; this does not cover those.)
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    # "default_pg" inside, as init_process_group itself does when it makes the store.
    return dist.PrefixStore("default_pg", dist.PrefixStore(f"ringtrain/attempt-{attempt}", store))


class PeerLostError(RankEnded):
    """Another rank ended (crashed, killed, its machine lost) while this one was talking to it.
    That rank's own output says why; this one reports it in one line and exits 1."""

    exit_code = 1


# What gloo and NCCL say when the other end of a collective went away.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "communicator was aborted")


def peer_lost(err: BaseException, rank: int) -> PeerLostError | None:
    """The one-line error for a collective that failed because another rank ended, else None."""
    text = str(err).strip()
    if not isinstance(err, RuntimeError) or not any(marker in text.lower() for marker in _PEER_LOST):
        return None
    # "[/path/to/gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:21635. This is ..."
    cause = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]).split(". ")[0][:200]
    return PeerLostError(
        f"rank {rank}: another rank ended while this one was waiting for it ({cause}); its own output says "
        f"why. The checkpoints are intact: the same command continues from the last one"
    )


def is_timeout(err: BaseException) -> bool:
    """Whether `err` is a collective that gave up waiting (strategy.timeout_minutes)."""
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


def name_unresponsive_ranks(info: DistInfo, timeout_minutes: float) -> str:
    """After a collective timed out: the one line saying which rank stopped answering.

    Every rank that is still alive checks in with rank 0 through torch's monitored_barrier,
    which names on rank 0 the ranks that did not; the others learn at least whether rank 0
    itself is the one missing.
    """
    # The ranks still alive timed out on the same collective, entered within about a step of
    # each other, so they reach this barrier about as close together: a third of the timeout
    # (5 to 30 s) is plenty, and every second of it delays the end of the job.
    wait = timedelta(seconds=max(5.0, min(30.0, timeout_minutes * 60 / 3)))
    fix = (f"no reply within strategy.timeout_minutes={timeout_minutes:g}; every rank stops. Look at that rank's "
           f"machine (stopped, swapping, hung in I/O), or raise strategy.timeout_minutes for slow steps")
    if info.health_group is None:
        return f"a collective timed out: {fix}"
    try:
        dist.monitored_barrier(group=info.health_group, timeout=wait, wait_all_ranks=True)
    except RuntimeError as err:
        # Rank 0's error in torch 2.13: "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in
        # 5000 ms" ("Rank 1 failed ..." for one). Only the numbers after "Rank(s)" are missing
        # ranks; reading every number before "failed to pass" counted rank 0 itself as well.
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
    """End a rank's process after a clean teardown, without Python's interpreter finalisation.

    torch's gloo backend keeps its worker threads after destroy_process_group, and they free
    the last collectives' work objects a moment later. Freeing the Python tensors those hold
    takes the GIL; if the interpreter is finalising by then, Python ends the thread and the
    process aborts (std::terminate, SIGABRT), so torchrun reports a failed job after a run that
    succeeded. A core dump showed it: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork -> take
    the GIL during Py_FinalizeEx (about 1 in 70 two-rank runs here). Nothing of ours needs
    finalising: logs and the standard streams are flushed first; event files and checkpoints
    are closed by then.
    """
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


# --- starting workers without torchrun ------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_entry(local_rank: int, world_size: int, port: int, fn: Callable, pickled_args: bytes, results) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N workers with all cores' threads each would fight over the cores
        # (2.5x slower measured with 2 workers on 2 cores). OMP_NUM_THREADS overrides this.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # tqdm (ringtrain's progress bar, and torch.compile's own) guards its output with a
    # multiprocessing lock, a semaphore that a worker leaving through os._exit never releases:
    # Python's resource tracker then warns of leaked semaphores at exit. A worker is one
    # process with its own output, so a thread lock is all it needs.
    tqdm.set_lock(threading.RLock())
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    result = fn(*pickle.loads(pickled_args))
    if local_rank == 0:
        # By value, as bytes: torch's multiprocessing pickler would send tensors (the weights a
        # Python caller gets back) as shared-memory handles that the parent fetches from this
        # process later, after exit_rank has ended it (ConnectionRefusedError in the parent).
        results.send_bytes(pickle.dumps(result))  # written to the pipe before returning
    results.close()
    exit_rank(0)  # a run that stopped early reports it through its result, on rank 0


def spawn_workers(nprocs: int, fn: Callable, args: tuple,
                  forward_signals: tuple[str, ...] | list[str] = ("SIGTERM", "SIGINT", "SIGUSR1")) -> Any:
    """Run `fn(*args)` in `nprocs` fresh processes on this node, as torchrun would; return rank 0's result.

    If any worker fails, the others are terminated and WorkerFailedError is raised here, so a
    failing rank ends the job instead of leaving the rest waiting in a collective.

    `args` reach every worker by value, as their own copy (plain pickle, as bytes). Handed to
    torch.multiprocessing as they are, tensors in them (the Python API's model and data sets)
    would be moved into shared memory, one storage for all ranks: each rank's optimizer would
    then update the same weights, every step applied N times.

    Stop signals sent to this process (`forward_signals`: `kill <pid>`, a scheduler, Ctrl-C)
    are forwarded to the live workers, as torchrun forwards them, and the workers stop the
    way trainer/signals.py describes (finish the step, save last.pt); rank 0's result then
    says `stopped`. Without forwarding, a SIGTERM here killed only this process and left the
    workers training with no one to report to. This process's own handlers are restored
    afterwards. If this process is SIGKILLed instead, torch.multiprocessing has the kernel
    send each worker SIGINT (PR_SET_PDEATHSIG), which stops them the same way: no orphans
    are left training.
    """
    try:
        pickled_args = pickle.dumps(args)
    except (pickle.PicklingError, AttributeError, TypeError) as err:  # a lambda, a class local to a function
        from ringtrain.errors import ConfigError

        raise ConfigError(
            f"the {nprocs} spawned ranks each need a copy of the model, data and task, and one does not "
            f"pickle ({' '.join(str(err).split())[:200]}); define those classes and functions at module level"
        ) from None
    ctx = mp.get_context("spawn")
    # A pipe, not a SimpleQueue: a queue's lock is a semaphore that workers leaving through
    # os._exit never release, and Python's resource tracker then warns of a leak at exit.
    parent_end, results = ctx.Pipe(duplex=False)
    port = _free_port()
    result, have_result = None, False
    with _ForwardedSignals(forward_signals) as forwarded:
        try:
            context = mp.start_processes(
                _spawned_entry,
                args=(nprocs, port, fn, pickled_args, results),
                nprocs=nprocs,
                join=False,
                start_method="spawn",
            )
            forwarded.attach(context.processes)
            while True:
                # Read rank 0's result while the workers run: a result bigger than the pipe's
                # buffer (the Python API's trained weights) would block rank 0 in send() while
                # this process waited for it to exit.
                if not have_result and parent_end.poll():
                    result, have_result = pickle.loads(parent_end.recv_bytes()), True
                if context.join(timeout=0.2):  # raises when a worker failed (others terminated)
                    break
        except mp.ProcessExitedException as err:
            code = err.exit_code if err.exit_code and err.exit_code > 0 else 1
            if forwarded.received and (-(err.exit_code or 0) in forwarded.signums or code - 128 in forwarded.signums):
                # Killed by the forwarded signal before it could handle it (still starting up),
                # or a repeated signal made it exit at once: nothing was saved by this stop.
                raise WorkerFailedError(
                    f"stopped by {forwarded.received}: worker rank {err.error_index} exited at once "
                    f"(status {err.exit_code}); nothing was saved by this stop",
                    exit_code=code if code > 128 else 128 + forwarded.received_signum,
                ) from None
            raise WorkerFailedError(
                f"worker rank {err.error_index} exited with code {err.exit_code}; its error is printed above",
                exit_code=code,
            ) from None
        except mp.ProcessRaisedException as err:
            # An unexpected exception: its traceback is what a developer needs, so show it whole.
            print(str(err).rstrip(), file=sys.stderr)
            last_line = str(err).strip().splitlines()[-1]
            raise WorkerFailedError(f"worker rank {err.error_index} failed: {last_line}", exit_code=1) from None
        results.close()
        if not have_result and parent_end.poll():
            result, have_result = pickle.loads(parent_end.recv_bytes()), True
    if not have_result:
        # torch.multiprocessing ends a worker that a KeyboardInterrupt reached before training
        # (a forwarded SIGINT while it was still starting) with status 0 and no result.
        if forwarded.received:
            raise WorkerFailedError(
                f"stopped by {forwarded.received} while the workers were starting; nothing to save",
                exit_code=128 + forwarded.received_signum,
            )
        raise WorkerFailedError("worker rank 0 ended without a result; its output is above", exit_code=1)
    return result


class _ForwardedSignals:
    """While active (main thread only), stop signals to this process go to the workers too.

    The handlers are Python-level: they run on the main thread, which waits in `join` with a
    timeout, so they run within a fraction of a second and may log. A signal that arrives
    before the workers exist is forwarded to them as soon as they do.
    """

    def __init__(self, names: tuple[str, ...] | list[str]):
        self.signums = [int(getattr(signal, name)) for name in names]
        self.received: str | None = None  # the first signal's name
        self._pending: list[int] = []
        self._processes: list = []
        self._previous: dict[int, Any] = {}

    @property
    def received_signum(self) -> int:
        return int(getattr(signal, self.received)) if self.received else 0

    def __enter__(self) -> "_ForwardedSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                self._previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def attach(self, processes: list) -> None:
        self._processes = list(processes)
        for signum in self._pending:
            self._send(signum)
        self._pending.clear()

    def _forward(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.received = self.received or name
        if not self._processes:
            self._pending.append(signum)
            return
        logging.getLogger("ringtrain").warning(f"received {name}: forwarding it to the {len(self._processes)} workers")
        self._send(signum)

    def _send(self, signum: int) -> None:
        for process in self._processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass
