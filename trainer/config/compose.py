"""Composing a command's config ahead of Hydra, so that a mistake is one line.

Every command (train, evaluate, sample, consolidate, prepare_tokens) is a Hydra app with its
own primary config in conf/. Before Hydra runs, `check_overrides` composes the config of
every job the command line asks for, exactly as Hydra will, and turns what Hydra would
report as a multi-line block (unknown key, missing option, an override it cannot read) into
one ConfigError line that names the key and the fix; `exit_on_user_error` prints it as
`error: ...` with exit status 2, before Hydra creates a run directory. A `PrimaryConfig`
says which conf/<name>.yaml the command composes and how its messages name it.
"""
from __future__ import annotations

import argparse
import difflib
import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ringtrain.conf
from ringtrain.errors import ConfigError

if TYPE_CHECKING:  # Hydra is imported when a command line is read, not with this module
    from hydra.core.override_parser.types import Override
    from omegaconf import DictConfig

# The shipped configs: conf/ in a clone, ringtrain/conf in an installed wheel.
CONF_DIR = Path(ringtrain.conf.__file__).parent
# More combinations than this are not all composed ahead; Hydra still checks each job itself.
_MAX_CHECKED_JOBS = 64
# Flags after which Hydra does not compose a config for a run.
_NO_RUN_FLAGS = ("help", "hydra_help", "info", "shell_completion", "version", "cfg")
# Settings Lightning users reach for, and what they are called here.
LIGHTNING_HABITS = {
    "trainer.devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "trainer.num_nodes": "torchrun --nnodes=N (see README, Several machines)",
    "trainer.fast_dev_run": "debug=fast_dev_run",
    "trainer.max_time": "trainer.max_steps",
    "trainer.gradient_clip_val": "trainer.grad_clip_norm",
    "trainer.accumulate_grad": "trainer.accumulate_grad_batches",
    "trainer.check_val_every_n_epoch": "trainer.eval_every_n_steps",
    "trainer.val_check_interval": "trainer.eval_every_n_steps",
    "trainer.limit_train_batches": "trainer.overfit_batches or trainer.max_steps",
    "trainer.ckpt_path": "trainer.resume=<path to last.pt>",
    "trainer.strategy": "strategy=single|dp|ddp",
    "ckpt_path": "trainer.resume=<path to last.pt>",
    "seed": "trainer.seed",
    "devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "precision": "trainer.precision",
    "max_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "batch_size": "trainer.batch_size",
    "lr": "optimizer.lr",
}
# The training config's sections: the components, the strategy, the trainer.
SECTIONS = ("model", "data", "task", "optimizer", "scheduler", "strategy", "trainer")
# Groups that are presets rather than sections of the run's config; choosing one on the
# command line changes several sections at once, these.
PRESET_GROUPS = ("experiment", "debug", "hparams_search")
PRESET_SECTIONS = ("trainer", "optimizer", "scheduler", "strategy")
# Sections that hold a `_target_` node: a key they lack may be a new argument (+key=value).
_COMPONENT_SECTIONS = ("model", "data", "task", "optimizer", "scheduler")


@dataclass(frozen=True)
class PrimaryConfig:
    """A command's primary config, conf/<name>.yaml, and how its messages name it."""

    name: str
    program: str  # the command as the user types it, e.g. "ringtrain evaluate"
    usage: str = ""  # a whole command line, the fix for a missing required setting
    # A key (or a section) the config does not have -> what to write instead.
    hints: Mapping[str, str] = field(default_factory=dict)
    # train's top level is config groups and presets; a tool's is its settings.
    presets: tuple[str, ...] = ()


TRAIN = PrimaryConfig(
    "train", "ringtrain", usage="ringtrain [group=option ...] [key=value ...]",
    hints={key: f"use {fix}" for key, fix in LIGHTNING_HABITS.items()}, presets=PRESET_GROUPS,
)


def parse_command_line(args: Sequence[str]) -> tuple[argparse.Namespace, list[Override]]:
    """Hydra's reading of `args` (the command line without the program): its flags and the
    parsed overrides; an override Hydra cannot read is a ConfigError."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed_args, _ = get_args_parser().parse_known_args(list(args))
    parser = OverridesParser.create()
    overrides = []
    for line in parsed_args.overrides:
        try:
            overrides.append(parser.parse_override(line))
        except HydraException as err:  # OverrideParseException, or the grammar's own errors
            first = str(err).strip().splitlines()[0]
            raise ConfigError(
                f"cannot read the override {line!r} ({first}); write group=option or key=value, "
                f"e.g. model=mlp optimizer.lr=0.01; quote a value with signs for Hydra inside the shell's quotes: \"key='a, b#'\""
            ) from None
    return parsed_args, overrides


def composes_a_job(parsed_args: argparse.Namespace) -> bool:
    """False for --help, --cfg, --info and the like, and for another primary config than ours
    (--config-name: Hydra reports on it itself)."""
    if any(getattr(parsed_args, flag, False) for flag in _NO_RUN_FLAGS):
        return False
    return not (parsed_args.config_path or parsed_args.config_name)


@dataclass(frozen=True)
class Outputs:
    """Where Hydra will write the first job the command line asks for, read ahead."""

    key: str  # the setting that says where: hydra.run.dir, or hydra.sweep.dir for a multirun
    directory: str | None  # its value (None: it cannot be resolved before Hydra runs)
    record_subdir: str | None  # hydra.output_subdir: the job's record (.hydra/), None for none
    multirun: bool


def check_overrides(
    args: list[str], primary: PrimaryConfig = TRAIN, validate: Callable[[Any], Any] | None = None,
) -> Outputs | None:
    """Compose (and `validate`, when given) the config of every job the command line asks
    for; raise ConfigError on a mistake. Return where the first job writes (None when the
    command line runs no job: --help, --cfg...).

    `args` is the command line without the program name. Sweeps are expanded as Hydra's basic
    sweeper would (up to _MAX_CHECKED_JOBS jobs); continuous search spaces (an Optuna
    `interval(...)`) are left to the sweeper.
    """
    from omegaconf import open_dict

    parsed_args, overrides = parse_command_line(args)
    if not composes_a_job(parsed_args):
        return None
    config_dir = parsed_args.config_dir
    if config_dir and not Path(config_dir).is_dir():
        raise ConfigError(f"--config-dir {config_dir!r} is not a directory; pass the folder that holds your <group>/<option>.yaml files")
    outputs = None
    for job in itertools.islice(jobs_of(overrides, parsed_args.multirun, primary), _MAX_CHECKED_JOBS):
        cfg = compose_or_explain(job, config_dir, primary, with_hydra=outputs is None)
        if outputs is None:
            outputs = _outputs(cfg, parsed_args.multirun)
            with open_dict(cfg):
                del cfg["hydra"]  # as Hydra hands the job its config
        if validate is not None:
            validate(cfg)
    return outputs


def _outputs(cfg: DictConfig, multirun: bool) -> Outputs:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:  # ${hydra.job.name} and the like have their values only once Hydra runs the job
        directory = OmegaConf.select(cfg, key, throw_on_missing=True)
    except OmegaConfBaseException:
        directory = None
    return Outputs(key, None if directory is None else str(directory), cfg.hydra.output_subdir, multirun)


def jobs_of(overrides: list[Override], multirun: bool, primary: PrimaryConfig = TRAIN) -> Iterator[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands the parsed `overrides`."""
    choices = []
    for override in overrides:
        if multirun and override.is_discrete_sweep():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        elif override.is_sweep_override():
            if not multirun:
                raise ConfigError(
                    f"{override.input_line!r} is a sweep; add -m to run one job per value "
                    f"({primary.program} -m {override.input_line})"
                )
            continue  # a continuous search space: only the sweeper can pick values
        else:
            choices.append([override.input_line])
    return (list(job) for job in itertools.product(*choices))


def compose_or_explain(overrides: list[str], config_dir: str | None = None, primary: PrimaryConfig = TRAIN,
                       with_hydra: bool = False) -> DictConfig:
    """The composed config for `overrides` (with its `hydra` node when `with_hydra`), or a
    ConfigError saying what is wrong and the fix."""
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from yaml import YAMLError

    try:
        return _compose(overrides, config_dir, primary.name, with_hydra)
    except YAMLError as err:  # a config file that is not YAML: PyYAML's multi-line report
        raise ConfigError(yaml_error_message(err)) from None
    except MissingConfigException as err:
        raise ConfigError(_missing_option_message(err, primary, config_dir)) from None
    except ConfigCompositionException as err:
        raise ConfigError(_composition_message(err, overrides, config_dir, primary)) from None


def yaml_error_message(err: Exception) -> str:
    """PyYAML's report as one line: the file, the line and column, what is wrong there."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or problem is None:
        return f"a config file is not valid YAML ({' '.join(str(err).split())}); fix its syntax"
    started = getattr(err, "context_mark", None)
    context = getattr(err, "context", None)
    where = f" ({context} that starts at line {started.line + 1}, column {started.column + 1})" if context and started else ""
    return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {problem}{where}; fix the YAML syntax there"


def _compose(overrides: list[str], config_dir: str | None, config_name: str, with_hydra: bool = False) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # called again in one process (tests)
        GlobalHydra.instance().clear()
    extra = []
    if config_dir:  # what --config-dir does: the user's folder is searched before conf/
        extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=extra + overrides, return_hydra_config=with_hydra)


def _missing_option_message(err, primary: PrimaryConfig, config_dir: str | None = None) -> str:
    missing = err.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    if group and err.options:
        close = difflib.get_close_matches(option, err.options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if group.startswith("hydra/"):  # sweepers and launchers are plugins, installed as extras
            hint = " (Optuna and joblib come with pip install -e '.[sweep]', submitit with '.[slurm]')"
        elif not close and not config_dir:  # most likely the user's own option, in a folder not given
            hint = f"; your own? put {group}/{option}.yaml in a config folder and pass --config-dir <folder>"
        return (
            f"{group}={option} is not an option of {group}; choose one of "
            f"{', '.join(sorted(err.options))}{hint}"
        )
    return _first_line(err, primary)


def _composition_message(err, overrides: list[str], config_dir: str | None, primary: PrimaryConfig) -> str:
    message = str(err)
    unknown = re.search(r"Could not override '([^']+)'", message)
    if unknown:
        return _unknown_key_message(unknown.group(1), overrides, config_dir, primary)
    exists = re.search(r"Could not append to config. An item is already at '([^']+)'", message)
    if exists:
        key = exists.group(1)
        return f"{key} already exists, so +{key}=... cannot add it; change it with {key}=<value>"
    absent = re.search(r"Could not delete from config. '([^']+)' does not exist", message)
    if absent:
        key = absent.group(1)
        return f"{key} is not set, so ~{key} cannot remove it; check the spelling (--cfg job prints the config)"
    return _first_line(err, primary)


def _unknown_key_message(key: str, overrides: list[str], config_dir: str | None, primary: PrimaryConfig) -> str:
    """Why `key` is not in the composed config, with the keys that are, or the option that has it."""
    section, _, rest = key.partition(".")
    hint = primary.hints.get(key) or primary.hints.get(section)
    if hint:
        return f"{key} is not a setting here; {hint}"
    others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        cfg = _compose(others, config_dir, primary.name, with_hydra=True)
    except Exception:
        return f"{key} is not a known setting; check the spelling against conf/{primary.name}.yaml"
    top_level = sorted(k for k in cfg if k != "hydra")
    if not rest and section in cfg:  # e.g. data=x, where data is a section but not a group
        return f"{key}=... would replace the whole {key} section; change its keys instead, e.g. {key}.<key>=<value>"
    if not rest or section not in cfg:
        return _unknown_top_level_message(key if not rest else section, not rest, top_level, primary)
    from omegaconf import OmegaConf

    parent_path = key.rpartition(".")[0]
    parent = OmegaConf.select(cfg, parent_path)
    chosen_groups = cfg.hydra.runtime.choices
    owners = options_defining(section, rest) if section in chosen_groups else []
    if owners and section == "strategy":
        chosen = chosen_groups[section]
        picks = " or ".join(f"{section}={o}" for o in owners)
        return f"{key} is not a setting of {section}={chosen}; it belongs to {picks}: choose that option or drop the override"
    if owners:
        picks = " or ".join(f"{section}={o}" for o in owners)
        return f"{key} is not a setting of this {section}; it belongs to {picks}: choose that option or drop the override"
    known = ", ".join(sorted(k for k in parent if k != "_target_")) if parent is not None and hasattr(parent, "keys") else ""
    if section in _COMPONENT_SECTIONS and parent_path == section:
        target = cfg[section].get("_target_", "?")
        return (
            f"{key} is not set by this {section} ({target}); to pass a new argument write +{key}=<value>, "
            f"or check the spelling (set now: {known or 'nothing'})"
        )
    return f"{key} is not a setting of {parent_path}; check the spelling (known: {known})"


def _unknown_top_level_message(name: str, whole_key: bool, top_level: list[str], primary: PrimaryConfig) -> str:
    if not primary.presets:  # a tool: its top level is its settings
        return f"{name} is not a setting of {primary.program}; the settings are {', '.join(top_level)}"
    names = top_level + list(primary.presets)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    what = "a config group or setting" if whole_key else "a config group"
    return f"{name} is not {what}; {hint}the groups are {', '.join(names)}"


def options_defining(group: str, dotted_key: str) -> list[str]:
    """The options of conf/<group>/ whose file sets `dotted_key`."""
    from omegaconf import OmegaConf

    return [name for name, node in option_nodes(group) if OmegaConf.select(node, dotted_key, default=None) is not None]


def option_nodes(group: str) -> Iterator[tuple[str, DictConfig]]:
    """(option name, the node its conf/<group>/<option>.yaml gives `group`) for every option."""
    from omegaconf import OmegaConf

    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        if "@package _global_" in path.read_text().split("\n", 1)[0]:
            node = node.get(group) or OmegaConf.create()  # the file spells out `group:` itself
        yield path.stem, node


def _first_line(err: BaseException, primary: PrimaryConfig) -> str:
    """Hydra's report in one line: its first line, the reason under it, and the key."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    reason = lines[1] if len(lines) > 1 and not lines[1].startswith("full_key:") else ""
    parts = [lines[0].rstrip(":"), reason, f"(at {key})" if key else ""]
    return " ".join(p for p in parts if p) + f"; see `{primary.program} --help`"
