"""`ringtrain` / `python -m ringtrain` / `python train.py`: compose the config with Hydra, check
it, train, return the metric (README.md "Usage" has the command lines)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ringtrain.checkpoints.manager import Resumed
from ringtrain.checkpoints.rundir import remove_if_empty
from ringtrain.config.app import TRAIN, run_app
from ringtrain.config.continuation import CONTINUED, continued_config, read_continued_run
from ringtrain.config.schema import validate
from ringtrain.distributed import exit_rank, under_torchrun
from ringtrain.errors import ConfigError, UserError, exit_on_user_error
from ringtrain.run import launch, stopped_error, sweep_value
from ringtrain.tools.continue_command import told_how_to_continue


def main() -> None:
    """Hand the command line to Hydra; on a torchrun rank, exit as a rank does."""
    # `_target_: my_pkg.MyNet` imports from where you run, as `python -m` would (a console
    # script or `python train.py` puts only its own folder on the path).
    sys.path.insert(1, os.getcwd())
    with exit_on_user_error():
        _strip_legacy_local_rank_arg()
        if under_torchrun() and any(arg in ("-m", "--multirun") for arg in sys.argv):
            raise ConfigError(
                "a multirun (-m) under torchrun would run the whole sweep on every rank; run it without torchrun, "
                "each job starting its own ranks: `ringtrain -m strategy=ddp strategy.nproc_per_node=N ...`")
        given = read_continued_run(sys.argv[1:])
    command = list(sys.argv)

    def train(cfg: Any) -> float:
        return train_job(cfg, given, command)

    try:
        run_app(TRAIN, train, config_name=CONTINUED if given else None)
    except SystemExit as exit:  # a mistake (2), a stop signal (143), non-finite values (3)
        if not under_torchrun():
            raise
        exit_rank(exit.code if isinstance(exit.code, int) else 1)
    if under_torchrun():  # here the rank finished cleanly
        exit_rank(0)


def train_job(cfg: Any, given: Resumed | None, command: list[str]) -> float:
    """One job of the command (a multirun has several): check it, train it on its ranks."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    run_dir, in_sweep = hydra.runtime.output_dir, hydra.mode == RunMode.MULTIRUN
    with exit_on_user_error(), told_how_to_continue(command, run_dir, cfg.trainer.resume, cfg.trainer.checkpoint):
        try:
            if given is not None:
                cfg = continued_config(cfg, given, list(hydra.overrides.task))
            job = validate(cfg)
        except UserError:
            remove_if_empty(Path(run_dir))  # Hydra made it for the job; it holds nothing yet
            raise
        job.group = Path(hydra.sweep.dir).name if in_sweep else None
        result = launch(job, run_dir, given=given, record=_record(cfg))
        if (stopped := stopped_error(result, job.trainer.checkpoint)) and not in_sweep:
            raise stopped
        return sweep_value(result)


def _record(cfg: Any) -> dict[str, str]:
    """The job's .hydra/ files as Hydra writes them (it is told not to, conf/train.yaml: the run
    writes them once the directory is its own, checkpoints/rundir.py)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra = OmegaConf.to_container(HydraConfig.instance().cfg, enum_to_str=True)
    return {"config.yaml": OmegaConf.to_yaml(cfg), "hydra.yaml": OmegaConf.to_yaml(hydra),
            "overrides.yaml": OmegaConf.to_yaml(hydra["hydra"]["overrides"]["task"])}


def _strip_legacy_local_rank_arg() -> None:
    """torch.distributed.launch passes `--local-rank N` (the seed tutorial's launcher), which is
    not Hydra's; its value belongs in LOCAL_RANK, where torchrun puts it."""
    kept, i = [], 0
    while i < len(sys.argv):
        arg = sys.argv[i]
        if arg in ("--local-rank", "--local_rank") and i + 1 < len(sys.argv):
            os.environ.setdefault("LOCAL_RANK", sys.argv[i + 1])
            i += 2
            continue
        if arg.startswith(("--local-rank=", "--local_rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        else:
            kept.append(arg)
        i += 1
    sys.argv[:] = kept


if __name__ == "__main__":
    main()
