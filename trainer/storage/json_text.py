"""JSON that every parser reads, for what ringtrain writes for scripts (metrics.json,
eval/*.json, sweep_summary.json): Python's json writes NaN / Infinity, which are not JSON
(JSON.parse refuses the file, jq makes them null). A diverged run has such metrics, so they are
written as null, and `allow_nan=False` makes any that slipped past an error, not a broken file.
"""
from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float in it (in dicts, lists and tuples) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def json_text(value: Any, **dumps_options: Any) -> str:
    return json.dumps(finite_or_none(value), allow_nan=False, **dumps_options)

