"""ringtrain's command line: compose the config with Hydra, train, return the metric.

    python train.py                                   # the default job (linear regression, CPU)
    python train.py model=transformer                 # any group=option / key=value overrides
    torchrun --nproc_per_node=2 train.py strategy=ddp
    python train.py -m optimizer.lr=1e-3,3e-3         # a sweep
    python train.py --config-dir my_conf model=my_net # your own components (README)
"""
import os
import signal
import sys


def _interrupted_outside_training(signum, frame):
    """Ctrl-C while starting up (imports, composing, building) or while finishing: nothing is
    being trained, so there is nothing to save; one line instead of a KeyboardInterrupt
    traceback from whatever was being imported. Training itself handles SIGINT in
    trainer/signals.py (finish the step, save last.pt, exit 143) and restores this after."""
    print("interrupted by SIGINT outside training (nothing to save); exiting with status 130", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


if __name__ in ("__main__", "__mp_main__") and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Before the heavy imports below (torch takes seconds). Also in the workers of a
    # self-launched DDP job, which import this file as __mp_main__. Not where SIGINT is
    # ignored (a shell's background job): that stays so.
    signal.signal(signal.SIGINT, _interrupted_outside_training)

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer.cli import (
    check_overrides,
    hydra_overrides_for_this_rank,
    overrides_implied_by_resume,
    refuse_multirun_under_torchrun,
    strip_legacy_local_rank_arg,
)
from trainer.distributed import exit_rank, under_torchrun
from trainer.errors import exit_on_user_error
from trainer.run import run
from trainer.resolvers import register_resolvers


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    # What the user typed: the options implied by trainer.resume=<checkpoint> only shaped the
    # composition (trainer/cli.py overrides_implied_by_resume) and change nothing stored.
    overrides = [o for o in hydra_cfg.overrides.task if o not in _IMPLIED_BY_RESUME]
    with exit_on_user_error():
        return run(cfg, hydra_cfg.runtime.output_dir, overrides, in_sweep=hydra_cfg.mode == RunMode.MULTIRUN)


_IMPLIED_BY_RESUME: list[str] = []


if __name__ == "__main__":
    # `_target_: my_pkg.MyNet` imports from where you run, as `python -m` would: Python puts
    # this script's folder on the path, not the current directory.
    sys.path.insert(1, os.getcwd())
    with exit_on_user_error():
        argv = strip_legacy_local_rank_arg(sys.argv)
        refuse_multirun_under_torchrun(argv)
        _IMPLIED_BY_RESUME = overrides_implied_by_resume(argv[1:])
        check_overrides(argv[1:] + _IMPLIED_BY_RESUME)
    sys.argv = argv + _IMPLIED_BY_RESUME + hydra_overrides_for_this_rank(argv)
    register_resolvers()
    try:
        main()
    except SystemExit as exit:  # a mistake (2), a stop signal (143), non-finite values (3)
        if not under_torchrun():
            raise
        exit_rank(exit.code if isinstance(exit.code, int) else 1)
    if under_torchrun():  # here the rank finished cleanly
        exit_rank(0)
