"""What the tools' Hydra apps share: the command line checked ahead, and typed settings.

evaluate, sample, consolidate, export and prepare_tokens are each a Hydra app with a primary config
conf/<tool>.yaml (its settings, their defaults and its --help), which starts from
conf/hydra/tool.yaml (nothing written into the current directory). So `--help`, `--cfg job`,
`key=value`, `+key`, `~key`, `--config-dir` and `-m` are training's, in every tool.

    run_tool            before Hydra: compose every job ahead (config/compose.py), so that a
                        mistake is one `error:` line and exit 2; then run the app
    call_with_settings  in the app: the composed config as the keyword arguments of the
                        tool's function, each checked against the type its parameter declares
"""
from __future__ import annotations

import inspect
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ringtrain.config.compose import PrimaryConfig, check_overrides
from ringtrain.config.resolvers import register_resolvers
from ringtrain.errors import ConfigError, exit_on_user_error

# How a type is named when a value is not of it.
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "text", dict: "a section of key: value"}


def run_tool(app: Callable[[], Any], primary: PrimaryConfig, validate: Callable[[DictConfig], Any] | None = None) -> None:
    """Check the command line (every job of a sweep, each `validate`d when given), then hand
    it to the Hydra app `app` (a function decorated with @hydra.main)."""
    # `_target_: my_pkg.MyNet` in a checkpoint imports from where you run, as for training (a
    # console script puts only its own folder on the path).
    sys.path.insert(1, os.getcwd())
    register_resolvers()
    with exit_on_user_error():
        check_overrides(sys.argv[1:], primary, validate)
    app()


def call_with_settings(function: Callable[..., Any], cfg: DictConfig, primary: PrimaryConfig) -> Any:
    """`function(**settings)`, the settings being the composed config (see settings_for)."""
    return function(**settings_for(function, cfg, primary))


def settings_for(function: Callable[..., Any], cfg: DictConfig, primary: PrimaryConfig) -> dict[str, Any]:
    """The composed config as `function`'s keyword arguments.

    The function's signature is the schema (the primary config holds the defaults): a key it
    does not take (added with +key=...), a required setting left `???`, and a value not of its
    parameter's type (int, float, bool, str, dict, X | None, Literal[...]) are each a
    ConfigError naming the key and the fix.
    """
    parameters = inspect.signature(function).parameters
    hints = typing.get_type_hints(function)
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
            continue  # removed with ~name: the function's own default
        if values.get(name, "???") == "???":
            raise ConfigError(f"{name} is required: {primary.usage}")
        settings[name] = _typed(name, values[name], hints.get(name, Any), parameter.default)
    return settings


def _typed(name: str, value: Any, annotation: Any, default: Any) -> Any:
    """`value` as the parameter `name: annotation` takes it, or a ConfigError."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if value in arguments:
            return value
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(map(str, arguments))}; pick one of them")
    if origin in (Union, types.UnionType):  # X | None
        if value is None and type(None) in arguments:
            return None
        kinds = [a for a in arguments if a is not type(None)]
        return _typed(name, value, kinds[0], default) if len(kinds) == 1 else value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation not in _KINDS or (isinstance(value, annotation) and not (isinstance(value, bool) and annotation is int)):
        return value
    if annotation is str:  # Hydra read it as a number, true/false or null: the text is lost
        raise ConfigError(f"{name}={value!r} is not text; quote it to pass it as text: {name}='...'")
    example = f"{name}={default}" if default not in (inspect.Parameter.empty, None) else f"{name}=..."
    raise ConfigError(f"{name}={value!r} is not {_KINDS[annotation]}; write e.g. {example}")
