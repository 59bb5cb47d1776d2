"""Checkpoints: CheckpointManager (manager.py) and what it uses, one concern a module, each
named in its own docstring (run directories and atomic file writing are ringtrain.storage).

May import: ringtrain.errors, ringtrain.distributed, ringtrain.storage. Never the strategies, config, loop or tools.
"""
