"""Checkpoints (run directories and atomic file writing are ringtrain.storage).

  manager.py   CheckpointManager: the run's parts registered, saved and restored; which checkpoint
               it continues from (read once), atomic (background) writes, rotation, unreadable set aside
  files.py     one checkpoint file: its format and names, writing it, reading it against its
               checksums, links and moving a file aside
  background.py  the copy of a state and the thread that writes it
  state_dicts.py model and optimizer state in ringtrain's plain format under every strategy
  sharded.py   each rank's shards with torch.distributed.checkpoint (fsdp, state_dict_type=sharded)
  initial_weights.py  trainer.init_from: a new run's starting weights
  frozen_base.py      adapters' checkpoints: the frozen base named by a CRC-32, not copied

May import: ringtrain.errors, ringtrain.distributed, ringtrain.storage. Never the strategies, config, loop or tools.
"""
