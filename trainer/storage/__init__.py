"""Files on disk that are not checkpoints, for any code that writes files: atomic.py (replacing a
file or folder atomically and durably, JSON any parser reads) and rundir.py (run directory names
that survive restarts, one job's claim on its directory).

May import: ringtrain.errors, ringtrain.distributed.
"""
