"""The one composition of the single-stage levers: what `plan_parallel`, `planner plan`, `planner
compare` and `evaluate` all plan with (`compose`).

A lever is only tried where the memory bound says it can matter, cheapest first:

1. the step as written, on every mesh (`Search`): when its plan fits the budget without the
   budget binding (its unconstrained optimum fits), that is the plan: a lever only adds work;
2. recomputation (`levers.remat.plan_remat`, `remat="auto"`: the fastest of off / each policy /
   the fewest first layers that fit), each candidate planned with host offload brought in only
   when it does not fit without (`offload="auto"`: the fewest optimizer-state leaves, largest
   first; skipped where the host has no memory space or link figure);
3. gradient accumulation (`levers.accumulate`), each microbatch step planned by 2 (recomputation
   inside the microbatch; no offload, which accumulation's emission does not stream): when asked
   for (`accumulate=k` or "auto"), or by default (`accumulate=None`) when the step is
   microbatch-invariant (`graph.batch_mixing`) and 1-2 needed a lever: the faster plan wins;
4. prefetch (`prefetch=None`, the default): where collectives overlap compute (not XLA:CPU) and
   the memory budget did not bind, the single-step plan's mesh is planned again with argument
   reshardings (parameter all-gathers) issued ahead of their use (`PlanOptions.prefetch`), and the
   faster plan kept (`_with_prefetch`). Always weighed,
   not only where the plan without it reshards arguments: with gathers that can hide, a sharded
   layout whose gradients are reduce-scattered can beat a replicated one that reshards nothing
   (gpt2-small on 1x8 H100: 0.02260 -> 0.02102 s/step). On the chosen mesh only: one more solve,
   not one per mesh (it makes some ILPs markedly harder, `PlanOptions.prefetch`).

5. pipeline stages (`planning.pipeline_lever`, `pipeline=None`, the default), where the caller can
   plan them (a `StageSearch`: a target of several hosts) and the step allows it: weighed against
   the plan of 1-4, the faster kept; planned when nothing of 1-4 fits. While they may still be
   weighed, 1-4 run without the smallest-peak searches (which only word a "does not fit" answer;
   they run after, when no pipeline fits either).

Each lever the plan uses records the plan it was weighed against (`without_*` in its record).
When nothing fits, the answer is the one-line "does not fit" after every lever was tried.
"""
from __future__ import annotations

import dataclasses
import math
import logging
from collections.abc import Callable, Sequence
from typing import Any

from planner.core.errors import InfeasiblePlanError, NotFasterError, OffloadUnavailableError, PlannerError
from planner.core.mesh import MeshSpec, default_axis_names
from planner.core.options import PlanOptions
from planner.core.plan import Plan
from planner.core.plan_records import PrefetchRecord
from planner.core.units import format_bytes
from planner.graph.ir import Graph
from planner.ilp.levers import levers_text, marked_tried
from planner.ilp.memory_bounds import memory_floor
from planner.ilp.offload import streamed
from planner.levers.accumulate import (Accumulated, micro_options, plan_accumulation, step_parts,
                                       why_microbatch_variant)
from planner.levers.remat import plan_remat, record as remat_record
from planner.planning.pipeline_lever import Pipelined, PipelineWeighing, StageSearch, why_not_weighed
from planner.search.mesh_plan import donated_inputs, overlaps
from planner.search.meshes import search_meshes
from planner.search.results import MeshResult, no_fit_error

log = logging.getLogger("planner")

# (graph, options, search for the smallest peak when nothing fits, only this mesh or None: every
# mesh of the run) -> one result per mesh, the best first (its plan None when no mesh gives one);
# may raise InfeasiblePlanError instead.
# (graph, options, smallest-peak search, only this mesh or None[, beat: a step time a plan must beat,
# meshes that provably cannot are pruned]) -> the mesh search's results
Search = Callable[..., Sequence[MeshResult]]

EXPLICIT_OFFLOAD = ("opt-state", "opt-state+params")

# Prefetch is kept only when it makes the step at least this much faster; its solve stops as soon as
# CP-SAT's bound proves it cannot (`solve(beat=...)`): proving that a plan of equal time is optimal
# costs a full proof, a bound this far under it much less, and a smaller gain is not worth another plan.
PREFETCH_GAIN = 1e-3


@dataclasses.dataclass(frozen=True)
class Composed:
    """What `compose` planned: the graph the plan is for (rewritten by recomputation, streamed for
    offload; under accumulation the microbatch step's), one result per mesh (best first), the
    accumulated step when k > 1 microbatches were chosen (emitted with `emit.accumulate`), and
    the pipeline stages weighed by default (`planning.pipeline_lever`): `pipelined` when they beat
    the single-step plan (then `plan` is theirs and `results` the single step's, possibly none),
    `pipeline_note` what weighing them gave (None: not weighed)."""

    graph: Graph
    results: tuple[MeshResult, ...]
    accumulated: Accumulated | None = None
    pipelined: Pipelined | None = None
    pipeline_note: str | None = None

    @property
    def plan(self) -> Plan:
        return self.pipelined.plan if self.pipelined is not None else self.results[0].plan


def compose(step: Callable[..., Any], graph: Graph, options: PlanOptions, search: Search,
            bounds: MeshSpec, stages: StageSearch | None = None) -> Composed:
    """`step` (traced as `graph`) planned with the levers `options` allows (module docstring).

    Args:
      search: plans a graph on the meshes of this run (`Search`).
      bounds: the mesh (or a 1-D mesh of every device) on which accumulation counts its buffers'
        smallest layouts in an infeasible answer.
      stages: plans pipeline stages for this run's target (`pipeline_lever.StageSearch`), given by
        callers planning for several hosts: with `options.pipeline` None they are weighed against
        the single-step plan, and planned when no single-step plan fits (`pipeline_lever`).

    Raises:
      InfeasiblePlanError: no plan fits `options.memory_budget` with any lever (one line).
      InvalidArgumentError: a lever asked for explicitly that this step cannot use.
    """
    if stages is None or options.pipeline is not None:
        return _levers(step, graph, options, search, bounds)
    why = why_not_weighed(graph, options)
    if why is not None:
        log.info("pipeline stages not weighed: %s", why)
        return dataclasses.replace(_levers(step, graph, options, search, bounds), pipeline_note=f"not weighed: {why}")
    weighing = PipelineWeighing(options, stages)
    try:  # no smallest-peak searches while a pipeline may still fit (they only word the answer)
        composed = _levers(step, graph, options, _no_smallest(search), bounds, weighing.time)
    except InfeasiblePlanError:
        weighed = weighing.verdict(math.inf)
        if weighed.pipelined is not None:
            return Composed(graph, (), None, weighed.pipelined, weighed.note)
        try:  # the answer with the smallest peaks searched for (which may also find a plan that fits)
            composed = _levers(step, graph, options, search, bounds)
        except InfeasiblePlanError as e:
            raise e.reworded(f"{e}; pipeline stages {weighed.note}") from None
        return dataclasses.replace(composed, pipeline_note=weighed.note)
    weighed = weighing.verdict(composed.plan.prediction.step_time_s)
    return dataclasses.replace(composed, pipelined=weighed.pipelined, pipeline_note=weighed.note)


def _levers(step: Callable[..., Any], graph: Graph, options: PlanOptions, search: Search, bounds: MeshSpec,
            rival: Callable[[float], float] = lambda single_s: math.inf) -> Composed:
    """The single-step levers (module docstring, 1-4), the plan's options as asked; `rival`: the
    step time of another way to plan the step, given the single step's (`PipelineWeighing.time`),
    which gradient accumulation must beat."""
    return _as_asked(_with_prefetch(_compose(step, graph, options, search, bounds, rival), options, search), options)


def _no_smallest(search: Search) -> Search:
    """`search` never searching for the smallest peak when nothing fits."""
    return lambda g, o, smallest, only=None, beat=math.inf: search(g, o, False, only, **_beat(beat))


def _as_asked(composed: Composed, options: PlanOptions) -> Composed:
    """`composed` with each plan's options the lever options as asked (the searches planned with
    resolved ones: offload "off" or "auto", no accumulation inside a microbatch)."""
    asked = {"offload": options.offload, "remat": options.remat, "accumulate": options.accumulate}

    def fix(plan: Plan | None) -> Plan | None:
        return plan and dataclasses.replace(plan, options=dataclasses.replace(plan.options, **asked))

    results = tuple(dataclasses.replace(r, plan=fix(r.plan)) for r in composed.results)
    acc = composed.accumulated
    return Composed(composed.graph, results, acc and dataclasses.replace(acc, plan=results[0].plan))


def _compose(step: Callable[..., Any], graph: Graph, options: PlanOptions, search: Search,
             bounds: MeshSpec, rival: Callable[[float], float]) -> Composed:
    if options.accumulate not in (None, 1):
        return _accumulated(step, graph, options, search, bounds, options.accumulate)
    try:
        single = _single(graph, options, search)
    except InfeasiblePlanError as e:
        tried = _tried(options)
        if not _may_accumulate(options, graph) or not _accumulation_may_fit(graph, options, bounds):
            raise _told(e, tried) from None
        log.info("no single-step plan fits: trying gradient accumulation")
        ceiling = rival(math.inf)
        try:
            found = _accumulated(step, graph, options, _capped(search, ceiling), bounds, "auto", smallest=2,
                                 ceiling=ceiling)
        except InfeasiblePlanError as acc:
            raise _closest(_told(e, tried + ("gradient accumulation",)), acc) from None
        return _weighed(found, False, None, e.min_memory_bytes)
    if _needed_lever(single.plan) and _may_accumulate(options, graph) \
            and _accumulation_may_fit(graph, options, bounds):  # microbatches take no offload
        # weighed on the fastest mesh of at most two axes the single step planned (each microbatch
        # count is another recomputation search; on every mesh that took Llama-70B on 8x8 past
        # 280 s; a 3-D mesh is only searched near a plan of fewer axes, `search.meshes`); its one
        # solve at a time leaves cores idle: each count's recomputation policies are probed side by side
        mesh = min((r for r in single.results if r.plan is not None and len(r.mesh.shape) <= 2),
                   key=lambda r: r.plan.prediction.step_time_s, default=single.results[0]).mesh
        log.info("the plan needs a memory lever: weighing gradient accumulation against it on mesh %s", mesh)
        ceiling = min(single.plan.prediction.step_time_s, rival(single.plan.prediction.step_time_s))
        try:
            found = _accumulated(step, graph, options,
                                 _capped(lambda g, o, smallest, only=None, beat=math.inf:
                                         search(g, o, smallest, mesh, **_beat(beat)), ceiling),
                                 bounds, "auto", smallest=2, ceiling=ceiling, threads=None)
        except PlannerError:
            return single
        if found.accumulated is not None and found.plan.prediction.step_time_s < single.plan.prediction.step_time_s:
            p = single.plan.prediction
            return _weighed(found, True, p.step_time_s, p.memory_bytes_per_device)
    return single


def _with_prefetch(composed: Composed, options: PlanOptions, search: Search) -> Composed:
    """`composed` or, where prefetch is weighed (module docstring, 4) and makes a faster plan on the
    same mesh, that plan with the recomputation record of the plan it replaces and a
    `PrefetchRecord` of it. Not for accumulated or host-offloaded plans (their searches plan other
    graphs and options), nor where collectives never overlap (XLA:CPU's are synchronous), nor where
    the memory budget bound the plan (`SolverStats.unbudgeted`): a prefetched gather holds its
    parameter from its issue on, which the memory model does not count (Known gaps), so a plan at
    the budget is where its prediction is least to be trusted; and there each solve runs memory
    rounds (Llama-2-70B b128 on 8x8 H100: ~35 s more for the same plan)."""
    plan = composed.plan
    offload = plan.levers.offload
    if options.prefetch is not None or composed.accumulated is not None or (offload is not None and offload.inputs) \
            or plan.solver.unbudgeted is not None or not overlaps(plan.mesh, options):
        return composed
    log.info("weighing prefetched parameter gathers on mesh %s", plan.mesh)
    beat = plan.prediction.step_time_s * (1 - PREFETCH_GAIN)
    try:
        results = search(composed.graph, dataclasses.replace(_offload(options, "off"), prefetch=True), False,
                         plan.mesh, beat=beat)
    except PlannerError as e:
        log.info("prefetch: %s", e)
        return composed
    found = results[0].plan if results else None
    if found is None or found.prediction.step_time_s >= beat:
        return composed
    p = plan.prediction
    found = found.with_levers(remat=plan.levers.remat, prefetch=PrefetchRecord(
        without_fits=True, without_step_time_s=p.step_time_s, without_memory_bytes=p.memory_bytes_per_device))
    return Composed(composed.graph, (dataclasses.replace(results[0], plan=found),) + composed.results[1:])


def compose_on_meshes(step: Callable[..., Any], graph: Graph, meshes: Sequence[MeshSpec], options: PlanOptions,
                      per_host: int | None, stages: StageSearch | None = None) -> Composed:
    """`compose` over a mesh search of `meshes` (`search.meshes.search_meshes`, hosts of `per_host`
    devices): how `planner plan` and `planner compare` plan (`stages`: as in `compose`)."""

    def search(g: Graph, o: PlanOptions, smallest: bool, only: MeshSpec | None = None,
               beat: float = math.inf) -> Sequence[MeshResult]:
        return search_meshes(g, [only] if only is not None else meshes, o, per_host, min_peak_search=smallest,
                             beat=beat)

    return compose(step, graph, options, search, MeshSpec((meshes[0].size,), default_axis_names(1)), stages)


def _single(graph: Graph, options: PlanOptions, search: Search, first_layers: bool = True,
            threads: int | None = 1) -> Composed:
    """Recomputation x host offload around the mesh search (module docstring, 1-2): recomputation
    first; host offload ("auto", the default) only when no recomputation policy fits without it
    (then every policy is tried again with it), or, when recomputation was needed, once without
    recomputation, the faster plan kept. `first_layers`: whether a scanned stack's first layers
    are weighed (`levers.remat.plan_remat(scan_first=)`; not for each microbatch count of the
    accumulation lever, which repeats this search per count); `threads`: `plan_remat`'s."""
    budget, mode = options.memory_budget, options.offload or "auto"
    if mode in EXPLICIT_OFFLOAD or mode == "off" or budget is None:
        explicit = mode in EXPLICIT_OFFLOAD

        def plan_fn(g: Graph, smallest: bool, beat: float = math.inf) -> tuple[Graph, Sequence[MeshResult]]:
            s = streamed(g) if explicit else g
            return s, _found(search(s, options if explicit else _offload(options, "off"), smallest, None,
                                    **_beat(beat)), budget)

        return _remat(graph, options, plan_fn, first_layers=first_layers, threads=threads)
    plain = _offload(options, "off")
    with_offload = _offload(options, "auto")

    def without(g: Graph, smallest: bool, beat: float = math.inf) -> tuple[Graph, Sequence[MeshResult]]:
        return g, _found(search(g, plain, smallest, None, **_beat(beat)), budget)

    def offloaded(g: Graph, smallest: bool, beat: float = math.inf) -> tuple[Graph, Sequence[MeshResult]]:
        s = streamed(g)
        return s, _found(search(s, with_offload, smallest, None, **_beat(beat)), budget)

    try:
        first = _remat(graph, dataclasses.replace(options, offload="off"), without, smallest=False,
                       first_layers=first_layers, threads=threads)
    except InfeasiblePlanError as e:
        log.info("no plan fits without host offload: planning with it")
        try:
            found = _remat(graph, options, offloaded, first_layers=first_layers, threads=threads)
        except OffloadUnavailableError as why:
            log.info("offload auto: %s", why)
            return _remat(graph, options, without, first_layers=first_layers, threads=threads)  # with the smallest peak searched for
        return Composed(found.graph, _offload_weighed(found.results, False, None, e.min_memory_bytes))
    remat = first.plan.levers.remat
    # offload alone is weighed when recomputation "auto" was needed to fit at all (when the plan
    # without it fits, `plan_remat` weighed that plan already; a forced policy is what was asked)
    if options.remat != "auto" or remat is None or remat.policy == "off" or remat.without_fits is not False:
        return first
    log.info("recomputation fits: weighing host offload without it")
    try:
        alone = _remat(graph, dataclasses.replace(options, remat="off"), offloaded, smallest=False,
                       first_layers=first_layers)
    except (InfeasiblePlanError, OffloadUnavailableError):
        return first
    if alone.plan.levers.offload is not None and alone.plan.levers.offload.inputs \
            and alone.plan.prediction.step_time_s < first.plan.prediction.step_time_s:
        p = first.plan.prediction
        return Composed(alone.graph, _offload_weighed(alone.results, True, p.step_time_s, p.memory_bytes_per_device))
    return first


def _remat(graph: Graph, options: PlanOptions, plan_fn, smallest: bool = True, first_layers: bool = True,
           threads: int | None = 1) -> Composed:
    """Recomputation (`levers.remat.plan_remat`, `options.remat`) over `plan_fn` (graph, smallest
    peak search) -> (the graph planned, its results); `smallest`: False never searches for the
    smallest peak (a caller that tries another lever after this one); `first_layers`, `threads`:
    `_single`'s."""
    def fn(g: Graph, want: bool, beat: float = math.inf):
        return plan_fn(g, want and smallest, beat)

    rewritten, (planned, results), policy, without = plan_remat(graph, options.remat, options.memory_budget, fn,
                                                                lambda found: found[1][0].plan, first_layers,
                                                                threads)
    if options.remat != "off":
        results = [dataclasses.replace(r, plan=remat_record(r.plan, graph, rewritten, policy, without))
                   if r.plan else r for r in results]
    return Composed(planned, tuple(results))


def _capped(search: Search, ceiling: float) -> Search:
    """`search` with every step time to beat at most `ceiling` (a microbatch slower than the step
    time the accumulated step must beat cannot help): `search` itself when `ceiling` is infinite."""
    if math.isinf(ceiling):
        return search
    return lambda g, o, smallest, only=None, beat=math.inf: search(g, o, smallest, only, beat=min(beat, ceiling))


def _beat(beat: float) -> dict[str, float]:
    """The `beat` keyword for a `Search` call: given only when finite (a search made elsewhere, a
    benchmark's single-mesh one, need not take it)."""
    return {} if math.isinf(beat) else {"beat": beat}


def _offload(options: PlanOptions, mode: str) -> PlanOptions:
    return options if options.offload == mode else dataclasses.replace(options, offload=mode)


def _found(results: Sequence[MeshResult], budget: float | None) -> Sequence[MeshResult]:
    """`results` when the best holds a plan; the one-line answer (`no_fit_error`) otherwise."""
    if results[0].plan is not None:
        return results
    raise no_plan(results, budget)


def _offload_weighed(results: Sequence[MeshResult], fits: bool, step_time_s: float | None,
                     memory_bytes: int | None) -> tuple[MeshResult, ...]:
    """Each plan's offload record with the plan without offload it was weighed against (whether it
    fits, its step time, its peak or the smallest found)."""
    out = []
    for r in results:
        rec = r.plan.levers.offload if r.plan is not None else None
        if rec is not None:
            rec = dataclasses.replace(rec, without_fits=fits, without_step_time_s=step_time_s,
                                      without_memory_bytes=memory_bytes)
            r = dataclasses.replace(r, plan=r.plan.with_levers(offload=rec))
        out.append(r)
    return tuple(out)


def _needed_lever(plan: Plan) -> bool:
    """Whether the single-step plan uses recomputation or host offload."""
    remat, offload = plan.levers.remat, plan.levers.offload
    return (remat is not None and remat.policy != "off") or (offload is not None and bool(offload.inputs))


def _may_accumulate(options: PlanOptions, graph: Graph) -> bool:
    """Accumulation by default: no pipeline, a budget, and a step whose loss no op computes across
    examples (`graph.batch_mixing`), so that k microbatches compute the step itself."""
    if options.accumulate is not None or options.pipeline or options.memory_budget is None:
        return False
    return why_microbatch_variant(graph) is None


def _accumulation_may_fit(graph: Graph, options: PlanOptions, bounds: MeshSpec) -> bool:
    """Whether k microbatches can fit the budget at all: what every plan keeps at the end of the
    step (`ilp.memory_bounds.memory_floor`) less the batch arguments, which accumulation shrinks,
    is under it (a budget below the state alone fails at once instead of after every k)."""
    n = bounds.size
    parts = step_parts(graph)
    batch = sum(graph.tensors[graph.inputs[i]].nbytes // n for i in parts.batch)
    floor = memory_floor(graph, n, donated_inputs(graph, options.donate_argnums)) - batch
    if floor > options.memory_budget:
        log.info("gradient accumulation cannot fit: the state alone needs %s per device", format_bytes(floor))
        return False
    return True


def _accumulated(step: Callable[..., Any], graph: Graph, options: PlanOptions, search: Search, bounds: MeshSpec,
                 accumulate: int | str, smallest: int = 1, ceiling: float = math.inf,
                 threads: int | None = 1) -> Composed:
    """Gradient accumulation (`levers.accumulate.plan_accumulation`, from `smallest` microbatches
    under "auto", `ceiling` the single step's time it is weighed against), each microbatch step
    planned with recomputation (`_single`, without offload; `threads`: its recomputation policies
    probed side by side, for a search of one mesh, whose solves leave cores idle); the best plan as
    the one result."""
    seen: list[Sequence[MeshResult]] = []

    def plan_micro(g: Graph, inner: float | None) -> tuple[Graph, Plan]:
        opts = _offload(micro_options(options, inner), "off")

        def recorded(h: Graph, o: PlanOptions, smallest: bool, only: MeshSpec | None = None,
                     beat: float = math.inf) -> Sequence[MeshResult]:
            results = search(h, o, smallest, only, **_beat(beat))
            seen.append(results)
            return results

        try:
            micro = _single(g, opts, recorded, first_layers=False, threads=threads)
        except InfeasiblePlanError as e:
            raise _accumulation_answer(e, seen[-1] if seen else ()) from None
        return micro.graph, micro.plan

    acc = plan_accumulation(step, graph, accumulate, options.memory_budget, plan_micro, bounds, options.unshard,
                            smallest=smallest, ceiling=ceiling)
    plan = acc.plan
    record = plan.levers.accumulation
    log.info("gradient accumulation: at best %d microbatch(es) of %d rows, %.4g s/step", record.microbatches,
             record.microbatch_rows, plan.prediction.step_time_s)
    inter = next((r.inter_host_axes for rs in seen for r in rs if r.plan is not None and r.mesh == plan.mesh), ())
    return Composed(acc.graph, (MeshResult(plan.mesh, plan, None, inter, 0.0),), acc if acc.k > 1 else None)


def _weighed(found: Composed, fits: bool, step_time_s: float | None, memory_bytes: int | None) -> Composed:
    """`found` (an accumulated plan) with the single-step plan it was weighed against recorded."""
    plan = found.plan
    rec = dataclasses.replace(plan.levers.accumulation, without_fits=fits, without_step_time_s=step_time_s,
                              without_memory_bytes=memory_bytes)
    plan = plan.with_levers(accumulation=rec)
    acc = dataclasses.replace(found.accumulated, plan=plan) if found.accumulated is not None else None
    return Composed(found.graph, (dataclasses.replace(found.results[0], plan=plan),), acc)


def _tried(options: PlanOptions) -> tuple[str, ...]:
    """The levers (`ilp.levers.LEVERS` names) a failed `_single` tried."""
    return tuple(name for name, on in (("rematerialisation", options.remat != "off"),
                                       ("host offload", options.offload != "off")) if on)


def _told(e: InfeasiblePlanError, tried: Sequence[str]) -> InfeasiblePlanError:
    """`e` with the levers `tried` said to be tried in its lever sentences (`ilp.levers.levers_text`)."""
    if not e.levers:
        return e
    after = marked_tried(e.levers, tried)
    text = str(e).replace(levers_text(e.levers), levers_text(after))
    return InfeasiblePlanError(text, e.min_memory_bytes, e.lower_bound_bytes, proven=e.proven, levers=after,
                               deterministic_time=e.deterministic_time)


def _closest(single: InfeasiblePlanError, accumulated: InfeasiblePlanError) -> InfeasiblePlanError:
    """The answer when neither a single-step plan nor accumulation fits: the single step's answer
    (it names every lever tried) and the smallest peak accumulation reached, and which got closest."""
    acc, one = accumulated.min_memory_bytes, single.min_memory_bytes
    best = min((x for x in (one, acc) if x is not None), default=None)
    if acc is None:
        return single
    closest = "gradient accumulation" if one is None or acc < one else "recomputation and host offload"
    return single.reworded(f"{single}; with gradient accumulation the smallest peak found is {format_bytes(acc)} "
                           f"(closest: {closest})", best)


def _accumulation_answer(e: InfeasiblePlanError, results: Sequence[MeshResult]) -> InfeasiblePlanError:
    """A microbatch step that fits no mesh: its answer with the smallest peak and least bound found."""
    over = [r for r in results if r.over_budget]
    if not over:
        return e
    need = min((r.min_memory_bytes for r in over if r.min_memory_bytes is not None), default=e.min_memory_bytes)
    floor = min((r.lower_bound_bytes for r in over if r.lower_bound_bytes is not None), default=None)
    return InfeasiblePlanError(str(e), need, floor)


def no_plan(results: Sequence[MeshResult], budget: float | None) -> PlannerError:
    """The error of a search where no mesh shape gave a plan: what did not fit, and what to try."""
    if any(r.over_budget for r in results):
        return no_fit_error(results, budget)
    if results and all(r.pruned is not None for r in results):  # a search given a step time to beat
        return NotFasterError("no plan beats the step time to beat: " + "; ".join(
            f"{r.mesh}: {r.pruned}" for r in results))
    errors = [r.error for r in results if r.error is not None]
    if len(errors) == 1:
        return errors[0]
    return PlannerError("no mesh shape could be planned: " + "; ".join(f"{r.mesh}: {r.error}" for r in results))
