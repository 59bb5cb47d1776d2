"""The configuration: the checked job, the data, task and model nodes, a checkpoint's recipe and
its replay, the sweep summary (a module each), and here every command's Hydra app (primary
config conf/<name>.yaml), composed once. May import the packages below it in
docs/ARCHITECTURE.md, except ringtrain.checkpoints; never the loop, the job or the tools.

`run_app` has Hydra raise its exception rather than print a report (HYDRA_FULL_ERROR), so that
a composition mistake's fields (the key, the options there are) make one line naming the fix,
exit 2. The `${ringtrain.*:}` resolvers the configs use are registered here too.
"""
from __future__ import annotations

import atexit
import difflib
import functools
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException, SearchPathException
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import configure_log, run_job
from hydra.experimental.callback import Callback
from hydra.types import HydraContext, RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from ringtrain.conf import CONF_DIR, options_defining
from ringtrain.config.recipe import Replay
from ringtrain.errors import ConfigError, exit_on_user_error
from ringtrain.storage.rundir import log_file, rank_tag, run_directory, run_name

# Settings Lightning users reach for, and what they are called here.
LIGHTNING_HABITS = {
    "trainer.devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "trainer.num_nodes": "torchrun --nnodes=N (see README, Several machines)",
    "trainer.fast_dev_run": "debug=fast_dev_run",
    "trainer.max_time": "trainer.max_steps",
    "trainer.gradient_clip_val": "trainer.grad_clip_norm",
    "trainer.accumulate_grad": "trainer.accumulate_grad_batches",
    "trainer.check_val_every_n_epoch": "trainer.eval_every_n_steps",
    "trainer.val_check_interval": "trainer.eval_every_n_steps (steps) or trainer.eval_every_fraction (of an epoch)",
    "trainer.limit_train_batches": "trainer.overfit_batches or trainer.max_steps",
    "trainer.ckpt_path": "trainer.resume=<path to last.pt>",
    "trainer.strategy": "strategy=single|dp|ddp|fsdp",
    "trainer.callbacks": "callbacks.<name>=... (conf/callbacks/)",
    "trainer.logger": "logger.<name>=... (conf/logger/)",
    "ckpt_path": "trainer.resume=<path to last.pt>",
    "seed": "trainer.seed",
    "devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "precision": "trainer.precision",
    "max_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "batch_size": "trainer.batch_size",
    "lr": "optimizer.lr",
}
# Groups that are presets rather than sections of the run's config.
PRESET_GROUPS = ("experiment", "debug", "hparams_search")
# Sections that hold a `_target_` node: a key they lack may be a new argument (+key=value).
COMPONENT_SECTIONS = ("model", "data", "task", "optimizer", "scheduler", "strategy", "adapter")


@dataclass(frozen=True)
class PrimaryConfig:
    """A command's primary config, conf/<name>.yaml, and how its messages name it."""

    name: str
    program: str  # the command as the user types it, e.g. "ringtrain evaluate"
    usage: str = ""  # a whole command line, the fix for a missing required setting
    # A key (or a section) the config does not have -> what to write instead.
    hints: Mapping[str, str] = field(default_factory=dict)
    presets: tuple[str, ...] = ()  # train's top level has preset groups; a tool's is its settings


@dataclass
class CommandLine:
    """This process's command line, as the entry module (ringtrain/__main__.py) read it. `replay`: the
    overrides a checkpoint records, which go before the user's; `checkpoint`: that checkpoint, read once."""

    program: str
    args: list[str]
    replay: Replay | None = None
    checkpoint: Any = None  # checkpoints/__init__.py Resumed

    @property
    def overrides(self) -> list[str]:
        """The user's overrides (key=value, group=option, +key, ~key), as typed."""
        return [arg for arg in self.args if ("=" in arg or arg.startswith("~")) and not arg.startswith("-")]

    @property
    def multirun(self) -> bool:
        return any(arg in ("-m", "--multirun") for arg in self.args)

    @property
    def config_dirs(self) -> list[str]:
        given = [value for flag, value in zip(self.args, self.args[1:]) if flag in ("--config-dir", "-cd")]
        return given + [arg.split("=", 1)[1] for arg in self.args if arg.startswith("--config-dir=")]

    def hydra_args(self) -> list[str]:
        """What Hydra reads: the user's arguments with the replayed overrides before their first
        override (Hydra's parser takes the overrides as one run of words)."""
        replayed = self.replay.overrides if self.replay else []
        first = next((i for i, arg in enumerate(self.args) if arg in self.overrides), len(self.args))
        return [*self.args[:first], *replayed, *self.args[first:]]


TRAIN = PrimaryConfig("train", "ringtrain", usage="ringtrain [group=option ...] [key=value ...]",
                      hints={key: f"use {fix}" for key, fix in LIGHTNING_HABITS.items()}, presets=PRESET_GROUPS)


def run_app(primary: PrimaryConfig, task: Callable[[Any], Any], command: CommandLine) -> Any:
    """The entry module already put `command`'s arguments (the replayed ones among them) where Hydra reads them."""
    register_resolvers()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # transformers' progress bars (loading weights) would come between a command's lines, or
    # before its one-line refusal; HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    jobs_started = []

    @functools.wraps(task)
    def job(cfg: Any) -> Any:
        jobs_started.append(True)
        return task(cfg)

    app = hydra.main(version_base="1.3", config_path="pkg://ringtrain.conf", config_name=primary.name)(job)
    with exit_on_user_error():
        try:
            if all(arg in command.overrides for arg in command.args):  # no flag (-m, --help, ...)
                return _run_composed_once(primary.name, job, command.hydra_args(), sweep=app)
            return app()
        except (ConfigCompositionException, MissingConfigException, OverrideParseException,
                SearchPathException, YAMLError) as err:
            raise ConfigError(composition_message(err, primary, command)) from None
        except ValueError as err:  # Hydra's word for `group=null` on the command line
            nulled = [o.split("=", 1)[0] for o in command.overrides if o.endswith("=null") and "." not in o]
            if jobs_started or "Config group override must be" not in str(err) or not nulled:
                raise
            raise ConfigError(f"{nulled[0]}=null cannot remove a group's option on the command line; write "
                              f"~{nulled[0]} instead") from None
        except OSError as err:
            if jobs_started or not err.filename:
                raise
            # Hydra making the run (or sweep) directory
            key = "hydra.sweep.dir" if command.multirun else "hydra.run.dir"
            path = Path(err.filename)
            existing = next(parent for parent in path.parents if parent.exists())
            why = (f"{existing} is a file, not a directory" if existing.is_file()
                   else f"nothing can be written in {existing} ({err.strerror})")
            raise ConfigError(f"the {key.split('.')[1]} directory {path} ({key}) cannot be created: {why}; set {key} "
                              f"to a directory you can write to") from None


def _run_composed_once(config_name: str, task: Callable[[Any], Any], overrides: list[str], sweep: Callable[[], Any]) -> Any:
    """`task` run as @hydra.main runs it (Hydra's logging, the run directory, hydra.callbacks) from
    one composition: @hydra.main composes the config twice, the first time only to read
    hydra.mode (a third of the default job's start-up). `sweep` (@hydra.main itself) runs what
    composes only as a multirun: a config that sets hydra.mode=MULTIRUN, or a mistake to report."""
    name = task.__module__.rpartition(".")[2]  # hydra.job.name as @hydra.main names it: the task's module
    with hydra.initialize_config_module("ringtrain.conf", job_name=name, version_base="1.3"):
        try:
            cfg = hydra.compose(config_name, overrides, return_hydra_config=True)
        except ConfigCompositionException:  # e.g. a=1,2 without -m: @hydra.main sweeps it or says why not
            cfg = None
        if cfg is not None and cfg.hydra.mode != RunMode.MULTIRUN:
            if cfg.hydra.mode is None:  # the override @hydra.main adds, and records
                cfg.hydra.mode = RunMode.RUN
                cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
            configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
            callbacks = HydraCallbacks(cfg)
            callbacks.on_run_start(config=cfg, config_name=config_name)
            done = run_job(task, cfg, "hydra.run.dir", None, HydraContext(GlobalHydra.instance().config_loader(), callbacks))
            callbacks.on_run_end(config=cfg, config_name=config_name, job_return=done)
            return done.return_value  # the task's exception, raised
    return sweep()


class HydraCallbacks:
    """The config's hydra.callbacks, told of a run as Hydra tells them: the end hooks in reverse
    order, and a callback's exception a warning."""

    def __init__(self, cfg: Any):
        self.callbacks = [instantiate(node) for node in (cfg.hydra.callbacks or {}).values()]

    def __getattr__(self, hook: str) -> Callable[..., None]:
        def notify(**arguments: Any) -> None:
            for callback in self.callbacks if hook.endswith("_start") else self.callbacks[::-1]:
                try:
                    getattr(callback, hook)(**arguments)
                except Exception as err:
                    warnings.warn(f"Callback {type(callback).__name__}.{hook} raised {type(err).__name__}: {err}")
        return notify


def register_resolvers() -> None:
    resolvers = {
        "ringtrain.run_name": run_name, "ringtrain.run_dir": run_directory, "ringtrain.log_file": log_file,
        "ringtrain.rank_tag": rank_tag, "ringtrain.direction": optimization_direction,
        "ringtrain.scratch_dir": scratch_directory,
        # one directory name: a sweep job's overrides may hold paths (a/b), which would nest its directory
        "ringtrain.one_name": lambda text: str(text).replace(os.sep, "_"),
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            # cached: one run name per process, however often the run directory is resolved
            OmegaConf.register_new_resolver(name, resolver, use_cache=name in ("ringtrain.run_name", "ringtrain.run_dir"))


def optimization_direction(mode: str) -> str:
    """Optuna's direction for the task's mode: a loss (min) or an accuracy (max)."""
    if mode not in ("min", "max"):
        raise ValueError(f"task.mode={mode!r} must be min or max")
    return "maximize" if mode == "max" else "minimize"


@functools.cache
def scratch_directory() -> str:
    """Where a tool's multirun keeps the multirun.yaml Hydra's sweeper writes (the tools write
    their results where they say): one per process, removed at exit."""
    path = tempfile.mkdtemp(prefix="ringtrain-multirun-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def composition_message(err: Exception, primary: PrimaryConfig, command: CommandLine) -> str:
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        # Hydra lists the options for group=option, not for one of a list (callbacks=[default,x]).
        group = err.missing_cfg_file.rpartition("/")[0]
        folders = [CONF_DIR / group, *(Path(folder) / group for folder in command.config_dirs)]
        if options := err.options or sorted({path.stem for folder in folders for path in folder.glob("*.yaml")}):
            return _missing_option_message(err.missing_cfg_file, options, command)
    if isinstance(err, SearchPathException):
        return f"{_lines(err)[0]}; pass --config-dir the folder that holds your <group>/<option>.yaml files"
    if replayed := _replayed_override_refused(err, command):
        return replayed
    if sweep := _sweep_outside_a_multirun(command):
        key, value = sweep.split("=", 1)
        return (f"'{sweep}' lists several values: add -m to sweep them, or, for one text with a comma, quote it "
                f"for Hydra inside the shell's quotes: \"{key}='{value}'\"")
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return _unknown_key_message(str(cause.full_key), getattr(cause, "parent_node", None), primary, command)
    if isinstance(err, OverrideParseException):
        lines = _lines(err)  # the parser's reason, between Hydra's heading and its link to the grammar
        reason = next((line for line in lines[1:] if line != "^" and not line.startswith("See ")), lines[0])
        return (f"cannot read the override '{err.override}' ({reason}); write group=option or key=value, e.g. model=mlp "
                f"optimizer.lr=0.01; quote a value with signs for Hydra inside the shell's quotes: \"key='a, b#'\"")
    if hasattr(err, "problem_mark"):  # a config file that is not YAML
        mark, start = err.problem_mark, getattr(err, "context_mark", None)
        context = f" ({err.context} that starts at line {start.line + 1}, column {start.column + 1})" if start else ""
        return f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: {err.problem}{context}; fix the YAML syntax there"
    return "; ".join(_lines(err)) + f"; see `{primary.program} --help`"


def _replayed_override_refused(err: Exception, command: CommandLine) -> str | None:
    """Hydra refusing an override the checkpoint recorded (a key the config composed here lacks),
    named as the checkpoint's."""
    replay = command.replay
    for line in replay.overrides if replay else ():
        key = line.split("=", 1)[0].lstrip("~")
        if f"'{key}'" in str(err) and not any(o.split("=", 1)[0].lstrip("+~") == key for o in command.overrides):
            return (f"checkpoint {replay.source} stores the override {line!r}, which your config here does not take "
                    f"({_lines(err)[0]}); give the --config-dir it was trained with, or set that key yourself")
    return None


def _sweep_outside_a_multirun(command: CommandLine) -> str | None:
    """The command line's first sweep override (a=1,2) when it is not a multirun, as typed."""
    if command.multirun:
        return None
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in command.overrides if not a.startswith("~")])
    except OverrideParseException:
        return None
    return next((o.input_line for o in overrides if o.is_sweep_override()), None)


def _lines(err: Exception) -> list[str]:
    return [line.strip().rstrip(".") for line in str(err).splitlines() if line.strip()] or [type(err).__name__]


# Groups a run may go without (Hydra removes a default with ~group; group=null is not an override), and what
# that does: what a user who types `none` means.
TURNED_OFF_BY_REMOVAL = {"logger": "~logger turns logging off", "adapter": "~adapter trains without an adapter"}


def _missing_option_message(missing: str, options: list[str], command: CommandLine) -> str:
    group, _, option = missing.rpartition("/")
    if command.replay and (hint := command.replay.config_dir_hint(group, option)):
        return hint
    close = difflib.get_close_matches(option, options, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    if group in TURNED_OFF_BY_REMOVAL and option.lower() in ("none", "off", "false", "no", "disabled"):
        hint = f"; {TURNED_OFF_BY_REMOVAL[group]}"
    elif group.startswith("hydra/"):  # sweepers and launchers are plugins, installed as extras
        hint = " (Optuna and joblib come with pip install 'ringtrain[sweep]', submitit with 'ringtrain[slurm]')"
    elif not close and not command.config_dirs:  # most likely the user's own, folder not given
        hint = f"; your own? put {group}/{option}.yaml in a config folder and pass --config-dir <folder>"
    return f"{group}={option} is not an option of {group}; choose one of {', '.join(sorted(options))}{hint}"


def _unknown_key_message(full_key: str, parent: Any, primary: PrimaryConfig, command: CommandLine) -> str:
    # The key as the command line typed it, which `full_key` (the part Hydra found missing) begins.
    typed = [arg.split("=", 1)[0].lstrip("+~") for arg in command.overrides]
    key = next((k for k in reversed(typed) if k == full_key or k.startswith(full_key + ".")), full_key)
    section, _, rest = key.partition(".")
    if hint := primary.hints.get(key) or primary.hints.get(section):
        return f"{key} is not a setting here; {hint}"
    known = sorted(str(k) for k in parent.keys() if k not in ("_target_", "hydra")) if parent is not None else []
    owner, _, name = full_key.rpartition(".")  # no owner: the top level of the config, where name is section
    if not owner and primary.presets:  # a group whose default is none (adapter) has a folder, not a section
        known = sorted(set(known) | {p.name for p in CONF_DIR.glob("[a-z]*/")} - {"hydra", *primary.presets})
    names = known if owner else known + list(primary.presets)
    close = difflib.get_close_matches(name, names, n=1)
    mean = f"did you mean {close[0]}? " if close else ""
    if not owner:
        if not primary.presets:  # a tool: its top level is its settings
            return f"{key} is not a setting of {primary.program}; {mean}the settings are {', '.join(known)}"
        what = "a config group or setting" if not rest else "a config group"
        return f"{section} is not {what}; {mean}the groups are {', '.join(names)}"
    owners = options_defining(section, rest) if section in COMPONENT_SECTIONS else []
    if owners:
        picks = " or ".join(f"{section}={option}" for option in owners)
        return f"{key} is not a setting of this {section}; it belongs to {picks}: choose that option or drop the override"
    if (section in COMPONENT_SECTIONS and owner == section) or (parent is not None and "_target_" in parent):
        target = parent.get("_target_", "?") if parent is not None else "?"
        this = f"this {section}" if owner == section else owner  # a callback's or logger's node: callbacks.target
        return (f"{key} is not set by {this} ({target}); {mean}to pass a new argument write +{key}=<value>, "
                f"or check the spelling (set now: {', '.join(known) or 'nothing'})")
    return f"{key} is not a setting of {owner}; {mean}known: {', '.join(known)}"


class SweepSummary(Callback):
    """conf/train.yaml's hydra.callbacks: after a multirun, the sweep's summary (config/sweep.py)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from ringtrain.config.sweep import write_summary

        write_summary(Path(config.hydra.sweep.dir))
