"""ringtrain's own models: plain `nn.Module`s, usable without the Trainer.

Each is built from a `_target_` node in conf/model/ exactly as a user's model is; sizes the
data dictates (in_features, num_classes, vocab_size) are filled in by argument name.
"""
from ringtrain.models.linear import LinearRegression
from ringtrain.models.mlp import MLPClassifier
from ringtrain.models.transformer import Transformer, TransformerConfig

__all__ = ["LinearRegression", "MLPClassifier", "Transformer", "TransformerConfig"]
