"""The collectives of a compiled program: kind, bytes, replica groups and how often each runs."""
from __future__ import annotations

import dataclasses
import pathlib
import re
import tempfile
from typing import Any

from xla_hooks.computations import base_name, trip_counts
from xla_hooks.hlo_text import ARRAY, COMMENT, COMPUTATION, INSTR, HloParseError, arrays, hlo_text, nbytes, \
    operand_names, split_call
from xla_hooks.replica_groups import expand_groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One logical collective in a compiled program (an async start/done pair counts once)."""

    kind: str
    name: str
    dtype: str  # element type; comma-joined when a tuple result mixes types
    shape: tuple[int, ...] | tuple[tuple[int, ...], ...]  # per element for tuple results
    result_bytes: int  # per device, summed over tuple elements
    operand_bytes: int  # per device, summed over operands
    group_size: int
    num_groups: int
    groups: tuple[tuple[int, ...], ...]
    computation: str  # enclosing HLO computation (e.g. a while body)
    # times it runs per program run: the product of the known trip counts of the while loops around
    # it (XLA annotates `known_trip_count` on loops it can count; 1 where it cannot)
    trips: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Collective kind {self.kind!r} must be one of {KINDS}")

    @property
    def bytes_moved_per_device(self) -> float:
        """Bytes each device sends under the ring algorithm, the usual model of these ops."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.result_bytes)
        if n <= 1:
            return 0.0
        frac = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * frac * self.result_bytes
        if self.kind == "reduce-scatter":
            return frac * self.operand_bytes
        return frac * self.result_bytes  # all-gather (output size), all-to-all


_MODULE = re.compile(r"^\s*HloModule\b.*$", re.M)
_HEADER_INT = re.compile(r"\b(num_partitions|replica_count)=(\d+)")


def collectives(compiled_or_text: Any, *, num_devices: int | None = None) -> tuple[Collective, ...]:
    """Lists the collectives of a compiled program in program order.

    Args:
      compiled_or_text: a `jax.stages.Compiled` or the HLO text it prints.
      num_devices: devices in the program, used for `replica_groups={}`; defaults to
        `num_partitions * replica_count` from the HloModule header (1 when absent).

    Returns:
      One `Collective` per logical collective instruction, including those in loop bodies.
    """
    text = hlo_text(compiled_or_text)
    module = _MODULE.search(text)
    header = {k: int(v) for k, v in _HEADER_INT.findall(module[0] if module else "")}
    if num_devices is None:
        num_devices = header.get("num_partitions", 1) * header.get("replica_count", 1)
    shapes: dict[str, str] = {}
    found: list[dict[str, Any]] = []
    starts: dict[str, dict[str, Any]] = {}
    computation, seen_hlo = "", module is not None
    for raw in text.splitlines():
        line = COMMENT.sub("", raw)
        m = INSTR.match(line)
        if m is None or not (m["shape"].startswith("(") or ARRAY.match(m["shape"])):
            if c := COMPUTATION.match(line):
                computation, seen_hlo = c["name"], True
            continue
        seen_hlo = True
        name, shape, op = m["name"], m["shape"], m["op"]
        shapes[name] = shape
        base = op.removesuffix("-start").removesuffix("-done")
        if base not in KINDS:
            continue
        operands, attrs = split_call(m["rest"])
        if op.endswith("-done"):
            start = starts.get(next(iter(operand_names(operands)), ""))
            if start is not None:
                start["shape"] = shape  # the done's result is the collective's output
            continue
        rec = dict(kind=base, name=name, shape=shape, operands=operands, attrs=attrs, comp=computation)
        found.append(rec)
        if op.endswith("-start"):
            starts[name] = rec
    if not seen_hlo:
        raise HloParseError(f"Input does not look like HLO text: {text[:80]!r}")
    loops = trip_counts(text)
    return tuple(dataclasses.replace(c, trips=loops.get(c.computation, 1))
                 for c in (_collective(r, shapes, num_devices) for r in found))


def _collective(rec: dict[str, Any], shapes: dict[str, str], num_devices: int) -> Collective:
    where = f"instruction {rec['name']!r}"
    result = arrays(rec["shape"])
    if not result:
        raise HloParseError(f"Cannot read the result shape {rec['shape']!r} of {where}")
    groups = expand_groups(rec["attrs"], num_devices, where)
    n = 2 if rec["kind"] == "collective-permute" else (len(groups[0]) if groups else 1)
    result_bytes = nbytes(result, where)
    inline = arrays(rec["operands"])
    names = operand_names(rec["operands"])
    if inline:
        operand_bytes = nbytes(inline, where)
    elif names and all(t in shapes for t in names):
        operand_bytes = nbytes([a for t in names for a in arrays(shapes[t])], where)
    else:  # operands defined outside the given text: infer from the result
        scale = {"all-gather": 1 / n, "reduce-scatter": n}.get(rec["kind"], 1)
        operand_bytes = int(result_bytes * scale)
    dtypes = list(dict.fromkeys(dt for dt, _ in result))
    is_tuple = rec["shape"].lstrip().startswith("(")
    return Collective(
        kind=rec["kind"],
        name=rec["name"],
        dtype=",".join(dtypes),
        shape=tuple(d for _, d in result) if is_tuple else result[0][1],
        result_bytes=result_bytes,
        operand_bytes=operand_bytes,
        group_size=n,
        num_groups=len(groups),
        groups=groups,
        computation=rec["comp"],
    )


# The first XLA:CPU pass that widens 16-bit collectives to float32 (float-normalization-bf16 does the
# same when it is off): XLA:CPU's collectives have no 16-bit reductions.
_WIDENING_PASS = "all-reduce-promotion"


def compile_with_program_collectives(lowered: Any) -> tuple[Any, tuple[Collective, ...]]:
    """Compiles `lowered` (a `jax.stages.Lowered`) once and returns the executable with the
    collectives as the partitioned program has them, before XLA:CPU runs every 16-bit collective in
    float32: the module is dumped just before `_WIDENING_PASS` (compiler options `xla_dump_to`,
    `xla_dump_hlo_pass_re`), after SPMD partitioning and the passes before it. On XLA:CPU a bf16
    program's collectives move twice the bytes in the compiled program that they move on a GPU
    (whose NCCL reduces bf16); these are the GPU's. Their `trips` come from the compiled module's
    loop annotations, matched by the loop bodies' names (`base_name`). Raises HloParseError when
    the backend dumped no such module (it has no such pass)."""
    with tempfile.TemporaryDirectory() as out:
        compiled = lowered.compile({"xla_dump_to": out, "xla_dump_hlo_pass_re": _WIDENING_PASS})
        found = sorted(pathlib.Path(out).glob(f"*before_{_WIDENING_PASS}.txt"))
        if not found:
            raise HloParseError(f"no module was dumped before the {_WIDENING_PASS!r} pass (not XLA:CPU?)")
        early = collectives(found[-1].read_text())
    loops = trip_counts(compiled)  # annotated by the later passes: matched by the loop bodies' names
    return compiled, tuple(dataclasses.replace(c, trips=loops.get(base_name(c.computation), c.trips))
                           for c in early)
