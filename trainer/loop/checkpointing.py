"""The loop's checkpoints: what goes into one, and taking it back out. Each part that owns
state gives its own: the strategy the weights and optimizer state (full, or each rank's
shards), the training parts the schedule and loss scaler, Progress where training stands,
every rank its RNG state; the run adds what rebuilds and decodes the model from the file
alone (config, data sizes, vocabulary). Writing the file is the CheckpointStore's business."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.checkpoints.files import CHECKPOINT_FORMAT, CheckpointError, load_model_weights, rng_state, set_rng_state
from ringtrain.checkpoints.sharded import load_sharded
from ringtrain.checkpoints.store import CheckpointStore
from ringtrain.config.schema import RunConfig
from ringtrain.data.bundle import DataBundle
from ringtrain.distributed import DistInfo, broadcast_object, gather_objects
from ringtrain.loop.parts import TrainingParts
from ringtrain.loop.progress import Progress


class Checkpointer:
    def __init__(self, run: RunConfig, dist: DistInfo, run_dir: Path, data: DataBundle, task: Any):
        self.run, self.dist = run, dist
        self.store = CheckpointStore(Path(run_dir) / "checkpoints", run.trainer.keep_last_k)
        # What rebuilds the model and decodes its outputs from the file alone (ringtrain
        # sample / evaluate), the same in every checkpoint of the run.
        self.description = {"config": run.resolved, "monitor": task.monitor,
                            "data_dims": dict(data.dims), "vocab": data.vocab}

    @property
    def last(self) -> Path:
        return self.store.last

    def save(self, parts: TrainingParts, progress: Progress, best: bool) -> None:
        """Every rank contributes; rank 0 writes step-<N>.pt, last.pt (and best.pt); every
        rank learns whether it worked."""
        rng = gather_objects(self.dist, rng_state(self.dist.device))  # every rank's, for exact resume
        weights = parts.strategy.checkpoint_weights(parts.model, parts.optimizer,
                                                    lambda: self.store.shards_path(progress.step))
        failure = None
        if self.dist.is_main:
            state = {"format": CHECKPOINT_FORMAT, **weights, **parts.state_dict(),
                     "progress": progress.state_dict(), "rng": rng, **self.description}
            try:
                self.store.save(state, progress.step, best)
            except CheckpointError as err:
                failure = str(err)
        # Also the barrier: nobody reads or resumes before the file is complete, and a failed
        # save (a full disk) ends every rank with its one line instead of leaving them waiting.
        failure = broadcast_object(self.dist, failure)
        if failure:
            raise CheckpointError(failure)


def load_weights_before_set_up(model, state: dict, path: Path) -> None:
    """Full weights load into the bare model before the strategy wraps or shards it; sharded
    ones once it has (load_training_state)."""
    if "shards" not in state:
        load_model_weights(model, state, path)


def load_training_state(parts: TrainingParts, state: dict, dist: DistInfo) -> Progress:
    """Put a checkpoint's state back into the set-up parts; return where training stood."""
    if "shards" in state:  # into the set-up model: each rank reads what its shards need
        load_sharded(state["shards"], parts.model, parts.optimizer)
    else:
        parts.strategy.load_optimizer_state(parts.model, parts.optimizer, state["optimizer"])
    parts.load_state_dict(state)
    rng = state["rng"]
    set_rng_state(rng[dist.rank] if len(rng) == dist.world_size else rng[0], dist.device)
    progress = Progress()
    progress.load_state_dict(state["progress"])
    return progress
