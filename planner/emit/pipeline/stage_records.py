"""What each stage of a pipelined step runs: its ops, tensors and input specs, its replicas, its plan.

`stage_records` traces the loss at the microbatch size and cuts it into the stages of the layouts
(`partition`); `set_replicas` marks the stages that accumulate gradients per data-parallel replica
(`programs.Replica`); `stage_plan` is a stage's intra-op plan. `runtime.PipelinedStep` builds its
programs from these records.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from planner.core.errors import InvalidArgumentError, MeshError, PlannerError, first_line
from planner.core.options import PlanOptions
from planner.core.plan import Plan, Prediction
from planner.core.plan_records import SolverStats
from planner.core.sharding import replicated, spec_axes
from planner.emit.pipeline.layout import StageLayout, data_axes, data_spec, find_spec
from planner.emit.pipeline.partition import partition
from planner.emit.pipeline.programs import Replica
from planner.emit.pipeline.stage_reuse import StageGraphs
from planner.emit.pipeline.same_stages import relabelled, reuse_key
from planner.graph.trace import trace
from planner.search.cores import idle_cores
from planner.search.mesh_plan import make_plan
from planner.stages.derived import is_float

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class StageWork:
    """What one stage of a pipelined step runs, devices aside (`stage_records`).

    Attributes:
      index, layout: the stage's position in the pipeline and its `StageLayout`.
      ops, own, bl: its ops, the parameters it owns and the batch leaves it reads (positions).
      acts_in, aux_in, outs, aux_out: the float and other tensors it receives from earlier stages
        and sends to later ones (the last stage's `outs` start with the loss).
      p_spec, b_spec, act: the specs on its mesh of its parameters, its batch leaves and each
        boundary tensor (by tensor id).
      sg: its `StageGraph` (forward + backward per microbatch).
      axes: the axes of its mesh that split the batch.
      replica: its data-parallel replicas' program (`set_replicas`), None where it reduces its
        gradients every microbatch.
      stacks: where its layout keeps its last layers under remat, the name stacks of the ops of
        those layers and of the layers before them (`programs.recompute_cut`).
    """

    index: int
    layout: StageLayout
    ops: tuple[int, ...]
    own: tuple[int, ...]
    bl: tuple[int, ...]
    acts_in: tuple[int, ...]
    aux_in: tuple[int, ...]
    outs: tuple[int, ...]
    aux_out: tuple[int, ...]
    p_spec: tuple
    b_spec: tuple
    act: Mapping[int, Any]
    sg: Any
    axes: tuple[int, ...]
    replica: Replica | None = None
    stacks: tuple[frozenset, frozenset] = (frozenset(), frozenset())


def stage_records(loss_fn: Callable[..., Any], layouts: Sequence[StageLayout], num_microbatches: int,
                  replica_grads: bool, params: Any, batch: Any, traces: StageGraphs | None = None):
    """What each stage runs, devices aside: per stage its op, parameter, batch and boundary
    tensors, the specs of its inputs, and its `StageGraph` (forward + backward per microbatch;
    `traces`: the traces to share, `stage_reuse`, a fresh `StageGraphs` when None).

    Returns:
      (graph, stages, needed_by, param_owner, mb): the loss traced at the microbatch size `mb`, a
      `StageWork` per stage, the stages reading each tensor and the stage owning each parameter.
    """
    B = num_microbatches
    leaves = jax.tree_util.tree_leaves(batch)
    size = int(np.shape(leaves[0])[0]) if leaves else 0
    if not leaves or any(np.ndim(x) < 1 or np.shape(x)[0] != size for x in leaves) or size % B:
        raise InvalidArgumentError(
            f"every batch leaf must have a leading dimension divisible by num_microbatches={B}; "
            f"got shapes {[np.shape(x) for x in leaves]}")
    mb = size // B
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    abstract_mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb,) + tuple(np.shape(x)[1:]), x.dtype), batch)
    traces = traces if traces is not None else StageGraphs()  # one program, one trace (`stage_reuse`)
    graph = traces.loss_graph(loss_fn, abstract_params, abstract_mb)
    if len(graph.outputs) != 1 or not isinstance(graph.outputs[0], int) or graph.tensors[graph.outputs[0]].shape:
        raise InvalidArgumentError("loss_fn must return one scalar (the mean loss over the batch)")
    n_params = len(jax.tree_util.tree_leaves(params))
    parts = partition(graph, layouts, n_params)
    op_stage, param_owner, producer, needed_by = parts.op_stage, parts.param_owner, parts.producer, parts.needed_by
    loss = graph.outputs[0]
    batch_ids = set(graph.inputs[n_params:])
    param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    batch_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    flat_params = jax.tree_util.tree_leaves(params)
    flat_mb = jax.tree_util.tree_leaves(abstract_mb)
    stages = []
    op_inputs = parts.reads
    for s, lay in enumerate(layouts):
        ops = tuple(op.index for op in graph.ops if op_stage[op.index] == s)
        own = tuple(k for k in range(n_params) if param_owner[k] == s)
        reads = {t for i in ops for t in op_inputs[i]}
        bl = tuple(k for k, t in enumerate(graph.inputs[n_params:]) if t in reads)
        incoming = sorted(t for t in reads if t in producer and producer[t] < s and t not in batch_ids)
        made = {t for i in ops for t in graph.ops[i].outputs} | {graph.inputs[k] for k in own}
        outgoing = sorted(t for t in made if any(u > s for u in needed_by.get(t, ())))
        if s == len(layouts) - 1:
            outgoing = [loss] + [t for t in outgoing if t != loss]
        fl = lambda ts: tuple(t for t in ts if is_float(graph.tensors[t].dtype))  # noqa: E731
        nf = lambda ts: tuple(t for t in ts if not is_float(graph.tensors[t].dtype))  # noqa: E731
        axes = data_axes(lay, batch_paths, abstract_mb)
        p_spec = []
        for k in own:
            shape = tuple(np.shape(flat_params[k]))
            p_spec.append(find_spec(lay.specs, param_paths[k], shape, lay.mesh) or replicated(len(shape)))
        b_spec = []
        for k in bl:
            shape = tuple(flat_mb[k].shape)
            b_spec.append(find_spec(lay.specs, batch_paths[k], shape, lay.mesh) or data_spec(shape, axes, lay.mesh))
        act = {t: data_spec(graph.tensors[t].shape, axes, lay.mesh) for t in incoming + outgoing}
        acts_in, aux_in, outs, aux_out = fl(incoming), nf(incoming), fl(outgoing), nf(outgoing)
        sg = traces.get(graph, ops, tuple(graph.inputs[k] for k in own),
                        acts_in, aux_in, tuple(graph.inputs[n_params + k] for k in bl), outs, aux_out)
        stages.append(StageWork(index=s, layout=lay, ops=ops, own=own, bl=bl, acts_in=acts_in, aux_in=aux_in,
                                outs=outs, aux_out=aux_out, p_spec=tuple(p_spec), b_spec=tuple(b_spec), act=act,
                                sg=sg, axes=axes, replica=None, stacks=_stacks(graph, parts.op_layer, ops, lay)))
    if replica_grads:
        stages = set_replicas(loss_fn, graph, stages, abstract_params, batch, mb, loss, traces)
    log.info("stage programs: %d traced, %d the same program as an earlier stage's", traces.traced, traces.reused)
    return graph, stages, needed_by, param_owner, mb


def _stacks(graph, op_layer, ops, lay: StageLayout) -> tuple[frozenset, frozenset]:
    """The name stacks of the stage's ops in the layers it keeps under remat and in those before them."""
    if not lay.kept_layers:
        return frozenset(), frozenset()
    kept = set(lay.layers[-lay.kept_layers:])
    split = ({graph.ops[i].name_stack for i in ops if op_layer[i] in kept},
             {graph.ops[i].name_stack for i in ops if op_layer[i] not in kept})
    return frozenset(split[0]), frozenset(split[1])


def set_replicas(loss_fn: Callable[..., Any], graph, stages: list[StageWork], abstract_params: Any, batch: Any,
                 mb: int, loss: int, traces: StageGraphs | None = None) -> list[StageWork]:
    """`stages` with each data-parallel stage's `programs.Replica` (its program traced at `mb / ways`
    rows) where every value it exchanges is batch-major or the loss and no parameter is split over
    a data axis; the other stages keep reducing gradients per microbatch (`traces`: the stage
    traces to share, `stage_reuse`)."""
    traces = traces if traces is not None else StageGraphs()
    traced: dict[int, Any] = {}
    out = []
    for st in stages:
        out.append(st)
        lay, axes = st.layout, tuple(a for a in st.axes if st.layout.mesh.shape[a] > 1)
        ways = lay.mesh.axis_size(axes) if axes else 1
        if ways <= 1 or mb % ways or any(set(axes) & spec_axes(sp) for sp in st.p_spec):
            continue
        if ways not in traced:
            traced[ways] = _replica_graph(loss_fn, graph, abstract_params, batch, mb, ways)
        g = traced[ways]
        if g is None:
            continue

        def kind(t, output=False):
            full, small = graph.tensors[t].shape, g.tensors[t].shape
            if full and small and small[0] * ways == full[0] and small[1:] == full[1:]:
                return "batch"
            if full == small and (not output or t == loss):
                return "mean" if output else "same"
            return None

        ins = {"a": [kind(t) for t in st.acts_in], "aux": [kind(t) for t in st.aux_in],
               "b": [kind(g.inputs[len(g.inputs) - len(jax.tree_util.tree_leaves(batch)) + k]) for k in st.bl]}
        outs = {"ct": [kind(t, True) for t in st.outs], "aux_out": [kind(t, True) for t in st.aux_out]}
        if any(k is None for ks in list(ins.values()) + list(outs.values()) for k in ks) or \
                "mean" in outs["aux_out"]:
            continue
        sg = traces.get(g, st.ops, tuple(g.inputs[k] for k in st.own), st.acts_in, st.aux_in,
                        tuple(g.inputs[len(g.inputs) - len(jax.tree_util.tree_leaves(batch)) + k]
                              for k in st.bl), st.outs, st.aux_out)
        full = st.sg
        planned = len(sg.graph.ops) == len(full.graph.ops) and sg.split == full.split and all(
            x.name == y.name for x, y in zip(sg.graph.ops, full.graph.ops))
        if sg.split is None and not lay.remat:
            continue
        names = lay.mesh.axis_names
        out[-1] = dataclasses.replace(st, replica=Replica(
            tuple(names[a] for a in axes), ways, sg, {k: tuple(v) for k, v in ins.items()},
            {k: tuple(v) for k, v in outs.items()}, planned))
    return out


def _replica_graph(loss_fn: Callable[..., Any], graph, abstract_params: Any, batch: Any, mb: int, ways: int):
    """The loss traced on one of `ways` replicas' share of a microbatch, when it is the microbatch's
    graph op for op (same ops, same tensor ids); None otherwise, or when it does not trace."""
    small = jax.tree.map(lambda x: jax.ShapeDtypeStruct((mb // ways,) + tuple(np.shape(x)[1:]), x.dtype),
                         batch)
    try:
        g = trace(loss_fn, abstract_params, small)
    except PlannerError:
        raise
    except Exception as e:  # the user's step on fewer rows (an MoE's routing groups): not ours to fix
        log.warning("the loss does not trace on one of %d data-parallel replicas' share of a microbatch "
                    "(%d of %d rows: %s: %s); stages split %d ways reduce their gradients every "
                    "microbatch instead of once per step", ways, mb // ways, mb, type(e).__name__,
                    first_line(e), ways)
        g = None
    same = g is not None and len(g.ops) == len(graph.ops) and all(
        a.name == b.name and a.outputs == b.outputs for a, b in zip(g.ops, graph.ops))
    return g if same else None


def stage_plan(st: StageWork, stage_plans: Sequence[Any], options: Any = None):
    """The stage's intra-op `Plan` of its `StageGraph`: the one given (`stage_plans`, as a saved
    plan records it) when it was made for this program, else planned now with the stage's
    parameter, batch and boundary shardings pinned."""
    sg, lay, s = st.sg, st.layout, st.index
    given = stage_plans[s] if s < len(stage_plans) else None
    if given is not None:
        if given.solver.ops != len(sg.graph.ops) or len(given.input_specs) != len(sg.graph.inputs) \
                or given.mesh != lay.mesh:
            raise InvalidArgumentError(
                f"stage {s}'s saved intra-op plan is for a program of {given.solver.ops} ops on "
                f"{given.mesh}, this step's stage has {len(sg.graph.ops)} ops on {lay.mesh}; re-plan")
        return given
    pins, opts = _problem(st, options)
    try:
        return make_plan(sg.graph, lay.mesh, opts, pins=pins)
    except MeshError:
        # No input of the stage can be split on its mesh (scalars, say): it runs replicated.
        g = sg.graph
        rank = [len(g.tensors[t].shape) if isinstance(t, int) else len(t.tensor.shape) for t in g.outputs]
        return Plan(mesh=lay.mesh, input_paths=g.input_paths,
                    input_specs=tuple(replicated(len(g.tensors[t].shape)) for t in g.inputs),
                    output_paths=g.output_paths, output_specs=tuple(replicated(r) for r in rank), op_specs=(),
                    prediction=Prediction(0.0, 0.0, 0.0, 0, 0.0, ()), decisions=(),
                    solver=SolverStats(status="replicated", ops=len(g.ops)), options=opts.recorded(),
                    in_tree=g.in_tree, out_tree=g.out_tree)


def _problem(st: StageWork, options: Any) -> tuple[dict, PlanOptions]:
    """The stage's pinned inputs (parameters, batch leaves, boundary tensors) and its plan's options."""
    sg = st.sg
    pins = {}
    for group, specs in (("p", st.p_spec), ("b", st.b_spec),
                         ("a", [st.act[t] for t in st.acts_in]),
                         ("aux", [st.act[t] for t in st.aux_in]),
                         ("ct", [st.act[t] for t in st.outs])):
        pins.update(zip(sg.input_positions(group), specs))
    if isinstance(options, Sequence):
        options = options[st.index]
    opts = dataclasses.replace(options or PlanOptions(), memory_budget=None, pipeline=False, tie_outputs=True,
                               donate_argnums=())  # a stage program's own inputs, not the step's arguments
    return pins, opts


def stage_plans(stages: Sequence[StageWork], given: Sequence[Any], options: Any = None,
                solved: dict | None = None) -> tuple:
    """Every stage's plan (`stage_plan`); a stage that runs the same program as an earlier one, on
    the same mesh with the same pins and options, takes that stage's plan renamed
    (`same_stages.relabelled`) instead of solving it again; so does one whose program `solved`
    (reuse key -> (plan, program), filled here) holds from an earlier call (a sweep's
    `PlanningMemo.stage_solved`). The distinct stages are solved side by side on the idle cores
    (CP-SAT releases the GIL; each plan is made alone, as in `LayerCostTable.fill`)."""
    solved = solved if solved is not None else {}
    problems = [_problem(st, options) for st in stages]
    keys = [None if st.index < len(given) and given[st.index] is not None
            else reuse_key(st.sg.graph, st.layout.mesh, *problem) for st, problem in zip(stages, problems)]
    first: dict = {}
    for i, key in enumerate(keys):
        if key is not None and key not in solved:
            first.setdefault(key, i)
    solve = [i for i, key in enumerate(keys) if key is None or first.get(key) == i]
    workers = problems[0][1].solver_workers if problems else 1
    threads = max(1, min(len(solve), idle_cores() // workers))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        made = dict(zip(solve, pool.map(lambda i: stage_plan(stages[i], given, options), solve)))
    for i in solve:
        if keys[i] is not None:
            solved.setdefault(keys[i], (made[i], stages[i].sg.graph))
    plans = []
    for i, (st, key) in enumerate(zip(stages, keys)):
        if i not in made:
            plan, program = solved[key]
            made[i] = relabelled(plan, program, st.sg.graph) or stage_plan(st, given, options)
        plans.append(made[i])
    return tuple(plans)
