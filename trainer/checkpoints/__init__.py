"""Checkpoints and run directories.

  atomic.py    replacing any file atomically and durably (temp file, fsync, rename, fsync
               the directory); imports nothing of ringtrain, so every layer may use it
  files.py     one checkpoint file: its format and names, writing it, reading and verifying it
  store.py     a run's checkpoints: step files, last.pt / best.pt links, rotation, stale-file
               cleanup, the newest readable one (find_resumable)
  resume.py    trainer.resume: which checkpoint a run continues from, and with which config
  restore.py   a trained model rebuilt from its checkpoint alone (trainer.sample, evaluate,
               consolidate)
  rundir.py    run directory names that survive restarts, and the one-job lock

May import: ringtrain.errors, ringtrain.config, ringtrain.strategies. Never the loop.
"""
