"""strategy=single: one process, one device; everything as the Strategy base does it."""
from __future__ import annotations

from ringtrain.strategies.base import Strategy


class Single(Strategy):
    """One process on one device (conf/strategy/single.yaml)."""
