"""Checkpoints and run directories.

  atomic.py    replacing any file atomically and durably (temp file, fsync, rename, fsync
               the directory); imports nothing of ringtrain, so every layer may use it
  files.py     one checkpoint file: its format and names, writing it, reading and verifying it
  store.py     a run's checkpoints: step files, last.pt / best.pt links, rotation, stale-file
               cleanup, the newest readable one (find_resumable)
  state_dicts.py  model and optimizer state in ringtrain's plain format, the same under every
               strategy (full, name-keyed, gathered to rank 0)
  sharded.py   each rank's shards with torch.distributed.checkpoint (fsdp, state_dict_type=sharded)
  resume.py    trainer.resume: which checkpoint a run continues from, and with which config
  rundir.py    run directory names that survive restarts, and the one-job lock

May import: ringtrain.errors, ringtrain.distributed. Never the strategies, config, loop or tools.
"""
