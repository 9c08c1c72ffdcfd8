"""Host offload of optimizer state in single-stage plans: which leaves, the liveness and copies it implies.

An optimizer-state leaf (an Adam moment) is read only by the optimizer update, so between steps it
can live in the host's memory (JAX memory kind "pinned_host"): the planned program takes it in a
host sharding, copies it to the device at its first consumer in the update, and hands its new value
back to the host. The device then holds it only while the update runs.

Decision (`PlanOptions.offload`): "opt-state" offloads every optimizer-state leaf; "auto" only the
part that overflows (DeepCompile's adaptive offloading): when no plan fits `memory_budget`, the
largest leaves go to the host until the memory lower bound fits, more if the solved plan still
does not. The memory model sees it through the problem's live ranges
(`live_ranges.offloaded_live_ranges`: one liveness for the ILP's budget constraints, `memory_profile`
and the reported peak; on XLA:CPU, whose update fusions read and write the host buffers in place,
an offloaded value is never on the device); the cost through `ilp.objective` (copies in and back at the host link's
bandwidth, `Hardware.host_bandwidth`; copies back exposed; copies in exposed too in a streamed
update, else hidden behind the compute before the update).

The update is streamed (`streamed`): the traced update's ops are put in an order where the state
leaves updated together (a parameter's moments, its update and its new value) form one contiguous
group, groups one after the other, and the emitted program holds each group's copies to the device
until the previous group's new values exist (`jax.lax.optimization_barrier`), so one group's state
is on the device at a time, as the liveness model (computed on that order) counts it. Without it
optax updates every leaf's first moment, then every second moment, so every offloaded leaf would be
on the device at once. The copies in are then exposed, not hidden behind earlier compute: only the
first group's could be.

Master parameters ("opt-state+params", and "auto" after every moment): a float32 parameter the
step reads before the update only to cast it to the compute dtype (`param_pairs`) can live on the
host too. Each cast copies it to the device for itself (`Problem.host_reads`: its bytes at that
op, one more copy in at the host link), the update copies it in again (its device range starts
at its first read in the update), and its new value goes back. A scanned stack's stacked
parameter counts too when each iteration casts its own layer's slice (`_slice_reads`: the scan's
indexing, a size-one slice of the leading axis and the squeeze of it, then the cast): each cast
then copies only that slice in (its share of the parameter's bytes), so a whole scan copies the
stack in once, a layer at a time, and no more than one layer's slice is on the device for it.
The update's copy is tied to the op before it (`jax.lax.optimization_barrier`), so that XLA does
not merge it with the cast's copy and keep one copy on the device from the forward to the update.

Where the devices have no host memory space, or the hardware no host link figure, the option is a
one-line error, never silently dropped. What a plan keeps on the host must fit the device's share of
its host's memory (`Hardware.host_memory_per_device`; `plan_offload`), else the plan does not fit
(one line); unchecked where the hardware gives no host memory figure. Not offloaded: saved activations, and parameters the step
reads in their own dtype (a float32 step's matmuls).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import jax.numpy as jnp
import numpy as np

from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, OffloadUnavailableError
from planner.core.plan_records import OffloadRecord
from planner.core.units import format_bytes
from planner.graph.ir import Graph
from planner.ilp.objective import offload_hidden, offload_transfer
from planner.ilp.live_ranges import fused_away, live_ranges, offloaded_live_ranges
from planner.ilp.problem import Problem, combinable_ops
from planner.ilp.memory_bounds import memory_lower_bound
from planner.ilp.solver import Solution
from planner.ilp.strategies import shard_bytes

log = logging.getLogger("planner")

HOST = "pinned_host"
DEVICE = "device"


def state_pairs(problem: Problem) -> tuple[tuple[int, int], ...]:
    """(argument, new value) tensor pairs of optimizer state, in argument order: a floating-point
    array argument read only by the optimizer update (ops whose results feed no matmul,
    `Problem.combinable`) whose new value is the output of the same path and type (tied, or handed
    back in its pinned layout), so both can share one host layout."""
    ties = set(problem.ties)
    return tuple((tin, tout) for tin, tout in _state_inputs(problem.graph, problem.combinable)
                 if (tin, tout) in ties or tout in problem.pinned_outputs)


def param_pairs(problem: Problem) -> tuple[tuple[int, int], ...]:
    """(argument, new value) tensor pairs of master parameters that can live on the host: as
    `state_pairs`, but read before the update too, there only by casts to another floating dtype
    (`_param_inputs`: mixed precision's bf16 copy, which the rest of the step reads instead)."""
    ties = set(problem.ties)
    return tuple((tin, tout) for tin, tout in _param_inputs(problem.graph, problem.combinable)
                 if (tin, tout) in ties or tout in problem.pinned_outputs)


def host_reads(graph: Graph, combinable: Set[int],
               pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, int, float], ...]:
    """(argument, op, share) for each read of an offloaded argument before the update: each copies
    the argument, or for a cast of one slice of it (`_slice_reads`) that slice, `share` of its
    bytes, to the device for itself (`Problem.host_reads`)."""
    wanted = {tin for tin, _ in pairs}
    out = []
    readers = _readers(graph)
    for tin in sorted(wanted):
        for o in dict.fromkeys(readers.get(tin, ())):
            if o in combinable:
                continue
            if graph.ops[o].name == "convert_element_type":
                out.append((tin, o, 1.0))
                continue
            reads = _slice_reads(graph, tin, o, readers)
            share = graph.tensors[graph.ops[o].outputs[0]].size / graph.tensors[tin].size
            out += [(tin, cast, share) for cast in reads or ()]
    return tuple(sorted(out, key=lambda r: (r[1], r[0])))


def _is_float_cast(graph: Graph, op_index: int, source_dtype) -> bool:
    op = graph.ops[op_index]
    dtype = graph.tensors[op.outputs[0]].dtype
    return op.name == "convert_element_type" and jnp.issubdtype(dtype, jnp.floating) and dtype != source_dtype


def _slice_reads(graph: Graph, tin: int, op_index: int, readers: dict[int, list[int]]) -> tuple[int, ...] | None:
    """The casts that read one layer of stacked parameter `tin` through op `op_index`, or None when
    that op is not such a read: a `slice` of size one on the leading axis and whole on the others
    (a scan's indexing of its stacked input), whose result is read only by one `squeeze` of that
    axis, whose result is read only by casts to another floating dtype. Only a scan's own indexing
    (`_scan_indexing`): emission runs `lax.scan`, which cuts the slice from the host array, and
    copies the squeezed slice in at each cast (`planner.emit.offload`); a slice the step itself
    takes would run on the host array and is not such a read."""
    op, t = graph.ops[op_index], graph.tensors[tin]
    if op.name != "slice" or len(op.outputs) != 1 or not t.shape or not _scan_indexing(graph, op_index):
        return None
    part = graph.tensors[op.outputs[0]]
    if part.shape != (1, *t.shape[1:]) or tuple(op.params.get("strides") or (1,) * len(t.shape)) != (1,) * len(t.shape):
        return None
    squeezes = readers.get(op.outputs[0], ())
    if len(squeezes) != 1 or graph.ops[squeezes[0]].name != "squeeze" \
            or tuple(graph.ops[squeezes[0]].params["dimensions"]) != (0,):
        return None
    casts = tuple(dict.fromkeys(readers.get(graph.ops[squeezes[0]].outputs[0], ())))
    if not casts or not all(_is_float_cast(graph, c, t.dtype) for c in casts):
        return None
    return casts


def sliced_from(graph: Graph, producers: Mapping[int, tuple[int, int]], x: int) -> int | None:
    """The stacked argument whose layer slice tensor `x` is (the `squeeze` of a `slice` of it, the
    chain `_slice_reads` accepts, walked back from the cast's operand), or None. `producers`:
    `graph.producers()`."""
    squeeze = graph.ops[producers[x][0]] if x in producers else None
    part = squeeze.tensor_inputs[0] if squeeze is not None and squeeze.name == "squeeze" and squeeze.tensor_inputs \
        else None
    cut = graph.ops[producers[part][0]] if part in producers else None
    return cut.tensor_inputs[0] if cut is not None and cut.name == "slice" and cut.tensor_inputs else None


def _scan_indexing(graph: Graph, op_index: int) -> bool:
    """Whether op `op_index` is in a scan's planning expansion but outside the body that evaluation
    runs (`graph.ir.Region`): an iteration's indexing of a stacked input, or a later iteration."""
    return any(r.kind == "scan" and r.start <= op_index < r.end
               and not any(b.start <= op_index < b.end for b in r.bodies)
               for rs in graph.regions.values() for r in rs)


def _readers(graph: Graph) -> dict[int, list[int]]:
    readers: dict[int, list[int]] = defaultdict(list)
    for op in graph.ops:
        for x in op.tensor_inputs:
            readers[x].append(op.index)
    return readers


def _candidates(graph: Graph) -> list[tuple[int, int]]:
    """(argument, new value) pairs of floating-point array arguments whose new value is an output of
    the same path and type."""
    outputs = {p: t for p, t in zip(graph.output_paths, graph.outputs) if isinstance(t, int)}
    out = []
    for tin, path in zip(graph.inputs, graph.input_paths):
        t, tout = graph.tensors[tin], outputs.get(path)
        if (t.shape and np.issubdtype(np.dtype(t.dtype), np.floating) and tout is not None and tout != tin
                and graph.tensors[tout] == t):
            out.append((tin, tout))
    return out


def _param_inputs(graph: Graph, combinable: Set[int]) -> list[tuple[int, int]]:
    """(argument, new value) pairs of `_candidates` read by the update and, before it, only by
    `convert_element_type` to another floating dtype (bf16 too), of the whole argument or of one
    layer's slice of it (`_slice_reads`)."""
    readers = _readers(graph)
    out = []
    for tin, tout in _candidates(graph):
        before = tuple(o for o in readers.get(tin, ()) if o not in combinable)
        if not before or len(before) == len(readers[tin]):
            continue
        dtype = graph.tensors[tin].dtype
        if all(_is_float_cast(graph, o, dtype) or _slice_reads(graph, tin, o, readers) for o in before):
            out.append((tin, tout))
    return out


def _state_inputs(graph: Graph, combinable: Set[int]) -> list[tuple[int, int]]:
    """(argument, new value) tensor pairs `state_pairs` chooses from, from the graph alone: a
    floating-point array argument read only by ops in `combinable` (`problem.combinable_ops`), whose
    new value is an output of the same path and type."""
    readers = _readers(graph)
    return [(tin, tout) for tin, tout in _candidates(graph)
            if readers.get(tin) and all(o in combinable for o in readers[tin])]


def streamed(graph: Graph) -> Graph:
    """`graph` with its optimizer update in streaming order, `Graph.update_groups` set.

    From the first op that reads optimizer state (`_state_inputs`) on, each op belongs to the
    state leaves it depends on; leaves that meet in one op (a parameter's two Adam moments, in its
    update) form one group. The ops that depend on no state leaf come first, then each group's
    ops, groups in the order of their first op, each in program order: a topological order (an
    op's operands are in its own group or earlier). `graph` itself when fewer than two groups
    form, or when control flow or recomputation reaches into that range."""
    if graph.update_groups:
        return graph
    combinable = combinable_ops(graph)
    inputs = [t for t, _ in _state_inputs(graph, combinable)]
    if len(inputs) < 2:
        return graph
    wanted = set(inputs)
    start = next(op.index for op in graph.ops if wanted.intersection(op.tensor_inputs))
    # master parameters join their moments' groups (their reads before the update are casts)
    inputs += [t for t, _ in _param_inputs(graph, combinable)]
    if (any(r.end > start for rs in graph.regions.values() for r in rs)
            or any(g.end > start for g in graph.recompute.values())):
        return graph
    parent = {t: t for t in inputs}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    leaf_of = {t: t for t in inputs}  # tensor -> a state leaf it depends on
    for op in graph.ops[start:]:
        roots = {find(leaf_of[x]) for x in op.tensor_inputs if x in leaf_of}
        if roots:
            r = min(roots)
            for other in roots:
                parent[other] = r
            for t in op.outputs:
                leaf_of[t] = r
    free, groups = [], defaultdict(list)
    for op in graph.ops[start:]:
        owner = next((leaf_of[t] for t in op.outputs if t in leaf_of), None)
        (free if owner is None else groups[find(owner)]).append(op)
    if len(groups) < 2:
        return graph
    order = list(graph.ops[:start]) + free
    ranges = []
    for ops in groups.values():  # insertion order: the order of each group's first op
        ranges.append((len(order), len(order) + len(ops)))
        order += ops
    ops = tuple(dataclasses.replace(op, index=k) for k, op in enumerate(order))
    return dataclasses.replace(graph, ops=ops, update_groups=tuple(ranges))


def graph_for(graph: Graph, plan) -> Graph:
    """The graph `plan` was made for, from the step's trace: `streamed` when the plan offloads."""
    return streamed(graph) if plan.levers.offload is not None and plan.levers.offload.streamed else graph


def unavailable(hardware, devices: Sequence[Any] = ()) -> str | None:
    """Why host offload cannot be planned here, or None: a device without a "pinned_host" memory
    (`jax.Device.addressable_memories`), or hardware without a host link figure
    (`Hardware.host_bandwidth`, needed to price the copies)."""
    for d in devices[:1]:
        memories = getattr(d, "addressable_memories", None)
        kinds = sorted({m.kind for m in memories()}) if callable(memories) else []
        if HOST not in kinds:
            return (f"the {getattr(d, 'platform', '?')} devices have no {HOST!r} memory "
                    f"(their memory kinds: {', '.join(kinds) or 'none'})")
    if hardware.host_bandwidth is None:
        return f"hardware {hardware.name!r} has no host link bandwidth (Hardware.host_bandwidth) to price the copies"
    return None


def with_offload(problem: Problem, pairs: Sequence[tuple[int, int]]) -> Problem:
    """`problem` with `pairs` kept on the host: their device live ranges and transfer costs."""
    pairs = tuple(pairs)
    fused = fused_away(problem.graph, problem.unwritten, problem.combinable, problem.memory_platform,
                       problem.recomputed)
    base = live_ranges(problem.graph, problem.donated, fused) if problem.offloaded else problem.live
    copied = problem.memory_platform != "cpu"  # XLA:CPU reads host buffers in place: no copies
    reads = host_reads(problem.graph, problem.combinable, pairs) if copied else ()
    return dataclasses.replace(problem, offloaded=pairs, host_reads=reads, live=offloaded_live_ranges(
        problem.graph, base, pairs, fused, copied=copied, update=problem.combinable))


def _smallest_bytes(problem: Problem, tid: int) -> int:
    node = problem.nodes[problem.owner[tid]]
    return min(shard_bytes(problem.graph.tensors[tid], s, problem.cost.mesh) for s in set(node.owned[tid]))


# Solves spent narrowing the doubling's overshoot (`plan_offload`): each halves the gap between the
# most leaves that did not fit and the fewest that did.
_REFINE_SOLVES = 3


def plan_offload(problem: Problem, mode: str, budget: float | None, devices: Sequence[Any],
                 solve: Callable[[Problem, bool], Solution]) -> tuple[Problem, Solution]:
    """`_plan_offload`, whose offloaded state must fit the devices' shares of their hosts' memory
    (`Hardware.host_memory_per_device`; unchecked where the hardware gives no figure).

    Raises:
      InfeasiblePlanError: as `_plan_offload`, or the state kept in host memory does not fit there.
    """
    offloaded, solution = _plan_offload(problem, mode, budget, devices, solve)
    hardware = problem.cost.hardware
    room = hardware.host_memory_per_device
    if offloaded.offloaded and math.isfinite(room) and (need := host_bytes(offloaded, solution.choice)) > room:
        raise InfeasiblePlanError(
            f"the state offloaded to host memory needs {format_bytes(need)} per device, more than a "
            f"{hardware.name} host holds per device ({format_bytes(room)}: "
            f"{format_bytes(hardware.host_memory_bytes)} for {hardware.devices_per_host} devices); "
            "use more devices or offload='off'")
    return offloaded, solution


def host_bytes(problem: Problem, choice: Sequence[int]) -> float:
    """Bytes per device the plan `choice` keeps in host memory (the offloaded leaves, as sharded)."""
    graph = problem.graph
    return float(sum(shard_bytes(graph.tensors[t], problem.spec(t, choice), problem.cost.mesh)
                     for t, _ in problem.offloaded))


def _plan_offload(problem: Problem, mode: str, budget: float | None, devices: Sequence[Any],
                  solve: Callable[[Problem, bool], Solution]) -> tuple[Problem, Solution]:
    """The problem with the offloaded state `mode` asks for, and its solution.

    `solve(problem, search)` solves under the budget (`search`: run the minimum-peak search when it
    raises `InfeasiblePlanError`). "opt-state": every leaf of `state_pairs`. "auto": none when a
    plan fits `budget` (or there is none); otherwise the fewest leaves, largest first, whose
    offload brings `memory_bounds.memory_lower_bound` under the budget, twice as many until a solved plan
    fits, then up to `_REFINE_SOLVES` halvings of the overshoot (the fastest fitting plan kept).

    Raises:
      InvalidArgumentError: host offload is unavailable (`unavailable`), in one line.
      InfeasiblePlanError: no plan fits even with every optimizer-state leaf on the host.
    """
    if mode == "off":
        return problem, solve(problem, True)
    why = unavailable(problem.cost.hardware, devices)
    if why is not None:
        raise OffloadUnavailableError(f"offload={mode!r} is unavailable: {why}; use offload='off'")
    moments, params = state_pairs(problem), param_pairs(problem)
    pairs = moments + params if mode in ("opt-state+params", "auto") else moments
    if not pairs and mode.startswith("opt-state"):
        raise InvalidArgumentError(f"offload={mode!r}: the step has no optimizer state to offload (arguments read "
                                   "only by the update whose new value is returned under the same path)")
    if mode == "opt-state+params" and not params:
        log.warning("offload='opt-state+params': no master parameter qualifies (a float32 parameter read "
                    "before the update only through casts to the compute dtype); the moments alone go to the host")
    if mode.startswith("opt-state"):
        offloaded = with_offload(problem, pairs)
        return offloaded, solve(offloaded, True)
    if budget is None or not pairs:
        return problem, solve(problem, True)
    try:
        return problem, solve(problem, False)
    except InfeasiblePlanError:
        pass
    # moments first (one copy in per step), then master parameters (one more for their casts)
    order = [p for group in (moments, params)
             for p in sorted(group, key=lambda p: -_smallest_bytes(problem, p[0]))]  # stable: argument order on ties
    lo, hi = 1, len(order)  # the fewest leaves whose offload brings the lower bound under the budget
    while lo < hi:
        mid = (lo + hi) // 2
        if memory_lower_bound(with_offload(problem, order[:mid])).max() <= budget:
            hi = mid
        else:
            lo = mid + 1
    k, failed = lo, lo - 1
    while True:
        last = k == len(order)
        offloaded = with_offload(problem, order[:k])
        log.info("offload auto: %d of %d optimizer-state leaves to the host (%d master parameters)", k, len(order),
                 max(0, k - len(moments)))
        try:
            found = offloaded, solve(offloaded, last)
            break
        except InfeasiblePlanError as e:
            if last:
                raise e.reworded(f"{e} (with all {len(order)} optimizer-state leaves offloaded to the host)") from None
            failed, k = k, min(len(order), 2 * k)
    # the doubling overshoots (Llama-70B on 1x8 H100: 412 leaves did not fit, 824 left 14.5 GB free):
    # a few halvings of the gap, each fitting plan with fewer leaves kept where it is no slower
    for _ in range(_REFINE_SOLVES):
        mid = (failed + k) // 2
        if mid <= failed:
            break
        offloaded = with_offload(problem, order[:mid])
        try:
            solution = solve(offloaded, False)
        except InfeasiblePlanError:
            failed = mid
            continue
        k = mid
        if solution.objective_s <= found[1].objective_s:
            found = offloaded, solution
        log.info("offload auto: %d of %d optimizer-state leaves fit", k, len(order))
    return found


def record(problem: Problem, choice: Sequence[int], mode: str) -> OffloadRecord:
    """What the plan keeps of the offload (`plan.levers.offload`): the argument and
    output positions on the host (emission reads them), their paths, bytes per device and the
    copies' times as the objective counts them."""
    graph = problem.graph
    in_pos = {t: i for i, t in enumerate(graph.inputs)}
    out_pos = {t: i for i, t in enumerate(graph.outputs) if isinstance(t, int)}
    copy_in, copy_back = offload_transfer(problem, choice)
    host = host_bytes(problem, choice)
    return OffloadRecord(
        mode=mode,
        streamed=bool(graph.update_groups),
        inputs=tuple(sorted(in_pos[t] for t, _ in problem.offloaded)),
        outputs=tuple(sorted(out_pos[o] for _, o in problem.offloaded if o in out_pos)),
        paths=tuple(graph.input_paths[in_pos[t]] for t, _ in problem.offloaded),
        params=len({t for t, _ in problem.offloaded} & {t for t, _ in param_pairs(problem)}),
        host_reads=tuple(sorted({op for _, op, _ in host_reads(graph, problem.combinable, problem.offloaded)})),
        candidates=len(state_pairs(problem)) + (len(param_pairs(problem)) if mode != "opt-state" else 0),
        host_bytes_per_device=int(host),
        copy_in_s=copy_in,
        copy_back_s=copy_back,
        hidden_s=offload_hidden(problem, choice),
    )


def bounding_problem(problem: Problem, mode: str) -> Problem:
    """The problem whose `memory_bounds.memory_lower_bound` holds for every offload `mode` may choose:
    every optimizer-state leaf on the host unless offload is off (the mesh search bounds meshes
    with it before solving)."""
    if mode == "off":
        return problem
    return with_offload(problem, offloadable_pairs(problem, mode))


def offloadable_pairs(problem: Problem, mode: str) -> tuple[tuple[int, int], ...]:
    """(argument, new value) pairs offload `mode` may keep on the host: the optimizer state, and
    unless the mode keeps to it ("opt-state") the master parameters; none when offload is off."""
    if mode == "off":
        return ()
    return state_pairs(problem) + (param_pairs(problem) if mode != "opt-state" else ())
