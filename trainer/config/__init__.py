"""The configuration: every command's Hydra app (app.py: composed once, a mistake one line),
the checked job (schema.py), the data, task and model nodes (builders.py, sizes.py), a
continued run's config (continuation.py) and what a checkpoint's stored config may name
(trust.py), the sweep summary (sweep.py).

May import: ringtrain.errors, ringtrain.distributed, ringtrain.components, ringtrain.checkpoints,
ringtrain.optim, ringtrain.data, ringtrain.models, ringtrain.strategies, ringtrain.callbacks,
ringtrain.loggers. Never the loop, the job or the tools.
"""
