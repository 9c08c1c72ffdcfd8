"""Sizes written by people ("80GB", "1.5GiB", 512e6) as numbers of bytes."""
from __future__ import annotations

import re
from typing import Any

from planner.errors import InvalidArgumentError

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, what: str = "memory_budget") -> float | None:
    """Bytes from a number or a string such as "80GB", "1.5GiB", "512MB"."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidArgumentError(f"{what}={value!r} must be positive")
        return float(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"{what}={value!r} is not a size; write bytes (1e9) or a string like '80GB' or '1.5GiB'")
    out = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if out <= 0:
        raise InvalidArgumentError(f"{what}={value!r} must be positive")
    return out
