"""Files on disk that are not checkpoints: any code that writes files may import these.

  atomic.py         replacing a file or folder atomically and durably, and JSON any parser reads
                    (metrics.json, eval/*.json, sweep_summary.json); imports nothing of ringtrain
  rundir.py         run directory names that survive restarts (a restarted torchrun job's notes
                    included), and one job's claim on its directory

May import: ringtrain.errors, ringtrain.distributed.
"""
