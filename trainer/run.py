"""One training job, from the command line (tools/train.py) and from Python (trainer.py). A job
refused before it trained (a checkpoint of another model, a component that fails to build or to
take its first step) takes back what it put into its run directory (storage/rundir.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ringtrain.callbacks import Callbacks, check_monitors
from ringtrain.callbacks.loggers import Loggers
from ringtrain.checkpoints import CheckpointManager, Part, Resumed
from ringtrain.checkpoints.files import RunDirError
from ringtrain.checkpoints.state_dicts import full_model_state_dict
from ringtrain.components import build, is_node
from ringtrain.config.builders import build_data, build_model, check_data_lengths, check_model_sizes, check_task
from ringtrain.config.schema import Job, gpu_preset_notice
from ringtrain.data import DataBundle
from ringtrain.data.tasks import validation_metrics
from ringtrain.storage import json_text, write_text_atomically
from ringtrain.storage.rundir import RunDirectory
from ringtrain.distributed import (
    DistInfo,
    DistributedSetupError,
    broadcast_object,
    is_timeout,
    name_unresponsive_ranks,
    peer_lost,
    teardown_distributed,
)
from ringtrain.errors import NONFINITE_EXIT, STOPPED_BY_SIGNAL_EXIT, USER_ERROR_EXIT, ComponentFailed, TrainingStopped, UserError, first_to_report
from ringtrain.loop import FitResult
from ringtrain.loop.fit import fit
from ringtrain.loop.loaders import is_stream
from ringtrain.loop.setup import failures_reported_as_mistakes, set_up_training
from ringtrain.loop.stopping import StopSignals, watching
from ringtrain.strategies import use_deterministic_algorithms

log = logging.getLogger("ringtrain")


def launch(job: Job, run_dir: str, given: Resumed | None = None, record: dict[str, str] | None = None,
           return_weights: bool = False) -> FitResult:
    """Train on this process, or on the ranks the strategy starts (ddp/fsdp without torchrun);
    the stop signals reach those ranks through this process too (Ctrl-C, `kill`). `given`: the
    checkpoint trainer.resume=<path> names, read already; `record`: the job's .hydra/ files."""
    return job.strategy.launch(train_rank, job, run_dir, given, record, return_weights,
                               stop_signals=tuple(job.trainer.stop_signals), accelerator=job.trainer.accelerator)


def stopped_error(result: FitResult, checkpoint: bool) -> TrainingStopped | None:
    """The exit a run's early end means; none (exit 0) for a stop a callback asked for (early stopping)."""
    if result.stop_kind == "non-finite":
        return TrainingStopped("training stopped on a non-finite value (see the log)", NONFINITE_EXIT)
    if result.stop_kind != "signal":
        return None
    if result.steps == 0:
        where = "before the first step; nothing to save"
    elif not checkpoint:
        where = f"after step {result.steps} (trainer.checkpoint=false: nothing saved)"
    else:
        where = f"at step {result.steps}; its checkpoint holds that step"
    return TrainingStopped(f"stopped by {result.stopped} {where}", STOPPED_BY_SIGNAL_EXIT)


def sweep_value(result: FitResult) -> float:
    """The monitored metric; a diverged (non-finite) run is the worst possible value, never NaN."""
    value = result.metrics.get(result.monitor, float("nan"))
    if not math.isfinite(value):
        return math.inf if result.mode == "min" else -math.inf
    return value


def train_rank(job: Job, run_dir: str, given: Resumed | None = None, record: dict[str, str] | None = None,
               return_weights: bool = False) -> FitResult:
    """Everything one rank does, with stop signals watched from the start. `return_weights`:
    rank 0's result carries the model's full weights (`model_state`), gathered from every rank
    while the process group lives (the Python API's caller may live in another process)."""
    with StopSignals(job.trainer.stop_signals) as stop:
        use_deterministic_algorithms(job.trainer.deterministic)  # before the device is set up
        dist = job.strategy.setup_process(job.trainer.accelerator)
        directory = RunDirectory(run_dir) if dist.is_main else None
        training = refused = clean_exit = False
        try:
            callbacks = _callbacks(job, dist)  # before the claim: a logger that cannot work leaves nothing on disk
            shared_dir = _claim(directory, run_dir, dist)
            checkpoints = CheckpointManager(shared_dir / "checkpoints", job.trainer, dist)
            resumed = checkpoints.resume(job.trainer.resume, job.resolved.get("model"), given)
            model, data, task = _build(job, dist, resumed)
            check_monitors(callbacks.all, validation_metrics(task))
            # Saved, never restored, the same at every save: what rebuilds the model (its recipe, config/recipe.py;
            # sizes; vocabulary), described once, here, on the bare model; the resolved config is for the record.
            description = {"job": job.recipe, "config": job.resolved, "monitor": task.monitor,
                           "data_dims": dict(data.dims), "vocab": data.vocab, "architecture": None}
            if callable(getattr(model, "save_pretrained", None)):  # a transformers model's class and config, as data
                from ringtrain.models.pretrained import architecture  # only for one: other jobs never load it

                description["architecture"] = architecture(model)
            checkpoints.register(callbacks=callbacks, description=Part(lambda: description, spread=True))
            with watching(job.strategy.timeout_minutes, dist.rank, dist.world_size) as watchdog:
                with failures_reported_as_mistakes("setting up training", "check the trainer.* and strategy.* settings", dist):
                    parts = set_up_training(job, dist, model, data, checkpoints)
                if dist.is_main:  # set up: the job trains here (a refusal so far said one line and wrote nothing)
                    log.info(f"run directory: {shared_dir}")
                    if notice := gpu_preset_notice(job.trainer):
                        log.warning(notice)
                    if record is not None and resumed is None:
                        directory.write_record(record)
                training = True  # from here only a failure of the first step is a refusal
                result = fit(job, dist, shared_dir, parts, task, callbacks, checkpoints, stop, watchdog)
            if return_weights:
                weights = full_model_state_dict(model)  # every rank takes part; rank 0 gets them
                result = dataclasses.replace(result, model_state=weights if dist.is_main else None)
            if dist.is_main:
                _report(result, model, shared_dir)
            clean_exit = True
            return result
        except Exception as err:
            refused = isinstance(err, ComponentFailed if training else UserError)
            if dist.is_distributed and is_timeout(err):
                raise DistributedSetupError(name_unresponsive_ranks(dist, job.strategy.timeout_minutes)) from None
            if dist.is_distributed and (lost := peer_lost(err, dist.rank)):
                raise lost from None
            if dist.is_distributed and isinstance(err, UserError):
                first_to_report(USER_ERROR_EXIT)  # claimed before leaving: a peer finding this rank gone says nothing
            raise
        finally:
            if directory is not None:
                directory.release(refused)
            teardown_distributed(clean_exit)


def _claim(directory: RunDirectory | None, run_dir: str, dist: DistInfo) -> Path:
    """Rank 0's run directory for every rank (under torchrun each rank's Hydra named its own),
    claimed by rank 0 for the whole job before anything is written there, and each rank's logging."""
    shared_dir = Path(broadcast_object(dist, os.path.abspath(run_dir)))
    refusal = broadcast_object(dist, directory.claim() if directory is not None else None)
    if refusal:
        raise RunDirError(refusal)
    # Rank 0 logs to the console and to train.log; other ranks only warnings and errors. Under Hydra (a
    # plain run, torchrun) its handlers are in place and basicConfig does nothing; a self-launched rank
    # and the Python API start with none, so they set up what Hydra would have.
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if dist.is_main:
        handlers.append(logging.FileHandler(shared_dir / "train.log", delay=True))  # appends to the launcher's
    logging.basicConfig(format=f"[%(asctime)s][%(name)s][rank {dist.rank}][%(levelname)s] - %(message)s", handlers=handlers)
    logging.getLogger().setLevel(logging.INFO if dist.is_main else logging.WARNING)
    return shared_dir


def _build(job: Job, dist: DistInfo, resumed: Resumed | None) -> tuple[nn.Module, DataBundle, Any]:
    """The data, the task and the model, on this rank, with the same initial weights on every rank."""
    cfg = job.trainer
    with failures_reported_as_mistakes(f"building the data{component_name(job.data)}", "check the data.* settings", dist):
        data = job.data if isinstance(job.data, DataBundle) else build_data(job.data, dist)
    with failures_reported_as_mistakes(f"building the task{component_name(job.task)}", "check the task.* settings", dist):
        task = check_task(build(job.task, "task")) if is_node(job.task) else job.task
    # Each rank trains and validates on its own share (refused here where the data's lengths need it built).
    if not is_stream(data.train):  # a stream has no length: each rank reads its own share (loop/streams.py)
        check_data_lengths(len(data.train), len(data.val), cfg, dist.world_size)
    torch.manual_seed(cfg.seed)
    with failures_reported_as_mistakes(f"building the model{component_name(job.model)}", "check the model.* settings", dist):
        model = job.model if isinstance(job.model, nn.Module) else build_model(job.model, data.dims)
    check_model_sizes(model, data.dims, data.train, job.data)
    # A resumed run's weights are its checkpoint's, except a frozen base the checkpoint only names.
    if cfg.init_from is not None and (resumed is None or "base" in resumed.state):
        from ringtrain.checkpoints.initial_weights import load_initial_weights

        count = load_initial_weights(model, cfg.init_from, cfg.trust_checkpoint)
        log.info(f"starting from the weights in {cfg.init_from} ({count} tensors)")
    elif cfg.init_from is not None:
        log.info(f"trainer.init_from={cfg.init_from} ignored: this run resumes from {resumed.path}")
    if job.adapter is not None:
        with failures_reported_as_mistakes("applying the adapter", "check the adapter.* settings", dist):
            model = build(job.adapter, "adapter").apply(model)
    torch.manual_seed(cfg.seed + dist.rank)  # dropout differs per rank; the data order is the sampler's
    return model, data, task


def component_name(node: dict | None) -> str:
    """The component a config node builds, for the line: its _target_ (or its splits')."""
    node = node if isinstance(node, dict) else {}
    target = node.get("_target_") or (node.get("train") or {}).get("_target_")
    return f" {target}" if target else ""


def _callbacks(job: Job, dist: DistInfo) -> Callbacks:
    """The job's callbacks, built on this rank, and its loggers (rank 0) behind the Loggers callback.
    A logger checks in its constructor what would fail only at its first write (its library, a
    store's URI, a key), so any failure here is one line naming the logger."""
    def built(section: str, name: str, node: Any) -> Any:
        if not is_node(node):  # the Python API's object
            return node
        fix = f"fix {section}.{name}.* or leave it out (~{section}.{name}" + (", or ~logger)" if section == "logger" else ")")
        with failures_reported_as_mistakes(f"building {section}.{name}", fix, dist):
            return build(node, f"{section}.{name}")

    made = {name: built("callbacks", name, node) for name, node in job.callbacks.items()}
    if dist.is_main and job.loggers:
        made["loggers"] = Loggers({name: built("logger", name, node) for name, node in job.loggers.items()})
    return Callbacks(made, dist.is_main, several_ranks=dist.is_distributed)


def _report(result: FitResult, model: nn.Module, run_dir: Path) -> None:
    write_text_atomically(run_dir / "metrics.json", json_text(result.summary(), indent=2, default=str))
    metrics = " ".join(f"{k}={v:.5g}" for k, v in result.metrics.items())
    # What ended it, in its own words: a signal, a callback's reason (early stopping's), non-finite values.
    ended = {None: "done", "non-finite": "stopped on a non-finite value"}.get(result.stopped, f"stopped by {result.stopped}")
    skipped = f", {result.skipped_steps} updates skipped (non-finite)" if result.skipped_steps else ""
    log.info(f"{ended}: {result.steps} steps in {result.train_seconds:.2f}s{skipped}" + (f", {metrics}" if metrics else ""))
    summary = getattr(model, "summary", None)
    if callable(summary):  # a model may say what it learned (the tutorial's w and b)
        log.info(summary())
    log.info(f"outputs in {run_dir}")
