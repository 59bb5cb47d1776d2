"""ringtrain's own models: plain `nn.Module`s, usable without the Trainer.

Each is built from a `_target_` node in conf/model/ exactly as a user's model is; sizes the
data dictates (in_features, num_classes, vocab_size) are filled in by argument name. A job
imports only the module of the model it chose.
"""
import importlib

_MODULE_OF = {"LinearRegression": "linear", "MLPClassifier": "mlp", "Transformer": "transformer",
              "TransformerConfig": "transformer"}


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"ringtrain.models.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'ringtrain.models' has no attribute {name!r}")


__all__ = list(_MODULE_OF)
