"""A checkpoint is data: the config it keeps may not run code the user did not name.

Rebuilding a run from a checkpoint's stored config (`trainer.resume=<file>`, `ringtrain
evaluate | sample | export | consolidate`) imports and calls each `_target_` in it, and
`trust_remote_code: true` runs Python from a model directory. So before anything is imported,
every target must be one the user's side names:
  * ringtrain's own code, and the targets of ringtrain's shipped configs (conf/);
  * the targets of the user's own config on this command line (--config-dir's files, overrides);
  * a `transformers` model, config or tokenizer class, or its `from_pretrained` (the library's
    own code; a directory's own code runs only with trust_remote_code);
  * torch's modules, losses and optimizers (torch.nn, torch.optim);
and `trust_remote_code: true` must be set by the user's own config too. Anything else is
refused in one line naming it and the flag that lets a user who trusts the file go on.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ringtrain.conf import CONF_DIR
from ringtrain.errors import ConfigError

_LIBRARIES = ("ringtrain.models.", "ringtrain.data.", "ringtrain.strategies.", "ringtrain.callbacks.",
              "ringtrain.loggers.", "ringtrain.optim.", "torch.nn.", "torch.optim.")


def check_trusted(stored: dict, source: str, own: Any, flag: str) -> None:
    """Refuse `stored` (a checkpoint's config, from `source`) if it names a target, or turns on
    trust_remote_code, that the user's own config `own` (this command's composed config) and
    ringtrain's do not; `flag` is the setting that allows it."""
    user = _user_config_files()
    own_targets = set(_targets(own)) if own is not None else set()
    own_targets |= set(_targets(user))
    for key, target in _targets_with_keys(stored):
        if target in own_targets or target in shipped_targets() or target.startswith(_LIBRARIES) or _hf_class(target):
            continue
        raise ConfigError(f"{source} names {key}._target_={target}, which neither your config nor ringtrain's names: "
                          f"rebuilding it would run that code; pass --config-dir <your config folder> if it names "
                          f"{target}, or {flag}=true if you trust the file")
    own_allows_remote_code = any(_remote_code_keys(own)) or any(_remote_code_keys(user))
    for key in _remote_code_keys(stored):
        if not own_allows_remote_code:
            raise ConfigError(f"{source} sets {key}=true, which would run Python from the model's directory; "
                              f"pass {flag}=true if you trust the file and that directory")


@functools.cache
def shipped_targets() -> frozenset[str]:
    """Every `_target_` of ringtrain's own configs."""
    return frozenset(_targets(_yaml_files(CONF_DIR)))


def _user_config_files() -> list[Any]:
    """The YAML files of --config-dir, which are the user's own config."""
    args = sys.argv[1:]
    dirs = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("--config-dir", "-cd")]
    dirs += [arg.split("=", 1)[1] for arg in args if arg.startswith("--config-dir=")]
    return [node for directory in dirs for node in _yaml_files(Path(directory))]


def _yaml_files(directory: Path) -> list[Any]:
    from omegaconf import OmegaConf

    nodes = []
    for path in sorted(directory.rglob("*.yaml")) if directory.is_dir() else []:
        try:
            nodes.append(OmegaConf.to_container(OmegaConf.load(path)))
        except Exception:  # a file that is not YAML: Hydra says so if it is used
            continue
    return nodes


def _targets_with_keys(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            yield key or "config", node["_target_"]
        for name, value in node.items():
            yield from _targets_with_keys(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets_with_keys(value, f"{key}.{i}")


def _targets(node: Any) -> Iterator[str]:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    return (target for _, target in _targets_with_keys(node))


def _remote_code_keys(node: Any, key: str = "") -> Iterator[str]:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for name, value in items:
        path = f"{key}.{name}" if key else str(name)
        if name == "trust_remote_code" and value not in (False, None):  # transformers trusts any truthy value
            yield path
        yield from _remote_code_keys(value, path)


def _hf_class(target: str) -> bool:
    """A model, config or tokenizer class of the transformers library, or its `from_pretrained`
    (the library's own code: a directory's code runs only with trust_remote_code, which is
    checked apart; remote code lives in transformers_modules, never in `transformers.`), named
    as transformers exports it (transformers.GPT2LMHeadModel) or where it is defined."""
    path = target.removesuffix(".from_pretrained")
    name = path.rpartition(".")[2]
    if not path.startswith("transformers.") or not name[:1].isupper():
        return False
    try:
        import transformers
    except ImportError:
        return False
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or path not in (f"transformers.{name}", f"{cls.__module__}.{cls.__qualname__}"):
        return False
    library = (transformers.PreTrainedModel, transformers.PretrainedConfig, transformers.PreTrainedTokenizerBase)
    return issubclass(cls, library) or name.startswith("Auto")
