"""Train from a clone: `python train.py [overrides]` is the `ringtrain` command (README).

    python train.py                                   # the default job (linear regression, CPU)
    python train.py model=transformer                 # any group=option / key=value overrides
    torchrun --nproc_per_node=2 train.py strategy=ddp
    python train.py -m optimizer.lr=1e-3,3e-3         # a sweep
    python train.py --config-dir my_conf model=my_net # your own components (README)
"""
import os
import sys

# This folder holds data/, models/ and trainer/: the sources of ringtrain.data, ringtrain.models
# and ringtrain, not import names of their own. `python path/to/train.py` puts it first on the
# path; dropped, a user's own `data`, `models` or `trainer` (from where they run) is the one
# imported. ringtrain itself comes from its install (`pip install -e .`).
if sys.path and os.path.realpath(sys.path[0] or os.curdir) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

from ringtrain.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
