"""`ringtrain` / `python -m ringtrain` / `python train.py`: compose the config with Hydra, check
it, train, return the metric (README.md "Usage" has the command lines).

`trainer.resume=<file>` continues that run in its own directory: the checkpoint is read once,
before Hydra composes, and the choices and overrides it records are replayed before the command
line's (config/recipe.py), so the run keeps its config, changed only where the command line says.
A different model is refused (checkpoints/manager.py): the weights and optimizer state belong to it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from ringtrain.storage.rundir import remove_if_empty
from ringtrain.config.app import TRAIN, CommandLine, run_app
from ringtrain.config.recipe import record
from ringtrain.config.schema import validate
from ringtrain.distributed import env_rank, exit_rank, under_torchrun
from ringtrain.errors import NONFINITE_EXIT, ConfigError, TrainingStopped, UserError, exit_on_user_error
from ringtrain.run import launch, stopped_error, sweep_value
from ringtrain.tools.app import with_checkpoint

log = logging.getLogger("ringtrain")

# What a continued run decides anew rather than replays: which file it resumes from, how a
# sweep searched, and, under torchrun, its ranks (torchrun's, not the ones the run started).
_NOT_REPLAYED = ("trainer.resume", "trainer.trust_checkpoint", "hparams_search")


def prepare(command: CommandLine) -> list[CommandLine]:
    """The command line as Hydra will read it: torch.distributed.launch's `--local-rank N` taken
    out, and the checkpoint trainer.resume=<file> names read with its recipe to replay."""
    command.args = _without_legacy_local_rank(command.args)
    if under_torchrun() and command.multirun:
        raise ConfigError(
            "a multirun (-m) under torchrun would run the whole sweep on every rank; run it without torchrun, "
            "each job starting its own ranks: `ringtrain -m strategy=ddp strategy.nproc_per_node=N ...`")
    skip = _NOT_REPLAYED + (("strategy.nproc_per_node",) if under_torchrun() else ())
    commands = with_checkpoint(command, "trainer.resume", skip)
    for each in commands:
        for path, given in (each.checkpoint or {}).items():
            _refuse_another_model_option(each, path, given.state["job"]["choices"].get("model"))
    return commands


def _refuse_another_model_option(command: CommandLine, path: str, kept: str | None) -> None:
    """`model=<option>` other than the checkpoint's: a continued run keeps its model."""
    option = next((o.split("=", 1)[1] for o in reversed(command.overrides) if o.split("=", 1)[0] == "model"), None)
    if option is not None and kept is not None and option != kept:
        raise ConfigError(f"{path} is a checkpoint of model={kept}, but the command line picks model={option}; a "
                          f"continued run keeps its model: drop model={option} to continue it, or drop trainer.resume "
                          f"to start a new run with model={option}")


def main(command: CommandLine) -> None:
    """Hand the command line to Hydra; on a torchrun rank, exit as a rank does."""
    # `_target_: my_pkg.MyNet` imports from where you run, as `python -m` would (a console
    # script or `python train.py` puts only its own folder on the path).
    sys.path.insert(1, os.getcwd())

    def train(cfg: Any) -> float:
        return train_job(cfg, command)

    try:
        run_app(TRAIN, train, command)
    except SystemExit as exit:  # a mistake (2), a stop signal (143), non-finite values (3)
        if not under_torchrun():
            raise
        exit_rank(exit.code if isinstance(exit.code, int) else 1)
    if under_torchrun():  # here the rank finished cleanly
        exit_rank(0)


def train_job(cfg: Any, command: CommandLine) -> float:
    """One job of the command (a multirun has several): check it, train it on its ranks."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    run_dir, in_sweep = hydra.runtime.output_dir, hydra.mode == RunMode.MULTIRUN
    given = (command.checkpoint or {}).get(str(cfg.trainer.resume))
    argv = [command.program, *command.args]
    with exit_on_user_error(), told_how_to_continue(argv, run_dir, cfg.trainer.resume, cfg.trainer.checkpoint):
        try:
            job = validate(cfg)
        except UserError:
            remove_if_empty(Path(run_dir))  # Hydra made it for the job; it holds nothing yet
            raise
        job.group = Path(hydra.sweep.dir).name if in_sweep else None
        job.recipe = record(hydra, job.resolved)
        result = launch(job, run_dir, given=given, record=_record(cfg))
        if (stopped := stopped_error(result, job.trainer.checkpoint)) and not in_sweep:
            raise stopped
        return sweep_value(result)



@contextlib.contextmanager
def told_how_to_continue(argv: list[str], run_dir: str, resume: Any, checkpointing: bool) -> Iterator[None]:
    """Around one run: when a stop signal ends it after last.pt was saved, rank 0 logs the
    command that continues it (`argv`: the command line as the user gave it)."""
    try:
        yield
    except TrainingStopped as stopped:
        if stopped.exit_code != NONFINITE_EXIT and checkpointing and env_rank() == 0:
            from ringtrain.tools.continue_command import continue_command

            log.info(f"to continue this run, in {os.getcwd()}: {continue_command(argv, run_dir, resume)}")
        raise

def _record(cfg: Any) -> dict[str, str]:
    """The job's .hydra/ files as Hydra writes them (it is told not to, conf/train.yaml: the run
    writes them once the directory is its own, storage/rundir.py)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra = OmegaConf.to_container(HydraConfig.instance().cfg, enum_to_str=True)
    return {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(hydra),
            "overrides.yaml": OmegaConf.to_yaml(hydra["hydra"]["overrides"]["task"])}


def _without_legacy_local_rank(args: list[str]) -> list[str]:
    """torch.distributed.launch passes `--local-rank N` (the seed tutorial's launcher), which is
    not Hydra's; its value belongs in LOCAL_RANK, where torchrun puts it."""
    kept, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg in ("--local-rank", "--local_rank") and i + 1 < len(args):
            os.environ.setdefault("LOCAL_RANK", args[i + 1])
            i += 2
            continue
        if arg.startswith(("--local-rank=", "--local_rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        else:
            kept.append(arg)
        i += 1
    return kept


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("train")
