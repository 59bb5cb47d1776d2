"""`ringtrain` / `python -m ringtrain` / `python train.py`: compose the config with Hydra, check
it, train, return the metric (README.md "Usage" has the command lines).

A run a stop signal ended logs, as its last line, the exact command that continues it: auto-resume
continues last.pt only in the same run directory, and a plain `python train.py` would get a new
time-stamped one (storage/rundir.py). So: the program as this process (or its torchrun) was
started, the user's arguments with `hydra.run.dir=<this run's directory>`, and trainer.resume at
this run's last.pt (a step file would go back to that step; null, which refuses checkpoints, auto).
"""
from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from ringtrain.config import TRAIN, CommandLine, run_app
from ringtrain.config.recipe import record
from ringtrain.config.schema import validate
from ringtrain.distributed import env_rank, exit_rank, under_torchrun
from ringtrain.errors import NONFINITE_EXIT, ConfigError, TrainingStopped, UserError, exit_on_user_error
from ringtrain.run import launch, stopped_error, sweep_value
from ringtrain.storage.rundir import remove_if_empty
from ringtrain.tools import with_checkpoint

log = logging.getLogger("ringtrain")
# What a continued run decides anew rather than replays: which file it resumes from, how a
# sweep searched, and, under torchrun, its ranks (torchrun's, not the ones the run started).
_NOT_REPLAYED = ("trainer.resume", "trainer.trust_checkpoint", "hparams_search")


def prepare(command: CommandLine) -> list[CommandLine]:
    """The command line as Hydra will read it: `--local-rank N` taken out, and the checkpoint
    trainer.resume=<file> names read with its recipe to replay."""
    command.args = _without_legacy_local_rank(command.args)
    if under_torchrun() and command.multirun:
        raise ConfigError(
            "a multirun (-m) under torchrun would run the whole sweep on every rank; run it without torchrun, "
            "each job starting its own ranks: `ringtrain -m strategy=ddp strategy.nproc_per_node=N ...`")
    skip = _NOT_REPLAYED + (("strategy.nproc_per_node",) if under_torchrun() else ())
    commands = with_checkpoint(command, "trainer.resume", skip)
    for each in commands:
        option = next((o.split("=", 1)[1] for o in reversed(each.overrides) if o.split("=", 1)[0] == "model"), None)
        for path, given in (each.checkpoint or {}).items():
            kept = given.state["job"]["choices"].get("model")
            if option is not None and kept is not None and option != kept:  # a continued run keeps its model
                raise ConfigError(f"{path} is a checkpoint of model={kept}, but the command line picks model={option}; "
                                  f"a continued run keeps its model: drop model={option} to continue it, or drop "
                                  f"trainer.resume to start a new run with model={option}")
    return commands


def main(command: CommandLine) -> None:
    try:
        run_app(TRAIN, lambda cfg: train_job(cfg, command), command)
    except SystemExit as exit:  # a mistake (2), a stop signal (143), non-finite values (3)
        if not under_torchrun():
            raise
        exit_rank(exit.code if isinstance(exit.code, int) else 1)
    if under_torchrun():  # here the rank finished cleanly
        exit_rank(0)


def train_job(cfg: Any, command: CommandLine) -> float:
    """One job of the command (a multirun has several): check it, train it on its ranks."""
    hydra = HydraConfig.get()
    run_dir, in_sweep = hydra.runtime.output_dir, hydra.mode == RunMode.MULTIRUN
    resume, checkpointing = cfg.trainer.resume, cfg.trainer.checkpoint
    given = (command.checkpoint or {}).get(str(resume))
    with exit_on_user_error():
        try:
            job = validate(cfg)
        except UserError:
            remove_if_empty(Path(run_dir))  # Hydra made it for the job; it holds nothing yet
            raise
        job.group = Path(hydra.sweep.dir).name if in_sweep else None
        job.recipe = record(hydra, job.resolved)
        # The job's .hydra/ files as Hydra writes them (the run writes them once the directory is its own).
        files = {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
                 "overrides.yaml": OmegaConf.to_yaml(hydra.overrides.task)}
        try:
            result = launch(job, run_dir, given=given, record=files)
            if (stopped := stopped_error(result, job.trainer.checkpoint)) and not in_sweep:
                raise stopped
        except TrainingStopped as stopped:  # by a stop signal, after last.pt: rank 0 says how to continue
            if stopped.exit_code != NONFINITE_EXIT and checkpointing and env_rank() == 0:
                argv = [command.program, *command.args]
                log.info(f"to continue this run, in {os.getcwd()}: {continue_command(argv, run_dir, resume)}")
            raise
        return sweep_value(result)


def continue_command(argv: list[str], run_dir: str, resume: Any) -> str:
    """The shell command that continues, from its last.pt, the run in `run_dir` that `argv` started."""
    arguments, directory = argv[1:], Path(run_dir).resolve()
    replaced = {"hydra.run.dir"} | ({"trainer.resume"} if resume != "auto" else set())
    kept = [a for a in arguments if a.startswith("-") or "=" not in a or a.split("=", 1)[0].lstrip("+~") not in replaced]
    if resume is None:
        kept.append("trainer.resume=auto")
    elif resume != "auto":
        kept.append(f"trainer.resume={directory / 'checkpoints' / 'last.pt'}")
    return shlex.join(_launcher(argv[0], arguments) + kept + [f"hydra.run.dir={directory}"])


def _launcher(program: str, arguments: list[str]) -> list[str]:
    """The words before the arguments: how this process, or its torchrun, was started."""
    if under_torchrun():
        try:  # its parent's command line, which ends with this worker's arguments
            raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
            parent = [os.fsdecode(word) for word in raw.split(b"\0")[:-1]]
        except OSError:
            parent = []
        if parent and parent[len(parent) - len(arguments):] == arguments and len(parent) > len(arguments):
            return _readable(parent[:len(parent) - len(arguments)])
        # No /proc, or a launcher that is not torchrun: the torchrun command that would do.
        script = _this_program(program)
        script = script[1:] if script[0] == _python() else ["--no-python", *script]
        return ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}", *script]
    return _this_program(program)


def _this_program(program: str) -> list[str]:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m ringtrain, python -m ringtrain.tools.train
        return [_python(), "-m", spec.name.removesuffix(".__main__")]
    if program.endswith(".py"):
        return [_python(), program]
    return [_by_name(program)]  # the `ringtrain` console script


def _readable(words: list[str]) -> list[str]:
    """A command line as /proc has it (`/venv/bin/python /venv/bin/torchrun ...`) as it was
    typed (`torchrun ...`) where the short names find the same programs."""
    if len(words) > 1 and os.path.basename(words[0]).startswith("python"):
        if os.path.abspath(words[0]) == os.path.abspath(sys.executable):
            words = [_python(), *words[1:]]
        if not words[1].startswith("-") and not words[1].endswith(".py"):  # a console script
            return [_by_name(words[1]), *words[2:]]
        return words
    return [_by_name(words[0]), *words[1:]]


def _python() -> str:
    return _by_name(sys.executable, ("python", "python3"))


def _by_name(path: str, names: tuple[str, ...] = ()) -> str:
    """The first of `names` (else `path`'s own name) that finds the program `path` on the PATH, else `path`."""
    for name in names or (os.path.basename(path),):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(path):
            return name
    return path


def _without_legacy_local_rank(args: list[str]) -> list[str]:
    """torch.distributed.launch passes `--local-rank N` (the seed tutorial's launcher), which is
    not Hydra's; its value belongs in LOCAL_RANK, where torchrun puts it."""
    kept, words = [], iter(args)
    for arg in words:
        name, joined, value = arg.partition("=")
        if name not in ("--local-rank", "--local_rank"):
            kept.append(arg)
        elif joined or (value := next(words, None)) is not None:  # --local-rank=N, or --local-rank N
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(arg)  # the last word, without its value
    return kept


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("train")
