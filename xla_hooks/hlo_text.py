"""HLO text as a compiled program prints it, read line by line: instructions, shapes and their bytes.

A small reader of `jax.stages.Compiled.as_text()`, not a full HLO parser: it looks at instruction
lines and computation headers only.
"""
from __future__ import annotations

import math
import re
from typing import Any

_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128, "f4e2m1fn": 4, "token": 0,
}  # f8* types are 8 bits, handled in _dtype_bits.

COMMENT = re.compile(r"/\*.*?\*/")
INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S.*?)\s+(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*[ (].*\{\s*$")
ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,<=\s]*)\]")


class HloParseError(ValueError):
    """Raised for input that is not HLO text this reader understands."""


def _dtype_bits(dtype: str, where: str) -> int:
    if dtype.startswith("f8"):
        return 8
    if dtype not in _BITS:
        raise HloParseError(f"Unknown element type {dtype!r} in {where}")
    return _BITS[dtype]


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (m["dtype"], tuple(int(d.replace("<=", "")) for d in m["dims"].split(",") if d.strip()))
        for m in ARRAY.finditer(shape)
    ]


def nbytes(arrays: list[tuple[str, tuple[int, ...]]], where: str) -> int:
    return sum(math.ceil(_dtype_bits(dt, where) * math.prod(dims) / 8) for dt, dims in arrays)


def split_call(rest: str) -> tuple[str, str]:
    """Splits `operands), attrs` at the parenthesis closing the operand list."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def operand_names(operands: str) -> list[str]:
    """Operand names, dropping any inline shapes (`f32[8]{0} %x` -> `x`)."""
    bare = ARRAY.sub(" ", re.sub(r"\{[^{}]*\}", " ", operands))
    return [t.lstrip("%") for t in re.split(r"[\s,()]+", bare) if t]


def ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def hlo_text(compiled_or_text: Any) -> str:
    """The text of a `jax.stages.Compiled` (or the HLO text given)."""
    if isinstance(compiled_or_text, str):
        return compiled_or_text
    if callable(getattr(compiled_or_text, "as_text", None)):
        text = compiled_or_text.as_text()
        if isinstance(text, str):
            return text
    raise HloParseError(
        f"Expected a jax.stages.Compiled or HLO text, got {type(compiled_or_text).__name__}"
    )
