"""Gradient accumulation in single-stage plans: k microbatches per step, planned and emitted.

A plain train step (`jax.value_and_grad` + an optimizer update, any signature: read by
`stages.derived.split_step`) runs as

    acc = 0 (float32, each gradient's planned layout)
    for each of k microbatches (a `lax.scan`):  forward + backward of the microbatch; acc += grads
    update once with acc / k; loss = mean of the k microbatch losses

inside one jitted program. Microbatch j holds rows j, j + k, j + 2k, ... of every batch array (a
reshape (B, ...) -> (B/k, k, ...) and a dynamic index on the second dim), so a batch split over
devices stays split the same way in every microbatch: no communication to form them. The loss
must be a mean over the batch rows (every zoo step's is): the mean of k microbatch means is the
full-batch mean.

Planning reuses the single-stage path unchanged: the step is traced at the microbatch size
(B/k rows) and planned by `make_plan` (the ILP, its memory constraints and its objective). From
that plan (prediction P, objective parts `plan.solver.step_parts`):

    time(k)   = k x (T - T_update) + T_update
    memory(k) = M + accumulator + batch

* T = P.step_time_s; T_update = the objective items of the optimizer update (op labels all of
  whose ops are update ops, `stages.clustering.op_phases`, and the optimizer state's argument
  nodes, into which the update's elementwise ops on that state are folded): they run once.
  The update's ops folded into a parameter's argument node (p - lr u follows p) stay in that
  node's item and are charged k times: an overestimate of (k-1) x that elementwise work.
  Everything else runs once per microbatch: forward/backward compute, their collectives (ZeRO-3
  parameter gathers k times), resharding, combined latencies, minus the hidden part (k times). The gradient
  reductions are paid k times as well: the emitted program reduces each microbatch's gradient
  before adding it (GSPMD loop carries hold no unreduced partial sums), and the cost says so.
* M = P.memory_bytes_per_device: the microbatch step's peak (arguments, one microbatch's
  activations, its gradients). accumulator = what a float32 accumulator adds to the gradients the
  microbatch step already holds, in the layout the plan gives each gradient (0 for float32
  gradients: the loop carry is the gradients' buffer, XLA adds each microbatch's gradient into it
  in place, as tests/test_accumulation.py checks on CPU); batch = k x the microbatch's bytes
  per device: the rest of the full batch argument ((k-1) x) plus the copy of the microbatch the
  loop body reads (the dynamic index copies its strided rows).

Selective unsharding (`unshard`, DeepCompile's term): a value the microbatch step reshards straight
from the arguments (a ZeRO-3 parameter's all-gather, `plan.solver.argument_reshards`) is the same
in every microbatch. Resharded once before the loop it saves (k - 1) x that resharding and holds
the resharded copy for the whole loop (added to memory(k)); the values with the most time saved per
byte are chosen while the budget allows. XLA's while-loop invariant code motion would hoist every
such resharding by itself (seen on XLA:CPU), so the ones not chosen are kept in the loop: their
arguments go through an `optimization_barrier` with the microbatch index.

With `memory_budget`, the microbatch step is planned under the budget less those extra bytes
(re-planned while the plan's own extra bytes do not fit, at most `_REPLANS` times).
`plan_accumulation` chooses k: for "auto" the divisors of the batch in ascending order, the
fastest that fits; it stops after the first fitting k whose next candidate is no faster
(step time grows with k once memory no longer binds). When nothing fits, it stops as soon as
two successive counts reach the same smallest peak (what is over the budget is not activations).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from planner.graph.batch_mixing import mixing_ops, summary
from planner.ilp.levers import RAISE
from planner.cost_model import ring_bytes
from planner.core.errors import InfeasiblePlanError, InvalidArgumentError, PlannerError
from planner.graph.ir import Graph, Tensor
from planner.graph.trace import trace
from planner.ilp.strategies import shard_bytes
from planner.core.mesh import MeshSpec
from planner.core.plan import Plan, Prediction
from planner.core.plan_records import AccumulationRecord, UnshardedValue
from planner.core.sharding import replicated
from planner.stages.derived import StepParts, split_step
from planner.core.units import format_bytes

log = logging.getLogger("planner")

__all__ = ["Accumulated", "accumulation_candidates", "combine", "micro_options", "plan_accumulation"]

_REPLANS = 3


@dataclasses.dataclass(frozen=True)
class Accumulated:
    """A planned accumulated step: the microbatch trace, its parts, the plan (prediction combined
    for k microbatches; `plan.levers.accumulation` records k and how) and k."""

    graph: Graph
    parts: StepParts
    plan: Plan
    k: int


def micro_options(options, budget: float | None):
    """The options the microbatch step is planned with: `budget`, no accumulation of its own, and no
    donated arguments. `combine` adds the accumulator to the microbatch plan's peak, which holds
    every gradient only when the state is not freed early; with the state donated that peak moves
    into the backward and the sum falls short of the compiled program's peak. The accumulated
    program is still emitted with the caller's donation."""
    return dataclasses.replace(options, memory_budget=budget, accumulate=1, donate_argnums=())


def _rows(graph: Graph, parts: StepParts) -> int:
    return graph.tensors[graph.inputs[parts.batch[0]]].shape[0]


def accumulation_candidates(rows: int) -> list[int]:
    """The microbatch counts that split `rows` batch rows evenly, ascending (1 = no accumulation)."""
    return [k for k in range(1, rows + 1) if rows % k == 0]


def _micro_args(graph: Graph, parts: StepParts, k: int) -> tuple:
    abstract = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (graph.tensors[i] for i in graph.inputs)]
    for p in parts.batch:
        x = abstract[p]
        abstract[p] = jax.ShapeDtypeStruct((x.shape[0] // k,) + tuple(x.shape[1:]), x.dtype)
    return tuple(jax.tree_util.tree_unflatten(graph.in_tree, abstract))


def _label(op) -> str:
    return f"{op.name} {op.name_stack}".strip()


def _update_labels(graph: Graph, parts: StepParts) -> frozenset[str]:
    """Objective item labels paid once per step: ops all of whose ops (by label) are update ops,
    and the optimizer state's argument nodes (`parts.extras` only the update reads: the update's
    elementwise ops on them are folded into those nodes)."""
    upd = set(parts.update)
    kinds: dict[str, set[bool]] = defaultdict(set)
    for op in graph.ops:
        kinds[_label(op)].add(op.index in upd)
    read_outside = {t for op in graph.ops if op.index not in upd for t in op.tensor_inputs}
    state = {f"input {graph.input_paths[k]}" for k in parts.extras if graph.inputs[k] not in read_outside}
    return frozenset(label for label, s in kinds.items() if s == {True}) | state


def grad_specs(graph: Graph, parts: StepParts, plan: Plan) -> list:
    """The planned layout of each parameter's gradient (replicated when the plan leaves it free)."""
    producers = graph.producers()
    planned = {(op, k): spec for op, k, spec in plan.op_specs}
    out = []
    for g in parts.grads:
        spec = planned.get(producers.get(g, (-1, 0)))
        out.append(spec if spec is not None else replicated(len(graph.tensors[g].shape)))
    return out


def extra_bytes(graph: Graph, parts: StepParts, plan: Plan, k: int) -> tuple[int, int]:
    """(accumulator, batch) bytes per device the k-microbatch program holds beyond the microbatch
    step's peak (module docstring)."""
    mesh = plan.mesh
    acc = sum(shard_bytes(Tensor(graph.tensors[g].shape, np.dtype(np.float32)), spec, mesh)
              - shard_bytes(graph.tensors[g], spec, mesh)
              for g, spec in zip(parts.grads, grad_specs(graph, parts, plan)))
    micro = sum(shard_bytes(graph.tensors[graph.inputs[p]], plan.input_specs[p], mesh) for p in parts.batch)
    return acc, k * micro if k > 1 else 0


def combine(graph: Graph, parts: StepParts, plan: Plan, k: int) -> Plan:
    """The microbatch plan with its prediction for k microbatches per step (module docstring) and
    `levers.accumulation` recording k, the microbatch's own figures and the parts added."""
    labels = _update_labels(graph, parts)
    items = plan.solver.step_parts.items
    once_compute = sum(it[2] for it in items if it[0] in labels)
    once_comm = sum(it[3] + it[4] for it in items if it[0] in labels)
    p = plan.prediction
    moved_once = sum(ring_bytes(c.kind, c.nbytes, c.group_size) for c in p.collectives if c.where in labels)
    acc, batch = extra_bytes(graph, parts, plan, k)
    pred = Prediction(
        step_time_s=k * p.step_time_s - (k - 1) * (once_compute + once_comm),
        compute_time_s=k * p.compute_time_s - (k - 1) * once_compute,
        communication_time_s=k * p.communication_time_s - (k - 1) * once_comm,
        memory_bytes_per_device=int(p.memory_bytes_per_device + acc + batch),
        bytes_moved_per_device=k * p.bytes_moved_per_device - (k - 1) * moved_once,
        collectives=p.collectives,
        hidden_communication_time_s=k * p.hidden_communication_time_s,
    )
    record = AccumulationRecord(
        microbatches=k, microbatch_rows=_rows(graph, parts), microbatch_step_time_s=p.step_time_s,
        update_time_s=once_compute + once_comm, microbatch_memory_bytes=p.memory_bytes_per_device,
        accumulator_bytes=acc, batch_bytes=batch, collectives="per microbatch (update collectives once)")
    return dataclasses.replace(plan, prediction=pred).with_levers(accumulation=record)


@dataclasses.dataclass(frozen=True)
class _Hoist:
    """A loop-invariant value the microbatch loop would reshard every iteration, resharded once."""

    tensor: int
    spec: Any  # the layout its readers read it in
    ops: tuple[int, ...]  # the ops computing it from the arguments (run once, before the loop)
    saving_s: float  # (k - 1) x the resharding's time
    moved: int  # (k - 1) x its bytes moved per device
    extra: int  # bytes per device the resharded copy holds for the whole loop


def _invariant_ops(graph: Graph, parts: StepParts) -> set[int]:
    """Ops of the microbatch step (not the update) computed from the non-batch arguments and
    constants alone: the same in every microbatch."""
    upd = set(parts.update)
    known = (set(graph.inputs) - {graph.inputs[p] for p in parts.batch}) | set(graph.consts)
    ops = set()
    for op in graph.ops:
        if op.index not in upd and all(t in known for t in op.tensor_inputs):
            ops.add(op.index)
            known.update(op.outputs)
    return ops


def hoistable(graph: Graph, parts: StepParts, plan: Plan, k: int) -> list[_Hoist]:
    """Selective unsharding's candidates (DeepCompile): each loop-invariant value (an argument such
    as a sharded parameter, or what is computed from it alone, such as its bfloat16 cast) that the
    microbatch step reshards before reading it (`plan.solver.argument_reshards`; a ZeRO-3
    parameter's all-gather), when every reader in the microbatch step reads it in one layout: resharded
    once before the loop instead of k times, at the cost of holding that copy for the whole loop."""
    if k < 2:
        return []
    inside = {i for regions in graph.regions.values() for r in regions for i in range(r.start, r.end)}
    invariant = _invariant_ops(graph, parts) - inside  # a loop's or branch's ops run with it
    producers = graph.producers()
    made_by = {t: producers[t][0] for t in producers}
    reads = {(op, pos): spec for op, pos, spec in plan.operand_specs}
    upd = set(parts.update)
    by_tensor: dict[int, list] = defaultdict(list)
    for op, pos, tensor, seconds, moved in plan.solver.argument_reshards or ():
        by_tensor[tensor].append((op, pos, seconds, moved))
    consumers = graph.consumers()
    out = []
    for tensor, edges in by_tensor.items():
        if tensor in made_by and made_by[tensor] not in invariant:
            continue
        specs = {reads.get((op, pos)) for op, pos, _, _ in edges}
        readers = {(c, pos) for c, pos in consumers.get(tensor, ()) if c not in upd}
        if len(specs) != 1 or None in specs or readers != {(op, pos) for op, pos, _, _ in edges}:
            continue
        ops, todo = set(), [tensor]
        while todo:
            t = todo.pop()
            if t in made_by and made_by[t] not in ops:
                ops.add(made_by[t])
                todo.extend(graph.ops[made_by[t]].tensor_inputs)
        if not ops <= invariant:
            continue
        spec = specs.pop()
        out.append(_Hoist(tensor, spec, tuple(sorted(ops)), (k - 1) * sum(e[2] for e in edges),
                          (k - 1) * sum(e[3] for e in edges), shard_bytes(graph.tensors[tensor], spec, plan.mesh)))
    return out


def unshard(graph: Graph, parts: StepParts, plan: Plan, k: int, budget: float | None, enabled: bool = True) -> Plan:
    """`combine`'s plan with selective unsharding (DeepCompile): of the `hoistable` values, those
    with the most resharding time saved per byte held, while the budget allows (all of them without
    one), are resharded once before the microbatch loop; the prediction loses their (k - 1)
    repeated reshardings and holds their copies for the loop. The others stay in the loop:
    XLA's while-loop invariant code motion would hoist them too (on XLA:CPU a ZeRO-3 parameter's
    all-gather leaves the loop by itself), so the emitted loop reads their arguments
    through an `optimization_barrier` with the microbatch index, which keeps them in it, as
    predicted. `levers.accumulation` records both (`unsharded`, `resharded_per_microbatch`)."""
    found = hoistable(graph, parts, plan, k)
    if not found:
        return plan
    chosen, used = [], plan.prediction.memory_bytes_per_device
    for h in sorted(found, key=lambda h: (-h.saving_s / max(1, h.extra), h.tensor)) if enabled else ():
        if budget is None or used + h.extra <= budget:
            chosen.append(h)
            used += h.extra
    kept = [h for h in found if h not in chosen]
    names = dict(zip(graph.inputs, graph.input_paths))
    arguments = set(graph.inputs)
    record = dataclasses.replace(
        plan.levers.accumulation,
        unsharded=tuple(UnshardedValue(h.tensor, names.get(h.tensor) or _label(graph.ops[h.ops[-1]]),
                                       tuple(tuple(a) for a in h.spec), tuple(h.ops), h.saving_s, h.extra)
                        for h in chosen),
        resharded_per_microbatch=tuple(sorted(
            {t for h in kept for t in ([h.tensor] if h.tensor in arguments else
                                       [x for i in h.ops for x in graph.ops[i].tensor_inputs if x in arguments])})))
    p = plan.prediction
    saved = sum(h.saving_s for h in chosen)
    pred = dataclasses.replace(
        p, step_time_s=p.step_time_s - saved, communication_time_s=p.communication_time_s - saved,
        memory_bytes_per_device=int(used),
        bytes_moved_per_device=p.bytes_moved_per_device - sum(h.moved for h in chosen))
    return dataclasses.replace(plan, prediction=pred).with_levers(accumulation=record)


def _fits(plan: Plan, budget: float | None) -> bool:
    return budget is None or plan.prediction.memory_bytes_per_device <= budget


def _plan_k(fn, graph: Graph, parts: StepParts, k: int, budget: float | None,
            plan_micro: Callable[[Graph, float | None], tuple[Graph, Plan]], mesh: MeshSpec,
            unsharding: bool = True) -> Accumulated:
    """Plans k microbatches; raises InfeasiblePlanError (min_memory_bytes for the whole program)."""
    if k == 1:
        planned, plan = plan_micro(graph, budget)
        plan = plan.with_levers(accumulation=AccumulationRecord(microbatches=1, microbatch_rows=_rows(graph, parts)))
        return Accumulated(planned, parts if planned is graph else split_step(planned), plan, 1)
    mgraph = trace(fn, *_micro_args(graph, parts, k), user_constraints=graph.user_constraints)
    mparts = split_step(mgraph)
    if (mparts.params, mparts.batch) != (parts.params, parts.batch):
        raise InvalidArgumentError(f"gradient accumulation: the step's structure changes with the batch size "
                                   f"({_rows(mgraph, mparts)} rows)")
    inner = budget
    best: int | None = None
    for _ in range(_REPLANS):
        try:
            planned, mplan = plan_micro(mgraph, inner)  # the microbatch step, rewritten if it recomputes
        except InfeasiblePlanError as e:
            extra = sum(_smallest_extra(mgraph, mparts, k, mesh))
            found = None if e.min_memory_bytes is None else e.min_memory_bytes + extra
            if best is not None:
                found = best if found is None else min(found, best)
            raise InfeasiblePlanError(str(e), found,
                                      None if e.lower_bound_bytes is None else e.lower_bound_bytes + extra) from None
        pparts = mparts if planned is mgraph else split_step(planned)
        plan = unshard(planned, pparts, combine(planned, pparts, mplan, k), k, budget, unsharding)
        if _fits(plan, budget):
            return Accumulated(planned, pparts, plan, k)
        used = plan.prediction.memory_bytes_per_device
        best = used if best is None else min(best, used)
        inner = budget - sum(extra_bytes(planned, pparts, mplan, k))
        if inner <= 0:
            break
    raise InfeasiblePlanError(f"no plan with {k} microbatches fits: the smallest found needs {format_bytes(best)}",
                              best)


def _smallest_extra(graph: Graph, parts: StepParts, k: int, mesh: MeshSpec) -> tuple[int, int]:
    """The accumulator and batch bytes at their smallest layouts (every mesh axis that divides a
    dim splits it): what the k-microbatch program adds to the microbatch step's minimum, at best."""
    f32 = np.dtype(np.float32)
    acc = sum(_min_shard(Tensor(graph.tensors[g].shape, f32), mesh) - _min_shard(graph.tensors[g], mesh)
              for g in parts.grads)
    micro = sum(_min_shard(graph.tensors[graph.inputs[p]], mesh) for p in parts.batch)
    return acc, k * micro if k > 1 else 0


def _min_shard(t: Tensor, mesh: MeshSpec) -> int:
    local = list(t.shape)
    shards = 1
    for size in sorted((s for s in mesh.shape if s > 1), reverse=True):
        for d in sorted(range(len(local)), key=lambda d: -local[d]):
            if local[d] % size == 0:
                local[d] //= size
                shards *= size
                break
    return t.nbytes // shards


def plan_accumulation(fn: Callable[..., Any], graph: Graph, accumulate: int | str, budget: float | None,
                      plan_micro: Callable[[Graph, float | None], tuple[Graph, Plan]], mesh: MeshSpec,
                      unsharding: bool = True, smallest: int = 1, ceiling: float = math.inf) -> Accumulated:
    """Plans `fn` (traced as `graph` at the full batch) with `accumulate` microbatches per step
    (an int k, or "auto": the fastest k that fits `budget`).

    Args:
      plan_micro: (microbatch graph, memory budget) -> (the graph planned: the microbatch graph,
        or it rewritten by recomputation; its single-stage plan), `planning.composition`; raises
        InfeasiblePlanError when nothing fits.
      mesh: the mesh (or, for a mesh search, a 1-D mesh of all devices) on which the extra
        buffers' smallest layouts are counted in an infeasible answer's minimum.
      unsharding: selective unsharding of loop-invariant reshardings (`unshard`).
      smallest: under "auto", the fewest microbatches tried (2: the caller planned the step itself).
      ceiling: under "auto", the step time of a plan found without accumulation (the caller's, which
        weighs accumulation against it): the first count that fits but is no faster ends the
        search. A rule, not a proof: each further count repeats the per-microbatch work (parameter
        gathers, launches, collectives' latency) more often and only gains memory, which the
        count that fit no longer needed; it halves what weighing accumulation costs where it
        loses (Llama-2-70B b128 on 8x8 H100: 2 then 4 microbatches, each a recomputation search,
        both slower than the single step).

    Raises:
      InvalidArgumentError: a step that cannot be split (one line saying why), or k not dividing
        the batch.
      InfeasiblePlanError: no k tried fits; the message gives the smallest peak found per k.
    """
    try:
        parts = split_step(graph)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(str(e).replace("cannot pipeline", "cannot accumulate gradients over")
                                   .replace("to pipeline it", "to accumulate gradients")) from None
    rows = _rows(graph, parts)
    if accumulate == "auto":
        candidates = [k for k in accumulation_candidates(rows) if k >= smallest]
    else:
        if rows % accumulate:
            raise InvalidArgumentError(f"accumulate={accumulate} does not divide the batch of {rows} rows; "
                                       f"choose one of {accumulation_candidates(rows)}")
        candidates = [accumulate]
    found: list[Accumulated] = []
    failed: dict[int, PlannerError] = {}
    for k in candidates:
        try:
            done = _plan_k(fn, graph, parts, k, budget, plan_micro, mesh, unsharding)
        except InvalidArgumentError:
            raise
        except PlannerError as e:  # over the budget, or the solver found no plan within its limit
            failed[k] = e
            if not found and _not_shrinking(failed):
                break  # what does not fit does not shrink with the microbatch: more microbatches cannot help
            continue
        if found and done.plan.prediction.step_time_s >= found[-1].plan.prediction.step_time_s:
            found.append(done)
            break
        if done.plan.prediction.step_time_s >= ceiling:
            found.append(done)
            log.info("gradient accumulation: %d microbatches fit at %.4g s/step, no faster than %.4g s/step "
                     "without: no more counts weighed", k, done.plan.prediction.step_time_s, ceiling)
            break
        found.append(done)
        if len(found) >= 2:
            break
    if found:
        best = min(found, key=lambda a: a.plan.prediction.step_time_s)
        if best.k > 1:
            _say_if_mixing(graph, parts, best.k)
        return best
    raise infeasible(failed, budget)


def step_mixing(graph: Graph, parts: StepParts) -> tuple:
    """The ops of the step's forward that mix the examples of its batch (`batch_mixing.mixing_ops`
    from its batch arguments to its loss): none for a microbatch-invariant step."""
    return mixing_ops(graph, [graph.inputs[i] for i in parts.batch], parts.loss, parts.forward)


def step_parts(graph: Graph) -> StepParts | None:
    """The step's parts (`stages.derived.split_step`), computed once per graph; None when the step
    cannot be split (then it is not split into microbatches by default)."""
    def split() -> StepParts | None:
        try:
            return split_step(graph)
        except InvalidArgumentError:
            return None

    return graph.cached(("split_step",), split)


def why_microbatch_variant(graph: Graph) -> str | None:
    """None when the step is proven microbatch-invariant (one batch size over its batch arguments,
    and no op of its forward mixes their examples, `step_mixing`); otherwise why not, in words.
    The levers that split the batch (accumulation, pipeline microbatches) are only on by default
    for an invariant step."""
    def why() -> str | None:
        parts = step_parts(graph)
        if parts is None:
            return "its loss and update could not be told apart (`planner.stages.derived`)"
        if len({graph.tensors[graph.inputs[i]].shape[0] for i in parts.batch}) != 1:
            return "its batch arguments differ in their leading size"
        found = step_mixing(graph, parts)
        return f"it mixes the examples of its batch: {summary(found)}" if found else None

    return graph.cached(("microbatch_variant",), why)


def _say_if_mixing(graph: Graph, parts: StepParts, k: int) -> None:
    """One log line when the step's forward mixes the examples of its batch (`batch_mixing`): its
    accumulated result then legitimately differs from the step's on the whole batch."""
    found = step_mixing(graph, parts)
    if found:
        log.warning("the step is not microbatch-invariant: %s; accumulating gradients over %d microbatches "
                    "computes it per microbatch, so its loss and gradients differ from the whole batch's",
                    summary(found), k)


def _not_shrinking(failed: Mapping[int, PlannerError]) -> bool:
    """The last two microbatch counts tried reach the same smallest peak (or the later a larger one)."""
    ks = list(failed)
    if len(ks) < 2:
        return False
    a, b = (getattr(failed[k], "min_memory_bytes", None) or getattr(failed[k], "lower_bound_bytes", None)
            for k in ks[-2:])
    return a is not None and b is not None and b >= a


def infeasible(failed: Mapping[int, PlannerError], budget: float | None) -> PlannerError:
    """One error for every microbatch count tried: the smallest per-device peak found and where
    (an InfeasiblePlanError; the one error itself when a single count failed for another reason)."""
    peaks = {k: e.min_memory_bytes for k, e in failed.items() if getattr(e, "min_memory_bytes", None) is not None}
    floors = [e.lower_bound_bytes for e in failed.values() if getattr(e, "lower_bound_bytes", None) is not None]
    if len(failed) == 1 and not isinstance(next(iter(failed.values())), InfeasiblePlanError):
        return next(iter(failed.values()))
    best_k = min(peaks, key=peaks.get) if peaks else None
    text = (f"no plan fits the memory budget of {format_bytes(budget) if budget else 'no limit'} per device with "
            f"gradient accumulation over {len(failed)} microbatch count(s) ({', '.join(map(str, failed))})")
    if best_k is not None:
        text += f": the smallest per-device peak found is {format_bytes(peaks[best_k])} with {best_k} microbatch(es)"
    if floors:
        text += f"; none can go below {format_bytes(min(floors))}"
    other = {k: e for k, e in failed.items() if not isinstance(e, InfeasiblePlanError)}
    if other:
        text += "; not planned: " + "; ".join(f"{k} microbatch(es): {str(e).splitlines()[0]}" for k, e in other.items())
    text += f"; tried: sharding every tensor, gradient accumulation. {RAISE}"
    return InfeasiblePlanError(text, peaks.get(best_k) if best_k is not None else None,
                               min(floors) if floors else None)


