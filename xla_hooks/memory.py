"""A compiled program's memory per device: XLA's buffer assignment and the host buffers of its entry layout."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from xla_hooks.hlo_text import HloParseError, hlo_text, nbytes


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStats:
    """Per-device buffer sizes from `compiled.memory_analysis()`.

    peak_bytes = argument_bytes + output_bytes + temp_bytes - alias_bytes: everything live at once,
    counting donated (aliased) buffers once. Generated code is reported but not included.
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int


_ENTRY_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*)\)->(.*)\}")
_LAID_OUT = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\]\{(?P<layout>[^}]*)\}")
HOST_MEMORY_SPACE = "S(5)"  # a layout's memory space 5: XLA's host memory (JAX's "pinned_host")


def entry_bytes(compiled_or_text: Any) -> tuple[int, int, int, int]:
    """(host argument bytes, all argument bytes, host result bytes, all result bytes) per device,
    from a compiled program's entry layout: the buffers in host memory carry memory space 5
    (`HOST_MEMORY_SPACE`) there, whatever `memory_analysis()` reports of them."""
    text = hlo_text(compiled_or_text)
    m = _ENTRY_LAYOUT.search(text.split("\n", 1)[0])
    if m is None:
        raise HloParseError("No entry_computation_layout in the module header")
    out = []
    for part in m.groups():
        host = total = 0
        for a in _LAID_OUT.finditer(part):
            b = nbytes([(a["dtype"], tuple(int(d) for d in a["dims"].split(",") if d))], "entry layout")
            total += b
            host += b if HOST_MEMORY_SPACE in a["layout"] else 0
        out += [host, total]
    return out[0], out[1], out[2], out[3]


def memory_stats(compiled: Any) -> MemoryStats:
    """Per-device memory of a compiled program, from XLA's buffer assignment."""
    stats = memory_analysis(compiled)
    if stats is None:
        raise ValueError(f"No memory analysis available for {type(compiled).__name__}")
    return stats


def memory_analysis(compiled: Any) -> MemoryStats | None:
    """`MemoryStats` of XLA's `memory_analysis()`; None where the object has none."""
    get = getattr(compiled, "memory_analysis", None)
    analysis = get() if callable(get) else None
    if analysis is None:
        return None
    arg, out = analysis.argument_size_in_bytes, analysis.output_size_in_bytes
    temp, alias = analysis.temp_size_in_bytes, analysis.alias_size_in_bytes
    return MemoryStats(
        argument_bytes=arg,
        output_bytes=out,
        temp_bytes=temp,
        alias_bytes=alias,
        generated_code_bytes=analysis.generated_code_size_in_bytes,
        peak_bytes=arg + out + temp - alias,
    )
