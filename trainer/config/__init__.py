"""The configuration: every command's Hydra app, the checked job, the data, task and model
nodes, a checkpoint's recipe and its replay, the sweep summary (a module each).

May import: ringtrain.errors, ringtrain.distributed, ringtrain.components, ringtrain.checkpoints,
ringtrain.optim, ringtrain.data, ringtrain.models, ringtrain.strategies, ringtrain.callbacks,
ringtrain.loggers. Never the loop, the job or the tools.
"""
