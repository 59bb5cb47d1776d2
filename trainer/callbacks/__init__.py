"""Callbacks: the loop's optional behaviours, ringtrain's own (chosen by conf/callbacks/, listed
in docs/ARCHITECTURE.md) and a user's alike (base.py has the API).

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints. Never the config,
the loop, the job or the tools.
"""
