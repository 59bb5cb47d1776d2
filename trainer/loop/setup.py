"""What one rank trains with, set up once: the model as the strategy runs it, the loaders, the
optimizer, the lr schedule and the precision (`TrainingParts`), restored from the checkpoint
the run continues from, if any; and the optimizer steps' batches, epoch after epoch.

A component whose constructor raises when built for real (a file it opens), or a model, task
and data that fail the first step (a shape, a dtype, a key), is the user's to fix (README: "What
only shows once the job runs"): `failures_reported_as_mistakes` ends the run in one line, exit 2,
naming what failed, the exception, where it was raised and what to check (errors.py
component_failed), not a traceback from inside ringtrain. A process group's failure keeps its
own line (distributed.py).
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ringtrain.checkpoints import CheckpointManager, Part
from ringtrain.checkpoints.files import load_model_weights, shards_name
from ringtrain.checkpoints.state_dicts import load_full_optimizer_state_dict
from ringtrain.data import DataBundle
from ringtrain.distributed import DistInfo, gather_objects, is_timeout, peer_lost
from ringtrain.errors import ComponentFailed, ConfigError, RankEnded, UserError, component_failed
from ringtrain.loop import Layout, Progress
from ringtrain.loop.loaders import Batch, BatchLoader, build_train_loader, build_val_loader, is_stream, worker_options
from ringtrain.loop.stopping import LOADING_TRAINING_BATCHES, Watchdog
from ringtrain.optim import WarmupCosine, build_optimizer, build_scheduler
from ringtrain.strategies import Precision, Strategy, set_matmul_precision

if TYPE_CHECKING:
    from ringtrain.loop.streams import StreamLoader

log = logging.getLogger("ringtrain")


@contextlib.contextmanager
def failures_reported_as_mistakes(what: str, fix: str, dist: DistInfo,
                                  armed: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """An exception inside (while `armed()`) is re-raised as `what` failed: ..., `fix`."""
    try:
        yield
    except RankEnded:
        raise
    except UserError as err:  # already one line; inside, it refuses the run (nothing of it is kept)
        if armed() and not isinstance(err, ComponentFailed):
            raise ComponentFailed(str(err)) from err
        raise
    except Exception as err:
        if not armed() or (dist.is_distributed and (is_timeout(err) or peer_lost(err, dist.rank))):
            raise
        raise component_failed(what, err, fix) from err


@dataclass
class TrainingParts:
    strategy: Strategy
    model: nn.Module  # the bare model (sharded in place under fsdp)
    module: nn.Module  # what the loop calls: wrapped, sharded and/or compiled by the strategy
    params: list[nn.Parameter]  # taken after sharding (FSDP2 makes them DTensors)
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    precision: Precision
    train_loader: BatchLoader | StreamLoader  # a map-style training set's, or a stream's (loop/streams.py)
    val_loaders: dict[str, BatchLoader]  # {"": the validation set's}, or its named parts' (a mixture's)
    layout: Layout  # how the data is dealt out: ranks, per-rank batch, accumulation
    progress: Progress  # where training stands
    saved_layout: Layout  # the layout of the checkpoint it continues from (this one's for a new run)
    total_steps: int  # the step the run ends at

    @property
    def streamed(self) -> bool:
        return is_stream(self.train_loader.dataset)

    def batches(self, watchdog: Watchdog, accumulate: int) -> Iterator[tuple[list[Batch], int, bool]]:
        """(micro-batches, the epoch's global position after them, whether they end the epoch)
        for each optimizer step to come, from the training position on, epoch after epoch."""
        progress, loader = self.progress, self.train_loader
        if self.streamed:  # no epochs: the steps' batches, one after another
            batches = loader.batches()
            while progress.step < self.total_steps:
                watchdog.feed(LOADING_TRAINING_BATCHES, progress.step)
                yield [next(batches) for _ in range(accumulate)], 0, False
            return
        while progress.step < self.total_steps:
            start, index = progress.samples_into_epoch, progress.epoch
            num_batches = loader.batches_left(start)
            if num_batches == 0:
                if start == 0:  # refused before work; a data set that changed size since would spin here
                    raise ConfigError(f"epoch {progress.epoch} has no batch of {loader.batch_size}; lower trainer.batch_size")
                # A run continued with more ranks or a bigger batch: the few samples left make no
                # full batch; an uninterrupted epoch of this layout would not train them either.
                log.info(f"the rest of epoch {progress.epoch} after sample {start} makes no batch of "
                         f"{loader.batch_size} per rank; continuing with epoch {progress.epoch + 1}")
                progress.finish_epoch()
                continue
            batches, taken = loader.batches(index, start), 0
            # Until the step that ends the epoch or the run (fit moves `progress` on after each yield).
            while progress.epoch == index and progress.step < self.total_steps:
                watchdog.feed(LOADING_TRAINING_BATCHES, progress.step)
                group = list(islice(batches, accumulate))
                if not group:
                    raise ConfigError(
                        f"epoch {progress.epoch} ended after {taken} of its {num_batches} batches: the training "
                        f"Dataset yields fewer samples than its __len__ says; make __len__ and __getitem__ agree")
                taken += len(group)
                yield group, loader.position(start, taken), taken >= num_batches


def set_up_training(job: Any, dist: DistInfo, model: nn.Module, data: DataBundle,
                    checkpoints: CheckpointManager) -> TrainingParts:
    """The parts (see the module), registered with `checkpoints`, and restored if the run resumes."""
    cfg, strategy, resumed = job.trainer, job.strategy, checkpoints.resumed
    state = resumed.state if resumed else None
    model = model.to(dist.device)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    if job.adapter is not None or (state is not None and "base" in state):  # most runs have no frozen base
        from ringtrain.checkpoints.frozen_base import base_identity, load_over_base
    base = base_identity(model) if job.adapter is not None else None
    # The one load outside checkpoints.restore: full weights go into the bare model before the
    # strategy wraps, shards or compiles it (each rank its copy, nothing broadcast or resharded).
    if state is not None and "base" in state:  # adapters over a base rebuilt from the config
        load_over_base(model, state, resumed.path, found=base)
    elif state is not None and "shards" not in state:
        load_model_weights(model, state, resumed.path)
    module = strategy.setup_module(model, dist, cfg)
    # Only what trains: the optimizer, clipping, the non-finite watch and zeroing see no frozen weight.
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"{type(model).__name__} has no trainable parameters (none, or all frozen): nothing to "
                          f"train; point model._target_ at a model with parameters, or leave some trainable")
    train_loader, val_loaders = _loaders(cfg, dist, data)
    optimizer = (job.optimizer(trainable) if callable(job.optimizer)
                 else build_optimizer(job.optimizer, model, dist.device, strategy.lr_scale(dist.world_size)))
    layout = Layout(dist.world_size, cfg.batch_size, cfg.accumulate_grad_batches)
    progress = Progress()
    total = steps_in_run(cfg, train_loader, progress)
    scheduler = job.scheduler(optimizer) if callable(job.scheduler) else build_scheduler(job.scheduler, optimizer, total)
    set_matmul_precision(dist.device, cfg.tf32)
    precision = Precision(strategy.autocast_precision(cfg.precision), dist.device)
    parts = TrainingParts(strategy, model, module, trainable, optimizer, scheduler, precision,
                          train_loader, val_loaders, layout, progress, layout, total)
    _register(checkpoints, parts, dist, base, cfg.trust_checkpoint)
    if resumed is not None:
        checkpoints.restore()
        # Where the run ends, at this layout (steps stay steps; epochs are counted from the
        # position reached); a cosine schedule reaches its end there too.
        parts.total_steps = steps_in_run(cfg, train_loader, progress)
        if isinstance(scheduler, WarmupCosine):
            scheduler.total_steps = parts.total_steps
    return parts


def _register(checkpoints: CheckpointManager, parts: TrainingParts, dist: DistInfo, base: dict[str, Any] | None,
              trusted: bool) -> None:
    """The parts, by their keys in the file, in the order restored. The strategy's weights load what
    needs the set-up model (the optimizer's state, or both from shards; full weights went into the
    bare model before). RNG states and a stream's position are every rank's, in rank order. Nothing
    here holds `checkpoints`: a cycle would keep the parts (a stream's workers) past the run."""
    model, optimizer, loader, directory = parts.model, parts.optimizer, parts.train_loader, checkpoints.directory
    source = checkpoints.resumed.path if checkpoints.resumed is not None else None

    def weights() -> dict[str, Any]:  # a save's shards go beside its step file, step-<N>.shards
        saved = parts.strategy.checkpoint_weights(model, optimizer, lambda: directory / shards_name(parts.progress.step))
        if base is not None and "model" in saved:  # the frozen base is named, not copied
            from ringtrain.checkpoints.frozen_base import trainable_weights  # a run over a frozen base only

            saved = {**saved, "model": trainable_weights(model, saved["model"]), "base": base}
        return saved

    def load_weights(state: dict[str, Any]) -> None:
        if "shards" in state:  # into the set-up model: each rank reads what its shards need
            from ringtrain.checkpoints.sharded import load_sharded  # DCP: imported only where used

            load_sharded(state["shards"], model, optimizer, trusted=trusted)
        else:
            load_full_optimizer_state_dict(model, optimizer, state["optimizer"])

    cuda = dist.device if dist.device.type == "cuda" else None

    def load_rng(states: list[dict[str, torch.Tensor]]) -> None:
        state = states[dist.rank] if len(states) == dist.world_size else states[0]
        torch.set_rng_state(state["cpu"])
        if cuda is not None and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], cuda)

    def load_stream(states: list[dict[str, Any]] | None) -> None:
        if states is None:
            raise ConfigError(f"{source} was saved by a run on a map-style data set, not a stream; "
                              f"continue it with its own data, or start a new run (trainer.resume=null)")
        loader.restore(states)

    checkpoints.register(
        weights=Part(weights, load_weights, spread=True), scheduler=parts.scheduler, scaler=parts.precision,
        layout=Part(lambda: asdict(parts.layout), lambda saved: setattr(parts, "saved_layout", Layout(**saved))),
        progress=parts.progress, rng=Part(lambda: gather_objects(dist, {"cpu": torch.get_rng_state(), **(
            {"cuda": torch.cuda.get_rng_state(cuda)} if cuda is not None else {})}), load_rng),
        **({"data_stream": Part(lambda: gather_objects(dist, loader.state_dict()), load_stream)} if parts.streamed else {}))


def checkpoint_activations(model: nn.Module) -> None:
    """trainer.activation_checkpointing: each layer's activations recomputed in backward, by the
    model's own switch: a transformers model's (non-reentrant, which frozen inputs and FSDP2
    allow; activation_checkpointing_enable, gradient_checkpointing_enable before transformers 5),
    ringtrain's Transformer's config."""
    hf_switch = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)
    if callable(hf_switch) and getattr(model, "supports_gradient_checkpointing", True):
        key = "activation_checkpointing_kwargs" if hasattr(model, "activation_checkpointing_enable") else "gradient_checkpointing_kwargs"
        hf_switch(**{key: {"use_reentrant": False}})
    elif hasattr(getattr(model, "config", None), "activation_checkpointing") and not callable(hf_switch):
        model.config.activation_checkpointing = True
    else:
        raise ConfigError(f"trainer.activation_checkpointing=true: {type(model).__name__} has no switch for it (a "
                          f"transformers model that supports it, or a config.activation_checkpointing); recompute "
                          f"inside your model with torch.utils.checkpoint, or set it false")


def steps_in_run(trainer: Any, loader: BatchLoader | StreamLoader, progress: Progress) -> int:
    """The step the run ends at: trainer.max_steps, else the steps taken, those that finish the
    current epoch from its data position, and the later epochs' steps, at this layout."""
    if trainer.max_steps > 0:
        return trainer.max_steps
    if is_stream(loader.dataset):
        raise ConfigError("a streamed training set has no epochs to count: set trainer.max_steps to the number of "
                          "optimizer steps to train")
    if progress.epoch >= trainer.max_epochs:
        return progress.step
    k = trainer.accumulate_grad_batches
    rest_of_epoch = math.ceil(loader.batches_left(progress.samples_into_epoch) / k)
    return progress.step + rest_of_epoch + (trainer.max_epochs - progress.epoch - 1) * math.ceil(len(loader) / k)


def _loaders(cfg: Any, dist: DistInfo, data: DataBundle) -> tuple[BatchLoader | StreamLoader, dict[str, BatchLoader]]:
    overfit = cfg.overfit_batches  # > 0: train and validate on the same first batches
    workers = worker_options(cfg, dist.device)
    if is_stream(data.train):
        from ringtrain.loop.streams import StreamLoader

        for setting in ("overfit_batches", "eval_every_fraction"):
            if value := getattr(cfg, setting):
                raise ConfigError(f"trainer.{setting}={value} needs epochs, which a streamed training set has not; use "
                                  f"trainer.max_steps and trainer.eval_every_n_steps")
        train_loader: BatchLoader | StreamLoader = StreamLoader(data.train, cfg.batch_size, dist, workers)
    else:
        train_loader = build_train_loader(
            data.train, cfg.batch_size, dist.rank, dist.world_size, cfg.seed, cfg.drop_last, dist.device,
            shuffle=not overfit, limit_batches=overfit, workers=workers,
        )

    def val_loader(dataset) -> BatchLoader:
        return build_val_loader(
            dataset, cfg.val_batch_size or cfg.batch_size, dist.rank, dist.world_size, dist.device,
            # overfit: the samples the ranks train on, the first overfit * batch * world_size
            limit_samples=overfit * cfg.batch_size * dist.world_size, limit_batches=cfg.limit_val_batches,
            workers=workers,
        )

    sources = {} if overfit else data.val_sources
    for name, part in sources.items():  # each rank validates at least one sample of each
        if len(part) < dist.world_size:
            raise ConfigError(f"the validation set's part {name!r} has {len(part)} samples, fewer than the "
                              f"{dist.world_size} processes that share it; give it more validation data")
    whole = data.train if overfit else data.val
    return train_loader, {name: val_loader(part) for name, part in (sources or {"": whole}).items()}
