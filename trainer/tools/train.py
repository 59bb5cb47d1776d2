"""`ringtrain` / `python -m ringtrain` / `python train.py`: compose the config with Hydra,
train, return the metric.

    ringtrain                                         # the default job (linear regression, CPU)
    ringtrain model=transformer                       # any group=option / key=value overrides
    torchrun --nproc_per_node=2 -m ringtrain strategy=ddp
    ringtrain -m optimizer.lr=1e-3,3e-3               # a sweep
    ringtrain --config-dir my_conf model=my_net       # your own components (README)
"""
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ringtrain.config.command_line import (
    check_overrides,
    hydra_overrides_for_this_rank,
    overrides_implied_by_resume,
    refuse_multirun_under_torchrun,
    strip_legacy_local_rank_arg,
)
from ringtrain.config.resolvers import register_resolvers
from ringtrain.tools.run_record import record_of_this_job, take_over
from ringtrain.tools.continue_command import told_how_to_continue
from ringtrain.errors import exit_on_user_error
from ringtrain.run import run
from ringtrain.distributed import exit_rank, under_torchrun

# What trainer.resume=<checkpoint> implied (set by main() before Hydra composes): it only
# shaped the composition (config/command_line.py overrides_implied_by_resume) and changes
# nothing stored.
_implied_by_resume: list[str] = []
# The command line as given (set by main()), for the command that continues a stopped run.
_command_line: list[str] = []


@hydra.main(version_base="1.3", config_path="pkg://ringtrain.conf", config_name="train")
def train(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if o not in _implied_by_resume]
    run_dir = hydra_cfg.runtime.output_dir
    with exit_on_user_error(), told_how_to_continue(_command_line, run_dir, cfg.trainer.resume, cfg.trainer.checkpoint):
        return run(cfg, run_dir, overrides, in_sweep=hydra_cfg.mode == RunMode.MULTIRUN,
                   record=record_of_this_job(cfg))


def main() -> None:
    """Check the command line, then hand it to Hydra; on a torchrun rank, exit as a rank does."""
    global _implied_by_resume, _command_line
    # `_target_: my_pkg.MyNet` imports from where you run, as `python -m` would (a console
    # script or `python train.py` puts only its own folder on the path).
    sys.path.insert(1, os.getcwd())
    register_resolvers()
    with exit_on_user_error():
        argv = strip_legacy_local_rank_arg(sys.argv)
        _command_line = list(argv)
        refuse_multirun_under_torchrun(argv)
        _implied_by_resume = overrides_implied_by_resume(argv[1:])
        # Composed as rank 0 will: under torchrun every rank refuses a directory it cannot make.
        outputs = check_overrides(argv[1:] + _implied_by_resume + hydra_overrides_for_this_rank(argv, rank=0))
    for_this_rank = hydra_overrides_for_this_rank(argv)
    no_record_by_hydra = take_over(outputs, for_this_rank)
    sys.argv = argv + _implied_by_resume + for_this_rank + no_record_by_hydra
    try:
        train()
    except SystemExit as exit:  # a mistake (2), a stop signal (143), non-finite values (3)
        if not under_torchrun():
            raise
        exit_rank(exit.code if isinstance(exit.code, int) else 1)
    if under_torchrun():  # here the rank finished cleanly
        exit_rank(0)


if __name__ == "__main__":
    main()
