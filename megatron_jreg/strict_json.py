"""JSON as the trainer and the analysis tools write it: strict, with ``null`` for a
non-finite number.

``json.dumps`` writes NaN and infinities as the bare words ``NaN``/``Infinity``, which
are not JSON (strict parsers, ``jq`` and JavaScript reject the file). A NaN displacement
or jump rate is written as ``null`` instead: never a number, never 0.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def dumps(value: Any, indent: int = 2) -> str:
    """Strict JSON text of ``value`` (non-finite floats as null), with a final newline."""
    return json.dumps(finite_or_null(value), indent=indent, allow_nan=False) + "\n"
