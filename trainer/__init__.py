"""ringtrain: config-driven PyTorch training. `from ringtrain import Trainer` for the Python API.

The package (the repository's trainer/ folder) is divided by concern:
  ringtrain.config       schemas, `_target_` components and their checks, the command line
  ringtrain.strategies   process groups, launching ranks, one class per strategy
  ringtrain.checkpoints  atomic files, the checkpoint store, resume, the run directory
  ringtrain.loop         one rank's training loop and its parts
  ringtrain.run          one job: launch the ranks, build the components, train
  ringtrain.trainer      the Python API (Trainer)
  ringtrain.tools        the commands (train, evaluate, sample, consolidate, prepare_tokens)
  ringtrain.models, ringtrain.data, ringtrain.conf   the repository's models/, data/, conf/
docs/ARCHITECTURE.md follows one run through them.

The import is lazy, so the command line's early checks do not pay for torch before they need it.
"""


def __getattr__(name: str):
    if name == "Trainer":
        from ringtrain.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")


__all__ = ["Trainer"]
