"""The training loop of one rank and its parts: fit, the optimizer step, evaluation, the
meters and loggers, precision, the non-finite watch, loaders, optimizers and schedules,
compilation, stop signals.

May import: ringtrain.errors, ringtrain.config, ringtrain.strategies, ringtrain.checkpoints,
ringtrain.data. Never the tools or the job (ringtrain.run).
"""
