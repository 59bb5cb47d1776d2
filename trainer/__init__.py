"""ringtrain's trainer: `from trainer import Trainer` for the Python API (trainer/trainer.py).

The import is lazy, so the command line's early checks (trainer.cli, trainer.errors) do not
pay for torch before they need it.
"""


def __getattr__(name: str):
    if name == "Trainer":
        from trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = ["Trainer"]
