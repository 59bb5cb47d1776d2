"""What the tools' Hydra apps share: the composed config as the keyword arguments of the tool's
function, each checked against its parameter. Each tool's primary config conf/<tool>.yaml (its
settings, defaults and --help) starts from conf/hydra/tool.yaml (nothing written into the
current directory). The function's signature is the schema: a key it does not take, a required
setting left `???`, a value not of its parameter's type are each one line.
"""
from __future__ import annotations

import inspect
import os
import sys
import typing
from collections.abc import Callable
from typing import Any

from ringtrain.components import fits
from ringtrain.config.app import PrimaryConfig, run_app
from ringtrain.errors import ConfigError, exit_on_user_error


def run_tool(primary: PrimaryConfig, tool: Callable[..., Any], show: Callable[[Any], None] = print) -> None:
    """`ringtrain <tool>`: every job the command line asks for (a multirun has several) is
    `tool(**settings)`, its result `show`n."""
    # `_target_: my_pkg.MyNet` in a checkpoint imports from where you run, as for training.
    sys.path.insert(1, os.getcwd())

    def job(cfg: Any) -> None:
        with exit_on_user_error():
            result = tool(**settings_for(tool, cfg, primary))
        show(result)

    run_app(primary, job)


def settings_for(function: Callable[..., Any], cfg: Any, primary: PrimaryConfig) -> dict[str, Any]:
    """The composed config as `function`'s keyword arguments (see the module docstring)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parameters = inspect.signature(function).parameters
    hints = typing.get_type_hints(getattr(function, "func", function))  # through a functools.partial
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{str(err).strip().splitlines()[0]}; see `{primary.program} --help`") from None
    values.pop("hydra", None)
    for name in values:
        if name not in parameters:
            fix = primary.hints.get(name) or f"the settings are {', '.join(parameters)}"
            raise ConfigError(f"{name} is not a setting of {primary.program}; {fix}")
    settings = {}
    for name, parameter in parameters.items():
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
