"""The training loop of one rank and its parts: fit (top to bottom), set-up, the optimizer
step, evaluation, the loop's checkpoints, meters and loggers, precision, the non-finite watch,
loaders, lr schedules, stop signals, the profiler.

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints, ringtrain.data,
ringtrain.strategies, ringtrain.config. Never the job (ringtrain.run) or the tools.
"""
