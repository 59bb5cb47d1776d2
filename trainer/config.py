"""Typed schemas for the composed Hydra config, and the validation that runs before any work.

`validate(cfg)` turns the composed DictConfig into a `RunConfig` of plain dataclasses.
Every user mistake it finds (unknown key, wrong type, impossible size, unknown option,
model/data mismatch, missing file, device that is not there) becomes one `ConfigError`
whose message names the key, the problem and the fix. `train.py` prints that one line
and exits with status 2, before a process group, a data set or a GPU is touched.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data import DATASETS
from models import MODELS


class ConfigError(ValueError):
    """A mistake in the user's configuration; the message is one line with the fix."""


PRECISIONS = ("32", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "cuda")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("constant", "cosine")
STRATEGIES = ("single", "dp", "ddp")
BACKENDS = ("auto", "gloo", "nccl")

# Which data sets each model can learn from (the model's inputs and outputs must fit).
COMPATIBLE_DATA = {
    "linear": ("regression",),
    "mlp": ("classification",),
    "transformer": ("tokens", "text"),
}
# Model sizes that are taken from the data set when the model is built.
DATA_DERIVED_MODEL_FIELDS = ("in_features", "out_features", "num_classes", "vocab_size")


@dataclass
class TrainerConfig:
    max_epochs: int = 10
    max_steps: int = -1
    batch_size: int = 32
    val_batch_size: int = 0
    accumulate_grad_batches: int = 1
    drop_last: bool = False
    precision: str = "32"
    accelerator: str = "auto"
    grad_clip_norm: float = 0.0
    eval_every_n_steps: int = 0
    limit_val_batches: int = 0
    overfit_batches: int = 0
    profile_steps: int = 0
    log_every_n_steps: int = 50
    checkpoint: bool = True
    checkpoint_every_n_steps: int = 0
    resume: Any = None  # str path or None
    seed: int = 0
    progress_bar: bool = True


@dataclass
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    name: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0


@dataclass
class StrategyConfig:
    name: str = "single"
    backend: str = "auto"
    nproc_per_node: int = 1
    timeout_minutes: float = 10.0
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    broadcast_buffers: bool = True
    scale_lr_by_world_size: bool = False


@dataclass
class RunConfig:
    """The validated run: typed sections plus the resolved config as plain data."""

    model_name: str
    model: Any  # the model's config dataclass (models/*.py), data-derived sizes still unset
    data_name: str
    data: Any  # the data set's config dataclass (data/*.py)
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    strategy: StrategyConfig
    trainer: TrainerConfig
    resolved: dict  # the whole resolved config, for checkpoints and TensorBoard


def validate(cfg: DictConfig) -> RunConfig:
    """Check the composed config and return it typed; raise ConfigError on the first mistake."""
    _reject_unknown_sections(cfg)
    model_name, data_name = _option_name(cfg, "model", MODELS), _option_name(cfg, "data", DATASETS)
    if data_name not in COMPATIBLE_DATA[model_name]:
        fitting = " or ".join(f"data={name}" for name in COMPATIBLE_DATA[model_name])
        raise ConfigError(
            f"model={model_name} cannot learn from data={data_name}; use {fitting} "
            f"(or drop the data= override: each model picks a fitting data set)"
        )
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {_omegaconf_message(err)}") from None
    run = RunConfig(
        model_name=model_name,
        model=_typed_model_config(cfg.model, MODELS[model_name][0]),
        data_name=data_name,
        data=_typed(cfg.data, DATASETS[data_name][0], "data", drop=("name",)),
        optimizer=_typed(cfg.optimizer, OptimizerConfig, "optimizer"),
        scheduler=_typed(cfg.scheduler, SchedulerConfig, "scheduler"),
        strategy=_typed(cfg.strategy, StrategyConfig, "strategy"),
        trainer=_typed(cfg.trainer, TrainerConfig, "trainer"),
        resolved=resolved,
    )
    _check_trainer(run.trainer)
    _check_optimization(run.optimizer, run.scheduler)
    _check_strategy(run.strategy, run.trainer)
    seq_len, block_size = getattr(run.data, "seq_len", None), getattr(run.model, "block_size", None)
    if seq_len is not None and block_size is not None and seq_len > block_size:
        raise ConfigError(
            f"data.seq_len={seq_len} exceeds model.block_size={block_size}; the model cannot see that "
            f"far back: raise model.block_size or drop the data.seq_len override (it follows block_size)"
        )
    if data_name == "text":
        from data.text import check_text_file

        try:
            check_text_file(run.data.path)
        except (OSError, ValueError) as err:
            raise ConfigError(str(err)) from None
    return run


# --- sections -------------------------------------------------------------------------------

_SECTIONS = ("model", "data", "optimizer", "scheduler", "strategy", "trainer")


def _reject_unknown_sections(cfg: DictConfig) -> None:
    for key in cfg:
        if key not in _SECTIONS and key != "hydra":
            raise ConfigError(
                f"unknown config section '{key}'; the sections are {', '.join(_SECTIONS)}"
            )
    for key in _SECTIONS:
        if key not in cfg or not isinstance(cfg[key], DictConfig):
            raise ConfigError(f"config section '{key}' is missing; pick one with {key}=<option>")


def _option_name(cfg: DictConfig, section: str, registry: dict) -> str:
    name = cfg[section].get("name")
    if name not in registry:
        raise ConfigError(
            f"{section}.name={name!r} is not a known {section}; choose one of "
            f"{', '.join(sorted(registry))}"
        )
    return name


def _typed(node: DictConfig, schema: type, section: str, drop: tuple[str, ...] = ()):
    """Merge `node` onto the dataclass `schema`: unknown keys and wrong types fail here."""
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in drop}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{section}.{_omegaconf_message(err)}") from None
    except (ValueError, TypeError) as err:  # the dataclass's own __post_init__ checks
        raise ConfigError(str(err)) from None


def _typed_model_config(node: DictConfig, schema: type):
    """Model configs are checked with placeholder sizes where the data set provides them."""
    names = {f.name for f in dataclasses.fields(schema)}
    placeholders = {k: 1 for k in DATA_DERIVED_MODEL_FIELDS if k in names}
    for key in placeholders:
        if key in node:
            raise ConfigError(
                f"model.{key} is set by the data set; change it on the data side instead "
                f"(e.g. data.vocab_size, data.num_features, data.num_classes)"
            )
    values = OmegaConf.to_container(node, resolve=True)
    values.pop("name", None)
    return _typed(OmegaConf.create({**values, **placeholders}), schema, "model")


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in message and "Key" in message:
        return f"{key}: unknown key ({message}); check the spelling against conf/"
    if "Value '" in message and "could not be converted" in message:
        return f"{key}: {message}; pass a value of the right type"
    return f"{key}: {message}" if key else message


# --- cross-field checks ---------------------------------------------------------------------


def _check_trainer(t: TrainerConfig) -> None:
    for name in ("batch_size", "accumulate_grad_batches", "log_every_n_steps"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be positive")
    for name in ("val_batch_size", "eval_every_n_steps", "limit_val_batches", "checkpoint_every_n_steps",
                 "overfit_batches", "profile_steps"):
        if getattr(t, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 0 (0 means default)")
    if t.max_steps <= 0 and t.max_epochs <= 0:
        raise ConfigError(
            "trainer.max_epochs and trainer.max_steps are both <= 0; set one of them positive"
        )
    if t.precision not in PRECISIONS:
        raise ConfigError(
            f"trainer.precision={t.precision!r} is not supported; use one of {', '.join(PRECISIONS)}"
        )
    if t.accelerator not in ACCELERATORS:
        raise ConfigError(
            f"trainer.accelerator={t.accelerator!r} is unknown; use one of {', '.join(ACCELERATORS)}"
        )
    if t.grad_clip_norm < 0:
        raise ConfigError(f"trainer.grad_clip_norm={t.grad_clip_norm} must be >= 0 (0 disables it)")
    cuda = _cuda_available()
    if t.accelerator == "cuda" and not cuda:
        raise ConfigError(
            "trainer.accelerator=cuda but no CUDA device is visible; use trainer.accelerator=cpu "
            "(or auto)"
        )
    if t.precision == "16-mixed" and (t.accelerator == "cpu" or not cuda):
        raise ConfigError(
            "trainer.precision=16-mixed needs a CUDA device (GradScaler); on CPU use "
            "trainer.precision=bf16-mixed or 32"
        )
    if t.resume is not None:
        if not isinstance(t.resume, str) or not os.path.isfile(t.resume):
            raise ConfigError(
                f"trainer.resume={t.resume!r} is not a file; pass the path of a checkpoint, "
                f"e.g. trainer.resume=outputs/runs/<run>/checkpoints/last.pt"
            )


def _check_optimization(o: OptimizerConfig, s: SchedulerConfig) -> None:
    if o.name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={o.name!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    if not o.lr > 0:
        raise ConfigError(f"optimizer.lr={o.lr} must be positive")
    if o.weight_decay < 0 or o.momentum < 0 or o.eps <= 0:
        raise ConfigError("optimizer.weight_decay and optimizer.momentum must be >= 0, optimizer.eps > 0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optimizer.betas={o.betas} must be two numbers in [0, 1)")
    if s.name not in SCHEDULERS:
        raise ConfigError(f"scheduler.name={s.name!r} is unknown; use one of {', '.join(SCHEDULERS)}")
    if s.warmup_steps < 0 or s.min_lr < 0:
        raise ConfigError("scheduler.warmup_steps and scheduler.min_lr must be >= 0")
    if s.min_lr > o.lr:
        raise ConfigError(f"scheduler.min_lr={s.min_lr} exceeds optimizer.lr={o.lr}; lower it")


def _check_strategy(s: StrategyConfig, t: TrainerConfig) -> None:
    if s.name not in STRATEGIES:
        raise ConfigError(f"strategy.name={s.name!r} is unknown; use one of {', '.join(STRATEGIES)}")
    if s.backend not in BACKENDS:
        raise ConfigError(f"strategy.backend={s.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if s.nproc_per_node <= 0 or s.timeout_minutes <= 0 or s.bucket_cap_mb <= 0:
        raise ConfigError(
            "strategy.nproc_per_node, strategy.timeout_minutes and strategy.bucket_cap_mb must be positive"
        )
    if s.name != "ddp" and s.nproc_per_node != 1:
        raise ConfigError(
            f"strategy.nproc_per_node={s.nproc_per_node} needs strategy=ddp; add strategy=ddp"
        )
    if s.name == "ddp" and s.backend == "nccl" and (t.accelerator == "cpu" or not _cuda_available()):
        raise ConfigError(
            "strategy.backend=nccl needs a CUDA device on every rank and none is visible; "
            "use strategy.backend=gloo (or auto) on CPU"
        )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
