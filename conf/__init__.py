"""ringtrain's configs, installed with the package as `ringtrain.conf` so that the commands find
them after a plain `pip install` (Hydra's `pkg://ringtrain.conf`), and what composes them outside
a command (the Python API's defaults, the messages that name the option a key belongs to):
Hydra's compose API, never a YAML file read by hand."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).parent


def composed(overrides: Iterable[str] = (), config_name: str = "job", config_dir: str | Path | None = None) -> Any:
    """conf/<config_name>.yaml composed by Hydra with `overrides`, and `config_dir`'s options (a
    --config-dir of the user's); inside a Hydra app, with its search path (--config-dir among it)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides=list(overrides))
    searched = [f"hydra.searchpath=[file://{Path(config_dir).absolute()}]"] if config_dir else []
    with initialize_config_module("ringtrain.conf", version_base="1.3"):
        return compose(config_name, overrides=[*searched, *overrides])


def option_names(group: str) -> list[str]:
    """The options of conf/<group>/ (their file names)."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def options_defining(group: str, dotted_key: str) -> list[str]:
    """The options of conf/<group>/ whose node, as Hydra composes it, sets `dotted_key`."""
    from omegaconf import OmegaConf

    return [name for name in option_names(group)
            if OmegaConf.select(composed([f"{group}={name}"])[group], dotted_key, default=None) is not None]
