"""Checkpoints and run directories: writing files atomically, the checkpoint store and its
rotation, deciding what to resume, rebuilding a model from a checkpoint alone, and the run
directory with its one-job lock.

May import: ringtrain.errors, ringtrain.config, ringtrain.strategies. Never the loop.
"""
