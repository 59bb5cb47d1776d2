"""ringtrain: config-driven PyTorch training. `from ringtrain import Trainer` for the Python API.

The package (the repository's trainer/ folder) is divided by concern:
  ringtrain.components   `_target_` nodes: checked against their target, built
  ringtrain.config       the commands' Hydra app, the checked job, a checkpoint's recipe
  ringtrain.strategies   process groups, launching ranks, one class per strategy
  ringtrain.storage      atomic writes, JSON text, the run directory
  ringtrain.checkpoints  the checkpoint manager, its files, plain and sharded state
  ringtrain.optim        optimizers and learning-rate schedules
  ringtrain.callbacks    the loop's optional behaviours (the callback API and the stock ones)
  ringtrain.loggers      TensorBoard, CSV, Weights & Biases, MLflow
  ringtrain.loop         one rank's training loop and its parts
  ringtrain.run          one job: launch the ranks, build the components, train
  ringtrain.trainer      the Python API (Trainer)
  ringtrain.tools        the commands (train, evaluate, sample, consolidate, export, prepare_tokens, upgrade)
  ringtrain.models, ringtrain.data, ringtrain.conf   the repository's models/, data/, conf/
docs/ARCHITECTURE.md follows one run through them.
"""


def __getattr__(name: str):
    if name == "Trainer":
        from ringtrain.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")


__all__ = ["Trainer"]
