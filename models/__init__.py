"""Models: each option name maps to a config dataclass and the nn.Module built from it."""
from torch import nn

from models.linear import LinearConfig, LinearRegression
from models.mlp import MLPClassifier, MLPConfig
from models.transformer import Transformer, TransformerConfig

MODELS: dict[str, tuple[type, type[nn.Module]]] = {
    "linear": (LinearConfig, LinearRegression),
    "mlp": (MLPConfig, MLPClassifier),
    "transformer": (TransformerConfig, Transformer),
}


def build_model(name: str, config) -> nn.Module:
    """Build the model registered as `name` from an instance of its config dataclass."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")
    config_class, model_class = MODELS[name]
    if not isinstance(config, config_class):
        # A mismatched config would fail later with an obscure attribute error.
        raise TypeError(
            f"model {name!r} needs a {config_class.__name__}, got {type(config).__name__}"
        )
    return model_class(config)
