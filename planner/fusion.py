"""Which values of a traced program XLA keeps in registers and which go through device memory.

XLA's fusion passes merge elementwise ops, broadcasts, layout-only ops and reductions into kernels
("fusions"); a value made and used inside one fusion never touches device memory (HBM). The cost
model therefore charges memory traffic at fusion boundaries, not per op: each fusion reads every
value it takes from outside once and writes every value used outside it once.

The grouping follows XLA's producer-consumer fusion in simplified form (`fusions`):
  - contractions (dot, convolution), gathers and scatters, sorts, collectives, custom calls and
    every primitive not listed in `_FUSIBLE` run as kernels of their own and fuse with nothing
    (XLA:GPU emits library calls for dots and convolutions);
  - a fusible op joins the fusion of its consumers when every consumer is a fusible op of one and
    the same fusion (a value used by two kernels is written once and read twice, as XLA does when
    it does not duplicate the producer);
  - a reduction is a fusion root: its producers fuse into it (input fusion), its result is written
    for its consumers;
  - a value that is a program output is written.
Approximations, stated: XLA duplicates cheap producers into several consumers (here the value is
written once instead) and caps fusion sizes (not modelled); multi-output sibling fusions of
reductions over one input are not formed (each reduction reads its input). tests/test_fusion.py
checks the resulting bytes against the `bytes accessed` of XLA's compiled cost analysis.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.graph import Graph

# Ops XLA fuses into loop / input fusions: elementwise arithmetic and comparisons, conversions,
# broadcasts and layout-only ops, slices and pads, iota, and reductions (as fusion roots).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin",
    "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "name", "optimization_barrier",
    "reduce_precision", "bitcast_convert_type", "random_bits", "random_wrap", "random_unwrap", "threefry2x32",
})
_LAYOUT = frozenset({
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev", "iota", "slice", "dynamic_slice",
    "pad", "concatenate",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "argmax", "argmin", "reduce_precision_sum"})
_FUSIBLE = _ELEMENTWISE | _LAYOUT | _REDUCTIONS


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
    """Which operands an op reads from and which results it writes to device memory.

    Attributes:
      fusion: the op's fusion id (ops of one fusion share it; an unfused op has its own).
      reads: per operand position, True when the op reads that value from memory (the first op of
        its fusion to read a value made outside the fusion; literals are never read).
      writes: per result, True when the value leaves the fusion (or the program).
    """

    fusion: int
    reads: tuple[bool, ...]
    writes: tuple[bool, ...]


def fusible(name: str) -> bool:
    """Whether XLA fuses ops of this primitive into loop / input fusions."""
    return name in _FUSIBLE


def fusions(graph: Graph) -> Mapping[int, Traffic]:
    """The fusion of every op of `graph` and its memory traffic (see the module docstring)."""
    consumers = graph.consumers()
    program_outputs = {t for t in graph.outputs if isinstance(t, int)}
    fusion_of: dict[int, int] = {}
    for op in reversed(graph.ops):
        fusion_of[op.index] = op.index
        if not fusible(op.name) or op.name in _REDUCTIONS:
            continue
        if any(t in program_outputs for t in op.outputs):
            continue
        users = {c for t in op.outputs for c, _ in consumers.get(t, ())}
        if not users:
            continue
        targets = {fusion_of[c] for c in users}
        if len(targets) == 1 and all(fusible(graph.ops[c].name) for c in users):
            fusion_of[op.index] = targets.pop()
    out: dict[int, Traffic] = {}
    read: set[tuple[int, int]] = set()  # (fusion, tensor) already read by an earlier op of the fusion
    producer = {t: op.index for op in graph.ops for t in op.outputs}
    for op in graph.ops:
        f = fusion_of[op.index]
        reads = []
        for x in op.inputs:
            if not isinstance(x, int):
                reads.append(False)
                continue
            inside = x in producer and fusion_of[producer[x]] == f
            first = (f, x) not in read
            read.add((f, x))
            reads.append(not inside and first)
        writes = tuple(t in program_outputs or any(fusion_of[c] != f for c, _ in consumers.get(t, ()))
                       for t in op.outputs)
        out[op.index] = Traffic(f, tuple(reads), writes)
    return out


def memory_traffic_bytes(graph: Graph, traffic: Mapping[int, Traffic] | None = None) -> float:
    """Bytes the unsharded program reads and writes in device memory after fusion (the figure XLA's
    cost analysis reports as `bytes accessed` for one device)."""
    traffic = fusions(graph) if traffic is None else traffic
    total = 0
    for op in graph.ops:
        tr = traffic[op.index]
        total += sum(graph.tensors[x].nbytes for x, r in zip(op.inputs, tr.reads) if r)
        total += sum(graph.tensors[t].nbytes for t, w in zip(op.outputs, tr.writes) if w)
    return float(total)
