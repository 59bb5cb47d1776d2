"""Callbacks: the loop's optional behaviours, ringtrain's own and a user's alike (base.py has
the API). The stock ones, chosen by conf/callbacks/: metrics.py (train/loss, grad_norm, the
learning rate), throughput.py (speed, MFU, the profiler), progress.py (the console), summary.py
(the model's parameters), loggers.py (hands metrics to ringtrain/loggers/), early_stopping.py,
best_checkpoints.py, ema.py.

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints. Never the config,
the loop, the job or the tools.
"""
