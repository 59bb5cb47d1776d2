"""Where a stream's reader is (rank of world_size, DataLoader worker of num_workers) and
whether a saved position can continue there: a stream's position is its own reader's, so it
continues exactly only on the same layout and data settings (data/streams.py, data/mixture.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import get_worker_info


def reader_layout(rank: int | None, world_size: int | None) -> dict[str, int]:
    """Where this process reads: rank of world_size (the process group's when set_rank was not
    called, so ranks never read alike), DataLoader worker of num_workers (0: the main process)."""
    if rank is None:
        group = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank, world_size = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if group else (0, 1)
    worker = get_worker_info()
    return {"rank": rank, "world_size": world_size, "worker": worker.id if worker else 0,
            "num_workers": worker.num_workers if worker else 0}


def reader_states(loader_state: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Each reader's dataset state in a StatefulDataLoader state_dict, in worker order."""
    if "_snapshot" not in loader_state:
        return [loader_state.get("dataset_state")]
    workers = loader_state["_snapshot"]["_worker_snapshots"]
    return [workers[f"worker_{i}"].get("dataset_state") for i in range(len(workers))]


def check_loader_state(dataset: Any, loader_state: dict[str, Any], rank: int, world_size: int,
                       num_workers: int) -> str | None:
    """`dataset.check_state` for every reader of a saved StatefulDataLoader state: the first reason, or None."""
    for worker, state in enumerate(reader_states(loader_state)):
        now = {"rank": rank, "world_size": world_size, "worker": worker, "num_workers": num_workers}
        if reason := dataset.check_state(state if isinstance(state, dict) else {}, now):
            return reason
    return None


# A new run that keeps the weights and reads the data from its start: what is left when the saved position cannot go on.
AFRESH = "or keep the weights and start the data afresh in a new run (trainer.init_from=<the checkpoint>)"


def settings_change(saved: Any, now: dict[str, Any], section: str = "data") -> str | None:
    """Why a position saved with reader layout and data settings `saved` cannot go on with `now`
    (None: it can), and what to set to resume it (`section`: the stream's config key)."""
    if not isinstance(saved, dict):
        return f"the saved data loader state holds no data stream position (it is another data set's); {AFRESH[3:]}"
    changed = next((key for key, value in now.items() if saved.get(key) != value), None)
    if changed is None:
        return None
    ranks, workers = saved.get("world_size"), saved.get("num_workers")
    # Named as the user sets them: the layout by the launcher and trainer.num_workers, files and tokenizer by their digests.
    if changed in ("rank", "world_size"):
        what = f"{ranks} rank{'s' * (ranks != 1)}, not {now['world_size']}"
        how = f"on {ranks} (torchrun --nproc_per_node={ranks}, or strategy.nproc_per_node={ranks})"
    elif changed in ("worker", "num_workers"):
        what, how = f"trainer.num_workers={workers}, not {now['num_workers']}", f"with trainer.num_workers={workers}"
    elif changed == "files":
        what = f"other files ({section}.path: their names or sizes, or the held-out documents, differ)"
        how = "over the files it read, unchanged"
    elif changed == "tokenizer":
        what, how = f"another tokenizer ({section}.tokenizer)", "with the tokenizer it had"
    else:
        what, how = f"{section}.{changed}={saved.get(changed)!r}, not {now[changed]!r}", f"with {section}.{changed}={saved.get(changed)!r}"
    return (f"the data stream was saved with {what}: a position continues exactly only with the same ranks, DataLoader "
            f"workers and data settings; resume {how}, {AFRESH}")
