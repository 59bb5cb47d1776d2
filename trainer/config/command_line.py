"""The command line before Hydra sees it.

`ringtrain.tools.train` calls these in order:
  strip_legacy_local_rank_arg   torch.distributed.launch's `--local-rank N` is not an override
  refuse_multirun_under_torchrun  every torchrun rank would run the whole sweep
  check_overrides               compose and validate every job's config now, so a typo, an
                                unknown option or a bad component is one line with the fix
                                (exit 2) instead of Hydra's multi-line report suggesting
                                `+key=value`, and before Hydra creates a run directory
                                (config/compose.py, shared with the other commands); and
                                that the run directory can be made
  hydra_overrides_for_this_rank ranks other than 0 write nothing into Hydra's run directory
"""
from __future__ import annotations

import os
from pathlib import Path

from ringtrain.checkpoints.restart_notes import directory_before_restart
from ringtrain.checkpoints.rundir import why_not_writable
from ringtrain.config import compose
from ringtrain.config.compose import PRESET_GROUPS, PRESET_SECTIONS, SECTIONS, Outputs, option_nodes
from ringtrain.config.schema import validate
from ringtrain.errors import ConfigError
from ringtrain.distributed import env_rank, under_torchrun

__all__ = [
    "strip_legacy_local_rank_arg", "refuse_multirun_under_torchrun", "check_overrides",
    "hydra_overrides_for_this_rank", "overrides_implied_by_resume",
]


def check_overrides(args: list[str]) -> Outputs | None:
    """Compose and validate every training job the command line asks for (config/compose.py),
    and check that the run directory can be made; a mistake is a ConfigError, one line,
    before Hydra makes a run directory. Returns where the first job writes."""
    outputs = compose.check_overrides(args, compose.TRAIN, validate)
    if outputs is not None and outputs.directory is not None:
        reason = why_not_writable(outputs.directory)
        if reason:
            raise ConfigError(
                f"the run directory {outputs.directory} ({outputs.key}) cannot be created: {reason}; "
                f"set {outputs.key} to a directory you can write to"
            )
    return outputs


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
            "a multirun (-m) under torchrun would run the whole sweep on every rank; run it without torchrun, "
            "each job starting its own ranks: `ringtrain -m strategy=ddp strategy.nproc_per_node=N ...`"
        )


def hydra_overrides_for_this_rank(argv: list[str], rank: int | None = None) -> list[str]:
    """Hydra overrides the command line implies for this process's run directory (`rank`:
    those of another rank, e.g. 0's, whose run directory every rank checks ahead).

    * Ranks other than 0 write nothing into Hydra's run directory: every rank composes the
      config, but the directory could differ between processes started a second apart, so
      rank 0's is broadcast once the process group is up (trainer/run.py). They log to the
      console only, as rank 0 does with their rank named (conf/hydra/job_logging/other_ranks.yaml).
    * trainer.resume=<path> continues in that checkpoint's own run directory (its .hydra/
      keeps the run's config), unless hydra.run.dir is given.
    * A torchrun worker restarted after a failure goes back to the directory its job used
      before (checkpoints/restart_notes.py), so trainer.resume=auto finds the checkpoint there.
    """
    rank = (env_rank() if under_torchrun() else 0) if rank is None else rank
    if rank != 0:
        return ["hydra.output_subdir=null", "hydra/job_logging=other_ranks", "hydra.run.dir=."]
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
        stored = load_checkpoint(resume[-1], mmap=True, verify=False)["config"]
    except CheckpointError:
        return []
    chosen = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a and not a.startswith("-")}
    _refuse_another_model(args, stored, resume[-1])
    implied = []
    for group in _RESUMED_GROUPS:
        if group in chosen or (group in PRESET_SECTIONS and chosen & set(PRESET_GROUPS)):
            continue
        section = stored.get(group)
        wanted = section.get("_target_") if isinstance(section, dict) else None
        matches = [name for name, node in option_nodes(group) if wanted is not None and node.get("_target_") == wanted]
        if len(matches) == 1:
            implied.append(f"{group}={matches[0]}")
    return implied


def _refuse_another_model(args: list[str], stored: dict, checkpoint: str) -> None:
    """`model=<option>` whose class is not the checkpoint's: a continued run keeps its model.
    (Composed on that option, the checkpoint's data would only make the model's sizes look
    missing, and the message would suggest adding them.)"""
    option = next((a.split("=", 1)[1] for a in reversed(args) if a.split("=", 1)[0].lstrip("+") == "model"), None)
    kept = (stored.get("model") or {}).get("_target_")
    chosen = dict(option_nodes("model")).get(option) if option else None
    if chosen is None or kept is None or chosen.get("_target_") == kept:
        return
    raise ConfigError(
        f"{checkpoint} is a checkpoint of {kept}, but model={option} is {chosen.get('_target_')}; a continued run "
        f"keeps its model: drop model={option} to continue it, or drop trainer.resume to start a new run with model={option}"
    )
