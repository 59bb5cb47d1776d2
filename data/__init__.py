"""ringtrain's own data sets and tasks: plain `Dataset`s inside small data components.

Each option in conf/data/ is a `_target_` pointing at one of these classes, built exactly as
a user's data component is (data/bundle.py says what a data component is); conf/task/ points
at the tasks in data/tasks.py.
"""
from ringtrain.data.bundle import DataBundle, DataError, DataModule

__all__ = ["DataBundle", "DataError", "DataModule"]
