"""Sizes written by people ("80GB", "1.5GiB", 512e6) as numbers of bytes."""
from __future__ import annotations

import argparse
import re
from typing import Any

from planner.core.errors import InvalidArgumentError

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


_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30,
           "ti": 2.0**40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
# 25Gbit, 25Gbit/s, 25Gbps, 25Gb/s (bits); 3.125GB/s, 3.125GBps, 50GiB/s, 3e9 (bytes per second)
_RATE = re.compile(r"^\s*" + _NUMBER + r"\s*([kKmMgGtT]i?)?\s*(bit/s|bits/s|bit|bits|bps|b/s|b|B/s|Bps|B)?\s*$")
_TIME = re.compile(r"^\s*" + _NUMBER + r"\s*(s|ms|us|µs|ns)?\s*$")
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(value: Any, what: str = "bandwidth") -> float:
    """Bytes per second from a number (bytes/s) or a string with units: bits ("25Gbit", "25Gbps",
    "100Gb/s": a lower-case b) or bytes ("3.125GB/s", "50GiB/s": an upper-case B).

    Raises:
      InvalidArgumentError: not a positive rate, in one line naming `what`.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value > 0:
            raise InvalidArgumentError(f"{what}={value!r} must be a positive number of bytes/s")
        return float(value)
    m = _RATE.match(str(value))
    if not m or (m.group(2) and m.group(3) is None):
        raise InvalidArgumentError(f"{what}={value!r} is not a bandwidth; write e.g. '25Gbit' (bits/s), '3.125GB/s' "
                                   "(bytes/s) or a number of bytes/s")
    number, prefix, unit = float(m.group(1)), (m.group(2) or "").lower(), m.group(3) or "B"
    bits = unit[0] == "b"
    out = number * _PREFIX[prefix] / (8.0 if bits else 1.0)
    if not out > 0:
        raise InvalidArgumentError(f"{what}={value!r} must be positive")
    return out


def parse_duration(value: Any, what: str = "latency") -> float:
    """Seconds from a number (seconds) or a string such as "10us", "2.5ms", "500ns", "1e-5s"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"{what}={value!r} must be >= 0 seconds")
        return float(value)
    m = _TIME.match(str(value))
    if not m:
        raise InvalidArgumentError(f"{what}={value!r} is not a duration; write e.g. '10us', '2ms' or seconds")
    return float(m.group(1)) * _SECONDS[m.group(2) or ""]


def parse_link(value: Any, what: str = "link") -> tuple[float, float | None]:
    """(bytes/s, latency seconds or None) from "BANDWIDTH[,LATENCY]" (e.g. "25Gbit" or "25Gbit,10us"),
    a number of bytes/s, or a mapping {"bandwidth": ..., "latency": ...}."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"bandwidth", "latency"})
        if unknown or "bandwidth" not in value:
            raise InvalidArgumentError(f"{what}={value!r}: expected {{'bandwidth': ..., 'latency': ...}} "
                                       "(latency optional)")
        latency = value.get("latency")
        return (parse_bandwidth(value["bandwidth"], f"{what} bandwidth"),
                None if latency is None else parse_duration(latency, f"{what} latency"))
    if isinstance(value, str) and "," in value:
        rate, _, latency = value.partition(",")
        return parse_bandwidth(rate, what), parse_duration(latency, f"{what} latency")
    return parse_bandwidth(value, what), None


def format_bytes(n: float | None) -> str:
    """Sizes for people, in decimal units as memory budgets are written (`80GB`): every printed size
    (`Plan.summary`, the command line's tables) uses this one function."""
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float | None) -> str:
    """A duration with its unit (s, ms, us, ns), "-" for None."""
    if s is None:
        return "-"
    if abs(s) >= 1:
        return f"{s:.3f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    if abs(s) >= 1e-6:
        return f"{s * 1e6:.2f} us"
    return f"{s * 1e9:.1f} ns"


def positive_int(text: str) -> int:
    """A count written on a command line (`--microbatches 4`), as an argparse type."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value
