"""ringtrain: config-driven PyTorch training. `from ringtrain import Trainer` for the Python API.

The package (the repository's trainer/ folder) is divided by concern, one subpackage each: its
docstring says what it holds, and docs/ARCHITECTURE.md lists them and follows one run through them.
"""


def __getattr__(name: str):
    if name == "Trainer":
        from ringtrain.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")


__all__ = ["Trainer"]
