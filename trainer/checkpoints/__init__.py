"""Checkpoints and run directories.

  atomic.py    replacing any file atomically and durably (temp file, fsync, rename, fsync
               the directory); imports nothing of ringtrain, so every layer may use it
  json_text.py JSON any parser reads (metrics.json, eval/*.json, sweep_summary.json):
               non-finite floats written as null
  checksums.py whether a checkpoint's bytes are those written (the CRC-32 of each zip record
               torch.save writes, and of each shard file)
  files.py     one checkpoint file: its format and names, writing it, reading and verifying it
  store.py     a run's checkpoints: step files, last.pt / best.pt links, rotation, stale-file
               cleanup
  fallback.py  the newest readable checkpoint (find_resumable); unreadable ones set aside in
               unreadable/, never deleted
  state_dicts.py  model and optimizer state in ringtrain's plain format, the same under every
               strategy (full, name-keyed, gathered to rank 0)
  sharded.py   each rank's shards with torch.distributed.checkpoint (fsdp, state_dict_type=sharded)
  resume.py    trainer.resume: which checkpoint a run continues from, and with which config
  rundir.py    run directory names that survive restarts, and the one-job lock

May import: ringtrain.errors, ringtrain.distributed. Never the strategies, config, loop or tools.
"""
