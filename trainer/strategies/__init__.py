"""Distributed training: process groups and collectives, launching ranks, and one strategy
class per way of training (single, dp, ddp, fsdp), chosen by `_target_` in conf/strategy/.

The strategy is the only place that knows which one it is. May import: ringtrain.errors.
"""
