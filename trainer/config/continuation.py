"""trainer.resume=<checkpoint>: continue that run with the config it keeps, in its own run
directory, changed only where the command line says.

`read_continued_run(args)` runs before Hydra composes: it reads the checkpoint (once: the run
takes its state from here) and registers conf/train.yaml with the stored run's options (those
whose `_target_` the stored sections have), so that an override of a key only those options
have (`data.path=...`) composes. `continued_config` then applies to the stored config what the
command line changed: `key=value` that key, `group=option` that section, a preset (experiment=,
debug=) the trainer, optimizer, scheduler and strategy sections. A different model is refused:
the weights and optimizer state belong to it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.checkpoints.manager import Resumed, first_difference
from ringtrain.conf import option_nodes
from ringtrain.config.app import PRESET_GROUPS
from ringtrain.config.trust import check_trusted
from ringtrain.distributed import under_torchrun
from ringtrain.errors import ConfigError

CONTINUED = "ringtrain_continued"  # the primary config registered for a continued run
PRESET_SECTIONS = ("trainer", "optimizer", "scheduler", "strategy")  # what a preset group changes
_GROUPS = ("model", "data", "task", "optimizer", "scheduler", "strategy")


def read_continued_run(args: list[str]) -> Resumed | None:
    """The checkpoint `trainer.resume=<file>` names on the command line (not in a multirun: each
    job reads its own), with the primary config for it registered; None when there is none."""
    if any(arg in ("-m", "--multirun") for arg in args):
        return None
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("trainer.resume=")]
    if not given or given[-1] in ("auto", "null") or not Path(given[-1]).is_file():
        return None
    resumed = Resumed(Path(given[-1]), load_checkpoint(given[-1], mmap=True))
    stored = resumed.state["config"]
    chosen = {arg.split("=", 1)[0].lstrip("+~") for arg in args if "=" in arg and not arg.startswith("-")}
    _refuse_another_model(args, stored, given[-1])
    implied = []
    for group in _GROUPS:
        if group in chosen or (group in PRESET_SECTIONS and chosen & set(PRESET_GROUPS)):
            continue
        wanted = (stored.get(group) or {}).get("_target_") if isinstance(stored.get(group), dict) else None
        matches = [name for name, node in option_nodes(group) if wanted is not None and node.get("_target_") == wanted]
        if len(matches) == 1:
            implied.append({f"override {group}": matches[0]})
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=CONTINUED, node={"defaults": ["train", *implied, "_self_"]})
    return resumed


def continued_config(composed: Any, resumed: Resumed, overrides: list[str]) -> Any:
    """The checkpoint's stored config with the command line's `overrides` applied (`composed`
    is what Hydra composed from them); its targets checked first (config/trust.py)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import DictConfig, OmegaConf

    stored = resumed.state["config"]
    if not composed.trainer.get("trust_checkpoint"):
        check_trusted(stored, f"checkpoint {resumed.path}", composed, "trainer.trust_checkpoint")
    result = OmegaConf.create(stored)
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
        elif key in composed:
            result[key] = composed[key]
    result.trainer.resume = str(resumed.path)
    typed = {override.key_or_group for override in parsed}
    strategy = result.get("strategy")
    if under_torchrun() and isinstance(strategy, DictConfig) and "nproc_per_node" in strategy \
            and "strategy.nproc_per_node" not in typed:
        # The stored run may have started its own ranks; this one runs on torchrun's.
        result.strategy.nproc_per_node = 1
    for section in ("callbacks", "logger"):  # not kept by checkpoints of before callbacks: this command's
        if section not in result and section in composed:
            result[section] = composed[section]
    if OmegaConf.to_container(result.model) != stored["model"]:
        changed = first_difference(stored["model"], OmegaConf.to_container(result.model), "model")
        raise ConfigError(f"{changed} differs from the checkpoint's; a continued run keeps its model (its weights and "
                          f"optimizer state belong to it): drop that override, or start a new run with trainer.resume=null")
    return result


def _refuse_another_model(args: list[str], stored: dict, checkpoint: str) -> None:
    """`model=<option>` whose class is not the checkpoint's: a continued run keeps its model."""
    option = next((a.split("=", 1)[1] for a in reversed(args) if a.split("=", 1)[0].lstrip("+") == "model"), None)
    kept = (stored.get("model") or {}).get("_target_")
    chosen = dict(option_nodes("model")).get(option) if option else None
    if chosen is None or kept is None or chosen.get("_target_") == kept:
        return
    raise ConfigError(
        f"{checkpoint} is a checkpoint of {kept}, but model={option} is {chosen.get('_target_')}; a continued run "
        f"keeps its model: drop model={option} to continue it, or drop trainer.resume to start a new run with model={option}"
    )
