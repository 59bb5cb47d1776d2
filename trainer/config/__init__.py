"""The configuration: every command's Hydra app (app.py: composed once, a mistake one line),
the checked job (schema.py), the data, task and model nodes (builders.py, sizes.py), what a
checkpoint records of its job and how a command replays it (recipe.py), the sweep summary
(sweep.py).

May import: ringtrain.errors, ringtrain.distributed, ringtrain.components, ringtrain.checkpoints,
ringtrain.optim, ringtrain.data, ringtrain.models, ringtrain.strategies, ringtrain.callbacks,
ringtrain.loggers. Never the loop, the job or the tools.
"""
