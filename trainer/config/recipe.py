"""What a checkpoint records of the job that trained it, as data, and how a command replays it.

A checkpoint holds no node that is built. It records the option chosen in each config group, the
overrides given, and the run's relative paths made absolute; every command that continues or
rebuilds the run (`trainer.resume=<file>`, the tools) has Hydra compose the job again from
ringtrain's configs and the user's own (--config-dir, the command line), the recorded choices and
overrides before the user's:

    {"choices": {"model": "transformer", ...}, "overrides": ["model.n_layers=4", ...],
     "paths": {"data.path": "/home/me/input.txt"}, "config_dirs": ["/home/me/my_conf"]}  # the last: messages only
    ringtrain evaluate checkpoint=x.pt data.path=other.txt
      -> model=transformer ... model.n_layers=4 data.path=/home/me/input.txt checkpoint=x.pt data.path=other.txt

A stored override is refused as README's "What is replayed is checked" lists (`_check_stored`); so
is a key the composed config lacks (Hydra's refusal, named as the checkpoint's).
"""
from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtrain.errors import ConfigError

# The config groups of conf/job.yaml whose choice a checkpoint records (hparams_search is how a
# sweep searched, not what one job trained).
JOB_GROUPS = ("task", "data", "model", "optimizer", "scheduler", "strategy", "trainer", "callbacks", "logger",
              "adapter", "experiment", "debug")
# Keyword arguments that make a library load or run code (transformers, torch.hub, torch.load,
# numpy.load): honoured from the user's own config only, never from a file.
CODE_LOADING_KEYS = frozenset({"trust_remote_code", "trust_repo", "weights_only", "allow_pickle", "source",
                               "code_revision", "use_safetensors", "pickle_module"})
_RESERVED_KEY = re.compile(r"^_\w*_$")  # Hydra's instantiate keys: _target_, _args_, _partial_, ...
_KEY_PART = re.compile(r"^\w+$")
_OPTION_NAME = re.compile(r"^\w[\w-]*$")  # an option of a group: no path, no '..'


@dataclass
class Replay:
    """A checkpoint's recipe as overrides for this command: `overrides` go before the user's."""

    source: Path  # the checkpoint they come from
    overrides: list[str] = field(default_factory=list)
    config_dirs: list[str] = field(default_factory=list)

    def config_dir_hint(self, group: str, option: str) -> str | None:
        """The line for an option the checkpoint picks that no config folder here has."""
        if f"{group}={option}" not in self.overrides:  # each replayed choice is one of them
            return None
        where = f" --config-dir {self.config_dirs[0]}" if self.config_dirs else " --config-dir <your config folder>"
        return (f"checkpoint {self.source} was trained with {group}={option}, which neither ringtrain's configs nor "
                f"yours here have; pass{where} (the folder that holds {group}/{option}.yaml)")


def local_paths(resolved: Mapping[str, Any], base: str = ".") -> dict[str, str]:
    """The job's values that name a file or folder by a path relative to `base` (the directory
    the run started in), made absolute (`model.pretrained_model_name_or_path: smollm` ->
    /home/me/proj/smollm): replayed after the overrides, so a command run from elsewhere finds
    the run's files."""
    found: dict[str, str] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, (Mapping, list)):  # a list's items by index: data.files.1=/home/me/b.txt
            for name, value in (node.items() if isinstance(node, Mapping) else enumerate(node)):
                walk(value, f"{key}.{name}")
        elif isinstance(node, str) and node and not os.path.isabs(node) and "${" not in node:
            path = os.path.join(base, node)  # a file, a folder, or a glob that matches some (corpus/*.jsonl)
            if os.path.exists(path) or (any(sign in path for sign in "*?[") and glob.glob(path)):
                found[key] = os.path.abspath(path)

    for section in ("model", "data", "task", "trainer", "adapter"):
        walk(resolved.get(section), section)
    return found


def record(hydra: Any, resolved: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The recipe of the job Hydra composed (`hydra`: its HydraConfig node; `resolved`: the job
    as validated, for its local paths): plain data."""
    choices = {group: str(option) for group, option in hydra.runtime.choices.items()
               if group in JOB_GROUPS and isinstance(option, str)}
    # A group's option is in `choices` already (a replayed run's pins among them).
    overrides = [line for line in hydra.overrides.task if not _key_of(line).startswith(("trainer.resume", "hydra"))
                 and not ("." not in _key_of(line) and choices.get(_key_of(line)) == str(line).split("=", 1)[-1])]
    config_dirs = [str(source.path) for source in hydra.runtime.config_sources
                   if source.provider == "command-line" and source.schema == "file"]
    return {"choices": choices, "overrides": [str(line) for line in overrides], "config_dirs": config_dirs,
            "paths": local_paths(resolved or {}, str(hydra.runtime.cwd))}


def replay(recipe: Any, source: Path, user_overrides: Iterable[str], skip: Iterable[str] = ()) -> Replay:
    """The overrides that compose `recipe` again (see the module docstring), less the keys the
    user sets now (theirs win, the keys under them too) and the keys or sections in `skip` (what
    this command decides itself: evaluate's strategy, the resume file; what it does not use: a
    tool's callbacks and loggers). Refuses a recipe that is not plain data."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    if not isinstance(recipe, Mapping) or not isinstance(recipe.get("choices"), Mapping) \
            or not isinstance(recipe.get("overrides"), list):
        raise ConfigError(f"checkpoint {source} records no job (its choices and overrides); it was written through the "
                          f"Python API, which rebuilds nothing from a file: build the model in Python and load "
                          f"torch.load(path, weights_only=True)['model'] into it")
    parser = OverridesParser.create()
    decided = {_key_of(line) for line in user_overrides} | set(skip)  # by the user, or by this command

    def wanted(key: str) -> bool:
        return not any(key == k or key.startswith(k + ".") for k in decided)

    overrides = []
    for group, option in recipe["choices"].items():
        if group not in JOB_GROUPS or not isinstance(option, str) or not _OPTION_NAME.match(option):
            raise _refusal(source, f"{group}={option}", "is not a choice of one of ringtrain's config groups")
        if wanted(group):
            overrides.append(f"{group}={option}")
    paths = recipe.get("paths") or {}  # the run's files, where the run had them: after its overrides
    for line in [*recipe["overrides"], *(f"{key}={_quoted(path)}" for key, path in paths.items())]:
        try:
            parsed = parser.parse_overrides([str(line)])[0]
        except OverrideParseException:
            raise _refusal(source, line, "is not an override Hydra reads") from None
        if wanted(parsed.key_or_group):  # what is not replayed needs no check
            _check_stored(parsed, source)
            overrides.append(parsed.input_line)
    return Replay(source, overrides, [d for d in recipe.get("config_dirs") or [] if isinstance(d, str)])


def _check_stored(override: Any, source: Path) -> None:
    line, key = override.input_line, override.key_or_group
    parts = key.split(".")
    if override.is_add() or override.is_force_add():
        raise _refusal(source, line, "adds a key to the config (a file may only change values your config has)")
    if override.package is not None or key.startswith("hydra") or "/" in key or not all(map(_KEY_PART.match, parts)):
        raise _refusal(source, line, "is not a setting of the job (a Hydra setting, a package or a group path)")
    if override.is_sweep_override():
        raise _refusal(source, line, "sweeps several values")
    if any(_RESERVED_KEY.match(part) for part in parts):
        raise _refusal(source, line, "sets an instantiation key, which chooses code")
    if override.is_delete():
        return
    if parts[-1] in CODE_LOADING_KEYS:
        raise _refusal(source, line, f"sets {parts[-1]}, which turns on code loading; only your own config may")
    value = override.value()
    if len(parts) == 1 and key in JOB_GROUPS:  # a group's option, or a list of them (callbacks=[a,b])
        options = value if isinstance(value, list) else [value]
        if not all(isinstance(o, str) and _OPTION_NAME.match(o) for o in options):
            raise _refusal(source, line, "picks an option that is not a plain option name")
    _check_value(value, line, source)


def _check_value(value: Any, line: str, source: Path) -> None:
    if isinstance(value, str) and "${" in value:
        raise _refusal(source, line, "holds an interpolation ${...}, which can create nodes and call resolvers")
    if isinstance(value, Mapping):
        for name, item in value.items():
            if _RESERVED_KEY.match(str(name)) or str(name) in CODE_LOADING_KEYS:
                raise _refusal(source, line, f"sets {name}, which chooses or loads code")
            _check_value(item, line, source)
    elif isinstance(value, list):
        for item in value:
            _check_value(item, line, source)


def _refusal(source: Path, line: Any, why: str) -> ConfigError:
    return ConfigError(f"checkpoint {source} stores the override {str(line)!r}, which {why}: a checkpoint is data, so "
                       f"it is not replayed; set what you want in your own config or on the command line, and pass the "
                       f"checkpoint's weights with trainer.init_from=<file> if you trust them")


def _quoted(path: Any) -> str:
    text = str(path)
    return text if re.fullmatch(r"[\w./+-]+", text) else "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _key_of(line: str) -> str:
    return str(line).split("=", 1)[0].lstrip("+~").split("@", 1)[0]
