"""One layer's cost on one logical mesh: the intra-op ILP's plan of the layer alone.

Alpa compiled and profiled every (layer range, submesh) pair; here each distinct layer is planned
by the intra-op ILP (`make_plan`) on the subgraph of its forward and backward ops at the microbatch
size, plus a one-op stand-in for each parameter's update (`param + grad`, tied to the parameter,
so the plan stores parameters where their update is cheap). A range of layers then costs the sum
of its layers' times, and its memory is assembled from theirs (`stage_cost`).

Per layer and logical mesh the plan gives:
  time_s      forward + backward time of one microbatch (compute and collectives, ILP prediction)
              without the data-parallel gradient reduction,
  sync_s      that gradient reduction, once per step (see below),
  apply_s     the optimizer update once per step (roofline of the update ops, sharded like the params),
  state_bytes parameters + gradient accumulator + optimizer state per device,
  act_bytes   activations kept from forward to backward, per microbatch in flight, per device,
  work_bytes  transient working memory of the layer's step beyond those;
and the same for the sharded-state layout (`zero_*`: every parameter split over every device of
the stage, `zero_spec`, the plan's layout all-gathered before the forward and the backward).

Gradients are accumulated over the microbatches on each data-parallel replica and reduced once per
step, before the update (as Megatron-LM and any gradient-accumulating trainer do), so the layer's
data-parallel gradient reduction is taken out of its per-microbatch time (`grad_sync`): the
collectives the plan predicts with reason "partial sum" over only the axes that split the
layer's batch dimension (dim 0 of its non-parameter inputs), i.e. the reductions of batch
contractions (weight, bias and norm-scale gradients; the loss mean's scalar one too). They are
priced as the ILP priced them (combined: bandwidth per collective, one latency per (kind, axes)
group); the per-microbatch time drops by their exposed part (their time beyond the communication
the plan hides behind compute, which they are first to use), and `sync_s` keeps all of it, exposed:
the stage pays it once after its last backward (`candidate.once_per_step_max`), not overlapped
with other stages' remaining backwards (a simplification, stated). The layer's ILP itself plans
for the whole step (`make_plan(microbatches=B)`): it weighs each gradient all-reduce at 1/B of its
time, exposed (`mesh_plan.reductions_weighed`; a reduce-scatter, which splits the parameter, keeps
its whole time), so that it does not trade a reduction paid once per step for per-microbatch
collectives that merely cost less for one microbatch (with float32 partial sums, the exact
default, a 145.6B GPT block on 24x8 A100s chose an all-to-all of its activations and a
per-microbatch all-gather of each gradient over the data axis instead: 3x slower at 96
microbatches); the prediction it returns prices one microbatch with them in full, as above. An
all-reduce over an axis that does not split the batch (a sequence split) is weighed so too but
priced per microbatch, as the runtime runs it, and so is every reduction of a plan that splits a
parameter over a data axis. A hand layout's solve keeps every all-reduce over its parameters' axes
whole (`make_plan(whole_axes=)`: the runtime runs them every microbatch). A plan whose weighed
objective is below its price by more than the gap is weighed against the layer's one-microbatch
plan, the cheaper step kept (`_discounted_per_microbatch`). Gradients the plan exchanges as
int8 over data axes (comm_precision "int8") move their quantisation with them: the ILP charges it
per microbatch, the runtime quantises each replica's accumulated gradient once per step
(`replica_quantisation`, `planner.emit.wire.reduce_replicas`).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import jax.numpy as jnp
import numpy as np
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from planner.cost_model import Hardware, get_hardware
from planner.core.errors import MeshError, PlannerError
from planner.core.options import PlanOptions
from planner.core.plan import PredictedCollective
from planner.core.sharding import Spec, active_axes, optimizer_spec, replicated, spec_axes
from planner.graph.ir import Graph
from planner.ilp.strategies import shard_bytes
from planner.ilp.problem import Problem
from planner.search.mesh_plan import cost_model_for, make_plan, plan_problem
from planner.stages.clustering import APPLY, Layers, op_phases
from planner.stages.data_axes import batch_axes, grad_sync, never_data, replica_quantisation
from planner.stages.layer_facts import LayerFacts, subgraph
from planner.stages.submesh import LogicalMesh

log = logging.getLogger("planner")

# The relative gap at which a layer's ILP stops ((plan - bound) / plan, CP-SAT's measure): its plan
# at most about 2% over the layer's optimum (a stage's time is a sum of its layers', so it too).
# CP-SAT finds these optima in well under a second and then may spend tens of seconds proving them;
# wider gaps move layer plans enough to change which microbatch counts fit (WORKSPACE.md, Design
# decisions, the solver's parameters).
LAYER_GAP = 0.02


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCost:
    """Predicted cost of one layer on one logical mesh (see the module docstring).

    Attributes:
      fwd_fraction: the forward's share of the layer's FLOPs (what rematerialisation repeats).
      input_specs: the plan's sharding of each external input of the layer's subgraph, in the
        subgraph's input order (identical layers list their inputs in the same order).
      zero_extra_s: extra all-gather time per microbatch of the sharded-state layout.
      zero_state_bytes: state bytes per device of the sharded-state layout.
      zero_specs: per external input, its sharded-state layout (None: not a parameter).
      sync_s: the data-parallel gradient reduction, once per step (not in `time_s`).
      comm_s: the exposed communication inside `time_s` (the plan's exposed communication without
        the part of the gradient reduction taken out to `sync_s`).
      hidden_s: communication the plan hides behind compute, per microbatch.
      data_axes: names of the mesh axes splitting the layer's batch (`batch_axes`).
      collectives: the layer plan's predicted collectives per microbatch (what a pipeline plan lists
        for the stage when the stage programs cannot be built, `planned.to_plan`).
      zero_collectives: the sharded-state layout's parameter all-gathers per microbatch (each
        gathered parameter twice: forward and backward), priced as `zero_extra_s` prices them.
      param_axes: names of the mesh axes splitting any of the layer's parameters: where one is a
        data axis of the stage holding the layer, the pipeline runtime reduces the whole stage's
        gradients every microbatch (`stage_columns.split_ranges`, `selection._replica_fallback`); one
        of the layer's own data axes puts its own reduction in `time_s` already.
      opt_state_bytes, opt_apply_s, opt_sync_s: state bytes per device, the update and the
        once-per-step gradient exchange of the sharded-optimizer layout (`optimizer_layout`).
      opt_host_bytes: the optimizer state's share of `opt_state_bytes` (what the
        offloaded-optimizer layout keeps in host memory between updates).
      opt_host_leaf_bytes: the largest one parameter's share of `opt_host_bytes` (what a streamed
        update, one parameter at a time, copies in at once).
      master_bytes, master_cast_bytes, master_leaf_bytes: per device, the layer's master parameters
        (read before the update only by casts to one narrower float, `master_params`) as the plan lays
        them out, their cast copies, and the largest one's bytes (what the offloaded-optimizer
        layout's `StageOption.offload_params` keeps in host memory).
      produced_specs: the plan's sharding of each value the layer makes that is used outside it,
        keyed by (position of the making op among the layer's ops, result index), so that identical
        layers key alike (`LayerCostTable.inner`: resharding between layers of one stage).
    """

    time_s: float
    apply_s: float
    state_bytes: float
    act_bytes: float
    work_bytes: float
    fwd_fraction: float = 0.0
    input_specs: tuple[Spec | None, ...] = ()
    zero_extra_s: float = 0.0
    zero_state_bytes: float = 0.0
    zero_work_bytes: float = 0.0
    zero_specs: tuple[Spec | None, ...] = ()
    sync_s: float = 0.0
    produced_specs: Mapping[tuple[int, int], Spec] = dataclasses.field(default_factory=dict)
    comm_s: float = 0.0
    hidden_s: float = 0.0
    data_axes: frozenset[str] = frozenset()
    collectives: tuple = ()
    zero_collectives: tuple = ()
    param_axes: frozenset[str] = frozenset()
    opt_state_bytes: float = 0.0
    opt_apply_s: float = 0.0
    opt_sync_s: float = 0.0
    opt_host_bytes: float = 0.0
    opt_host_leaf_bytes: float = 0.0
    master_bytes: float = 0.0
    master_cast_bytes: float = 0.0
    master_leaf_bytes: float = 0.0


# A layer that cannot be planned on a mesh (a pin the mesh cannot take, or no plan): never chosen.
INFEASIBLE = LayerCost(math.inf, math.inf, math.inf, math.inf, math.inf, 0.0, (), math.inf, math.inf, math.inf, (),
                       math.inf)


def zero_spec(shape: tuple[int, ...], spec: Spec, mesh) -> Spec:
    """`spec` with every mesh axis it leaves unused added to a dimension it divides (largest first)."""
    out = [list(axes) for axes in spec]
    used = {a for axes in spec for a in axes}
    for a in active_axes(mesh):
        if a in used:
            continue
        for d in sorted(range(len(shape)), key=lambda d: -shape[d] // max(1, mesh.axis_size(out[d]))):
            have = mesh.axis_size(out[d])
            if (shape[d] // have) % mesh.shape[a] == 0 and shape[d] % have == 0:
                out[d].append(a)
                break
    return tuple(tuple(axes) for axes in out)


def layer_cost(graph: Graph, layers: Layers, facts: LayerFacts, layer: int, lmesh: LogicalMesh,
               hardware: str | Hardware, options: PlanOptions, pinned: Mapping[int, Spec] | None = None,
               microbatches: int = 1) -> LayerCost:
    """The layer planned alone on `lmesh` with the inputs `pinned` fixes, for a step of `microbatches`
    microbatches (see the module docstring)."""
    return layer_step_cost(graph, layers, facts, layer, lmesh, hardware, options, pinned, microbatches)[0]


@dataclasses.dataclass(frozen=True, slots=True)
class StepSolve:
    """A layer's solve at `microbatches` (`layer_step_cost`), kept so that another count of the same
    microbatch size (another batch size of the step) takes a plan without a solve where that plan is
    provably within the gap there (`reuse`).

    The step-weighted objective of every plan is affine in the share s = 1/B it weighs the plan's
    all-reduces at, where no strategy of the layer's ILP quantises (`affine`: `make_plan`'s
    `weighed_once_s` holds the slope of the chosen plan; only costs move with the share, the hidden
    capacity does not), and no plan's objective falls as the share grows. So the least objective
    V(s) is non-decreasing and concave (a minimum of affine functions): a solve's bound at s bounds V
    at every larger share, and two solves' bounds at s_a < s_b bound V between them by their chord.
    The one-microbatch solve (`microbatches` 1, `once_s` None: a bound only) solves the plain ILP,
    whose combinable all-reduces may hide where the weighed ILP at share 1 keeps them exposed, so
    each plan's plain objective is at most its weighed one (hiding less never shortens the step,
    `objective.hidden_time`) and its bound bounds V(1).
    """

    microbatches: int
    objective_s: float
    bound_s: float
    once_s: float | None  # None: the one-microbatch solve, whose objective is not the weighed one
    found: LayerCost  # the solve's plan's cost
    affine: bool = True

    @property
    def share(self) -> float:
        return 1.0 / self.microbatches


def step_bound(solves: Sequence[StepSolve], share: float) -> float | None:
    """A lower bound on every plan's step-weighted objective at `share` from `solves` of the same
    layer (see `StepSolve`), or None where none bounds it."""
    best = max((s.bound_s for s in solves if s.share <= share), default=None)
    for a in solves:
        for b in solves:
            if a.affine and b.affine and a.share <= share < b.share:
                chord = a.bound_s + (share - a.share) / (b.share - a.share) * (b.bound_s - a.bound_s)
                best = chord if best is None else max(best, chord)
    return best


def reuse(solves: Sequence[StepSolve], microbatches: int, alone: Callable[[], LayerCost]) -> LayerCost | None:
    """The layer's cost for `microbatches` (> 1) from earlier `solves` of the same layer at other
    counts, or None where it needs a solve: the plan of least objective here among theirs (each
    plan's objective is affine in the share, `once_s` its slope), where it is within the gap of
    `step_bound`. `alone`: the layer's one-microbatch cost (`layer_cost` at one microbatch), where
    needed."""
    if microbatches <= 1:
        return None
    share = 1.0 / microbatches
    priced = [(s.objective_s + (share - s.share) * s.once_s, s) for s in solves if s.once_s is not None]
    bound = step_bound(solves, share)
    if not priced or bound is None:
        return None
    objective, best = min(priced, key=lambda p: p[0])
    if objective - bound > LAYER_GAP * objective:
        return None
    return _cheaper_step(best.found, objective, microbatches, alone)


def layer_step_cost(graph: Graph, layers: Layers, facts: LayerFacts, layer: int, lmesh: LogicalMesh,
                    hardware: str | Hardware, options: PlanOptions, pinned: Mapping[int, Spec] | None = None,
                    microbatches: int = 1, alone: Callable[[Problem], LayerCost] | None = None,
                    problem: Problem | None = None, keep: Callable[[Callable[[], Problem]], Problem] | None = None,
                    cost_models: dict | None = None) -> tuple[LayerCost, StepSolve | None]:
    """`layer_cost`, with the solve's `StepSolve` (None: no plan, or a step-weighted solve whose
    objective is not affine in the share or that has no bound). `alone`: the layer's
    one-microbatch cost where the caller keeps it (planned here otherwise), given the layer's ILP
    (`problem`: the same at every count, built once for both solves where both are needed;
    `keep`: where given, the caller's store of layer ILPs for later batch sizes of the shape family,
    `keep(make)` the one it keeps for this layer, made by `make` where it keeps none yet;
    `cost_models`: the caller's ILP cost models, `mesh_plan.cost_model_for(memo=)`)."""
    # once per layer: every mesh's ILP of it then shares the subgraph's memos (fusions, signatures, live ranges)
    sub, ext = graph.cached(("layer_subgraph", layers, layer), lambda: subgraph(
        graph, facts.ops, f"{layers.names[layer]}/", facts.param_grads, facts.exported))
    if not sub.ops:
        return LayerCost(0.0, 0.0, 0.0, 0.0, 0.0), None
    cost = lmesh.cost_model(get_hardware(hardware))
    opts = dataclasses.replace(options, memory_budget=None, pipeline=False, tie_outputs=True,
                               inter_host_axes=lmesh.host_axes, hardware=hardware,
                               donate_argnums=())  # a layer's subgraph: no step arguments of its own
    pins = {j: pinned[t] for j, t in enumerate(ext) if pinned and t in pinned} or None
    refused = [v for v in (pins or {}).values() if isinstance(v, Exception)]
    if refused:  # a pinned leaf this mesh cannot hold as pinned
        log.info("layer %s on %s: %s", layers.names[layer], lmesh.mesh, refused[0])
        return INFEASIBLE, None
    # a hand layout's parameter axes: their all-reduces run every microbatch (`splits_data`, or a
    # tensor axis's sequence split), so the step-weighted solve keeps them whole
    whole = frozenset().union(*(spec_axes(pinned[t]) for t in ext if t in pinned and t in facts.param_inputs)
                              ) if pins else frozenset()
    whole |= never_data(graph, ext, facts.param_inputs, lmesh.mesh) if microbatches > 1 else frozenset()
    try:
        if problem is None:
            def make() -> Problem:
                return plan_problem(sub, lmesh.mesh, opts, pins=pins,
                                    cost=cost_model_for(lmesh.mesh, opts, memo=cost_models))
            problem = make() if keep is None else keep(make)
        plan = make_plan(sub, lmesh.mesh, opts, pins=pins, problem=problem, lp_level=2,
                         gap=LAYER_GAP, microbatches=microbatches, whole_axes=whole)  # small ILPs: `ilp.solver.solve`
        weighed = _from_plan(graph, layers, facts, layer, lmesh, cost, sub, ext, plan)

        def one_microbatch() -> LayerCost:
            # the step-weighted solve weighed at 1/microbatches what the price does not discount so
            # (`_discounted_per_microbatch`): the layer's one-microbatch plan may be cheaper
            log.info("layer %s on %s: its plan for %d microbatches is priced above what its solve weighed; "
                     "planned for one microbatch too", layers.names[layer], lmesh.mesh, microbatches)
            return alone(problem) if alone is not None else _from_plan(
                graph, layers, facts, layer, lmesh, cost, sub, ext,
                make_plan(sub, lmesh.mesh, opts, pins=pins, problem=problem, lp_level=2, gap=LAYER_GAP))

        found = weighed if microbatches == 1 else _cheaper_step(weighed, plan.solver.objective_s, microbatches,
                                                                 one_microbatch)
        return found, _step_solve(plan.solver, problem, microbatches, weighed)
    except (MeshError, PlannerError) as e:
        log.info("layer %s on %s: %s", layers.names[layer], lmesh.mesh, e)
        return INFEASIBLE, None


def _step_solve(st, problem: Problem, microbatches: int, found: LayerCost) -> StepSolve | None:
    """The solve's record for other counts (`StepSolve`), or None where it has no bound, or its
    weighed objective is not affine in the share (`weighed_once_s` None)."""
    if None in (st.objective_s, st.gap) or (microbatches > 1 and st.weighed_once_s is None):
        return None
    affine = not any(q for node in problem.nodes for q in node.quantise_s)
    return StepSolve(microbatches, st.objective_s, st.objective_s * (1.0 - st.gap),
                     st.weighed_once_s if microbatches > 1 else None, found, affine)


def _cheaper_step(found: LayerCost, objective: float | None, microbatches: int,
                  alone: Callable[[], LayerCost]) -> LayerCost:
    """`found` (a step-weighted plan's cost whose solve's objective was `objective`), or the layer's
    one-microbatch cost (`alone`, asked for only then) where `_discounted_per_microbatch` says the
    solve may have discounted `found` and the one-microbatch plan's step is cheaper."""
    if not _discounted_per_microbatch(objective, found, microbatches):
        return found
    one = alone()
    return one if microbatches * one.time_s + one.sync_s < microbatches * found.time_s + found.sync_s else found


def _discounted_per_microbatch(weighed: float | None, found: LayerCost, microbatches: int) -> bool:
    """Whether the step-weighted solve (`make_plan(microbatches=)`) may have chosen the layer's plan
    for a discount its price does not give, by more than the gap: the layer's price per microbatch
    (`found.time_s` and its share of `found.sync_s`) above the solve's objective `weighed` by more
    than the gap. The solve weighs at 1/microbatches every combinable all-reduce over axes it was not told
    to keep whole (`whole_axes`: a hand layout's parameter axes); the price defers only those over
    the layer's data axes, and none where the layer splits a parameter over a data axis
    (`splits_data`); it also gives the deferred reductions only their exposed part (they are first
    to use the hidden capacity, see the module docstring) where the weighed solve lets the other
    collectives hide in their place. Llama-70B's megatron-tp layer on 8x8 H100 at 16-row
    microbatches of 128: 0.01806 s per microbatch priced against 0.01730 s for the one-microbatch
    plan (0.01986 s before `whole_axes`: a sequence split over the tensor axis all-reducing
    weight-gradient partial sums over it). For every layer since the per-layer ILPs' solver
    settings made them ~2x faster (`cpsat._Model.solve`, gap > 0): `planner plan --model llama-70b
    --cluster 128x8:h100 --batch 2048 --pipeline auto`'s own-layout pipelines at 2048 microbatches
    went 26.39 -> 18.78 s/step, at 128 18.46 -> 17.21 (148 re-plans); GPT-39B b1024 re-plans 59
    layers (WORKSPACE.md, Measured)."""
    return weighed is None or found.time_s + found.sync_s / microbatches > weighed * (1 + LAYER_GAP)


def splits_data(costs: Iterable[LayerCost]) -> bool:
    """Whether a stage of layers planned as `costs` splits a parameter over one of its data axes (some
    layer's `param_axes` meets some layer's `data_axes`): the pipeline runtime then reduces the
    stage's gradients every microbatch (`selection._replica_fallback`)."""
    costs = tuple(costs)
    return bool(frozenset().union(*(c.param_axes for c in costs)) & frozenset().union(*(c.data_axes for c in costs)))


def _from_plan(graph: Graph, layers: Layers, facts: LayerFacts, layer: int, lmesh: LogicalMesh, cost, sub: Graph,
               ext: Sequence[int], plan) -> LayerCost:
    """The layer's cost under its subgraph's `plan`."""
    mesh = lmesh.mesh
    spec_of_input = dict(zip(ext, plan.input_specs))
    param_set = set(facts.param_inputs)
    param_shard = sum(shard_bytes(graph.tensors[t], spec_of_input.get(t) or replicated(len(graph.tensors[t].shape)),
                                  mesh) for t in ext if t in param_set)
    ratio = param_shard / facts.param_bytes_total if facts.param_bytes_total else 1.0 / mesh.size
    state = 2 * param_shard + (facts.state_bytes_total - facts.param_bytes_total) * ratio
    # Activations kept for the backward pass: values made by forward ops, read by this layer's backward ops.
    produced_spec = {}
    for op_index, k, spec in plan.op_specs:
        produced_spec[sub.ops[op_index].outputs[k]] = spec
    produced_spec.update(spec_of_input)
    act = 0.0
    for t in facts.saved:
        spec = produced_spec.get(t)
        act += shard_bytes(graph.tensors[t], spec, mesh) if spec is not None else graph.tensors[t].nbytes
    peak = float(plan.prediction.memory_bytes_per_device)
    work = max(0.0, peak - param_shard - act)
    apply_bytes = 2 * facts.state_bytes_total + facts.param_bytes_total
    apply_s = cost.compute_time(facts.apply_flops * ratio, apply_bytes * ratio, facts.apply_dtypes)
    # Sharded-state variant: store each parameter split over all axes, gather the plan's layout twice.
    zero_specs, zero_extra, zero_param, zero_gathers = [], 0.0, 0.0, []
    for j, t in enumerate(ext):
        spec = spec_of_input.get(t)
        if t not in param_set or spec is None:
            zero_specs.append(None)
            continue
        tensor = graph.tensors[t]
        z = zero_spec(tensor.shape, spec, mesh)
        zero_specs.append(z)
        zero_param += shard_bytes(tensor, z, mesh)
        extra_axes = tuple(sorted({a for axes in z for a in axes} - {a for axes in spec for a in axes}))
        if extra_axes:
            gathered = shard_bytes(tensor, spec, mesh)
            zero_extra += 2 * cost.collective_time("all-gather", gathered, extra_axes)
            gather = PredictedCollective("all-gather", tuple(mesh.axis_names[a] for a in extra_axes), gathered,
                                         mesh.axis_size(extra_axes),
                                         f"{layers.names[layer]} input {j} (forward and backward)", "sharded state")
            zero_gathers += [gather, gather]
    zratio = zero_param / facts.param_bytes_total if facts.param_bytes_total else 1.0 / mesh.size
    zero_state = 2 * zero_param + (facts.state_bytes_total - facts.param_bytes_total) * zratio
    data = batch_axes([spec_of_input.get(t) for t in ext if t not in param_set], mesh)
    sync, exposed = grad_sync(plan.prediction, data, cost)
    quantise = replica_quantisation(sub, plan, data, cost)  # int8 exchanges: quantised once per step too
    param_axes = frozenset(mesh.axis_names[a] for t in ext if t in param_set
                           for a in spec_axes(spec_of_input.get(t) or ()) if mesh.shape[a] > 1)
    if param_axes & data:
        # a parameter split over a data axis: the pipeline runtime reduces every microbatch
        # (`stage_records.set_replicas`), as the layer's plan prices it; nothing once per step
        sync, exposed, quantise = 0.0, 0.0, 0.0
    sync += quantise
    exported = set(sub.outputs)
    produced = {(op_index, k): spec for op_index, k, spec in plan.op_specs
                if sub.ops[op_index].outputs[k] in exported}
    pred = plan.prediction
    own = [(t, spec_of_input.get(t)) for t in ext if t in param_set]
    opt_state, opt_apply, opt_sync = (state, apply_s, sync) if param_axes & data else optimizer_layout(
        graph, facts, own, data, param_shard, cost, apply_bytes, (state, apply_s, sync))
    leaf = largest_state_leaf(graph, facts, own, () if param_axes & data else data, mesh)
    casts = master_params(graph)
    masters = [(shard_bytes(graph.tensors[t], spec or replicated(len(graph.tensors[t].shape)), mesh), casts[t])
               for t, spec in own if t in casts]
    return LayerCost(pred.step_time_s - exposed - quantise, apply_s, state, act, work, facts.fwd_fraction,
                     tuple(spec_of_input.get(t) for t in ext), zero_extra, zero_state, work + param_shard,
                     tuple(zero_specs), sync, produced, max(0.0, pred.communication_time_s - exposed),
                     pred.hidden_communication_time_s, data, tuple(pred.collectives), tuple(zero_gathers),
                     param_axes, opt_state, opt_apply, opt_sync, max(0.0, opt_state - 2 * param_shard), leaf,
                     sum(b for b, _ in masters), sum(b * r for b, r in masters), max((b for b, _ in masters), default=0.0))


def optimizer_layout(graph: Graph, facts: LayerFacts, params: Sequence[tuple[int, Spec | None]],
                     data: frozenset[str], param_shard: float, cost, apply_bytes: float,
                     plan_layout: tuple[float, float, float]) -> tuple[float, float, float]:
    """(state bytes per device, update time, once-per-step gradient exchange) of the layer in the
    sharded-optimizer state layout: parameters and gradient accumulators as the plan lays them
    out, the optimizer state (moments, master copies: the state beyond parameters and gradients)
    split over the layer's data axes too (`core.sharding.optimizer_spec`), as Megatron-LM's
    distributed optimizer and ZeRO stage 1 keep it. Once per step each gradient is reduce-scattered
    over the data axes into that layout (where the plan layout all-reduces it), updated there, and
    the parameter all-gathered back (`emit.pipeline.programs`): the same bytes on a ring as the
    all-reduce, one collective more. `plan_layout`: the plan layout's three, returned where the
    layer has no data axis to add or no parameter takes one."""
    mesh = cost.mesh
    axes = tuple(sorted(mesh.axis_names.index(a) for a in data))
    sizes = dict(enumerate(mesh.shape))
    opt_param, exchange, groups = 0.0, 0.0, set()
    for t, spec in params:
        tensor = graph.tensors[t]
        spec = spec or replicated(len(tensor.shape))
        ospec = optimizer_spec(tensor.shape, spec, axes, sizes)
        if ospec is None:
            opt_param += shard_bytes(tensor, spec, mesh)
            continue
        opt_param += shard_bytes(tensor, ospec, mesh)
        added = tuple(sorted(spec_axes(ospec) - spec_axes(spec)))
        full = shard_bytes(tensor, spec, mesh)
        for kind in ("reduce-scatter", "all-gather"):  # combined as `grad_sync` prices the all-reduces
            exchange += cost.collective_time(kind, full, added, True)
            groups.add((kind, added))
    if not groups or not facts.param_bytes_total:
        return plan_layout
    exchange += sum(cost.collective_latency(kind, axes) for kind, axes in groups)
    oratio = opt_param / facts.param_bytes_total
    state = 2 * param_shard + (facts.state_bytes_total - facts.param_bytes_total) * oratio
    apply_s = cost.compute_time(facts.apply_flops * oratio, apply_bytes * oratio, facts.apply_dtypes)
    return state, apply_s, exchange


def narrow_casts(graph: Graph, tensors: Iterable[int], read: Callable[[int], bool] = lambda i: True
                 ) -> dict[int, Any]:
    """Per tensor of `tensors` that the ops `read` selects (by index) read only by casts to one
    narrower floating dtype (mixed precision's float32 master parameters), that dtype. What the
    stage tables price (`master_params`) and the pipeline runtime emits
    (`emit.pipeline.programs.master_casts`) decide by this one rule."""
    wanted = set(tensors)
    kinds: dict[int, set] = {}
    for op in graph.ops:
        if not read(op.index):
            continue
        for t in op.tensor_inputs:
            if t in wanted:
                kinds.setdefault(t, set()).add(
                    graph.tensors[op.outputs[0]].dtype if op.name == "convert_element_type" else None)
    out = {}
    for t in wanted:
        found, source = kinds.get(t, {None}), graph.tensors[t].dtype
        if len(found) == 1 and None not in found and jnp.issubdtype(source, jnp.floating):
            (low,) = found
            if jnp.issubdtype(low, jnp.floating) and np.dtype(low).itemsize < np.dtype(source).itemsize:
                out[t] = low
    return out


def master_params(graph: Graph) -> dict[int, float]:
    """Per input tensor that the step reads before its update only by casts to one narrower floating
    dtype (`narrow_casts`): the cast's bytes per byte of it. Once per graph (`Graph.cached`)."""
    def make() -> dict[int, float]:
        phases = op_phases(graph)
        return {t: np.dtype(low).itemsize / np.dtype(graph.tensors[t].dtype).itemsize
                for t, low in narrow_casts(graph, graph.inputs, lambda i: phases[i] != APPLY).items()}
    return graph.cached("master params", make)


def largest_state_leaf(graph: Graph, facts: LayerFacts, params: Sequence[tuple[int, Spec | None]],
                       data: frozenset[str], mesh) -> float:
    """Bytes per device of the largest one parameter's optimizer state (its moments: the state
    beyond parameters and gradients, in proportion to the parameter's bytes) as the
    sharded-optimizer layout splits it over the `data` axes (none: as the parameter is laid out)."""
    if not facts.param_bytes_total:
        return 0.0
    axes = tuple(sorted(mesh.axis_names.index(a) for a in data))
    sizes = dict(enumerate(mesh.shape))
    ratio = (facts.state_bytes_total - facts.param_bytes_total) / facts.param_bytes_total
    most = 0.0
    for t, spec in params:
        tensor = graph.tensors[t]
        spec = spec or replicated(len(tensor.shape))
        ospec = optimizer_spec(tensor.shape, spec, axes, sizes) if axes else None
        most = max(most, shard_bytes(tensor, ospec if ospec is not None else spec, mesh) * ratio)
    return most
