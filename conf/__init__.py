"""ringtrain's configs, installed with the package as `ringtrain.conf` so that the commands find
them after a plain `pip install` (Hydra's `pkg://ringtrain.conf`), and what reads a group's
shipped options (for the messages that name the option a key belongs to)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).parent


def option_nodes(group: str) -> Iterator[tuple[str, Any]]:
    """(option name, the node its conf/<group>/<option>.yaml gives `group`) for every option."""
    from omegaconf import OmegaConf

    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        if "@package _global_" in path.read_text().split("\n", 1)[0]:
            node = node.get(group) or OmegaConf.create()  # the file spells out `group:` itself
        yield path.stem, node


def options_defining(group: str, dotted_key: str) -> list[str]:
    """The options of conf/<group>/ whose file sets `dotted_key`."""
    from omegaconf import OmegaConf

    return [name for name, node in option_nodes(group) if OmegaConf.select(node, dotted_key, default=None) is not None]
