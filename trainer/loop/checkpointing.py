"""The loop's checkpoints: what goes into one, and taking it back out. Each part that owns
state gives its own: the strategy the weights and optimizer state (full, or each rank's
shards), the training parts the schedule and loss scaler, Progress where training stands,
every rank its RNG state; the run adds what rebuilds and decodes the model from the file
alone (config, data sizes, vocabulary). Writing the file is the CheckpointStore's business."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ringtrain.checkpoints.background import BackgroundWriter, detached_copy
from ringtrain.checkpoints.files import CHECKPOINT_FORMAT, CheckpointError, load_model_weights, rng_state, set_rng_state
from ringtrain.checkpoints.store import CheckpointStore
from ringtrain.config.schema import RunConfig
from ringtrain.data.bundle import DataBundle
from ringtrain.distributed import DistInfo, broadcast_object, gather_objects
from ringtrain.loop.parts import TrainingParts
from ringtrain.loop.progress import Layout, Progress
from ringtrain.loop.watchdog import SAVING, feed

log = logging.getLogger("ringtrain")


class Checkpointer:
    """Saves a run's checkpoints: every rank contributes its part, rank 0 writes.

    With trainer.async_checkpoint (the default) rank 0 only copies the state to CPU memory at a
    save and writes it in a background thread (checkpoints/background.py): training goes on
    while the file is written, fsynced and linked. A write's failure is learned at the next
    save or at `flush`, and raised there on every rank. `flush` waits for the write: fit calls
    it after the last step (the final save, a stop signal's save); leaving the `with` block on
    an exception waits too, so no process exits with its newest save half done.
    """

    def __init__(self, run: RunConfig, dist: DistInfo, run_dir: Path, data: DataBundle, task: Any):
        self.run, self.dist = run, dist
        self.store = CheckpointStore(Path(run_dir) / "checkpoints", run.trainer.keep_last_k)
        # What rebuilds the model and decodes its outputs from the file alone (ringtrain
        # sample / evaluate), the same in every checkpoint of the run.
        self.description = {"config": run.resolved, "monitor": task.monitor,
                            "data_dims": dict(data.dims), "vocab": data.vocab}
        self.writer = BackgroundWriter() if run.trainer.async_checkpoint else None
        self._snapshot: dict[str, Any] | None = None  # the last copy written in the background

    @property
    def last(self) -> Path:
        return self.store.last

    def save(self, parts: TrainingParts, progress: Progress, best: bool) -> None:
        """Every rank contributes; rank 0 writes step-<N>.pt, last.pt (and best.pt), now or in
        the background; every rank learns whether the write (or the previous one) failed."""
        feed(SAVING)
        # The previous background write ends first: its failure stops the run before more is
        # gathered, only one copy of the state waits in memory, and its rotation cannot delete
        # the shards directory that a sharded save is about to write.
        self.flush()
        rng = gather_objects(self.dist, rng_state(self.dist.device))  # every rank's, for exact resume
        weights = parts.strategy.checkpoint_weights(parts.model, parts.optimizer,
                                                    lambda: self.store.shards_path(progress.step))
        failure = None
        if self.dist.is_main:
            state = {"format": CHECKPOINT_FORMAT, **weights, **parts.state_dict(),
                     "progress": progress.state_dict(), "rng": rng, **self.description}
            failure = self._write(state, progress.step, best)
        # Also the barrier: nobody reads or resumes before the file is complete (or, written in
        # the background, before it is copied), and a failed save (a full disk) ends every rank
        # with its one line instead of leaving them waiting.
        failure = broadcast_object(self.dist, failure)
        if failure:
            raise CheckpointError(failure)

    def flush(self) -> None:
        """Every rank: wait for rank 0's background write; its failure raises CheckpointError
        on every rank. Nothing to do without trainer.async_checkpoint."""
        feed(SAVING)
        if self.writer is None:
            return
        failure = broadcast_object(self.dist, _failure_message(self.writer.wait(), self.store.directory))
        if failure:
            raise CheckpointError(failure)

    def _write(self, state: dict[str, Any], step: int, best: bool) -> str | None:
        """Rank 0: write now, or start writing a copy in the background; the failure, if known."""
        if self.writer is None:
            try:
                self.store.save(state, step, best)
            except CheckpointError as err:
                return str(err)
            return None
        # A deep copy: on CPU the state's tensors are the live parameters and optimizer moments,
        # which the next step changes in place while the thread writes.
        # The previous copy's write has ended (save waited for it): its memory is reused.
        snapshot = self._snapshot = detached_copy(state, reuse=self._snapshot)
        self.writer.submit(lambda: self.store.save(snapshot, step, best))
        return None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception no collective is safe (another rank may be gone): rank 0 only waits,
        # so the write in flight ends complete (last.pt is linked only then) before the process does.
        if self.writer is not None and exc_type is not None:
            failure = _failure_message(self.writer.wait(), self.store.directory)
            if failure:
                log.warning(failure)


def _failure_message(err: BaseException | None, directory: Path) -> str | None:
    """One line for a background write's failure (CheckpointError's already is one)."""
    if err is None:
        return None
    if isinstance(err, CheckpointError):
        return str(err)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"cannot save checkpoint in {directory}: {type(err).__name__}{': ' + text if text else ''}"


def load_weights_before_set_up(model, state: dict, path: Path) -> None:
    """Full weights load into the bare model before the strategy wraps or shards it; sharded
    ones once it has (load_training_state)."""
    if "shards" not in state:
        load_model_weights(model, state, path)


def load_training_state(parts: TrainingParts, state: dict, dist: DistInfo) -> tuple[Progress, Layout]:
    """Put a checkpoint's state back into the set-up parts; return where training stood and
    the layout it was trained in."""
    if "shards" in state:  # into the set-up model: each rank reads what its shards need
        from ringtrain.checkpoints.sharded import load_sharded  # DCP: imported only where used

        load_sharded(state["shards"], parts.model, parts.optimizer)
    else:
        parts.strategy.load_optimizer_state(parts.model, parts.optimizer, state["optimizer"])
    parts.load_state_dict(state)
    rng = state["rng"]
    set_rng_state(rng[dist.rank] if len(rng) == dist.world_size else rng[0], dist.device)
    layout = saved_layout(state)
    progress = Progress()
    progress.load_state_dict(load_position(state["progress"], layout))
    return progress, layout


def saved_layout(state: dict) -> Layout:
    """The layout a checkpoint was trained in: saved since the position is global; for older
    checkpoints, the number of ranks that gave their RNG state and the stored config's batch."""
    if "layout" in state:
        return Layout(**state["layout"])
    trainer = (state.get("config") or {}).get("trainer") or {}
    return Layout(len(state["rng"]), trainer.get("batch_size", 0), trainer.get("accumulate_grad_batches", 0))


def load_position(progress: dict, layout: Layout) -> dict:
    """A checkpoint's progress with its epoch position in samples of the global order. Before
    the position was global it counted one rank's micro-batches, all of them full mid-epoch:
    the same position is batches * per-rank batch * ranks of the layout that took them."""
    progress = dict(progress)
    if "batches_into_epoch" in progress:
        batches = progress.pop("batches_into_epoch")
        if batches and not layout.batch_size:
            raise CheckpointError(
                f"the checkpoint is {batches} batches into epoch {progress['epoch']} but does not say their "
                f"size (its config has no trainer.batch_size); start a new run with trainer.resume=null"
            )
        progress["samples_into_epoch"] = batches * layout.batch_size * layout.world_size
    return progress
