"""Train from a clone: `python train.py [overrides]` is the `ringtrain` command (README).

    python train.py                                   # the default job (linear regression, CPU)
    python train.py model=transformer                 # any group=option / key=value overrides
    torchrun --nproc_per_node=2 train.py strategy=ddp
    python train.py -m optimizer.lr=1e-3,3e-3         # a sweep
    python train.py --config-dir my_conf model=my_net # your own components (README)
"""
from ringtrain.__main__ import main

if __name__ == "__main__":
    main()
