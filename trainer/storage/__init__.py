"""Files on disk that are not checkpoints: any code that writes files may import these.

  atomic.py         replacing a file or folder atomically and durably; imports nothing of ringtrain
  json_text.py      JSON any parser reads (metrics.json, eval/*.json, sweep_summary.json)
  rundir.py         run directory names that survive restarts, and one job's claim on its directory
  restart_notes.py  how a restarted torchrun job finds its directory again

May import: ringtrain.errors, ringtrain.distributed.
"""
