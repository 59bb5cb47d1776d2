"""The commands (`ringtrain <tool> ...`, ringtrain/__main__.py), a module each, each a Hydra app
with its primary config in conf/. May import anything in ringtrain; nothing in ringtrain imports
them.

Here, what their Hydra apps share (and checkpoint_model.py): the checkpoint a command names,
read once before Hydra composes (its recipe replayed, config/recipe.py), and the composed config
as the keyword arguments of the tool's function. The function's signature is the schema: a key it does not
take, a required setting left `???`, a value not of its parameter's type are each one line; the
job's sections (conf/job.yaml) reach its `job` parameter, resolved.
"""
from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from ringtrain.checkpoints import Resumed
from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.components import fits
from ringtrain.conf import composed
from ringtrain.config import CommandLine, PrimaryConfig, register_resolvers, run_app
from ringtrain.config.builders import resolve
from ringtrain.config.recipe import replay
from ringtrain.config.schema import OPTIONAL_SECTIONS, SECTIONS
from ringtrain.errors import ConfigError, exit_on_user_error

JOB_SECTIONS = SECTIONS + OPTIONAL_SECTIONS  # what conf/job.yaml composes; the rest is the tool's
TOOLS_DO_NOT_REPLAY = ("strategy", "trainer.resume", "trainer.trust_checkpoint", "hparams_search", "callbacks", "logger")


def with_checkpoint(command: CommandLine, key: str = "checkpoint", skip: Iterable[str] = TOOLS_DO_NOT_REPLAY) -> list[CommandLine]:
    """`command` with the checkpoint its `key=<file>` names read once, and its recipe to replay
    but for `skip` (a tool's own strategy; what a tool does not use). A multirun over several
    (-m key=a,b) is one command per recipe: checkpoints trained with the same choices and
    overrides share one sweep, each other recipe gets a sweep of its own."""
    try:
        parsed = OverridesParser.create().parse_overrides(command.overrides)
    except OverrideParseException:
        return [command]  # Hydra says what is wrong with it, in one line
    paths: list[str] = []
    for override in parsed:
        if override.key_or_group != key or override.is_delete():
            continue
        if override.is_discrete_sweep() and command.multirun:
            paths.extend(str(value) for value in override.sweep_string_iterator())
        elif not override.is_sweep_override() and override.value() is not None:
            paths.append(str(override.value()))
    read = {path: Resumed(Path(path), load_checkpoint(path, mmap=True)) for path in dict.fromkeys(paths)
            if path not in ("auto", "null") and Path(path).is_file()}
    replays = {path: replay(given.state.get("job"), given.path, command.overrides, skip) for path, given in read.items()}
    by_recipe: dict[tuple[str, ...], list[str]] = {}
    for path, replayed in replays.items():
        by_recipe.setdefault(tuple(replayed.overrides), []).append(path)
    if len(by_recipe) <= 1:
        command.replay, command.checkpoint = next(iter(replays.values()), None), read
        return [command]
    others = [arg for arg in command.args if arg.split("=", 1)[0].lstrip("+") != key]
    return [CommandLine(command.program, [*others, f"{key}={','.join(group)}"], replays[group[0]], {p: read[p] for p in group})
            for group in by_recipe.values()]


def composed_job(state: dict, path: str | Path, overrides: Iterable[str] = (), config_dir: str | Path | None = None) -> dict:
    """The job of a checkpoint as a tool composes it, for a caller in Python (`sample(...)` without
    `job`): its recipe replayed before `overrides` (`config_dir`: as --config-dir); resolved."""
    register_resolvers()
    overrides = list(overrides)
    replayed = replay(state.get("job"), Path(path), overrides, skip=TOOLS_DO_NOT_REPLAY)
    return resolve(composed(replayed.overrides + overrides, config_dir=config_dir))


prepare = with_checkpoint  # a tool's command line, as the entry (ringtrain/__main__.py) prepares it


def tool_main(name: str, usage: str, tool: Callable[..., Any],
              show: Callable[[Any], None] = print) -> Callable[[CommandLine], None]:
    """A tool module's `main(command)`, `ringtrain <name>` on conf/<name>.yaml (`usage`: a whole command
    line, the fix for a missing setting): each job of the command line is `tool(**settings)`, its
    result `show`n; a `command` parameter gets the command line (and the checkpoints it read)."""
    primary = PrimaryConfig(name, f"ringtrain {name}", usage=usage)

    def main(command: CommandLine) -> None:
        def job(cfg: Any) -> None:
            with exit_on_user_error():
                result = tool(**settings_for(tool, cfg, primary, command))
            show(result)

        run_app(primary, job, command)

    return main


def settings_for(function: Callable[..., Any], cfg: Any, primary: PrimaryConfig, command: CommandLine) -> dict[str, Any]:
    """The composed config as `function`'s keyword arguments (see the module docstring)."""
    parameters = inspect.signature(function).parameters
    hints = typing.get_type_hints(getattr(function, "func", function))  # through a functools.partial
    try:
        values = resolve(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{str(err).strip().splitlines()[0]}; see `{primary.program} --help`") from None
    job = {name: values.pop(name) for name in JOB_SECTIONS if name in values}
    for name in values:
        if name not in parameters:
            fix = primary.hints.get(name) or f"the settings are {', '.join(parameters)}"
            raise ConfigError(f"{name} is not a setting of {primary.program}; {fix}")
    settings = {name: given for name, given in (("job", job), ("command", command)) if name in parameters}
    for name, parameter in parameters.items():
        if name in settings:
            continue
        if name not in values and parameter.default is not inspect.Parameter.empty:
            continue  # removed with ~name, or not a setting: the function's own default
        if values.get(name, "???") == "???":
            raise ConfigError(f"{name} is required: {primary.usage}")
        settings[name] = _typed(name, values[name], hints.get(name, Any), parameter.default)
    return settings


def _typed(name: str, value: Any, annotation: Any, default: Any) -> Any:
    """`value` as the parameter `name: annotation` takes it (an int where a float goes), or one line."""
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if fits(value, annotation):
        return value
    if annotation is str or str in typing.get_args(annotation):  # Hydra read it as a number, a bool or null
        raise ConfigError(f"{name}={value!r} is not text; quote it to pass it as text: {name}='...'")
    allowed = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
    if allowed:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}; pick one of them")
    example = f"{name}={default}" if default not in (inspect.Parameter.empty, None) else f"{name}=..."
    kind = getattr(annotation, "__name__", str(annotation).replace("typing.", ""))
    raise ConfigError(f"{name}={value!r} is not of type {kind}; write e.g. {example}")
