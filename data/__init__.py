"""Data sets: each option name maps to a config dataclass and a builder of a DataBundle.

A DataBundle holds the train and validation Datasets, the task (loss and metrics), and the
model sizes the data dictates (input features, classes, vocabulary).
"""
from __future__ import annotations

from typing import Callable

from data.bundle import DataBundle, DataError
from data.classification import ClassificationConfig, build_classification
from data.regression import RegressionConfig, build_regression
from data.tasks import ClassificationTask, LanguageModelTask, RegressionTask, Task
from data.text import TextConfig, build_text
from data.tokens import TokensConfig, build_tokens

DATASETS: dict[str, tuple[type, Callable[..., DataBundle]]] = {
    "regression": (RegressionConfig, build_regression),
    "classification": (ClassificationConfig, build_classification),
    "tokens": (TokensConfig, build_tokens),
    "text": (TextConfig, build_text),
}

# The task each data set trains for, known before any data is built (a sweep's direction).
TASKS: dict[str, type[Task]] = {
    "regression": RegressionTask,
    "classification": ClassificationTask,
    "tokens": LanguageModelTask,
    "text": LanguageModelTask,
}


def build_data(name: str, config) -> DataBundle:
    """Build the data set registered as `name` from an instance of its config dataclass."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    config_class, builder = DATASETS[name]
    if not isinstance(config, config_class):
        raise TypeError(f"data set {name!r} needs a {config_class.__name__}, got {type(config).__name__}")
    return builder(config)


__all__ = ["DATASETS", "TASKS", "DataBundle", "DataError", "build_data"]
