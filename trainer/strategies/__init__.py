"""One class per way of training (single, dp, ddp, fsdp), chosen by `_target_` in
conf/strategy/, plus what they share: the process-group base, starting ranks through torch's
elastic launcher, and compiling the model.

May import: ringtrain.errors, ringtrain.distributed, ringtrain.checkpoints.
"""
