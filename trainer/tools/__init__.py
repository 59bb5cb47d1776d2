"""The commands, each a Hydra app with its own primary config in conf/: train, evaluate,
sample, consolidate, export, prepare_tokens; `ringtrain <tool> ...` reaches each
(ringtrain/__main__.py). Also what the tools share: rebuilding a model from a checkpoint.

May import anything in ringtrain; nothing in ringtrain imports them.
"""
