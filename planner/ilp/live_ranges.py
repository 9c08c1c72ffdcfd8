"""Live ranges: the ops during which each tensor occupies device memory, and the values XLA keeps
inside fusions that take none."""
from __future__ import annotations

from collections.abc import Collection, Sequence

from planner.graph.fusion import in_place_stacks
from planner.graph.ir import Graph

# Backends that never write a value XLA keeps inside a fusion (experiments/check_gpu.py); XLA:CPU writes
# all but the optimizer update's (`kept_in_fusion`).
KEEPS_FUSED_VALUES_IN_REGISTERS = frozenset({"gpu"})


def kept_in_fusion(tid: int, producer: int, unwritten: Collection[int], combinable: Collection[int],
                   platform: str, recomputed: Collection[int] = ()) -> bool:
    """Whether the memory model gives value `tid` (made by op `producer`) no buffer: XLA computes it
    inside the fusion reading it and never writes it (`unwritten`); on `platform`s outside
    `KEEPS_FUSED_VALUES_IN_REGISTERS`, only a value of the optimizer update (the combinable tail) and
    one XLA recomputes in the fusions that read it (`recomputed`, `planner.graph.fusion.recomputed`)."""
    if tid in recomputed:
        return True
    return tid in unwritten and (platform in KEEPS_FUSED_VALUES_IN_REGISTERS or producer in combinable)


def fused_away(graph: Graph, unwritten: Collection[int], combinable: Collection[int],
               platform: str = "cpu", recomputed: Collection[int] = ()) -> frozenset[int]:
    """Values the memory model gives no buffer (`kept_in_fusion`; `ilp.liveness._materialised`)."""
    return frozenset(t for op in graph.ops for t in op.outputs
                     if kept_in_fusion(t, op.index, unwritten, combinable, platform, recomputed))


def last_reads(graph: Graph, fused: Collection[int] = ()) -> list[int]:
    """Per tensor, the last op that reads it (-1: none), where a read of a `fused` value is a read
    of that value's operands: XLA recomputes the value inside each fusion that consumes it, so its
    operands stay in memory until then (a bf16 gradient converted to float32 for the update is read
    by the update, not by the convert right after the backward)."""
    last = [-1] * len(graph.tensors)
    for op in graph.ops:
        for x in op.inputs:
            if isinstance(x, int):
                last[x] = max(last[x], op.index)
    for op in reversed(graph.ops):  # a fused value's readers come later: its last read is final here
        reach = max((last[t] for t in op.outputs if t in fused), default=-1)
        if reach > op.index:
            for x in op.inputs:
                if isinstance(x, int):
                    last[x] = max(last[x], reach)
    return last


def live_ranges(graph: Graph, donated: Sequence[tuple[int, int]] = (),
                fused: Collection[int] = ()) -> tuple[tuple[int, int], ...]:
    """(first, last) op index during which each tensor occupies memory.

    Arguments and constants live for the whole program, except a donated argument (`donated`:
    (argument, the output that takes its buffer) pairs, `build_problem`), which lives to its last
    use, or to just before it when that use writes the output (an in-place update: one buffer, as
    XLA aliases it); one that is never read lives nowhere. Results live from
    their producer to their last use, or to the end when they are program outputs. A result that
    never leaves its fusion (`planner.graph.fusion`) still counts from its producer to its last use: XLA
    keeps it in registers, but dropping such values under-predicted XLA:CPU's compiled peak of the
    conv net with batch norm (wresnet-tiny; experiments/check_memory.py). The `fused` values
    of the optimizer update (`fused_away`) take no memory; their operands are read where they are
    (`last_reads`).
    """
    end = len(graph.ops)
    first = [-1] * len(graph.tensors)
    last = last_reads(graph, fused)
    for op in graph.ops:
        for t in op.outputs:
            first[t] = op.index
            last[t] = max(op.index, last[t])
    used = {tin: last[tin] for tin, _ in donated}
    for t in list(graph.inputs) + list(graph.consts):
        first[t], last[t] = -1, end
    for x in graph.outputs:
        if isinstance(x, int):
            last[x] = end
    for tin, tout in donated:
        last[tin] = used[tin] - 1 if used[tin] == first[tout] else used[tin]
    _alias_scan_outputs(graph, first, last)
    return tuple(zip(first, last))


def _alias_scan_outputs(graph: Graph, first: list[int], last: list[int]) -> None:
    """An unrolled scan's stacked output (`graph.fusion.in_place_stacks`) is one buffer the scan
    writes each iteration's value into: it lives from the first iteration's value on, and the
    per-iteration values take no memory of their own (counting both held every layer's residuals
    twice at the stack)."""
    kept = set(graph.inputs) | set(graph.consts) | {x for x in graph.outputs if isinstance(x, int)}
    for i in in_place_stacks(graph):
        op = graph.ops[i]
        parts = [x for x in op.inputs if isinstance(x, int) and x not in kept]
        made = [first[x] for x in parts if first[x] >= 0]
        if not made:
            continue
        out = op.outputs[0]
        first[out] = min(made)
        for x in parts:
            first[x], last[x] = -1, -2


def offloaded_live_ranges(graph: Graph, live: Sequence[tuple[int, int]], offloaded: Sequence[tuple[int, int]],
                          fused: Collection[int] = (), copied: bool = True,
                          update: Collection[int] | None = None) -> tuple[tuple[int, int], ...]:
    """`live` with the device ranges of host-offloaded values (`planner.ilp.offload`).

    `copied` (XLA:GPU, TPU): the update runs on device copies: an argument kept on the host is on
    the device from its first consumer in `update` (the optimizer update's ops; None: any op) to its
    last read (it is copied in for the optimizer update; reads before it, a master parameter's
    casts, copy it for themselves: `Problem.host_reads`), and its new value from its producer to
    its last read inside the step (then it is copied out); neither is held to the end of the step.
    Reads as `last_reads`. Not `copied` (XLA:CPU): the update's fusions read and write the host
    buffers in place, so neither is ever on the device (the
    compiled HLO has memory space S(5) only in its entry layout and no copies, and its temporary
    bytes do not change when leaves move to the host; tests/test_offload.py)."""
    first_use = [-1] * len(graph.tensors)
    for op in reversed(graph.ops):
        if update is not None and op.index not in update:
            continue
        for x in op.inputs:
            if isinstance(x, int):
                first_use[x] = op.index
    last = last_reads(graph, fused)
    out = list(live)
    nowhere = (-1, -2)
    for tin, tout in offloaded:
        if not copied:
            out[tin] = nowhere
            if tout >= 0:
                out[tout] = nowhere
            continue
        if first_use[tin] >= 0:
            out[tin] = (first_use[tin], last[tin])
        if tout >= 0:
            first = live[tout][0]
            out[tout] = (first, max(last[tout], first))
    return tuple(out)
