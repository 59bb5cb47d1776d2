"""Typed schemas for the composed Hydra config, and the validation that runs before any work.

`validate(cfg)` turns the composed DictConfig into a `RunConfig`: the trainer and strategy
sections as typed dataclasses, the components (model, data, task, optimizer, scheduler) as
their checked `_target_` nodes (trainer/builders.py). Every user mistake it finds (unknown
key, wrong type, impossible size, a component that does not import or does not take its
arguments, a model the data does not fit, missing file, device that is not there) becomes
one `ConfigError` whose message names the key, the problem and the fix. `train.py` prints
that one line and exits with status 2, before a process group, a data set or a GPU is
touched, and before Hydra creates the run directory.
"""
from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ringtrain.config.compose import CONF_DIR, SECTIONS
from ringtrain.config.data_lengths import check_data_lengths, check_validation_limit
from ringtrain.errors import ConfigError
from ringtrain.strategies.base import Strategy

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "cuda")
NONFINITE_POLICIES = ("stop", "skip", "ignore")  # trainer.on_nonfinite (ringtrain/loop/nonfinite.py)
# torch.compile's modes (trainer.compile_mode); "default" passes none.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TrainerConfig:
    """The trainer section's settings and their types. Their defaults, and what each means,
    are in conf/trainer/default.yaml, the one place they are written (`trainer_config()`
    reads them for the Python API)."""

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
    limit_val_batches: int
    overfit_batches: int
    profile_steps: int
    log_every_n_steps: int
    checkpoint: bool
    checkpoint_every_n_steps: int
    keep_last_k: int
    async_checkpoint: bool
    resume: Any  # "auto", a checkpoint path, or None
    init_from: Optional[str]  # starting weights (checkpoints/initial_weights.py), or None
    on_nonfinite: str
    stop_signals: list[str]
    seed: int
    progress_bar: bool
    num_workers: int
    pin_memory: Optional[bool]
    persistent_workers: bool
    prefetch_factor: int
    compile: bool
    compile_mode: str
    tf32: bool
    peak_tflops: float
    cpu_alternative: Optional[str]  # a GPU-sized preset's advice for a CPU (gpu_preset_notice)


def trainer_config(**settings: Any) -> TrainerConfig:
    """conf/trainer/default.yaml's settings with `settings` changed, checked and typed."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "trainer" / "default.yaml"))
    return typed_section({**defaults, **settings}, TrainerConfig, "trainer")


@dataclass
class RunConfig:
    """The validated run: typed sections, component nodes, and the resolved config as plain data.

    A component is a `_target_` node (plain dicts), or None where the Python API was handed
    the built object (`Trainer.fit(model, train_set, val_set, task)`). The optimizer and
    scheduler may also be callables from the Python API: `optimizer(params)`,
    `scheduler(optimizer)`.
    """

    model: dict | None
    data: dict | None
    task: dict | None
    optimizer: Any
    scheduler: Any
    strategy: Strategy  # built from its node: ringtrain/strategies
    trainer: TrainerConfig
    resolved: dict  # the whole resolved config, for checkpoints and TensorBoard


def validate(cfg: DictConfig) -> RunConfig:
    """Check the composed config and return it typed; raise ConfigError on the first mistake."""
    from ringtrain.config.builders import check_components
    from ringtrain.config.dry_step import data_lengths, dry_step
    from ringtrain.config.sizes import defer_data_sizes

    _reject_unknown_sections(cfg)
    defer_data_sizes(cfg)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"config: {_omegaconf_message(err)}") from None
    resolved.pop("hydra", None)
    run = RunConfig(
        model=resolved["model"],
        data=resolved["data"],
        task=resolved["task"],
        optimizer=resolved["optimizer"],
        scheduler=resolved["scheduler"],
        strategy=build_strategy(resolved["strategy"]),
        trainer=typed_section(cfg.trainer, TrainerConfig, "trainer"),
        resolved=resolved,
    )
    check_options(run.trainer, run.strategy)
    seq_len, block_size = run.data.get("seq_len"), run.model.get("block_size")
    if isinstance(seq_len, int) and isinstance(block_size, int) and seq_len > block_size:
        raise ConfigError(
            f"data.seq_len={seq_len} exceeds model.block_size={block_size}; the model cannot see that "
            f"far back: raise model.block_size or drop the data.seq_len override (it follows block_size)"
        )
    resuming_a_file = run.trainer.resume not in (None, "auto")  # which ignores init_from
    check_components(run.model, run.data, run.task, run.optimizer, run.scheduler, run.trainer.max_steps,
                     init_from=None if resuming_a_file else run.trainer.init_from)
    dry_step(run.model, run.data, run.task)
    if (lengths := data_lengths(run.data)) is not None:  # each rank's share and batch, before any work
        check_data_lengths(*lengths, run.trainer, run.strategy.planned_ranks())
    return run


def check_options(trainer: TrainerConfig, strategy: Strategy) -> None:
    """The cross-field checks of the trainer section, then the strategy's own refusals (its
    ranks against torchrun's among them), then what needs its ranks."""
    _check_trainer(trainer)
    strategy.check(trainer)
    check_validation_limit(trainer, strategy.planned_ranks())


def build_strategy(node: Any) -> Strategy:
    """The strategy a conf/strategy/<option>.yaml node (or your own) names by `_target_`,
    built now: a strategy's constructor only stores and checks its options."""
    from ringtrain.config.components import build, check, check_built

    check(node, "strategy", kind=Strategy)
    return check_built(build(node, "strategy"), "strategy", Strategy)


def strategy_option(name: str, **options: Any) -> Strategy:
    """conf/strategy/<name>.yaml's strategy with `options` changed (the Python API's
    `strategy="ddp"` or `{"name": "ddp", "nproc_per_node": 2}`)."""
    path = CONF_DIR / "strategy" / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"strategy {name!r} is not an option of conf/strategy/; use one of {names}")
    node = OmegaConf.to_container(OmegaConf.load(path))
    unknown = sorted(set(options) - set(node))
    if unknown:
        raise ConfigError(
            f"strategy={name} has no setting {unknown[0]!r}; its settings are {', '.join(k for k in node if k != '_target_')}"
        )
    return build_strategy({**node, **options})


# --- sections -------------------------------------------------------------------------------



def _reject_unknown_sections(cfg: DictConfig) -> None:
    for key in cfg:
        if key not in SECTIONS and key != "hydra":
            raise ConfigError(
                f"unknown config section '{key}'; the sections are {', '.join(SECTIONS)}"
            )
    for key in SECTIONS:
        if key not in cfg or not isinstance(cfg[key], DictConfig):
            raise ConfigError(f"config section '{key}' is missing; pick one with {key}=<option>")


def typed_section(node: DictConfig | dict, schema: type, section: str):
    """Merge `node` onto the dataclass `schema`: unknown keys and wrong types fail here."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{section}.{_omegaconf_message(err)}") from None
    except (ValueError, TypeError) as err:  # the dataclass's own __post_init__ checks
        raise ConfigError(str(err)) from None


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    message = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in message and "Key" in message:
        return f"{key}: unknown key ({message}); check the spelling against conf/"
    if "Value '" in message and "could not be converted" in message:
        return f"{key}: {message}; pass a value of the right type"
    return f"{key}: {message}" if key else message


# --- cross-field checks ---------------------------------------------------------------------

# What 0 does for the settings where it stands for a default (conf/trainer/default.yaml).
ZERO_MEANS = {
    "val_batch_size": "trainer.batch_size",
    "eval_every_n_steps": "evaluate at each epoch's end and at the last step",
    "limit_val_batches": "the whole validation set",
    "checkpoint_every_n_steps": "save only at evaluations, at the end and on a stop signal",
    "overfit_batches": "off, train on the whole training set",
    "profile_steps": "no profiler",
}


def _check_trainer(t: TrainerConfig) -> None:
    for name in ("batch_size", "accumulate_grad_batches", "log_every_n_steps"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be positive")
    for name, zero in ZERO_MEANS.items():
        if getattr(t, name) < 0:
            raise ConfigError(f"trainer.{name}={getattr(t, name)} must be >= 0 (0: {zero})")
    if t.max_steps <= 0 and t.max_epochs <= 0:
        raise ConfigError(
            "trainer.max_epochs and trainer.max_steps are both <= 0; set one of them positive"
        )
    if t.max_steps == 0 or t.max_steps < -1:
        raise ConfigError(
            f"trainer.max_steps={t.max_steps} {'would train nothing' if t.max_steps == 0 else 'is not a number of steps'}; "
            f"set the number of optimizer steps to train, or -1 to train trainer.max_epochs epochs"
        )
    if t.precision not in PRECISIONS:
        lightning = {"bf16": "bf16-mixed", "16": "16-mixed", "fp16": "16-mixed", "32-true": "32"}.get(str(t.precision))
        hint = f"trainer.precision={lightning} is the mixed-precision name here; " if lightning else ""
        raise ConfigError(
            f"trainer.precision={t.precision!r} is not supported; {hint}use one of {', '.join(PRECISIONS)}"
        )
    if t.num_workers < 0 or t.prefetch_factor <= 0:
        raise ConfigError("trainer.num_workers must be >= 0 and trainer.prefetch_factor positive")
    if t.persistent_workers and t.num_workers == 0:
        raise ConfigError("trainer.persistent_workers=true needs worker processes; set trainer.num_workers >= 1")
    if t.accelerator not in ACCELERATORS:
        raise ConfigError(
            f"trainer.accelerator={t.accelerator!r} is unknown; use one of {', '.join(ACCELERATORS)}"
        )
    if t.grad_clip_norm < 0:
        raise ConfigError(f"trainer.grad_clip_norm={t.grad_clip_norm} must be >= 0 (0 disables it)")
    if t.compile_mode not in COMPILE_MODES:
        raise ConfigError(
            f"trainer.compile_mode={t.compile_mode!r} is not a torch.compile mode; use one of {', '.join(COMPILE_MODES)}"
        )
    if t.compile_mode != "default" and not t.compile:
        raise ConfigError(
            f"trainer.compile_mode={t.compile_mode} has no effect without compiling; add trainer.compile=true"
        )
    if not (math.isfinite(t.peak_tflops) and t.peak_tflops >= 0):
        raise ConfigError(
            f"trainer.peak_tflops={t.peak_tflops} must be >= 0 (the device's peak TFLOP/s; 0 looks the GPU up)"
        )
    _check_devices(t)
    _check_run_control(t)


def _check_devices(t: TrainerConfig) -> None:
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


def gpu_preset_notice(t: TrainerConfig) -> str | None:
    """The line a preset sized for a GPU (trainer.cpu_alternative set) gives when the run will be
    on the CPU: such a run compiles for minutes or takes minutes a step, with nothing said."""
    if not t.cpu_alternative or (t.accelerator != "cpu" and _cuda_available()):
        return None
    return (
        f"this preset is sized for a GPU and the run is on the CPU (no GPU visible, or trainer.accelerator=cpu): "
        f"it will be very slow; use {t.cpu_alternative} instead"
    )


def _check_run_control(t: TrainerConfig) -> None:
    """Resuming, checkpoints and stopping."""
    if t.resume not in (None, "auto"):
        if not isinstance(t.resume, str) or not os.path.isfile(t.resume):
            raise ConfigError(
                f"trainer.resume={t.resume!r} is not a file; pass the path of a checkpoint "
                f"(e.g. trainer.resume=outputs/runs/<run>/checkpoints/last.pt), auto or null"
            )
    # A continued run (trainer.resume=<path>) ignores init_from: its file may be gone by then.
    resuming_a_file = t.resume not in (None, "auto")
    if t.init_from is not None and not resuming_a_file and not os.path.isfile(t.init_from):
        # A save_pretrained / `ringtrain export format=hf` folder holds its weights as model.safetensors.
        weights = os.path.join(str(t.init_from), "model.safetensors")
        fix = f"pass {weights}" if os.path.isdir(t.init_from) and os.path.isfile(weights) else (
            "pass a checkpoint (.pt) or a .safetensors file to start from, or null")
        raise ConfigError(f"trainer.init_from={t.init_from!r} is not a file; {fix}")
    if t.keep_last_k < 1:
        raise ConfigError(f"trainer.keep_last_k={t.keep_last_k} must be >= 1 (1 keeps only the newest checkpoint)")
    if t.on_nonfinite not in NONFINITE_POLICIES:
        raise ConfigError(f"trainer.on_nonfinite={t.on_nonfinite!r} is unknown; use one of {', '.join(NONFINITE_POLICIES)}")
    for name in t.stop_signals:
        if not isinstance(getattr(signal, str(name), None), signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(
                f"trainer.stop_signals: {name!r} is not a signal this process can catch; use names like "
                f"SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (or [] to handle none)"
            )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
