"""Inter-op planning: from a train step and a cluster to pipeline stages on submeshes.

    pp = plan_pipeline(train_step, (state, batch), make_cluster(8, 8, "v100", inter_host_gbit=25),
                       PlanOptions(pipeline="auto"))
    print(pp.summary())

For each candidate microbatch count B the step is traced at the microbatch size, its ops grouped
into layers, every distinct layer planned by the intra-op ILP on every logical mesh of every
submesh (once: identical layers share the result), and Alpa's DP picks stage boundaries and
submeshes. With `pipeline="auto"` the best single-stage plan (the whole cluster, no microbatching)
competes too. The batch is the last positional argument; every leaf of it is split along axis 0.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from planner.core.errors import InfeasiblePlanError
from planner.core.options import PlanOptions
from planner.core.pipeline_records import HandLayoutCounts
from planner.core.units import format_bytes
from planner.cost_model import Cluster
from planner.graph.ir import Graph
from planner.stages.candidate import Candidate, once_per_step_max, stage_plans, to_pipeline_plan
from planner.stages.clustering import stacked_inputs, stacked_note
from planner.stages.cost_table import LAYER_VARIANTS, planned_layers
from planner.stages.layer_facts import boundary_bytes
from planner.stages.microbatches import PlanningMemo, UntraceableMicrobatches, none_traces
from planner.stages.pipeline_plan import PipelinePlan
from planner.stages.search_space import SearchSpace, ignoring_memory, layer_table, price, search_space
from planner.stages.selection import cheapest_as_run
from planner.stages.single_stage import SingleStage, as_single_stage_plan, single_stage
from planner.stages.submesh import LogicalMesh

log = logging.getLogger("planner")


@dataclasses.dataclass(frozen=True)
class _Found:
    """What the search has found so far.

    Attributes:
      candidates: one per microbatch count that traces, in the order tried (the single stage last).
      untraceable: why each count that does not trace does not.
      stacked: parameter paths stacked over layers (read on the first count, `clustering.stacked_inputs`).
      evaluations: t_max bounds the DP tried, over all its runs.
      priced / pruned: microbatch counts whose hand layouts were priced / skipped by the pruning rule.
      single: the single stage of `pipeline="auto"` (None: not tried).
      skipped: microbatch counts not planned (`_with_count_or_stop`).
      beat: a step time found elsewhere, which the hand layouts' pruning rule weighs as a candidate.
    """

    candidates: tuple[Candidate, ...] = ()
    untraceable: tuple[str, ...] = ()
    stacked: tuple[str, ...] = ()
    evaluations: int = 0
    priced: tuple[int, ...] = ()
    pruned: tuple[int, ...] = ()
    single: SingleStage | None = None
    skipped: tuple[int, ...] = ()
    beat: float = math.inf


def plan_pipeline(fn: Callable[..., Any], args: tuple[Any, ...], cluster: Cluster,
                  options: PlanOptions | None = None, *, batch_argnum: int | tuple[int, ...] = -1,
                  max_mesh_ndim: int = 2,
                  microbatch_limit: int | None = None, rel_gap: float = 0.0, num_layers: int | None = None,
                  full_graph: Graph | None = None,
                  pins: Callable[[Graph, LogicalMesh], Mapping[int, Any]] | None = None,
                  devices: Sequence[Any] = (), layer_variants: Sequence[str] = LAYER_VARIANTS,
                  memo: PlanningMemo | None = None, beat: float = math.inf) -> PipelinePlan:
    """Plans pipeline stages for `fn(*args)` on `cluster`.

    Args:
      fn: the train step (traced, never run).
      args: its arguments (arrays or ShapeDtypeStructs); `args[batch_argnum]` is the batch.
      cluster: hosts x devices and their links.
      options: `pipeline` (True: at least two stages; "auto": the single-stage plan on the whole
        cluster without microbatching competes too, priced as the whole-program plan that
        `planned.plan_stages` returns for it, and is reported), `num_microbatches`
        (None: try every count dividing the batch, or the `microbatch_limit` largest), `schedule`,
        `memory_budget` (default: the device memory), `solver_time_limit` for each layer's ILP.
      batch_argnum: position(s) of the batch argument(s).
      max_mesh_ndim: 1 plans submeshes as 1-D meshes only (faster), 2 adds 2-D ones.
      microbatch_limit: how many microbatch counts to try when none is given (None: all).
      rel_gap: relative spacing of the DP's t_max candidates (0: exact).
      num_layers: layer count for balanced clustering when the model has no repeated modules.
      full_graph: `trace(fn, *args)` when the caller already has it (saves a trace).
      pins: `(graph, logical mesh) -> {program input tensor id: Spec}` (`planner.configs.pins.stage_pins`):
        each layer's ILP keeps the pinned inputs it reads as pinned, so a pin applies to the stage
        that holds the pinned leaf; a mesh that cannot take a pin is not used for those layers.
      devices: the devices the plan will run on (none: planned abstractly). The single-stage plan
        of `pipeline="auto"` is made for the first `cluster.num_devices` of them, so that
        `planned.plan_stages` can return it as it is when one stage wins.
      layer_variants: the hand layouts each layer is also planned in (`cost_table.LAYER_VARIANTS`;
        none with `pins`, which fix the layout themselves).
      memo: what plans of this step at other batch sizes found (`PlanningMemo`), used and filled:
        its symbolic trace, and its layer plans at the microbatch sizes they share.
      beat: a step time found elsewhere (the single-step plan a default pipeline is weighed
        against, `planner.planning.pipeline_lever`): a count is priced in the hand layouts only
        where its pipeline ignoring memory could beat it (the pruning rule of `_with_hand_layouts`).

    Raises:
      InfeasiblePlanError: no stage assignment fits the memory budget.
    """
    space = search_space(fn, args, cluster, options or PlanOptions(pipeline=True), batch_argnum=batch_argnum,
                         max_mesh_ndim=max_mesh_ndim, microbatch_limit=microbatch_limit, rel_gap=rel_gap,
                         num_layers=num_layers, full_graph=full_graph, pins=pins, devices=devices,
                         layer_variants=layer_variants, memo=memo)
    found = _Found(beat=beat)
    for i, B in enumerate(space.counts):
        found, stop = _with_count_or_stop(space, found, B)
        if stop:
            found = dataclasses.replace(found, skipped=space.counts[i + 1:])
            if found.skipped:
                log.info("B=%s not planned: microbatches of %d rows fit no pipeline in any layout, and larger ones "
                         "hold more activations", ",".join(map(str, found.skipped)), space.batch // B)
            break
    if not found.candidates and found.untraceable and space.options.pipeline != "auto":  # "auto": the single stage
        raise none_traces(found.untraceable, space.counts)
    for k in range(len(found.candidates)):
        if not found.candidates[k].table.variants:
            break
        if found.candidates[k].B not in found.priced + found.pruned:
            found = _with_hand_layouts(space, found, k)
    if space.options.pipeline == "auto":
        found = _with_single_stage(space, found)
    if memo is not None:
        memo.family, memo.traced, memo.step = space.graphs.family, space.graphs.traced, fn
    return _chosen(space, found)


def _with_count_or_stop(space: SearchSpace, found: _Found, B: int) -> tuple[_Found, bool]:
    """`found` with the candidate of `B` microbatches (`_with_count`), and whether `plan_pipeline`
    stops there: the candidate fits no pipeline in the layers' own plans nor, priced now, in the
    hand layouts. Then no count of larger microbatches is planned. A rule, not a proof: every layout
    holds at least as many bytes of activations per microbatch at more rows, and the parameters'
    and optimizer state's bytes do not depend on them; a larger microbatch only admits batch splits a
    smaller one could not divide (2 rows over 4 devices), which spread the same activations over
    more devices. Not applied without a memory budget, when `B` did not trace (its size then says
    nothing), or when the hand layouts were not priced (the pruning rule of `_with_hand_layouts`)."""
    found = _with_count(space, found, B)
    c = found.candidates[-1] if found.candidates else None
    if c is None or c.B != B or c.dp is not None or not math.isfinite(space.budget) or not c.table.variants:
        return found, False
    found = _with_hand_layouts(space, found, len(found.candidates) - 1, stopping=True)
    return found, B in found.priced and found.candidates[-1].dp is None


def _with_count(space: SearchSpace, found: _Found, B: int) -> _Found:
    """`found` with the candidate of `B` microbatches: the DP over the layers' own plans (or with why
    the step does not trace on them)."""
    try:
        graph, layers, table, _ = layer_table(space, B)
    except UntraceableMicrobatches as e:  # e.g. an MoE step whose token groups are longer than a microbatch
        log.warning("B=%d: %s; not a candidate", B, e)
        return dataclasses.replace(found, untraceable=found.untraceable + (str(e),))
    stacked = found.stacked
    if B == space.counts[0]:
        stacked = tuple(graph.input_paths[i] for i in stacked_inputs(graph, layers))
        if stacked:
            log.warning("%s", stacked_note(stacked))
    st, dp, step = price(space, B, table, boundary_bytes(graph, layers), ("",))
    log.info("B=%d: %s", B, "no pipeline of the per-layer plans fits the budget" if dp is None else
             f"{len(dp.stages)} stages, predicted {step:.4g} s/step")
    return dataclasses.replace(
        found, candidates=found.candidates + (Candidate(B, graph, layers, table, st, dp, step),), stacked=stacked,
        evaluations=found.evaluations + (dp.evaluations if dp is not None else 0))


def _with_hand_layouts(space: SearchSpace, found: _Found, k: int, stopping: bool = False) -> _Found:
    """`found` with candidate `k` priced in the hand layouts too (`LayerCostTable.variants`), unless
    the pruning rule skips it (against the best candidate and `found.beat`; `stopping`: the stop
    rule of `_with_count_or_stop` asks, which needs the pricing whatever `found.beat` is).

    The hand layouts only help where memory binds: a layer's own plan is the fastest, so a count B
    whose pipeline of the layers' own plans ignoring memory is no faster than the best pipeline found
    is not planned in them (a pruning rule, not a proof: a hand layout's layers are never faster, but
    their gradient reduction, charged once per step, may be)."""
    c = found.candidates[k]
    best_step = min([x.step_s for x in found.candidates] + ([] if stopping else [found.beat]))
    if math.isfinite(best_step) and not _memory_binds(space, c, best_step):
        return dataclasses.replace(found, pruned=found.pruned + (c.B,))
    st, dp, step = price(space, c.B, c.table, c.st.boundary, ("", *c.table.variants))
    candidates = found.candidates
    if step < c.step_s:
        log.info("B=%d with the %s layouts: %d stages, predicted %.4g s/step", c.B, "/".join(c.table.variants),
                 len(dp.stages), step)
        candidates = candidates[:k] + (Candidate(c.B, c.graph, c.layers, c.table, st, dp, step),) + candidates[k + 1:]
    return dataclasses.replace(found, candidates=candidates, priced=found.priced + (c.B,),
                               evaluations=found.evaluations + (dp.evaluations if dp is not None else 0))


def _memory_binds(space: SearchSpace, c: Candidate, best_step: float) -> bool:
    """Whether the candidate's pipeline is slower than the same ignoring memory, and that could beat
    `best_step` (the hand layouts can then help)."""
    free, bound = ignoring_memory(space, c.B, c.table, c.st.boundary)
    free_step = math.inf if bound is None else bound.objective_s + once_per_step_max(c.table, free, bound.stages)
    binds = not (bound is None or bound.objective_s >= best_step or c.step_s <= free_step * (1 + 1e-9))
    if binds:
        log.info("B=%d: %.4g s/step, %.4g ignoring memory: pricing the hand layouts", c.B, c.step_s, free_step)
    return binds


def _with_single_stage(space: SearchSpace, found: _Found) -> _Found:
    """`found` with the single stage of `pipeline="auto"` as a candidate."""
    best_pp = min((c.step_s for c in found.candidates), default=math.inf)
    candidate, single = single_stage(space, best_pp)
    return dataclasses.replace(found, candidates=found.candidates + ((candidate,) if candidate else ()), single=single)


def _chosen(space: SearchSpace, found: _Found) -> PipelinePlan:
    """The fastest feasible candidate as run (`selection.cheapest_as_run`), as a `PipelinePlan`.

    Raises:
      InfeasiblePlanError: no candidate fits the memory budget.
    """
    feasible = [c for c in found.candidates if c.dp is not None and math.isfinite(c.step_s)]
    if not feasible:
        raise _nothing_fits(space, found.skipped)
    plans, best, per_microbatch = cheapest_as_run(
        space.fn, space.args, feasible, lambda c: (c.step_s, len(c.dp.stages)),
        lambda c: stage_plans(c, space.shapes, space.meshes, space.cluster), space.batch, space.batch_argnum)
    one = found.single
    pp = to_pipeline_plan(best, plans, space.options, space.cluster, space.t_start, space.timings,
                          planned_layers(space.cache), None if one is None else one.time_s, None if one is None else one.free_s,
                          tuple((c.B, c.step_s, len(c.dp.stages) if c.dp else 0) for c in found.candidates),
                          _planning_facts(space, found, per_microbatch))
    return as_single_stage_plan(pp, one)


def _planning_facts(space: SearchSpace, found: _Found, per_microbatch: list[str]) -> dict[str, Any]:
    """What `plan_pipeline` adds to `PipelinePlan.planning`."""
    return {"dp_evaluations": found.evaluations, "logical_meshes": len(space.meshes),
            **({"grad_sync_per_microbatch": tuple(per_microbatch)} if per_microbatch else {}),
            **({"stacked_params": tuple(found.stacked)} if found.stacked else {}),
            **({"hand_layout_counts": HandLayoutCounts(tuple(found.priced), tuple(found.pruned))}
               if space.hand_layouts else {}),
            **({"single_stage_mesh_search": found.single.mesh_search} if space.options.pipeline == "auto" else {}),
            **({"single_stage_bound": found.single.bound} if found.single is not None and found.single.bound else {}),
            **({"larger_microbatches_skipped": found.skipped} if found.skipped else {}),
            "shape_family": space.graphs.family_note}


def _nothing_fits(space: SearchSpace, skipped: tuple[int, ...]) -> InfeasiblePlanError:
    """The error when no candidate fits the memory budget."""
    tried = [B for B in space.counts if B not in skipped]
    larger = f" (not planned: {', '.join(map(str, skipped))}, larger microbatches)" if skipped else ""
    hand = f" and in the {', '.join(space.layer_variants)} layouts" if space.hand_layouts else ""
    return InfeasiblePlanError(
        f"no pipeline of {space.cluster} built from the per-layer plans (each layer's fastest plan on each "
        f"mesh{hand}, "
        f"with or without recomputation and sharded state) fits the memory budget of {format_bytes(space.budget)} "
        f"per device for any of "
        f"{tried} microbatches{larger}; raise memory_budget, use more devices or more microbatches")
