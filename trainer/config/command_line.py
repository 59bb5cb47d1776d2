"""The command line before Hydra sees it.

`ringtrain.tools.train` calls these in order:
  strip_legacy_local_rank_arg   torch.distributed.launch's `--local-rank N` is not an override
  refuse_multirun_under_torchrun  every torchrun rank would run the whole sweep
  check_overrides               compose and validate every job's config now, so a typo, an
                                unknown option or a bad component is one line with the fix
                                (exit 2) instead of Hydra's multi-line report suggesting
                                `+key=value`, and before Hydra creates a run directory
  hydra_overrides_for_this_rank ranks other than 0 write nothing into Hydra's run directory
"""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

from ringtrain.checkpoints.rundir import directory_before_restart
from ringtrain.config.schema import CONF_DIR, PRESET_GROUPS, PRESET_SECTIONS, SECTIONS
from ringtrain.errors import ConfigError
from ringtrain.distributed import env_rank, under_torchrun
CONFIG_NAME = "train"
# More combinations than this are not all composed ahead; Hydra still checks each job itself.
_MAX_CHECKED_JOBS = 64
# Flags after which Hydra does not compose a config for a run.
_NO_RUN_FLAGS = ("help", "hydra_help", "info", "shell_completion", "version", "cfg")
# Settings Lightning users reach for, and what they are called here.
LIGHTNING_HABITS = {
    "trainer.devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "trainer.num_nodes": "torchrun --nnodes=N (see README, Several machines)",
    "trainer.fast_dev_run": "debug=fast_dev_run",
    "trainer.max_time": "trainer.max_steps",
    "trainer.gradient_clip_val": "trainer.grad_clip_norm",
    "trainer.accumulate_grad": "trainer.accumulate_grad_batches",
    "trainer.check_val_every_n_epoch": "trainer.eval_every_n_steps",
    "trainer.val_check_interval": "trainer.eval_every_n_steps",
    "trainer.limit_train_batches": "trainer.overfit_batches or trainer.max_steps",
    "trainer.ckpt_path": "trainer.resume=<path to last.pt>",
    "trainer.strategy": "strategy=single|dp|ddp",
    "ckpt_path": "trainer.resume=<path to last.pt>",
    "seed": "trainer.seed",
    "devices": "strategy=ddp strategy.nproc_per_node=N (or torchrun --nproc_per_node=N)",
    "precision": "trainer.precision",
    "max_epochs": "trainer.max_epochs",
    "max_steps": "trainer.max_steps",
    "batch_size": "trainer.batch_size",
    "lr": "optimizer.lr",
}


def strip_legacy_local_rank_arg(argv: list[str]) -> list[str]:
    """Remove `--local-rank N` / `--local_rank=N` (torch.distributed.launch) from argv.

    Hydra would read it as a malformed override. The value is kept in LOCAL_RANK, which is
    where torchrun puts it too.
    """
    kept, i = [], 0
    while i < len(argv):
        arg = argv[i]
        for flag in ("--local-rank", "--local_rank"):
            if arg == flag and i + 1 < len(argv):
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
                i += 1
                break
            if arg.startswith(flag + "="):
                os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
                break
        else:
            kept.append(arg)
        i += 1
    return kept


def refuse_multirun_under_torchrun(argv: list[str]) -> None:
    if under_torchrun() and any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError(
            "a multirun (-m) under torchrun would run the whole sweep on every rank; run "
            "`python train.py -m strategy=ddp strategy.nproc_per_node=N ...` instead"
        )


def hydra_overrides_for_this_rank(argv: list[str]) -> list[str]:
    """Hydra overrides the command line implies for this process's run directory.

    * Ranks other than 0 write nothing into Hydra's run directory: every rank composes the
      config, but the directory could differ between processes started a second apart, so
      rank 0's is broadcast once the process group is up (trainer/run.py).
    * trainer.resume=<path> continues in that checkpoint's own run directory (its .hydra/
      keeps the run's config), unless hydra.run.dir is given.
    * A torchrun worker restarted after a failure goes back to the directory its job used
      before (trainer/rundir.py), so trainer.resume=auto finds the checkpoint there.
    """
    if under_torchrun() and env_rank() != 0:
        return ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]
    args = argv[1:]
    if any(a in ("-m", "--multirun") for a in args) or any(a.startswith("hydra.run.dir=") for a in args):
        return []
    resume = next((a.split("=", 1)[1] for a in args if a.startswith("trainer.resume=")), None)
    if resume and Path(resume).is_file() and Path(resume).parent.name == "checkpoints":
        return [f"hydra.run.dir={Path(resume).resolve().parent.parent}", "hydra.output_subdir=null"]
    previous = directory_before_restart() if under_torchrun() else None
    if previous:
        return [f"hydra.run.dir={previous}", "hydra.output_subdir=null"]
    return []


# Sections whose conf/ option a continued run's checkpoint implies (overrides_implied_by_resume).
_RESUMED_GROUPS = tuple(s for s in SECTIONS if s != "trainer")  # the trainer group has one option


def overrides_implied_by_resume(args: list[str]) -> list[str]:
    """`group=option` for the run that trainer.resume=<checkpoint> continues, where the command
    line chooses no option for that group itself.

    The command line is composed on conf/'s defaults (ahead by check_overrides, then by Hydra)
    before trainer/resume.py swaps in the checkpoint's stored config. Composed on the default
    linear model and regression data, an override of a key only the stored run's options have
    (`model.n_layers=3`, `data.path=...`, `strategy.nproc_per_node=2`) failed to compose, and
    the message advised choosing another option. Composed on the stored run's own options, such
    an override reaches config_to_continue, which applies it or refuses a changed model in one
    line. train.py appends these to what Hydra composes and leaves them out of the overrides
    it hands to config_to_continue: only what the user typed changes the stored config.
    An option is implied only when exactly one conf/<group>/*.yaml has the stored section's
    `_target_`; a checkpoint that cannot be read implies nothing (loading it
    later reports why, in one line).
    """
    from ringtrain.checkpoints.files import CheckpointError, load_checkpoint

    if any(a in ("-m", "--multirun") for a in args):
        return []
    resume = [a.split("=", 1)[1] for a in args if a.startswith("trainer.resume=")]
    if not resume or resume[-1] in ("auto", "null") or not Path(resume[-1]).is_file():
        return []
    try:
        stored = load_checkpoint(resume[-1], mmap=True)["config"]
    except CheckpointError:
        return []
    chosen = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a and not a.startswith("-")}
    implied = []
    for group in _RESUMED_GROUPS:
        if group in chosen or (group in PRESET_SECTIONS and chosen & set(PRESET_GROUPS)):
            continue
        section = stored.get(group)
        wanted = section.get("_target_") if isinstance(section, dict) else None
        matches = [name for name, node in _option_nodes(group) if wanted is not None and node.get("_target_") == wanted]
        if len(matches) == 1:
            implied.append(f"{group}={matches[0]}")
    return implied


# --- composing ahead ------------------------------------------------------------------------


def check_overrides(args: list[str]) -> None:
    """Compose and validate the config of every job the command line asks for; raise
    ConfigError on a mistake.

    `args` is the command line without the program name. Sweeps are expanded as Hydra's basic
    sweeper would (up to _MAX_CHECKED_JOBS jobs); continuous search spaces (an Optuna
    `interval(...)`) are left to the sweeper.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from ringtrain.config.schema import validate

    parsed_args, _ = get_args_parser().parse_known_args(args)
    if any(getattr(parsed_args, flag, False) for flag in _NO_RUN_FLAGS):
        return
    if parsed_args.config_path or parsed_args.config_name:
        return  # another primary config than conf/train.yaml: Hydra reports on it itself
    config_dir = parsed_args.config_dir
    if config_dir and not Path(config_dir).is_dir():
        raise ConfigError(f"--config-dir {config_dir!r} is not a directory; pass the folder that holds your <group>/<option>.yaml files")

    parser = OverridesParser.create()
    overrides = []
    for line in parsed_args.overrides:
        try:
            overrides.append(parser.parse_override(line))
        except HydraException as err:  # OverrideParseException, or the grammar's own errors
            first = str(err).strip().splitlines()[0]
            raise ConfigError(
                f"cannot read the override {line!r} ({first}); write group=option or key=value, "
                f"e.g. model=mlp optimizer.lr=0.01"
            ) from None

    choices = []
    for override in overrides:
        if parsed_args.multirun and override.is_discrete_sweep():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        elif override.is_sweep_override():
            if not parsed_args.multirun:
                raise ConfigError(
                    f"{override.input_line!r} is a sweep; add -m to run one job per value "
                    f"(python train.py -m {override.input_line})"
                )
            continue  # a continuous search space: only the sweeper can pick values
        else:
            choices.append([override.input_line])
    for job in itertools.islice(itertools.product(*choices), _MAX_CHECKED_JOBS):
        validate(compose_or_explain(list(job), config_dir))


def compose_or_explain(overrides: list[str], config_dir: str | None = None):
    """The composed config for `overrides`, or a ConfigError saying what is wrong and the fix."""
    from hydra.errors import ConfigCompositionException, MissingConfigException

    try:
        return _compose(overrides, config_dir)
    except MissingConfigException as err:
        raise ConfigError(_missing_option_message(err)) from None
    except ConfigCompositionException as err:
        raise ConfigError(_composition_message(err, overrides, config_dir)) from None


def _compose(overrides: list[str], config_dir: str | None = None):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # called again in one process (tests)
        GlobalHydra.instance().clear()
    extra = []
    if config_dir:  # what --config-dir does: the user's folder is searched before conf/
        extra = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=extra + overrides)


def _missing_option_message(err) -> str:
    missing = err.missing_cfg_file or ""
    group, _, option = missing.rpartition("/")
    if group and err.options:
        hint = ""
        if group.startswith("hydra/"):  # sweepers and launchers are plugins, installed as extras
            hint = " (Optuna and joblib come with pip install -e '.[sweep]', submitit with '.[slurm]')"
        return (
            f"{group}={option} is not an option of {group}; choose one of "
            f"{', '.join(sorted(err.options))}{hint}"
        )
    return _first_line(err)


def _composition_message(err, overrides: list[str], config_dir: str | None = None) -> str:
    message = str(err)
    unknown = re.search(r"Could not override '([^']+)'", message)
    if unknown:
        return _unknown_key_message(unknown.group(1), overrides, config_dir)
    exists = re.search(r"Could not append to config. An item is already at '([^']+)'", message)
    if exists:
        key = exists.group(1)
        return f"{key} already exists, so +{key}=... cannot add it; change it with {key}=<value>"
    return _first_line(err)


def _unknown_key_message(key: str, overrides: list[str], config_dir: str | None = None) -> str:
    """Why `key` is not in the composed config, with the keys that are, or the option that has it."""
    if key in LIGHTNING_HABITS:
        return f"{key} is not a setting here; use {LIGHTNING_HABITS[key]}"
    section, _, rest = key.partition(".")
    others = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        cfg = _compose(others, config_dir)
    except Exception:
        return f"{key} is not a known setting; check the spelling against conf/"
    groups = ", ".join(sorted(k for k in cfg if k != "hydra") + list(PRESET_GROUPS))
    if not rest:
        return f"{key} is not a config group or setting; the groups are {groups}"
    if section not in cfg:
        return f"{section} is not a config group; the groups are {groups}"
    from omegaconf import OmegaConf

    parent_path = key.rpartition(".")[0]
    parent = OmegaConf.select(cfg, parent_path)
    owners = _options_defining(section, rest)
    if owners and section == "strategy":
        chosen = _option_with_target(section, cfg[section].get("_target_"))
        picks = " or ".join(f"{section}={o}" for o in owners)
        return f"{key} is not a setting of {section}={chosen}; it belongs to {picks}: choose that option or drop the override"
    if owners:
        picks = " or ".join(f"{section}={o}" for o in owners)
        return f"{key} is not a setting of this {section}; it belongs to {picks}: choose that option or drop the override"
    known = ", ".join(sorted(k for k in parent if k != "_target_")) if parent is not None and hasattr(parent, "keys") else ""
    if section in ("model", "data", "task", "optimizer", "scheduler") and parent_path == section:
        target = cfg[section].get("_target_", "?")
        return (
            f"{key} is not set by this {section} ({target}); to pass a new argument write +{key}=<value>, "
            f"or check the spelling (set now: {known})"
        )
    return f"{key} is not a setting of {parent_path}; check the spelling (known: {known})"


def _options_defining(group: str, dotted_key: str) -> list[str]:
    """The options of conf/<group>/ whose file sets `dotted_key`."""
    from omegaconf import OmegaConf

    return [name for name, node in _option_nodes(group) if OmegaConf.select(node, dotted_key, default=None) is not None]


def _option_with_target(group: str, target: str | None) -> str:
    """The name of the conf/<group>/ option whose `_target_` is `target` (else the target)."""
    return next((name for name, node in _option_nodes(group) if node.get("_target_") == target), str(target))


def _option_nodes(group: str):
    """(option name, the node its conf/<group>/<option>.yaml gives `group`) for every option."""
    from omegaconf import OmegaConf

    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        node = OmegaConf.load(path)
        if "@package _global_" in path.read_text().split("\n", 1)[0]:
            node = node.get(group) or OmegaConf.create()  # the file spells out `group:` itself
        yield path.stem, node


def _first_line(err: BaseException) -> str:
    """Hydra's report in one line: its first line, the reason under it, and the key."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    reason = lines[1] if len(lines) > 1 and not lines[1].startswith("full_key:") else ""
    parts = [lines[0].rstrip(":"), reason, f"(at {key})" if key else ""]
    return " ".join(p for p in parts if p) + "; see `python train.py --help`"
