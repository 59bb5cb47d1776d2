"""The config a continued run (trainer.resume=<checkpoint>) trains with: the checkpoint's own,
with what the command line changes."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.checkpoints.resume import KEPT_SECTIONS, first_difference
from ringtrain.config.compose import PRESET_GROUPS, PRESET_SECTIONS
from ringtrain.distributed import under_torchrun
from ringtrain.errors import ConfigError


def config_to_continue(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """The config stored in trainer.resume's checkpoint, with the command line's changes.

    `composed` is what Hydra composed from the command line `overrides`; only what they name
    is taken from it: `key=value` sets that key, `group=option` that group's section, a preset
    (experiment=, debug=) the trainer, optimizer, scheduler and strategy sections.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    path = composed.trainer.resume
    stored = OmegaConf.create(load_checkpoint(path, mmap=True, verify=False)["config"])  # the config only (checksums: resume.py)
    result = stored.copy()
    parsed = OverridesParser.create().parse_overrides(overrides)
    for override in parsed:
        key = override.key_or_group
        if key.startswith("hydra") or override.is_delete():
            continue
        if "." in key:
            OmegaConf.update(result, key, OmegaConf.select(composed, key), merge=False)
        elif key in PRESET_GROUPS:
            for section in PRESET_SECTIONS:
                result[section] = composed[section]
        elif key in result:
            result[key] = composed[key]
    result.trainer.resume = path
    strategy, typed = result.get("strategy"), {override.key_or_group for override in parsed}
    if under_torchrun() and isinstance(strategy, DictConfig) and "nproc_per_node" in strategy \
            and "strategy.nproc_per_node" not in typed:
        # The stored run may have started its own ranks (strategy.nproc_per_node=N); this one
        # runs on torchrun's, whose number decides (the strategy refuses a different one typed).
        result.strategy.nproc_per_node = 1
    for section in KEPT_SECTIONS:
        if OmegaConf.to_container(result[section]) != OmegaConf.to_container(stored[section]):
            changed = first_difference(OmegaConf.to_container(stored[section]), OmegaConf.to_container(result[section]), section)
            raise ConfigError(
                f"{changed} differs from the checkpoint's; a continued run keeps its model (its weights and optimizer "
                f"state belong to it): drop that override, or start a new run with trainer.resume=null"
            )
    return result
