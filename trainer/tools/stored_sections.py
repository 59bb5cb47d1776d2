"""A checkpoint's stored config as sections of `ringtrain evaluate`'s config.

The command line changes the stored config as training's: `data.path=other.txt` changes a key
it has (a misspelt one is refused), `+data.x=1` adds one, `~data.x` removes one. Hydra checks
each override against the config it composes, so that must hold the stored keys before Hydra
runs: `register_stored_sections` reads the config of every checkpoint the command line names
(-m checkpoint=a,b: several) and registers its model, data, task and trainer sections as the
option `from_checkpoint/sections`, an optional default of conf/evaluate.yaml. A value the
checkpoints share is registered as it is (`--cfg job` prints it); where they differ it is
`???`, which `overlay` reads as "this checkpoint's own value".
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.errors import ConfigError

# The stored config's sections an override may change; the optimizer and schedule are unused,
# and the strategy is evaluate's own (strategy=auto|single|ddp).
SECTIONS = ("model", "data", "task", "trainer")
GROUP, OPTION = "from_checkpoint", "sections"
OWN_VALUE = "???"  # OmegaConf's MISSING: each checkpoint keeps its own value


def checkpoints_named(overrides: Sequence, multirun: bool) -> list[str]:
    """The paths `checkpoint=...` names among Hydra's parsed `overrides` (every value of a sweep)."""
    paths: list[str] = []
    for override in overrides:
        if override.key_or_group != "checkpoint" or override.is_delete():
            continue
        if override.is_sweep_override():
            if multirun and override.is_discrete_sweep():
                paths.extend(str(value) for value in override.sweep_string_iterator())
        elif override.value() is not None:
            paths.append(str(override.value()))
    return paths


def register_stored_sections(stored_configs: Sequence[Mapping[str, Any]]) -> None:
    """Make `from_checkpoint/sections` the sections these stored configs share (see above)."""
    from hydra.core.config_store import ConfigStore

    if not stored_configs:
        return
    sections = {}
    for name in SECTIONS:
        nodes = [config.get(name) for config in stored_configs]
        if all(isinstance(node, Mapping) for node in nodes):
            sections[name] = shared_value(nodes)
    ConfigStore.instance().store(group=GROUP, name=OPTION, node=sections)


def shared_value(values: Sequence[Any]) -> Any:
    """What `values` (one per checkpoint) have in common: the value where all are equal, a
    mapping of the shared values of their keys where all are mappings, else OWN_VALUE."""
    if all(isinstance(value, Mapping) for value in values):
        keys = list(dict.fromkeys(key for value in values for key in value))
        return {
            key: shared_value([value[key] for value in values]) if all(key in value for value in values) else OWN_VALUE
            for key in keys
        }
    if any(isinstance(value, Mapping) for value in values):
        return OWN_VALUE
    return _literal(values[0]) if all(value == values[0] for value in values[1:]) else OWN_VALUE


def _literal(value: Any) -> Any:
    """A stored value as OmegaConf reads it back unchanged: the stored config is resolved, so
    a `${...}` left in it is text (a model's `${data.dims.vocab_size}`, config/sizes.py)."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, list):
        return [_literal(item) for item in value]
    return value


def overlay(stored: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The stored section as the composed one `given` says: OWN_VALUE keeps the stored value,
    any other value replaces it or is added, and a stored key `given` lacks was removed (~key)."""
    result: dict[str, Any] = {}
    for key, value in given.items():
        if value == OWN_VALUE:
            if key in stored:
                result[key] = stored[key]
        elif isinstance(value, Mapping) and isinstance(stored.get(key), Mapping):
            result[key] = overlay(stored[key], value)
        else:
            result[key] = value
    return result


def stored_section(stored: Mapping[str, Any], name: str, path: str) -> Mapping[str, Any]:
    """The checkpoint's section `name`, refused when it has none (a run of the Python API)."""
    section = stored.get(name)
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"checkpoint {path!r} holds no {name} config (trained through the Python API?); evaluate it in Python"
        )
    return section
