"""Batches from a streamed training set: a torch `IterableDataset` (data=stream, data=mixture,
or a user's own), read through torchdata's `StatefulDataLoader`, whose state (the dataset's
`state_dict()` in each worker, and what the loader had yielded) goes into every checkpoint, one
per rank, so that a resumed run continues at the next unseen example without reading through
the consumed ones.

A stream has no length: the run is `trainer.max_steps` steps, and its position is the stream's
own, not a global epoch position, so it continues exactly only on as many ranks and workers as
saved it. It must not end (`batches`). The stream's protocol, all of it optional but `__iter__`:

    set_rank(rank, world_size)         which share of the data this rank reads
    state_dict() / load_state_dict()   its position (torchdata's protocol); without them the
                                       loader replays the consumed batches on resume
    check_resume(state, rank, world_size, num_workers) -> str | None
                                       why a saved position cannot continue here, one line
    resume_note(state) -> str | None   something a continued run should say (changed weights)
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ringtrain.data.batches import to_device
from ringtrain.distributed import DistInfo
from ringtrain.errors import ConfigError
from ringtrain.loop.loaders import Batch, WorkerOptions

log = logging.getLogger("ringtrain")


class StreamLoader:
    def __init__(self, dataset: IterableDataset, batch_size: int, dist: DistInfo, workers: WorkerOptions):
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:
            raise ConfigError("a streamed training set is read with torchdata's StatefulDataLoader: "
                              "pip install 'ringtrain[stream]' (or torchdata)") from None
        if callable(set_rank := getattr(dataset, "set_rank", None)):
            set_rank(dist.rank, dist.world_size)
        self.dataset, self.batch_size, self.dist, self.workers = dataset, batch_size, dist, workers
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which newer torch deprecates
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
            self.loader = StatefulDataLoader(dataset, batch_size=batch_size, **workers.loader_arguments(dataset))

    def restore(self, states: list[dict[str, Any]]) -> None:
        """Continue at this rank's position in `states` (every rank's, from a checkpoint)."""
        rank, world = self.dist.rank, self.dist.world_size
        if len(states) != world:
            raise ConfigError(
                f"the data stream was saved by {len(states)} ranks, not {world}: a stream's position continues exactly "
                f"only on as many ranks and DataLoader workers as saved it; resume with {len(states)} ranks, or start "
                f"a new run (trainer.resume=null)")
        state = states[rank]
        check = getattr(self.dataset, "check_resume", None)
        if callable(check) and (reason := check(state, rank, world, self.workers.num_workers)):
            raise ConfigError(reason)  # before load_state_dict, which fails on another layout without a word
        note = getattr(self.dataset, "resume_note", None)
        if callable(note) and (said := note(state)) and self.dist.is_main:
            log.info(said)
        if not callable(getattr(self.dataset, "state_dict", None)) and self.dist.is_main:
            log.warning(f"{type(self.dataset).__name__} has no state_dict(): the loader reads through the batches "
                        f"consumed before the checkpoint to continue after them")
        self.loader.load_state_dict(state)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def batches(self) -> Iterator[Batch]:
        """This rank's batches, on the device, from where the stream stands (called once a run:
        another iterator would restart the workers from the main process's copy)."""
        taken = 0
        for taken, batch in enumerate(self.loader, start=1):
            yield to_device(batch, self.dist.device)
        raise ConfigError(
            f"the streamed training set {type(self.dataset).__name__} ended after {taken} batches of this run; a "
            f"stream must not end (the ranks would fall out of step): repeat its data, and let trainer.max_steps "
            f"end the run")
