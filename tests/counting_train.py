"""train.py (or `ringtrain <tool>`, its first word the tool) that counts, per process, how often the job's config is composed (Hydra composing
it to run it; @hydra.main, which a command line with flags goes through, also composes once
with run_mode=MULTIRUN to read `hydra.mode` before that, counted apart as `mode_probes`), validated (ringtrain's validate)
and a checkpoint read from disk (torch.load of a .pt file), and prints them as its last line:

    counts: rank=<rank> compositions=<n> validations=<n> checkpoint_reads=<n> [<file> ...] mode_probes=<n>

Run it exactly like train.py (also under torchrun).
"""
import atexit
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train.py")
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from hydra._internal.hydra import Hydra  # noqa: E402  (counting only)
from hydra.types import RunMode  # noqa: E402

import ringtrain.tools.train as train  # noqa: E402

counts = {"compositions": 0, "mode_probes": 0, "validations": 0, "checkpoint_reads": []}


def counted(name, original):
    def call(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)
    return call


original_compose = Hydra.compose_config


def compose_config(self, *args, **kwargs):
    probe = kwargs.get("run_mode") == RunMode.MULTIRUN and kwargs.get("validate_sweep_overrides") is False
    counts["mode_probes" if probe else "compositions"] += 1
    return original_compose(self, *args, **kwargs)


Hydra.compose_config = compose_config
train.validate = counted("validations", train.validate)
original_load = torch.load


def load(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and str(f).endswith(".pt"):
        counts["checkpoint_reads"].append(os.path.basename(str(f)))
    return original_load(f, *args, **kwargs)


torch.load = load


@atexit.register
def report() -> None:
    reads = counts["checkpoint_reads"]
    line = (f"counts: rank={os.environ.get('RANK', '0')} compositions={counts['compositions']} "
            f"validations={counts['validations']} checkpoint_reads={len(reads)} {' '.join(reads)} "
            f"mode_probes={counts['mode_probes']}\n")
    os.write(sys.stdout.fileno(), line.encode())


# A torchrun rank ends with os._exit (ringtrain.distributed.exit_rank): report before it.
import ringtrain.distributed as distributed  # noqa: E402

original_exit = distributed.exit_rank


def exit_rank(code=0):
    report()
    original_exit(code)


train.exit_rank = distributed.exit_rank = exit_rank

if __name__ == "__main__":
    from ringtrain.__main__ import main

    sys.argv[0] = TRAIN
    main()  # train, or the tool the first word names (evaluate ...)
