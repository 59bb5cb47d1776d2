"""The checked job, before any process group, data or GPU is touched: `validate(cfg)` turns the
composed config into a `Job` or raises one ConfigError line for the first mistake (README, "Checked
before any work"). Cheap constructions run too (the data component, whose constructor only checks,
by contract; the task; the optimizer and schedule on a stand-in parameter), so that their own
argument checks fire now, not after minutes of data setup and the ranks' start.
"""
from __future__ import annotations

import inspect
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ringtrain.components import build, check, check_built, is_node
from ringtrain.conf import composed, option_names
from ringtrain.config.builders import check_data, check_model, check_task, check_validation_limit, resolve
from ringtrain.config.recipe import record
from ringtrain.data import DataBundle
from ringtrain.errors import ConfigError
from ringtrain.loggers import Logger
from ringtrain.strategies import Strategy

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "cuda")
NONFINITE_POLICIES = ("stop", "skip", "ignore")  # trainer.on_nonfinite (ringtrain/loop/nonfinite.py)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("regional", "whole")  # strategies/compilation.py
SECTIONS = ("model", "data", "task", "optimizer", "scheduler", "strategy", "trainer")  # every run has these
OPTIONAL_SECTIONS = ("callbacks", "logger", "adapter")


@dataclass
class TrainerConfig:
    """The trainer section's types; their defaults and meanings are written only in
    conf/trainer/default.yaml (`trainer_config()` composes them for the Python API)."""

    max_epochs: int
    max_steps: int
    batch_size: int
    val_batch_size: int
    accumulate_grad_batches: int
    drop_last: bool
    precision: str
    accelerator: str
    grad_clip_norm: float
    eval_every_n_steps: int
    eval_every_fraction: float
    eval_every_minutes: float
    limit_val_batches: int
    overfit_batches: int
    profile_steps: int
    log_every_n_steps: int
    checkpoint: bool
    checkpoint_every_n_steps: int
    keep_last_k: int
    async_checkpoint: bool
    resume: Any  # "auto", a checkpoint path, or None
    trust_checkpoint: bool  # a sharded checkpoint's index unpickled whole (checkpoints/sharded.py)
    init_from: Optional[str]  # starting weights (checkpoints/initial_weights.py), or None
    on_nonfinite: str
    stop_signals: list[str]
    seed: int
    deterministic: bool
    progress_bar: bool
    num_workers: int
    pin_memory: Optional[bool]
    persistent_workers: bool
    prefetch_factor: int
    compile: bool
    compile_mode: str
    compile_scope: str
    tf32: bool
    activation_checkpointing: bool
    peak_tflops: float
    cpu_alternative: Optional[str]  # a GPU-sized preset's advice for a CPU (gpu_preset_notice)


def trainer_config(**settings: Any) -> TrainerConfig:
    defaults = OmegaConf.to_container(composed()["trainer"])
    return typed_trainer({**defaults, **settings})


@dataclass
class Job:
    """A checked job: what each rank builds and trains (it travels to spawned ranks). Components
    are `_target_` nodes built on each rank (the model needs the data's sizes and the seed), or
    objects the Python API was handed; the task and the strategy are built here."""

    trainer: TrainerConfig
    strategy: Strategy
    task: Any  # the built task (or its node, when a function builds it: not called before the run)
    model: dict | nn.Module  # a node, or the Python API's model
    data: dict | DataBundle  # a node, or the Python API's data sets
    optimizer: dict | Callable
    scheduler: dict | Callable | None
    callbacks: dict[str, Any] = field(default_factory=dict)  # name -> node, or a Callback (Python API)
    loggers: dict[str, Any] = field(default_factory=dict)  # name -> node, or a Logger (Python API)
    adapter: dict | None = None  # e.g. LoRA (models/lora.py), applied to the built model
    resolved: dict = field(default_factory=dict)  # the resolved config: checkpoints and loggers record it
    recipe: dict | None = None  # the groups' choices and the overrides (config/recipe.py); None from Python
    group: str | None = None  # the sweep's name, for a multirun's job (loggers group its runs)


def validate(cfg: Any) -> Job:
    """A config composed with Hydra's settings (`hydra`: the compose API's return_hydra_config)
    gives the job its recipe (config/recipe.py); @hydra.main's job sets it from HydraConfig."""
    from ringtrain.callbacks import HOOKS, Callback, unknown_hooks

    hydra = None
    if isinstance(cfg, DictConfig) and "hydra" in cfg:
        hydra, cfg = cfg.hydra, OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        resolved = resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {_omegaconf_message(err)}") from None
    _check_sections(resolved)
    trainer = typed_trainer(resolved["trainer"])
    strategy = build_strategy(resolved["strategy"])
    check_options(trainer, strategy)
    dims = check_data(resolved["data"])
    task_node = resolved["task"]
    task = check_task(build(task_node, "task")) if inspect.isclass(check(task_node, "task")) else task_node
    check_model(resolved["model"], dims, f"the data ({resolved['data'].get('_target_', 'data.train/val')}, which "
                                         f"gives {', '.join(dims or {}) or 'no sizes'})")
    check_optimization(resolved["optimizer"], resolved["scheduler"], trainer.max_steps)
    callbacks, loggers = named_nodes(resolved, "callbacks"), named_nodes(resolved, "logger")
    for name, node in callbacks.items():
        target = check(node, f"callbacks.{name}", kind=Callback)
        if inspect.isclass(target) and (unknown := unknown_hooks(target)):
            raise ConfigError(f"callbacks.{name}: {node['_target_']} defines {', '.join(unknown)}, which ringtrain never "
                              f"calls; its hooks are {', '.join(HOOKS)} (Lightning's on_train_batch_end is on_step_end)")
    for name, node in loggers.items():
        check(node, f"logger.{name}", kind=Logger)
    adapter = resolved.get("adapter")
    if adapter is not None:
        check(adapter, "adapter")
    return Job(trainer, strategy, task, resolved["model"], resolved["data"], resolved["optimizer"],
               resolved["scheduler"], callbacks, loggers, adapter, resolved, record(hydra, resolved) if hydra else None)


def check_optimization(optimizer: Any, scheduler: Any, max_steps: int) -> None:
    """The optimizer and schedule nodes against their targets, and built on a stand-in
    parameter, so that their own argument checks (a negative lr) fire before any work."""
    from ringtrain.optim import OPTIMIZER_KEYS, SCHEDULER_KEYS, build_optimizer, build_scheduler

    optimizer_class = scheduler_class = False
    if isinstance(optimizer, dict):
        optimizer_class = inspect.isclass(check(optimizer, "optimizer", kind=torch.optim.Optimizer, provided={"params"},
                                                reserved=OPTIMIZER_KEYS, passed={"params"}))
    if isinstance(scheduler, dict):
        scheduler_class = inspect.isclass(check(scheduler, "scheduler", kind=LRScheduler, provided={"optimizer", "total_steps"},
                                                reserved=SCHEDULER_KEYS, passed={"optimizer"}))
    if optimizer_class:
        built = check_built(build_optimizer(optimizer, nn.Linear(2, 2), torch.device("cpu")), "optimizer", torch.optim.Optimizer)
        if scheduler is None or scheduler_class:
            check_built(build_scheduler(scheduler, built, max(max_steps, 1000)), "scheduler", LRScheduler)


def named_nodes(resolved: dict, section: str) -> dict[str, Any]:
    """A section of named components (callbacks, logger): name -> node; a name set to null is off."""
    nodes = resolved.get(section) or {}
    if not isinstance(nodes, dict) or is_node(nodes):
        raise ConfigError(f"{section} must map names to components ({section}.<name>._target_=...), got {nodes!r}; "
                          f"e.g. +{section}.mine={{_target_: my_pkg.Mine}}")
    return {name: node for name, node in nodes.items() if node is not None}


def build_strategy(node: Any) -> Strategy:
    """The strategy a conf/strategy/<option>.yaml node (or your own) names by `_target_`, built
    now: a strategy's constructor only stores and checks its options."""
    check(node, "strategy", kind=Strategy)
    return check_built(build(node, "strategy"), "strategy", Strategy)


def strategy_option(name: str, **options: Any) -> Strategy:
    """conf/strategy/<name>.yaml's strategy (composed by Hydra) with `options` changed (the
    Python API's `strategy="ddp"` or `{"name": "ddp", "nproc_per_node": 2}`)."""
    if name not in option_names("strategy"):
        raise ConfigError(f"strategy {name!r} is not an option of conf/strategy/; use one of "
                          f"{', '.join(option_names('strategy'))}")
    node = OmegaConf.to_container(composed([f"strategy={name}"])["strategy"])
    unknown = sorted(set(options) - set(node))
    if unknown:
        raise ConfigError(
            f"strategy={name} has no setting {unknown[0]!r}; its settings are {', '.join(k for k in node if k != '_target_')}"
        )
    return build_strategy({**node, **options})


def _check_sections(resolved: dict) -> None:
    for key in resolved:
        if key not in SECTIONS + OPTIONAL_SECTIONS:
            raise ConfigError(f"unknown config section '{key}'; the sections are {', '.join(SECTIONS + OPTIONAL_SECTIONS)}")
    for key in SECTIONS:
        if not isinstance(resolved.get(key), dict) and not (key == "scheduler" and key in resolved):
            raise ConfigError(f"config section '{key}' is missing; pick one with {key}=<option>")


def typed_trainer(values: dict) -> TrainerConfig:
    """`values` merged onto TrainerConfig: unknown keys and wrong types fail here."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), values))
    except OmegaConfBaseException as err:
        raise ConfigError(f"trainer.{_omegaconf_message(err)}") from None


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in message and "Key" in message:
        return f"{key}: unknown key ({message}); check the spelling against conf/"
    if "Value '" in message and "could not be converted" in message:
        return f"{key}: {message}; pass a value of the right type"
    return f"{key}: {message}" if key else message


# What 0 does for the settings where it stands for a default (conf/trainer/default.yaml).
ZERO_MEANS = {
    "val_batch_size": "trainer.batch_size",
    "eval_every_n_steps": "off (evaluate at each epoch's end and at the last step)",
    "limit_val_batches": "the whole validation set",
    "checkpoint_every_n_steps": "save only at evaluations, at the end and on a stop signal",
    "overfit_batches": "off, train on the whole training set",
    "profile_steps": "no profiler",
    "num_workers": "load in the training process",
    "eval_every_minutes": "off",
    "grad_clip_norm": "no clipping",
}
CHOICES = {"precision": PRECISIONS, "accelerator": ACCELERATORS, "compile_mode": COMPILE_MODES,
           "compile_scope": COMPILE_SCOPES, "on_nonfinite": NONFINITE_POLICIES}
_LIGHTNING_PRECISIONS = {"bf16": "bf16-mixed", "16": "16-mixed", "fp16": "16-mixed", "32-true": "32"}


def check_options(t: TrainerConfig, strategy: Strategy) -> None:
    """The cross-field checks of the trainer section, then the strategy's own refusals (its
    ranks against torchrun's among them), then what needs its ranks."""
    for name in ("batch_size", "accumulate_grad_batches", "log_every_n_steps", "prefetch_factor", "keep_last_k"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be positive; set trainer.{name} to 1 or more")
    for name, zero in ZERO_MEANS.items():
        if getattr(t, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 0 (0: {zero})")
    for name, choices in CHOICES.items():
        if (value := getattr(t, name)) not in choices:
            known = _LIGHTNING_PRECISIONS.get(str(value)) if name == "precision" else None
            hint = f"trainer.precision={known} is the mixed-precision name here; " if known else ""
            raise ConfigError(f"trainer.{name}={value!r} is not supported; {hint}use one of {', '.join(choices)}")
    if t.max_steps <= 0 and t.max_epochs <= 0:
        raise ConfigError("trainer.max_epochs and trainer.max_steps are both <= 0; set one of them positive")
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(
            f"trainer.max_steps={t.max_steps} {'would train nothing' if t.max_steps == 0 else 'is not a number of steps'}; "
            f"set the number of optimizer steps to train, or -1 to train trainer.max_epochs epochs")
    if t.persistent_workers and t.num_workers == 0:
        raise ConfigError("trainer.persistent_workers=true needs worker processes; set trainer.num_workers >= 1")
    if not 0 <= t.eval_every_fraction <= 1:
        raise ConfigError(f"trainer.eval_every_fraction={t.eval_every_fraction} must be in [0, 1] (0.25: four "
                          f"times an epoch; 0: off)")
    for name, default in (("compile_mode", "default"), ("compile_scope", "regional")):
        if getattr(t, name) != default and not t.compile:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} has no effect without compiling; add trainer.compile=true")
    if not (math.isfinite(t.peak_tflops) and t.peak_tflops >= 0):
        raise ConfigError(f"trainer.peak_tflops={t.peak_tflops} must be >= 0 (the device's peak TFLOP/s; 0 looks the GPU up)")
    cuda = torch.cuda.is_available()
    if t.accelerator == "cuda" and not cuda:
        raise ConfigError("trainer.accelerator=cuda but no CUDA device is visible; use trainer.accelerator=cpu (or auto)")
    if t.precision == "16-mixed" and (t.accelerator == "cpu" or not cuda):
        raise ConfigError("trainer.precision=16-mixed needs a CUDA device (GradScaler); on CPU use "
                          "trainer.precision=bf16-mixed or 32")
    _check_run_control(t)
    strategy.check(t)
    check_validation_limit(t, strategy.planned_ranks())


def gpu_preset_notice(t: TrainerConfig) -> str | None:
    """The line a preset sized for a GPU (trainer.cpu_alternative set) gives when the run will be
    on the CPU: such a run compiles for minutes or takes minutes a step, with nothing said."""
    if not t.cpu_alternative or (t.accelerator != "cpu" and torch.cuda.is_available()):
        return None
    return (f"this preset is sized for a GPU and the run is on the CPU (no GPU visible, or trainer.accelerator=cpu): "
            f"it will be very slow; use {t.cpu_alternative} instead")


def _check_run_control(t: TrainerConfig) -> None:
    if t.resume not in (None, "auto") and (not isinstance(t.resume, str) or not os.path.isfile(t.resume)):
        raise ConfigError(f"trainer.resume={t.resume!r} is not a file; pass the path of a checkpoint "
                          f"(e.g. trainer.resume=outputs/runs/<run>/checkpoints/last.pt), auto or null")
    # A continued run (trainer.resume=<path>) ignores init_from: its file may be gone by then.
    if t.init_from is not None and t.resume in (None, "auto") and not os.path.isfile(t.init_from):
        # A save_pretrained / `ringtrain export format=hf` folder holds its weights as model.safetensors.
        weights = os.path.join(str(t.init_from), "model.safetensors")
        fix = f"pass {weights}" if os.path.isdir(t.init_from) and os.path.isfile(weights) else (
            "pass a checkpoint (.pt) or a .safetensors file to start from, or null")
        raise ConfigError(f"trainer.init_from={t.init_from!r} is not a file; {fix}")
    for name in t.stop_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"trainer.stop_signals: {name!r} is not a signal this process can catch; use names "
                              f"like SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (or [] to handle none)")
